"""Objects of the cluster as the JSON ``kubectl get -o json`` prints: what a user inspects, typed plainly."""

from __future__ import annotations

import json
from typing import Any

from k8s.cluster import Cluster


def get(cluster: Cluster, kind: str, name: str = "", *, namespace: str | None = None,
        selector: str | None = None) -> dict[str, Any]:
    """One object (``name``), or a List of those ``selector`` picks."""
    args = ["get", kind, *([name] if name else []), "-o", "json"]
    if namespace:
        args += ["--namespace", namespace]
    if selector:
        args += ["--selector", selector]
    found: dict[str, Any] = json.loads(cluster.run("kubectl", *args).stdout)
    return found
