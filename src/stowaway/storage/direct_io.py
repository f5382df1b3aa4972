"""Moving whole checkpoints between a slot's mapping and a file with ``O_DIRECT``, checksumming on the side.

``O_DIRECT`` skips the page cache: a checkpoint does not pass through it twice
(once copied in, once written back), it does not grow the cache by its own
size and charge that to the pod's memory limit, and the device runs at its
own speed. It needs page-aligned memory, offsets and lengths: a slot's
payload starts on a page and its mapping is page rounded, so whole pages are
moved and a written file is cut back to its length. A filesystem that
refuses ``O_DIRECT`` (at open or at the first transfer) gets buffered I/O.

The xxh3 checksum runs in a second thread while the transfers run (xxh3 and
the system calls both release the GIL), so it costs no time unless the
device outruns it.
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from stowaway.storage import checksum

CHUNK_BYTES = 32 * 2**20


def page_round(nbytes: int) -> int:
    return -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE


def open_file(path: Path, flags: int, mode: int = 0o600, direct: bool = True) -> int:
    """Open with ``O_DIRECT`` when asked and the filesystem supports it, else without."""
    if direct:
        try:
            return os.open(path, flags | os.O_DIRECT | os.O_CLOEXEC, mode)
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
    return os.open(path, flags | os.O_CLOEXEC, mode)


def write_from(fd: int, payload: memoryview, nbytes: int,
               before_chunk: Callable[[int], None]) -> tuple[str, checksum.Pieces]:
    """Write the first ``nbytes`` of ``payload`` (a page-rounded mapping) to ``fd``; return their checksum, whole
    and piece by piece (``checksum.Pieces``).

    ``before_chunk`` is called with each chunk's size first (the write-rate limit).
    """
    with ThreadPoolExecutor(1, thread_name_prefix="checksum") as hashing:
        digest = hashing.submit(checksum.digests_of, payload, nbytes)
        direct = _is_direct(fd)
        for begin in range(0, nbytes, CHUNK_BYTES):
            end = min(begin + CHUNK_BYTES, nbytes)
            before_chunk(end - begin)
            if direct:
                try:
                    _write_all(fd, payload[begin : min(page_round(end), len(payload))])
                    continue
                except OSError as exc:
                    if exc.errno != errno.EINVAL:
                        raise
                    direct = _stop_direct(fd, begin)
            _write_all(fd, payload[begin:end])
        os.ftruncate(fd, nbytes)
        return digest.result()


def read_into(fd: int, payload: memoryview, nbytes: int) -> tuple[int, str]:
    """Read up to ``nbytes`` from ``fd`` into ``payload`` (a page-rounded mapping); return (count, checksum)."""
    hasher = checksum.new()
    with ThreadPoolExecutor(1, thread_name_prefix="checksum") as hashing:
        direct = _is_direct(fd)
        offset = 0
        while offset < nbytes:
            end = min(offset + CHUNK_BYTES, nbytes)
            try:
                count = os.readv(fd, [payload[offset : min(page_round(end), len(payload)) if direct else end]])
            except OSError as exc:
                if not direct or exc.errno != errno.EINVAL:
                    raise
                direct = _stop_direct(fd, offset)
                continue
            count = min(count, nbytes - offset)
            if count == 0:
                break
            hashing.submit(hasher.update, payload[offset : offset + count])
            offset += count
    return offset, hasher.hexdigest()


def enable(fd: int) -> bool:
    """Turn on ``O_DIRECT`` for a descriptor opened without it (one the sidecar passed), where the filesystem
    allows it (tmpfs does not); whether it is on."""
    try:
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_DIRECT)
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
        return False
    return True


def disable(fd: int) -> None:
    """Go back to buffered I/O, after a filesystem that took ``O_DIRECT`` refused an aligned transfer."""
    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_DIRECT)


def _is_direct(fd: int) -> bool:
    return bool(fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT)


def _stop_direct(fd: int, offset: int) -> bool:
    """Fall back to buffered I/O at ``offset`` after the filesystem refused an aligned transfer."""
    os.lseek(fd, offset, os.SEEK_SET)
    disable(fd)
    return False


def _write_all(fd: int, chunk: memoryview) -> None:
    while chunk:
        chunk = chunk[os.write(fd, chunk) :]
