"""Shared pytest configuration: the options and the tools that only some tests need, set up only for them.

Nothing here imports the Kubernetes harness: the fixtures of ``k8s`` tests
live in ``tests/k8s/conftest.py``, which pytest loads only when it collects
that folder, and which builds the control plane's binaries before the first
``k8s`` test it selects (see docs/testing-kubernetes.md). Prometheus's
binaries are located (and installed when missing) by ``hack/prometheus``,
before the first test marked ``prometheus``; SeaweedFS's ``weed``, the S3
server of the tests marked ``s3``, is built by ``hack/e2e/gobuild`` (cached
outside the repository) before the first of them (``s3server``). A run that
selects none of them says so after collection, so a tool left out is never
mistaken for a tool tested.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import s3server

from bench import s3server as bench_s3server

HACK = Path(__file__).resolve().parents[1] / "hack"


def pytest_addoption(parser: pytest.Parser) -> None:
    """``--kubeconfig``: run ``k8s`` tests against an existing cluster.

    Declared here, not beside the ``k8s`` fixtures, because pytest reads
    options before it collects (and so before it loads) ``tests/k8s/conftest.py``.
    """
    parser.addoption(
        "--kubeconfig",
        metavar="PATH",
        default=None,
        help="run k8s-marked tests against the cluster in this kubeconfig instead of "
        "starting a local control plane (default: $KUBECONFIG if set). Write "
        "--kubeconfig=PATH: without '=' and without test paths, pytest mistakes "
        "PATH for a test path before it has read this option",
    )


def _selected(items: list[pytest.Item], marker: str) -> bool:
    return any(item.get_closest_marker(marker) for item in items)


def pytest_collection_finish(session: pytest.Session) -> None:
    """Put ``prometheus`` and ``promtool`` on PATH before the first test that needs them.

    ``hack/prometheus`` installs Debian's package when they are missing,
    which can take longer than a test's timeout, hence here rather than in
    a fixture. When it fails, its message is on the terminal and the tests
    fail where they look for the binaries (``metrics/promtools.py``).
    """
    if session.config.option.collectonly:
        return
    if _selected(session.items, "s3"):
        _build_weed(session)
    if not _selected(session.items, "prometheus"):
        return
    capture = session.config.pluginmanager.getplugin("capturemanager")
    with capture.global_and_fixture_disabled() if capture is not None else contextlib.nullcontext():
        found = subprocess.run([str(HACK / "prometheus")], stdout=subprocess.PIPE, text=True, check=False)
    if found.returncode == 0 and found.stdout.strip():
        os.environ["PATH"] = f"{found.stdout.strip()}{os.pathsep}{os.environ.get('PATH', '')}"


def _build_weed(session: pytest.Session) -> None:
    """Build SeaweedFS's ``weed`` (cached outside the repository) and say where it is, for ``s3server``.

    Only a missing Go toolchain makes the s3 tests skip (with that
    message); a build that fails otherwise fails them, with its log.
    """
    capture = session.config.pluginmanager.getplugin("capturemanager")
    with capture.global_and_fixture_disabled() if capture is not None else contextlib.nullcontext():
        try:
            os.environ["STOWAWAY_WEED"] = str(bench_s3server.build_weed())
        except bench_s3server.NoWeed as exc:
            os.environ["STOWAWAY_WEED_MISSING"] = str(exc)
        except RuntimeError:
            return


def pytest_report_collectionfinish(config: pytest.Config, items: list[pytest.Item]) -> list[str]:
    """Say which tools this run leaves out, and why."""
    lines = []
    if not _selected(items, "k8s"):
        lines.append("k8s tests: none selected, so no control plane is built or started")
    if not _selected(items, "prometheus"):
        lines.append("prometheus tests: none selected, so prometheus and promtool are not looked for")
    if not _selected(items, "s3"):
        lines.append("s3 tests: none selected, so no S3 server (SeaweedFS) is built or started")
    return lines


@pytest.fixture(scope="session")
def s3_server() -> Iterator[s3server.S3Server]:
    """One SeaweedFS S3 server for the session; each test takes a bucket of its own (``s3_bucket``)."""
    with bench_s3server.running(s3server.weed_binary()) as server:
        yield server


@pytest.fixture
def s3_bucket(s3_server: s3server.S3Server, request: pytest.FixtureRequest) -> str:
    """A new, empty bucket named after the test."""
    name = "t-" + "".join(c if c.isalnum() else "-" for c in request.node.name.lower())[:40].strip("-")
    name = f"{name}-{uuid.uuid4().hex[:8]}"
    s3_server.create_bucket(name)
    return name
