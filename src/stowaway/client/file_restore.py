"""``load()`` of a step from storage, same number of ranks, onto the CPU: the rank reads its own stored file.

Staged by the sidecar, the file went into a slot and from there into new
tensors: two passes over the state's bytes and, in a new pod, two first
touches of as much memory (the slot's and the tensors'), one after the
other. Here the sidecar opens the file read-only and passes the descriptor
(``Link.open_files``; the storage stays mounted only in the sidecar), and the
rank reads it with ``O_DIRECT`` in chunks into a ring of small buffers:
reader threads only read, each chunk as soon as a buffer is free, while the
oldest chunk read is checksummed on another thread and copied into the
destination tensors on the caller's. The restore takes about the longest of
the read, the checksum and the copy, not the read plus the checksum (as
when one thread read and checksummed: 1.8x the ``O_DIRECT`` read reference
at 1 GiB), and the slot is allocated later, by ``reserve`` or the first save.

The chunks are small, and several are read at once. A ring of 16 MiB
buffers read one after the other took 1.2-2x the read reference of the
same file: the ring is fresh memory, which this VM backs at its first touch,
and eight ranks each faulting 48 MiB in to restore 32 MiB apiece touched
more fresh memory than they read. A ring of 1 MiB chunks with three reads in
flight read as fast as the reference or faster (docs/benchmarks.md,
"Restore from storage read by the rank").

Nothing is returned before the whole file matched the manifest's xxh3-64
checksum. A file found corrupt or unreadable is left to the sidecar to stage
(``Restorer``), which checks it again, counts it, and sets a corrupt step
aside so that the job can save that step number again.

Destinations on a GPU keep the staged path: from the pinned slot the
host-to-device copies run at full speed, from these pageable buffers not.
"""

from __future__ import annotations

import errno
import mmap
import os
import struct
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch

from stowaway.client.link import Link
from stowaway.client.stored_files import read_manifest
from stowaway.errors import CheckpointCorrupt, SaveFailed
from stowaway.format import codec, dtensors, in_place, template
from stowaway.format import safetensors_header as st
from stowaway.format import tree as tree_mod
from stowaway.storage import checksum, direct_io, manifest

CHUNK_BYTES = 2**20
READERS = 3
# One per read in flight, one being checksummed and copied, and one read ahead.
BUFFERS = READERS + 2


def suits(map_location: Any, into: Any) -> bool:
    """Whether every tensor the restore writes lives on the CPU: then this path, else the staged one."""
    if torch.device(map_location).type != "cpu":
        return False
    if into is None:
        return True
    walked = template.walk(into)
    return walked is not None and all(tensor.device.type == "cpu" for tensor in walked.tensors)


def load(link: Link, job: str, rank: int, step: int, allow_pickle: bool, meshes: tuple[Any, ...],
         into: Any) -> tuple[Any, int]:
    """The state of ``step`` read from this rank's stored file, and the bytes read."""
    where = Path(f"step {step} of job {job}")
    opened, fds = link.open_files(step, (rank,))
    if opened.reason is not None:
        raise SaveFailed(opened.reason)
    manifest_fd, fd = fds
    try:
        try:
            entry = read_manifest(manifest_fd, where / "manifest.json").file_for(rank)
        except manifest.ManifestError as exc:
            raise CheckpointCorrupt(str(exc)) from exc
        reader = _FileReader(fd, entry, where / entry.name)
        return reader.state(allow_pickle, meshes, into), entry.bytes
    finally:
        os.close(manifest_fd)
        os.close(fd)


