"""What the kernel says about memory: page-cache growth and peak resident sizes."""

from __future__ import annotations

import ctypes
import ctypes.util
import threading
from collections.abc import Callable
from pathlib import Path

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")


def release_free_heap() -> None:
    """Give freed heap memory back to the kernel, so the next allocation starts from untouched pages.

    Every restore measurement starts this way: a restore at job start fills
    memory the process has never touched, and a heap warmed by the previous
    repetition would hide the page faults that cost most of it.
    """
    _libc.malloc_trim(0)


def file_cache_bytes() -> int:
    """Page cache of regular files (the file LRU lists), which excludes shared memory."""
    fields = {}
    for line in Path("/proc/meminfo").read_text().splitlines():
        name, value = line.split(":", 1)
        fields[name] = int(value.split()[0]) * 1024
    return fields["Active(file)"] + fields["Inactive(file)"]


def status_bytes(pid: int | str, field: str) -> int:
    """A size field of /proc/PID/status, e.g. VmHWM (peak RSS) or RssAnon (private resident memory)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/{pid}/status has no {field}")


class Peak:
    """Samples a value in a thread and keeps its maximum.

    A sampler is the only way to see some peaks: a persist that drops its
    pages at the end leaves no trace in a before/after difference, and the
    kernel keeps no high-water mark of private memory alone.
    """

    INTERVAL = 0.002

    def __init__(self, read: Callable[[], int]) -> None:
        self._read = read
        self.peak = read()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.INTERVAL):
            try:
                self.peak = max(self.peak, self._read())
            except (OSError, RuntimeError):
                return

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak


def cache_growth() -> Peak:
    """Peak growth of the file page cache from now on."""
    baseline = file_cache_bytes()
    return Peak(lambda: file_cache_bytes() - baseline)
