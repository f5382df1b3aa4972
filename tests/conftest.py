"""Shared pytest configuration: the options and the tools that only some tests need, set up only for them.

Nothing here imports the Kubernetes harness: the fixtures of ``k8s`` tests
live in ``tests/k8s/conftest.py``, which pytest loads only when it collects
that folder, and which builds the control plane's binaries before the first
``k8s`` test it selects (see docs/testing-kubernetes.md). Prometheus's
binaries are located (and installed when missing) by ``hack/prometheus``,
before the first test marked ``prometheus``. A run that selects neither says
so after collection, so a tool left out is never mistaken for a tool tested.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
from pathlib import Path

import pytest

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
    if session.config.option.collectonly or not _selected(session.items, "prometheus"):
        return
    capture = session.config.pluginmanager.getplugin("capturemanager")
    with capture.global_and_fixture_disabled() if capture is not None else contextlib.nullcontext():
        found = subprocess.run([str(HACK / "prometheus")], stdout=subprocess.PIPE, text=True, check=False)
    if found.returncode == 0 and found.stdout.strip():
        os.environ["PATH"] = f"{found.stdout.strip()}{os.pathsep}{os.environ.get('PATH', '')}"


def pytest_report_collectionfinish(config: pytest.Config, items: list[pytest.Item]) -> list[str]:
    """Say which tools this run leaves out, and why."""
    lines = []
    if not _selected(items, "k8s"):
        lines.append("k8s tests: none selected, so no control plane is built or started")
    if not _selected(items, "prometheus"):
        lines.append("prometheus tests: none selected, so prometheus and promtool are not looked for")
    return lines
