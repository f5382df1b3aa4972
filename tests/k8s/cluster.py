"""What a ``k8s`` test gets: a handle on *some* real Kubernetes cluster.

The same tests run against the control plane the suite starts itself
(:func:`managed_cluster`) or against an existing cluster named by
``--kubeconfig`` / ``KUBECONFIG`` (:func:`external_cluster`, e.g. kind on a
laptop), so they may only rely on what both provide: a kubeconfig, the API
server URL, kubectl/helm binaries and an API client.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from kubernetes import client, config

from .control_plane import ControlPlane
from .tools import Tools, client_binary

LOOPBACK = ("127.0.0.1", "localhost", "::1")


@dataclass(frozen=True)
class Cluster:
    """A reachable cluster plus the CLIs to drive it."""

    kubeconfig: Path
    server: str
    kubectl: Path | None
    helm: Path | None
    # Version the suite pinned and started; None for an external cluster.
    pinned_version: str | None
    # Scratch space for CLI state (helm caches etc.), private to this run.
    scratch: Path

    @property
    def managed(self) -> bool:
        """True when the suite started this control plane itself."""
        return self.pinned_version is not None

    def api_client(self) -> client.ApiClient:
        """A fresh ``kubernetes.client.ApiClient`` authenticated via the kubeconfig."""
        return config.new_client_from_config(config_file=str(self.kubeconfig))

    def cli_env(self) -> dict[str, str]:
        """Environment for kubectl/helm: our kubeconfig, hermetic helm dirs."""
        env = dict(os.environ)
        env["KUBECONFIG"] = str(self.kubeconfig)
        for var in ("HELM_CACHE_HOME", "HELM_CONFIG_HOME", "HELM_DATA_HOME"):
            env[var] = str(self.scratch / var.lower())
        return env

    def run(self, tool: str, *args: str, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        """Run ``kubectl`` or ``helm`` against this cluster and capture output.

        On failure the assertion message carries the command's stderr, which is
        where the server's error message ends up.
        """
        binary = {"kubectl": self.kubectl, "helm": self.helm}[tool]
        if binary is None:
            raise AssertionError(f"no {tool} binary: run hack/control-plane/build or put {tool} on PATH")
        result = subprocess.run(
            [str(binary), *args],
            env=self.cli_env(),
            text=True,
            capture_output=True,
            timeout=timeout,
            check=False,
        )
        if check and result.returncode != 0:
            raise AssertionError(
                f"`{tool} {' '.join(args)}` failed with status {result.returncode}:\n{result.stderr}{result.stdout}"
            )
        return result


@contextlib.contextmanager
def loopback_bypasses_proxy() -> Iterator[None]:
    """Make sure HTTP(S)_PROXY settings never capture traffic to 127.0.0.1.

    CI machines often export a proxy; Go and Python clients would then try to
    reach our loopback API server through it.
    """
    saved = {var: os.environ.get(var) for var in ("NO_PROXY", "no_proxy")}
    for var, value in saved.items():
        entries = [e for e in (value or "").split(",") if e]
        entries += [host for host in LOOPBACK if host not in entries]
        os.environ[var] = ",".join(entries)
    try:
        yield
    finally:
        for var, value in saved.items():
            if value is None:
                os.environ.pop(var, None)
            else:
                os.environ[var] = value


@contextlib.contextmanager
def managed_cluster(tools: Tools, keep_workdir: bool = False) -> Iterator[tuple[Cluster, ControlPlane]]:
    """Start etcd, kube-apiserver and kube-controller-manager; stop them after."""
    plane = ControlPlane(tools).start()
    try:
        yield (
            Cluster(
                kubeconfig=plane.kubeconfig,
                server=plane.server,
                kubectl=tools.kubectl,
                helm=tools.helm,
                pinned_version=tools.kubernetes_version,
                scratch=plane.workdir,
            ),
            plane,
        )
    finally:
        plane.stop(keep_workdir=keep_workdir)


def external_cluster(kubeconfig: str, tools: Tools | None, scratch: Path) -> Cluster:
    """Describe an existing cluster; nothing is started or stopped."""
    path = Path(kubeconfig.split(os.pathsep)[0]).expanduser().resolve()
    if not path.is_file():
        raise FileNotFoundError(f"kubeconfig {path} does not exist")
    configuration = client.Configuration()
    config.load_kube_config(config_file=str(path), client_configuration=configuration)
    return Cluster(
        kubeconfig=path,
        server=configuration.host,
        kubectl=client_binary("kubectl", tools.kubectl if tools else None),
        helm=client_binary("helm", tools.helm if tools else None),
        pinned_version=None,
        scratch=scratch,
    )
