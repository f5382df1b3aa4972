"""The operator's Prometheus series; with the sidecar's metrics module, the only door to ``prometheus_client``.

The series live in a registry of their own (never the library's global one), so
a test can read one operator's numbers without another's. Labels are bounded:
an admission's ``result`` comes from :data:`RESULTS`, every one exported from
the start at 0 so a rate over it exists before the first event; there is no
namespace, pod or policy label, whose values would grow with the cluster.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

# What the webhook did with a pod it was called for.
#   injected: the sidecar was added.  skipped: a namespace the operator never touches.
#   already_injected: the pod carries the sidecar already (a reinvocation or a copied pod).
#   denied: refused with an admission error naming the cause.  error: an unexpected failure (see the log).
RESULTS = ("injected", "skipped", "already_injected", "denied", "error")

# 1 ms (policy cached by the API server, a small pod) to the API server's 30 s webhook timeout ceiling.
BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class OperatorMetrics:
    """The series one operator process exports, created in ``registry``."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.injections = Counter(
            "stowaway_operator_injections", "Pods the injection webhook answered, by result.", ["result"],
            registry=self.registry,
        )
        for result in RESULTS:
            self.injections.labels(result)
        self.webhook_duration = Histogram(
            "stowaway_operator_webhook_duration_seconds",
            "Time the injection webhook took to answer, from the request to the patch or refusal.",
            buckets=BUCKETS, registry=self.registry,
        )
        self.reconcile_errors = Counter(
            "stowaway_operator_policy_reconcile_errors",
            "Failed attempts to judge a CheckpointPolicy or refresh its status.", registry=self.registry,
        )

    def admitted(self, result: str, seconds: float) -> None:
        """Count one webhook answer; an unknown result is a bug, counted as ``error`` rather than a new series."""
        self.injections.labels(result if result in RESULTS else "error").inc()
        self.webhook_duration.observe(seconds)

    def serve(self, port: int, address: str = "0.0.0.0") -> None:
        """Serve ``/metrics`` from a daemon thread; raises OSError if the port is taken."""
        start_http_server(port, addr=address, registry=self.registry)

    def exposition(self) -> tuple[bytes, str]:
        """The text a scrape gets, and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
