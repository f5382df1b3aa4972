"""The Kubernetes control plane for ``k8s`` tests, and the operator's fixtures.

pytest loads this file only when it collects ``tests/k8s``, so a run of
other tests neither imports the Kubernetes harness nor builds its binaries.
Tests marked ``k8s`` get a real cluster through the fixtures below:

* by default the suite starts its own control plane (etcd, kube-apiserver,
  kube-controller-manager; plus kube-scheduler and kwok fake nodes for tests
  that use ``k8s_nodes``) from binaries built by ``hack/control-plane/build``;
* with ``--kubeconfig PATH`` (declared in ``tests/conftest.py``) or
  ``KUBECONFIG`` set, the same tests run against that existing cluster and
  nothing is started.

Missing binaries are built before the first ``k8s`` test (outside any
per-test timeout) or the tests fail with instructions; they are never
skipped silently. See docs/testing-kubernetes.md.

The operator's fixtures are registered here once for every module: a
session-scoped fixture imported into two test modules is two fixtures, one
per module: two operator processes with two webhooks, each called for every pod.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Iterator

import pytest
from kubernetes import client

from .api_fixture import k8s_api
from .cluster import Cluster, external_cluster, loopback_bypasses_proxy, managed_cluster
from .control_plane import ControlPlane, FakeNodes
from .operator_fixtures import checkpointpolicy_crd, operator_kubeconfig, ready_policy, stowaway_operator
from .tools import Tools, ToolsMissing, ensure_built, locate
from .wait import eventually

__all__ = ["checkpointpolicy_crd", "k8s_api", "operator_kubeconfig", "ready_policy", "stowaway_operator"]

_TOOLS = pytest.StashKey[Tools | ToolsMissing]()
KEEP_ENV = "STOWAWAY_K8S_KEEP"  # =1 keeps the control plane's temp dir and logs


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Refuse tests that use the cluster fixtures without the ``k8s`` marker.

    ``pytest -m k8s`` / ``-m "not k8s"`` must select exactly the tests that
    need a cluster, so a forgotten marker is a usage error, not a surprise.
    """
    unmarked = [
        item.nodeid
        for item in items
        if "_k8s_plane" in getattr(item, "fixturenames", ()) and item.get_closest_marker("k8s") is None
    ]
    if unmarked:
        raise pytest.UsageError(
            "tests using the Kubernetes fixtures must be marked @pytest.mark.k8s: " + ", ".join(unmarked)
        )


def _external_kubeconfig(config: pytest.Config) -> str | None:
    return config.getoption("kubeconfig") or os.environ.get("KUBECONFIG") or None


def pytest_report_collectionfinish(config: pytest.Config, items: list[pytest.Item]) -> list[str]:
    """Say loudly which cluster the selected ``k8s`` tests will talk to."""
    if not any(item.get_closest_marker("k8s") for item in items):
        return []
    external = _external_kubeconfig(config)
    if external:
        return [f"k8s tests: EXISTING cluster from kubeconfig {external}"]
    return ["k8s tests: local control plane built by hack/control-plane/build"]


def pytest_collection_finish(session: pytest.Session) -> None:
    """Build missing control-plane binaries once, before the first test runs.

    Done here rather than in a fixture because a cold build takes minutes and
    fixtures run under the per-test timeout. Failures are stored and reported
    by the ``k8s_cluster`` fixture, so only ``k8s`` tests fail.
    """
    config = session.config
    if config.option.collectonly or _external_kubeconfig(config):
        return
    if not any(item.get_closest_marker("k8s") for item in session.items):
        return
    capture = config.pluginmanager.getplugin("capturemanager")
    try:
        if capture is not None:
            with capture.global_and_fixture_disabled():
                config.stash[_TOOLS] = ensure_built()
        else:
            config.stash[_TOOLS] = ensure_built()
    except ToolsMissing as exc:
        config.stash[_TOOLS] = exc


def _tools(config: pytest.Config) -> Tools:
    found = config.stash.get(_TOOLS, None)
    if found is None:  # e.g. fixture used by a test without the k8s marker
        try:
            found = ensure_built()
        except ToolsMissing as exc:
            found = exc
        config.stash[_TOOLS] = found
    if isinstance(found, ToolsMissing):
        pytest.fail(str(found), pytrace=False)
    return found


@pytest.fixture(scope="session")
def _k8s_plane(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Cluster, ControlPlane | None]]:
    external = _external_kubeconfig(request.config)
    with loopback_bypasses_proxy():
        if external:
            try:
                tools: Tools | None = locate()
            except ToolsMissing:
                tools = None
            scratch = tmp_path_factory.mktemp("k8s-cli")
            yield external_cluster(external, tools, scratch), None
            return
        keep = os.environ.get(KEEP_ENV) == "1"
        with managed_cluster(_tools(request.config), keep_workdir=keep) as (cluster, plane):
            yield cluster, plane


@pytest.fixture(scope="session")
def k8s_cluster(_k8s_plane: tuple[Cluster, ControlPlane | None]) -> Cluster:
    """The cluster under test: kubeconfig, server URL, kubectl/helm paths, API client."""
    return _k8s_plane[0]


@pytest.fixture(scope="session")
def k8s_nodes(_k8s_plane: tuple[Cluster, ControlPlane | None], k8s_api: client.ApiClient) -> Iterator[list[str]]:
    """Names of schedulable Ready nodes.

    For the local control plane this starts kube-scheduler and kwok, which
    fakes nodes whose pods report Running without a container runtime. For an
    existing cluster it lists the nodes it already has.
    """
    cluster, plane = _k8s_plane
    if plane is None:
        nodes = client.CoreV1Api(k8s_api).list_node().items
        ready = [
            n.metadata.name
            for n in nodes
            if not n.spec.unschedulable
            and any(c.type == "Ready" and c.status == "True" for c in n.status.conditions or [])
        ]
        if not ready:
            pytest.fail(f"cluster {cluster.server} has no Ready schedulable nodes", pytrace=False)
        yield ready
        return
    fake = FakeNodes(plane).start()
    try:
        yield list(fake.names)
    finally:
        fake.stop()


@pytest.fixture
def k8s_namespace(request: pytest.FixtureRequest, k8s_api: client.ApiClient) -> Iterator[str]:
    """A fresh namespace named after the test, deleted afterwards (not awaited)."""
    slug = re.sub(r"[^a-z0-9]+", "-", request.node.name.lower()).strip("-")[:40].strip("-")
    digest = hashlib.sha1(request.node.nodeid.encode()).hexdigest()[:6]
    name = f"t-{slug}-{digest}"
    core = client.CoreV1Api(k8s_api)
    core.create_namespace({"metadata": {"name": name, "labels": {"stowaway.test": "true"}}})
    try:
        # Pods are rejected until the ServiceAccount controller made "default".
        eventually(
            lambda: core.read_namespaced_service_account("default", name),
            what=f"ServiceAccount default in namespace {name}",
        )
        yield name
    finally:
        core.delete_namespace(name)
