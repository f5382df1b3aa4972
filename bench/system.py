"""What the kernel says about memory: page-cache growth and peak resident sizes."""

from __future__ import annotations

import threading
from pathlib import Path


def file_cache_bytes() -> int:
    """Page cache of regular files (the file LRU lists), which excludes shared memory."""
    fields = {}
    for line in Path("/proc/meminfo").read_text().splitlines():
        name, value = line.split(":", 1)
        fields[name] = int(value.split()[0]) * 1024
    return fields["Active(file)"] + fields["Inactive(file)"]


def peak_rss_bytes(pid: int | str = "self") -> int:
    """VmHWM: the peak resident set, shared-memory pages the process touched included."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/{pid}/status has no VmHWM")


class CacheGrowth:
    """Samples the file page cache in a thread and keeps the peak growth over a baseline.

    A sampler is the only way to see the peak: a persist that drops its pages
    at the end leaves no trace in a before/after difference.
    """

    INTERVAL = 0.002

    def __init__(self) -> None:
        self.peak = 0
        self._baseline = file_cache_bytes()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.INTERVAL):
            self.peak = max(self.peak, file_cache_bytes() - self._baseline)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, file_cache_bytes() - self._baseline)
        return self.peak