class _FileReader:
    def __init__(self, fd: int, entry: manifest.FileEntry, where: Path) -> None:
        self._fd = fd
        self._entry = entry
        self._where = where
        self._direct = False

    def state(self, allow_pickle: bool, meshes: tuple[Any, ...], into: Any) -> Any:
        size = self._entry.bytes
        stored = os.fstat(self._fd).st_size
        if stored != size:
            raise CheckpointCorrupt(f"{self._where} holds {stored} bytes, the manifest says {size}; "
                                    "`stowaway verify` names what differs")
        header_bytes = 8 + self._header_length()
        # Page-sized and page-aligned, as O_DIRECT needs; unmapped when the last view of them goes.
        chunk = max(CHUNK_BYTES, direct_io.page_round(header_bytes))
        buffers = [mmap.mmap(-1, chunk) for _ in range(BUFFERS)]
        self._direct = direct_io.enable(self._fd)
        hasher = checksum.new()
        starts = iter(range(0, size, chunk))
        # In file order: (buffer, offset, its read); a buffer is read into again once its chunk is copied.
        reads: deque[tuple[int, int, Future[int]]] = deque()
        filler = None
        with ThreadPoolExecutor(READERS, thread_name_prefix="stowaway-read") as reading, \
                ThreadPoolExecutor(1, thread_name_prefix="stowaway-hash") as hashing:

            def read_next(index: int) -> None:
                offset = next(starts, None)
                if offset is not None:
                    reads.append((index, offset, reading.submit(self._read_chunk, buffers[index], offset)))

            try:
                for index in range(BUFFERS):
                    read_next(index)
                while reads:
                    index, offset, read = reads.popleft()
                    data = memoryview(buffers[index])[:read.result()]
                    hashed = hashing.submit(hasher.update, data)
                    if filler is None:
                        layout, tree = codec.parsed_header(data[:header_bytes], size)
                        filler = _Filler(layout, tree, into)
                    filler.copy(np.frombuffer(data, dtype=np.uint8), offset)
                    hashed.result()
                    read_next(index)
            finally:
                for _, _, read in reads:
                    read.cancel()  # after an error: the reads not started yet are not made
        if hasher.hexdigest() != self._entry.xxh3_64:
            raise CheckpointCorrupt(f"{self._where} does not match the manifest's xxh3-64 checksum; "
                                    "`stowaway verify` names what differs")
        assert filler is not None
        return filler.state(allow_pickle, meshes)

    def _header_length(self) -> int:
        first = os.pread(self._fd, 8, 0)
        if len(first) < 8:
            raise CheckpointCorrupt(f"{self._where} is too short for a safetensors header")
        length = int(struct.unpack("<Q", first)[0])
        if length > st.MAX_HEADER_BYTES or 8 + length > self._entry.bytes:
            raise CheckpointCorrupt(f"{self._where} starts with a header length of {length}, which does not fit "
                                    f"its {self._entry.bytes} bytes")
        return length

    def _read_chunk(self, buffer: mmap.mmap, offset: int) -> int:
        """Read the chunk at ``offset`` into ``buffer`` whole (or to the end of the file)."""
        wanted = min(len(buffer), self._entry.bytes - offset)
        view = memoryview(buffer)
        done = 0
        while done < wanted:
            # O_DIRECT moves whole pages: the last chunk is read page-rounded and comes back short.
            end = min(direct_io.page_round(wanted), len(buffer)) if self._direct else wanted
            try:
                count = os.preadv(self._fd, [view[done:end]], offset + done)
            except OSError as exc:
                if not self._direct or exc.errno != errno.EINVAL:
                    raise
                # A filesystem that took the flag but refuses the transfer: read through the page cache.
                direct_io.disable(self._fd)
                self._direct = False
                continue
            if count == 0:
                raise CheckpointCorrupt(f"{self._where} ends at byte {offset + done}, where the manifest says it "
                                        f"holds {self._entry.bytes}")
            done += count
        return wanted


class _Filler:
    """Each stored tensor's destination, and the copying of a chunk's bytes into the ones it overlaps.

    The copies are numpy's (one thread, the GIL released): torch's start its
    intra-op threads, which, spinning beside the read thread on the same
    cores, made the copies take two to three times as long on two cores.
    """

    def __init__(self, layout: st.Layout, tree: dict[str, Any], into: Any) -> None:
        self._tree = tree
        self._start = layout.data_start
        specs = {item.spec.name: item.spec for item in layout.tensors}
        self._destinations: in_place.Destinations | None = None
        given: dict[str, list[torch.Tensor]] = {}
        if into is not None:
            metas = {name: torch.empty(spec.shape, dtype=tree_mod.TORCH_DTYPES[spec.dtype], device="meta")
                     for name, spec in specs.items()}
            self._destinations = in_place.match(tree, metas, into)
            for name, target in self._destinations.targets:
                given.setdefault(name, []).append(target)
        self.tensors: dict[str, torch.Tensor] = {}
        # Given tensors the bytes cannot be read into (not contiguous), filled from a copy once it is checked.
        self._later: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._placed: list[tuple[int, int, np.ndarray]] = []
        for item in layout.tensors:
            targets = given.get(item.spec.name, [])
            if targets and targets[0].is_contiguous():
                read_into, others = targets[0], targets[1:]
            else:
                read_into, others = torch.empty(item.spec.shape, dtype=tree_mod.TORCH_DTYPES[item.spec.dtype]), targets
            # Also where a given tensor is returned instead: the other half of a tie that ``into`` lacks.
            self.tensors[item.spec.name] = read_into
            self._later.extend((other, read_into) for other in others)
            if item.end > item.begin:
                # Detached: the bytes of a Parameter that requires grad are written as any tensor's.
                flat = read_into.detach().reshape(-1).view(torch.uint8).numpy()
                self._placed.append((self._start + item.begin, self._start + item.end, flat))
        self._next = 0

    def copy(self, chunk: np.ndarray, offset: int) -> None:
        """Copy the bytes of ``chunk``, which holds the file's bytes from ``offset`` on, where they belong."""
        end = offset + chunk.size
        placed = self._placed
        while self._next < len(placed):
            begin, stop, flat = placed[self._next]
            if begin >= end:
                return
            low, high = max(begin, offset), min(stop, end)
            np.copyto(flat[low - begin : high - begin], chunk[low - offset : high - offset])
            if stop > end:
                return
            self._next += 1

    def state(self, allow_pickle: bool, meshes: tuple[Any, ...]) -> Any:
        with torch.no_grad():
            for target, source in self._later:
                target.copy_(source)
        replaced = self._destinations.by_node if self._destinations is not None else None
        return tree_mod.unflatten(self._tree, self.tensors, dtensors.Rebuilder(self._tree, meshes), allow_pickle,
                                  replaced)
