"""What the kernel says about memory: page-cache growth and peak resident sizes."""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
import threading
from collections.abc import Callable, Mapping
from pathlib import Path

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
# A counter some VM kernels keep next to virtio-balloon's free page reporting.
_REPORTED_KIB = Path("/sys/module/page_reporting/parameters/reported_kib")


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


def reported_to_host_bytes() -> int:
    """Memory the guest kernel has handed back to its hypervisor so far (free page reporting); 0 if none or unknown.

    Where freed pages go back to the host, the next touch of each makes the
    host back it again (``python -m bench.first_touch`` measures the cost).
    Every allocation on a fresh heap (a first save, a restore into new
    tensors, the copy-out reference) pays it for whatever the kernel hands
    out, so runs on such a machine spread more; the report says so in its
    machine line.
    """
    try:
        return int(_REPORTED_KIB.read_text()) * 1024
    except (OSError, ValueError):
        return 0


def status_bytes(pid: int | str, field: str) -> int:
    """A size field of /proc/PID/status, e.g. VmHWM (peak RSS) or RssAnon (private resident memory)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/{pid}/status has no {field}")


def reset_peak_rss() -> None:
    """Start the process's VmHWM afresh from its current RSS, so that it tells the peak of one phase."""
    Path("/proc/self/clear_refs").write_text("5")


def shm_bytes(directory: Path, prefix: str = "") -> int:
    """Shared memory allocated to the files of ``directory`` whose names start with ``prefix``.

    Allocated, not apparent, size: a file sized with ``ftruncate`` holds
    memory only for the pages written since.
    """
    total = 0
    with os.scandir(directory) as entries:
        for entry in entries:
            if entry.name.startswith(prefix):
                with contextlib.suppress(FileNotFoundError):
                    total += entry.stat(follow_symlinks=False).st_blocks * 512
    return total


class Peaks:
    """Samples values in one thread and keeps the maximum of each.

    A sampler is the only way to see some peaks: a persist that drops its
    pages at the end leaves no trace in a before/after difference, and the
    kernel keeps no high-water mark of private memory alone. One thread
    samples them all, so that adding a value does not add a thread that
    competes with the measurement for the cores. A value that can no longer
    be read (its process ended) keeps the peak it had.
    """

    INTERVAL = 0.002

    def __init__(self, readers: Mapping[str, Callable[[], int]], interval: float = INTERVAL) -> None:
        self._readers = dict(readers)
        self._interval = interval
        self.peaks = {name: read() for name, read in self._readers.items()}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while self._readers and not self._stop.wait(self._interval):
            for name, read in list(self._readers.items()):
                try:
                    self.peaks[name] = max(self.peaks[name], read())
                except (OSError, RuntimeError):
                    del self._readers[name]

    def stop(self) -> dict[str, int]:
        self._stop.set()
        self._thread.join()
        return self.peaks


class Peak:
    """One value sampled by ``Peaks``."""

    def __init__(self, read: Callable[[], int], interval: float = Peaks.INTERVAL) -> None:
        self._peaks = Peaks({"value": read}, interval)

    def stop(self) -> int:
        return self._peaks.stop()["value"]


def cache_growth() -> Peak:
    """Peak growth of the file page cache from now on."""
    baseline = file_cache_bytes()
    return Peak(lambda: file_cache_bytes() - baseline)
