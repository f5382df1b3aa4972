"""What a user would look at when pods do not come up: attached to the failure of an e2e test."""

from __future__ import annotations

from k8s.cluster import Cluster


def namespace_report(cluster: Cluster, namespace: str, selector: str = "app.kubernetes.io/name") -> str:
    """Pods and events of ``namespace``, and the last log lines of the containers of the pods ``selector`` picks."""
    parts = []
    for args in (("get", "pods", "-o", "wide"), ("get", "events", "--sort-by=.lastTimestamp"),
                 ("logs", "--all-containers", "--prefix", "--tail=40", "-l", selector)):
        shown = cluster.run("kubectl", "--namespace", namespace, *args, check=False)
        parts.append(f"$ kubectl -n {namespace} {' '.join(args)}\n{shown.stdout}{shown.stderr}")
    return "\n".join(parts)
