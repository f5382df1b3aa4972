"""The one place the sidecar reports what it measured.

Handlers call these methods and nothing else; each call feeds the Prometheus
series (``metrics``) at once, and a few running totals are kept for the log
line at shutdown. Nothing grows with the number of saves: a daemon that lives
for weeks must not keep every measurement.
"""

from __future__ import annotations

import math
import threading
from collections import Counter
from collections.abc import Callable

from stowaway.protocol import messages
from stowaway.sidecar.metrics import SidecarMetrics


class Stats:
    def __init__(self, metrics: SidecarMetrics | None = None) -> None:
        self.metrics = metrics if metrics is not None else SidecarMetrics()
        self._lock = threading.Lock()
        self._persists = 0
        self._persisted_bytes = 0
        self._commits = 0
        self._last_committed_step = -1
        self._failures: Counter[str] = Counter()
        self._restores: Counter[str] = Counter()
        self._pooled_spare_saves = 0

    def watch(self, ranks_connected: Callable[[], int], slots_in_flight: Callable[[], int],
              connected_since: Callable[[], float | None]) -> None:
        """Report these gauges by asking the callables at scrape time."""
        self.metrics.watch(ranks_connected, slots_in_flight, connected_since)

    def stale_after(self, seconds: float) -> None:
        """The job's limit on a commit's age, for the alerts: only the job's owner knows its save interval."""
        self.metrics.stale_after.set(seconds)

    def save_reported(self, blocking: float, slot_wait: float) -> None:
        """A rank's own measurement of one save; untrusted input, so nonsense is dropped."""
        if _duration(blocking) and _duration(slot_wait):
            self.metrics.save_blocking.observe(blocking)
            self.metrics.slot_wait.observe(slot_wait)

    def staging_reported(self, request: messages.Persist) -> None:
        """A rank's measurements of the copy of one ``save(overlap=True)``, if it was one; nonsense is dropped."""
        staging, stall, hidden = request.staging_seconds, request.stall_seconds or 0.0, request.hidden_seconds
        if staging is None or hidden is None:
            return
        if all(_duration(value) for value in (staging, stall, request.blocking_seconds)):
            self.metrics.staging.observe(staging)
            self.metrics.stall.observe(stall)
            self.metrics.overlap_hidden.inc(hidden)

    def pooled_spare_saved(self) -> None:
        """A save borrowed a pooled spare: how often the pod's ranks outran their own slots."""
        self.metrics.pooled_spare_saves.inc()
        with self._lock:
            self._pooled_spare_saves += 1

    def restored(self, source: str, seconds: float) -> None:
        """A rank's report of one restore; its duration is the rank's measurement, so nonsense is dropped."""
        self.metrics.restores.labels(source).inc()
        if _duration(seconds):
            self.metrics.restore_duration.labels(source).observe(seconds)
        with self._lock:
            self._restores[source] += 1

    def persist_finished(self, nbytes: int, seconds: float) -> None:
        self.metrics.persist_duration.observe(seconds)
        self.metrics.persisted_bytes.inc(nbytes)
        with self._lock:
            self._persists += 1
            self._persisted_bytes += nbytes

    def committed(self, step: int, seconds: float, when: float) -> None:
        self.metrics.commit_duration.observe(seconds)
        with self._lock:
            self._commits += 1
            self._last_committed_step = max(self._last_committed_step, step)
            self.metrics.last_committed_step.set(self._last_committed_step)
            self.metrics.last_commit_timestamp.set(when)

    def failed(self, reason: str) -> None:
        self.metrics.failed(reason)
        with self._lock:
            self._failures[reason] += 1

    def summary(self) -> dict[str, object]:
        with self._lock:
            return {
                "persists": self._persists,
                "persisted_bytes": self._persisted_bytes,
                "commits": self._commits,
                "last_committed_step": self._last_committed_step,
                "failures": dict(self._failures),
                "restores": dict(self._restores),
                "pooled_spare_saves": self._pooled_spare_saves,
            }


def _duration(value: float) -> bool:
    return math.isfinite(value) and value >= 0
