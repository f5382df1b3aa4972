"""Fixtures of the ``e2e`` tests: the product running in real pods.

By default the suite prepares everything itself (``environment.prepare``): it starts a Docker engine when none
runs, builds the images and a single-node kind cluster from sources, and loads the images into the node.
With ``--kubeconfig PATH`` (or ``KUBECONFIG``) the tests run against that cluster instead; a kind cluster it
names gets the images loaded. Where no Docker engine can run, the e2e tests are skipped and say why.
See docs/testing-kubernetes.md.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from k8s.api_fixture import k8s_api
from k8s.cluster import Cluster, external_cluster, loopback_bypasses_proxy
from k8s.tools import ToolsMissing, locate

from .environment import DockerUnavailable, Environment, SetupFailed, prepare, teardown

__all__ = ["k8s_api"]  # a fixture: imported to be registered here

_PREPARED = pytest.StashKey[Environment | DockerUnavailable | SetupFailed]()


def _external_kubeconfig(config: pytest.Config) -> str | None:
    return config.getoption("kubeconfig") or os.environ.get("KUBECONFIG") or None


def pytest_collection_finish(session: pytest.Session) -> None:
    """Prepare before the first test: a cold build takes longer than a test's timeout."""
    config = session.config
    selected = [item for item in session.items if item.get_closest_marker("e2e")]
    if config.option.collectonly or not selected:
        return
    needs_cluster = any("k8s_cluster" in getattr(item, "fixturenames", ()) for item in selected)
    capture = config.pluginmanager.getplugin("capturemanager")
    try:
        if capture is not None:
            with capture.global_and_fixture_disabled():
                prepared = prepare(needs_cluster=needs_cluster, external_kubeconfig=_external_kubeconfig(config))
        else:
            prepared = prepare(needs_cluster=needs_cluster, external_kubeconfig=_external_kubeconfig(config))
    except (DockerUnavailable, SetupFailed) as exc:
        config.stash[_PREPARED] = exc
        return
    config.stash[_PREPARED] = prepared


def pytest_sessionfinish(session: pytest.Session) -> None:
    prepared = session.config.stash.get(_PREPARED, None)
    if isinstance(prepared, Environment):
        teardown(prepared)


@pytest.fixture(scope="session")
def e2e_environment(request: pytest.FixtureRequest) -> Environment:
    """Docker running and the images built (skips where Docker cannot run)."""
    prepared = request.config.stash.get(_PREPARED, None)
    if isinstance(prepared, DockerUnavailable):
        pytest.skip(str(prepared))
    if isinstance(prepared, SetupFailed):
        pytest.fail(str(prepared), pytrace=False)
    if prepared is None:
        pytest.fail("the e2e environment was not prepared: are these tests marked e2e?", pytrace=False)
    return prepared


@pytest.fixture(scope="session")
def k8s_cluster(e2e_environment: Environment, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """The kind cluster, in place of the k8s tests' control plane: ``k8s_api``, shared with the k8s tests,
    works on it unchanged. Its pods really run, from images loaded into the node."""
    if e2e_environment.kubeconfig is None:
        pytest.fail("no cluster was prepared for this session", pytrace=False)
    try:
        tools = locate()
    except ToolsMissing:
        tools = None
    with loopback_bypasses_proxy():
        yield external_cluster(str(e2e_environment.kubeconfig), tools, tmp_path_factory.mktemp("e2e-cli"))
