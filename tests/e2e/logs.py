"""A container's log as ``kubectl logs --follow`` streams it, kept after the pod is gone."""

from __future__ import annotations

import subprocess
from pathlib import Path

from k8s.cluster import Cluster


class FollowedLog:
    """Streams one container's log into a file until the container ends.

    A deleted pod's log cannot be read afterwards, so what its containers print
    while they stop (the sidecar's drain) is only seen by following it.
    """

    def __init__(self, cluster: Cluster, namespace: str, pod: str, container: str, path: Path) -> None:
        assert cluster.kubectl is not None, "no kubectl binary"
        self.path = path
        self.what = f"{pod}/{container}"
        with path.open("wb") as out:
            self._process = subprocess.Popen(
                [str(cluster.kubectl), "--namespace", namespace, "logs", "--follow", pod, "-c", container],
                env=cluster.cli_env(), stdout=out, stderr=subprocess.STDOUT)

    def text(self) -> str:
        return self.path.read_text(errors="replace")

    def ended(self, timeout: float) -> str:
        """The whole log, once the container has ended (and so has the stream)."""
        try:
            self._process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.stop()
            raise AssertionError(
                f"the log of {self.what} still streams after {timeout:.0f} s:\n{self.text()}") from None
        return self.text()

    def stop(self) -> None:
        if self._process.poll() is None:
            self._process.kill()
            self._process.wait(timeout=30)
