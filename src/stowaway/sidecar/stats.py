"""The one place the sidecar reports what it measured.

Handlers call these methods and nothing else; the metrics exporter (a later
layer) reads from here, so no handler knows about Prometheus.
"""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass, field


@dataclass
class Stats:
    persists: int = 0
    persisted_bytes: int = 0
    commits: int = 0
    last_committed_step: int = -1
    last_commit_unix: float = 0.0
    failures: Counter[str] = field(default_factory=Counter)
    blocking_seconds: list[float] = field(default_factory=list)
    slot_wait_seconds: list[float] = field(default_factory=list)
    persist_seconds: list[float] = field(default_factory=list)
    commit_seconds: list[float] = field(default_factory=list)
    ranks_connected: int = 0
    slots_in_flight: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def save_reported(self, blocking: float, slot_wait: float) -> None:
        with self._lock:
            self.blocking_seconds.append(blocking)
            self.slot_wait_seconds.append(slot_wait)

    def persist_finished(self, nbytes: int, seconds: float) -> None:
        with self._lock:
            self.persists += 1
            self.persisted_bytes += nbytes
            self.persist_seconds.append(seconds)

    def committed(self, step: int, seconds: float, when: float) -> None:
        with self._lock:
            self.commits += 1
            self.last_committed_step = max(self.last_committed_step, step)
            self.last_commit_unix = when
            self.commit_seconds.append(seconds)

    def failed(self, reason: str) -> None:
        with self._lock:
            self.failures[reason] += 1

    def summary(self) -> dict[str, object]:
        with self._lock:
            return {
                "persists": self.persists,
                "persisted_bytes": self.persisted_bytes,
                "commits": self.commits,
                "last_committed_step": self.last_committed_step,
                "failures": dict(self.failures),
            }
