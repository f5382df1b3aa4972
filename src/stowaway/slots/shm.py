"""Slot files in a tmpfs: allocation, pre-faulting, growth, capacity checks.

Pages are reserved with ``posix_fallocate``, so that a full tmpfs fails the
allocation with ENOSPC instead of killing the rank with SIGBUS in the middle
of a copy. They are not faulted in at allocation: ``MAP_POPULATE`` after
``posix_fallocate`` faults them in on one thread, while the first copy
faults the same pages in on every thread torch copies with, which made the
whole first save faster (docs/benchmarks.md, "What changed four rounds
before"). A slot allocated ahead of its first use (``prefault``) has its
pages faulted in by a background thread instead.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
from dataclasses import dataclass
from pathlib import Path

from stowaway.errors import ShmCapacityError
from stowaway.slots import header, pooled_lock

SLOT_FILE_MODE = 0o660
# madvise(MADV_POPULATE_WRITE), Linux 5.14 and later: write-fault a range now. Called through ctypes,
# which releases the GIL for the whole call; mmap.madvise holds it.
_MADV_POPULATE_WRITE = 23
# MADV_POPULATE_WRITE holds the process's mmap lock for the range it is given: any mmap, munmap or brk of the
# rank's training thread (a large tensor allocated or freed) waits for it. One slot at once stalled a save
# right after the first until the whole slot was resident; in 8 MiB steps, such a wait lasts one step.
POPULATE_CHUNK_BYTES = 8 * 2**20
_libc = ctypes.CDLL(None, use_errno=True)


def _page_round(nbytes: int) -> int:
    page = mmap.PAGESIZE
    return (nbytes + page - 1) // page * page


def file_size_for(capacity: int) -> int:
    return header.HEADER_BYTES + _page_round(max(capacity, 1))


class SlotFile:
    """One mapped slot file. The owner of the slot (rank or sidecar) decides who may write."""

    def __init__(self, path: Path, fd: int, writable: bool) -> None:
        self.path = path
        self._fd = fd
        self._writable = writable
        self._map: mmap.mmap | None = None
        # Kept apart from the mapping so that another thread reading the capacity never sees it closed mid-remap.
        self._mapped_bytes = 0
        self._remap()

    @classmethod
    def create(cls, path: Path, capacity: int) -> SlotFile:
        """Create (or take over) a slot file of at least ``capacity`` payload bytes."""
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, SLOT_FILE_MODE)
        try:
            os.fchmod(fd, SLOT_FILE_MODE)
            size = _reserve(fd, capacity)
        except BaseException:
            os.close(fd)
            raise
        slot = cls(path, fd, writable=True)
        header.write_empty(slot.header_view, size - header.HEADER_BYTES)
        return slot

    @classmethod
    def borrow_pooled(cls, path: Path) -> SlotFile | None:
        """Open a pooled spare (created if missing) holding its write lock; None while another process holds it.

        Never truncated here: another rank may map it. A file too short for a
        header was created by a rank that died before it initialised it.
        """
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, SLOT_FILE_MODE)
            os.fchmod(fd, SLOT_FILE_MODE)
        except FileExistsError:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            if not pooled_lock.try_lock(fd, exclusive=True):
                os.close(fd)
                return None
            initialised = os.fstat(fd).st_size >= header.HEADER_BYTES
            if not initialised:
                _reserve(fd, 1)
            slot = cls(path, fd, writable=True)
        except BaseException:
            os.close(fd)
            raise
        if not initialised:
            header.write_empty(slot.header_view, slot.capacity)
        return slot

    def try_lock(self, exclusive: bool) -> bool:
        """Take this pooled spare's write (or read) lock, or turn the one held into it (``pooled_lock``)."""
        return pooled_lock.try_lock(self._fd, exclusive)

    def unlock(self) -> None:
        pooled_lock.unlock(self._fd)

    @property
    def sized(self) -> bool:
        """Whether it was ever sized for a state: a pooled spare is created holding a page, for whoever borrows it."""
        return self.capacity > _page_round(1)

    @property
    def stale(self) -> bool:
        """Whether another process has grown the file since it was mapped here (``refresh`` follows it)."""
        return os.fstat(self._fd).st_size != (len(self._map) if self._map is not None else 0)

    @classmethod
    def open(cls, path: Path, writable: bool) -> SlotFile:
        flags = (os.O_RDWR if writable else os.O_RDONLY) | os.O_NOFOLLOW | os.O_CLOEXEC
        return cls(path, os.open(path, flags), writable)

    def _remap(self) -> None:
        if self._map is not None:
            self._map.close()
        size = os.fstat(self._fd).st_size
        if size < header.HEADER_BYTES:
            raise header.SlotHeaderError(f"{self.path} is {size} bytes, shorter than a slot header")
        prot = mmap.PROT_READ | (mmap.PROT_WRITE if self._writable else 0)
        self._map = mmap.mmap(self._fd, size, flags=mmap.MAP_SHARED, prot=prot)
        self._mapped_bytes = size

    def prefault(self) -> None:
        """Fault every page into this mapping, so that the first save into it writes to resident pages.

        Runs without the GIL, a chunk at a time (``POPULATE_CHUNK_BYTES``). A
        kernel before 5.14 refuses the advice; the first save then faults the
        pages in itself.
        """
        assert self._map is not None and self._writable
        anchor = ctypes.c_char.from_buffer(self._map)
        try:
            start, size = ctypes.addressof(anchor), len(self._map)
            for offset in range(0, size, POPULATE_CHUNK_BYTES):
                length = min(POPULATE_CHUNK_BYTES, size - offset)
                if _libc.madvise(ctypes.c_void_p(start + offset), ctypes.c_size_t(length), _MADV_POPULATE_WRITE):
                    break  # refused (a kernel before 5.14): the rest would be refused alike
        finally:
            del anchor

    @property
    def capacity(self) -> int:
        return self._mapped_bytes - header.HEADER_BYTES

    @property
    def header_view(self) -> memoryview:
        assert self._map is not None
        return memoryview(self._map)[: header.HEADER_BYTES]

    def payload(self, nbytes: int | None = None) -> memoryview:
        assert self._map is not None
        end = len(self._map) if nbytes is None else header.HEADER_BYTES + nbytes
        return memoryview(self._map)[header.HEADER_BYTES : end]

    def read_header(self) -> header.SlotHeader:
        return header.read(self.header_view)

    def refresh(self) -> None:
        """Follow a growth made by the other side."""
        if self.stale:
            self._remap()

    def grow(self, capacity: int) -> None:
        """Enlarge the slot; only its current owner may call this.

        The header keeps its generation, so a generation never repeats on a
        file (a pooled spare's writers each start from the header's).
        """
        generation = self.read_header().generation
        size = _reserve(self._fd, capacity)
        self._remap()
        header.write_empty(self.header_view, size - header.HEADER_BYTES, generation)

    def linked_at(self, path: Path) -> bool:
        """Whether ``path`` names this very file, so that whoever opens it there maps what this mapping maps.

        A directory emptied under a live mapping, or replaced by another one,
        leaves the mapping on a file nobody else can open any more.
        """
        try:
            named = os.stat(path, follow_symlinks=False)
        except (FileNotFoundError, NotADirectoryError):
            return False
        mine = os.fstat(self._fd)
        return (named.st_dev, named.st_ino) == (mine.st_dev, mine.st_ino)

    @property
    def owner_uid(self) -> int:
        return os.fstat(self._fd).st_uid

    def close(self) -> None:
        if self._map is not None:
            # A tensor may still view the mapping; the kernel then drops it with the process.
            with contextlib.suppress(BufferError):
                self._map.close()
            self._map = None
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def _reserve(fd: int, capacity: int) -> int:
    """Size the file behind ``fd`` for ``capacity`` payload bytes, its pages reserved; the file's size."""
    size = file_size_for(capacity)
    os.ftruncate(fd, size)
    os.posix_fallocate(fd, 0, size)
    return size


