"""The chart installed the way users install it, from the images the session built."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import contextmanager

from k8s.cluster import Cluster
from k8s.operator_fixtures import CHART

from .diagnostics import namespace_report
from .environment import PRODUCT_IMAGE


@contextmanager
def installed_chart(cluster: Cluster, namespace: str) -> Iterator[str]:
    """``helm install`` into ``namespace`` in the ``operator`` TLS mode; yields the release, uninstalls after.

    The chart's CRD is applied first, as docs/operator.md tells users who
    upgrade to: Helm installs ``crds/`` only where the CRD is missing, and a
    kind cluster kept from an earlier session holds the CRD of its day.
    Uninstalling waits: the webhook (failurePolicy Fail) must not outlive its operator.
    """
    release = f"s{uuid.uuid4().hex[:6]}"
    repository, tag = PRODUCT_IMAGE.rsplit(":", 1)
    cluster.run("kubectl", "apply", "--server-side", "--force-conflicts", "-f", str(CHART / "crds"))
    try:
        result = cluster.run(
            "helm", "install", release, str(CHART), "--namespace", namespace,
            "--set", f"image.repository={repository}", "--set", f"image.tag={tag}",
            "--set", "image.pullPolicy=Never", "--set", "webhook.tls.mode=operator",
            "--wait", "--timeout", "180s", timeout=240, check=False)
        assert result.returncode == 0, f"helm install failed: {result.stderr}\n" + namespace_report(
            cluster, namespace)
        yield release
    finally:
        cluster.run("helm", "uninstall", release, "--namespace", namespace, "--wait", check=False)
