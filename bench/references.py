"""The physical references: what copying and writing the same bytes costs without Stowaway.

Each one does only the unavoidable work, in the rank's own process, on the
same tensors and the same storage as Stowaway, so that a ratio against it
says how much Stowaway adds.
"""

from __future__ import annotations

import contextlib
import mmap
import os
from collections.abc import Iterator
from pathlib import Path

import torch

from stowaway.client import pinned

PAGE = mmap.PAGESIZE
WRITE_CHUNK = 64 * 2**20


def round_up(nbytes: int) -> int:
    return -(-nbytes // PAGE) * PAGE


class ResidentBuffer:
    """Shared memory whose pages are all allocated and mapped before it is timed."""

    def __init__(self, path: Path, nbytes: int) -> None:
        self.path = path
        self.nbytes = round_up(max(nbytes, 1))
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        os.posix_fallocate(self._fd, 0, self.nbytes)
        self._map = mmap.mmap(self._fd, self.nbytes, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
        self.tensor = torch.frombuffer(self._map, dtype=torch.uint8)

    @contextlib.contextmanager
    def registered_with_cuda(self) -> Iterator[None]:
        """The mapping registered as pinned host memory, as Stowaway registers a slot that receives GPU tensors."""
        address = self.tensor.data_ptr()
        if not pinned.register(address, self.nbytes):
            raise RuntimeError("CUDA refused to pin the reference buffer, so the pinned copy cannot be measured; "
                               "raise RLIMIT_MEMLOCK (ulimit -l)")
        try:
            yield
        finally:
            pinned.unregister(address)

    def views(self, sources: list[torch.Tensor]) -> list[torch.Tensor]:
        """Views of the buffer laid out back to back, one per source tensor, of its dtype and shape."""
        views, offset = [], 0
        for source in sources:
            size = source.numel() * source.element_size()
            offset = -(-offset // source.element_size()) * source.element_size()
            views.append(self.tensor[offset : offset + size].view(source.dtype).view(source.shape))
            offset += size
        return views

    def close(self) -> None:
        del self.tensor
        self._map.close()
        os.close(self._fd)
        self.path.unlink(missing_ok=True)


def copy_into(targets: list[torch.Tensor], sources: list[torch.Tensor]) -> None:
    """Plain ``copy_``: from a GPU, the device-to-host copy an in-process saver makes into pageable memory.

    Back the other way, into the state's own tensors, it is the floor of a restore in place.
    """
    for target, source in zip(targets, sources, strict=True):
        target.copy_(source)


def copy_into_pinned(targets: list[torch.Tensor], sources: list[torch.Tensor]) -> None:
    """Non-blocking copies into pinned ``targets``, then a wait for them: the floor of a GPU save."""
    for target, source in zip(targets, sources, strict=True):
        target.copy_(source, non_blocking=True)
    torch.cuda.synchronize()


def copy_out_fresh(sources: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """What any restore must do at least: new private tensors on ``device`` filled from shared memory."""
    if device.type == "cpu":
        return [source.clone() for source in sources]
    copies = [source.to(device) for source in sources]
    torch.cuda.synchronize()
    return copies


def write_file(buffer: ResidentBuffer, path: Path, direct: bool) -> None:
    """Write the whole buffer sequentially and fdatasync it, as a durable save must."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if direct else 0)
    fd = os.open(path, flags, 0o600)
    try:
        view = memoryview(buffer._map)
        for begin in range(0, buffer.nbytes, WRITE_CHUNK):
            chunk = view[begin : begin + WRITE_CHUNK]
            while chunk:
                chunk = chunk[os.write(fd, chunk) :]
        os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def read_file(buffer: ResidentBuffer, path: Path) -> None:
    """Read a file back from the device (O_DIRECT, so no cached page is counted) into the buffer."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        view = memoryview(buffer._map)
        for begin in range(0, buffer.nbytes, WRITE_CHUNK):
            os.readv(fd, [view[begin : begin + WRITE_CHUNK]])
    finally:
        os.close(fd)