@dataclass(frozen=True)
class ShmUsage:
    free_bytes: int
    held_by_job: int


def usage(shm_dir: Path, job_globs: tuple[str, ...]) -> ShmUsage:
    stats = os.statvfs(shm_dir)
    held = sum(p.stat().st_blocks * 512 for glob in job_globs for p in shm_dir.glob(glob) if p.is_file())
    return ShmUsage(stats.f_bavail * stats.f_frsize, held)


def check_capacity(
    shm_dir: Path, job_globs: tuple[str, ...], per_rank_bytes: int, local_world_size: int, already_mine: int,
    pooled_bytes: int = 0,
) -> None:
    """Fail before writing anything if the local ranks' slots cannot all fit.

    Too small a /dev/shm is the most common failure of shared-memory
    checkpointing in Kubernetes (the default is 64 MiB), and tmpfs reports it
    as SIGBUS in the middle of a copy, so we check up front and say which
    setting to raise.
    """
    now = usage(shm_dir, job_globs)
    needed = per_rank_bytes * local_world_size + pooled_bytes
    available = now.free_bytes + now.held_by_job
    if needed <= available:
        return
    pooled = f" and {_gib(pooled_bytes)} of pooled spares" if pooled_bytes else ""
    raise ShmCapacityError(
        f"shared memory at {shm_dir} is too small: {local_world_size} local rank(s) need "
        f"{_gib(needed)} for their slots ({_gib(per_rank_bytes)} each{pooled}), but only "
        f"{_gib(available)} is available ({_gib(now.free_bytes)} free, "
        f"{_gib(now.held_by_job - already_mine)} held by other ranks of this job). "
        "Raise the CheckpointPolicy's spec.sharedMemory.sizeLimit (in Kubernetes) or the size of "
        "/dev/shm (docker --shm-size), or lower spec.sharedMemory.slotsPerRank / Checkpointer(slots=...), "
        "or keep one slot per rank and pool a spare (slotsPerRank: 1, pooledSpares: 1)."
    )


def _gib(nbytes: int) -> str:
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MiB"
