"""Reading byte ranges of stored files through descriptors the sidecar passed, each range checked.

The storage is mounted only into the sidecar; for a resharding restore it
opens a step's files read-only and passes the descriptors over the rank's
socket (``Link.open_files``). A rank reads the ranges it needs with
``preadv``, straight into the destination's memory where the caller gives
it, and checks each against the manifest's piece checksums
(``checksum.Pieces``): the pieces a range touches are read whole, the
bytes around the range into scratch buffers, and hashed together.

Pieces read only in part for a range (its first and last) are kept, a few
per file, checked: the next range often lies in them (small tensors sit
together), and is then served without reading again.

Where the sidecar's shared memory still holds a file (a restart on the same
pod with another number of ranks), it passes the slot instead, and the same
ranges are read from behind the slot's header, checked the same way. Where
the storage passes no files (a bucket alone), the ranges are staged by the
sidecar through one of the rank's slots (``staged_ranges``), and checked the
same way again: every source is a ``ByteSource``.

A file of a manifest without pieces (format version 1) can only be checked
whole: its first read reads and checks all of it, and later reads are served
from that copy.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Protocol

from stowaway.errors import CheckpointCorrupt
from stowaway.storage import checksum, manifest

# Checked pieces kept per file for the ranges that follow (each is at most a few MiB).
KEPT_PIECES = 16


class ByteSource(Protocol):
    """Where a stored file's bytes are read from."""

    def readv(self, buffers: list[memoryview], offset: int) -> int:
        """Fill ``buffers`` in order from byte ``offset`` of the file; how many bytes it filled (0 past its end)."""
        ...

    def size(self) -> int | None:
        """The file's size where the source can tell it (a stored file), else None (a slot holds more)."""
        ...

    def close(self) -> None: ...


class Descriptor:
    """A passed descriptor: a stored file, or a slot holding one whose bytes begin ``base`` bytes in."""

    def __init__(self, fd: int, base: int = 0) -> None:
        self.fd = fd
        self.base = base

    def readv(self, buffers: list[memoryview], offset: int) -> int:
        return os.preadv(self.fd, buffers, self.base + offset)

    def size(self) -> int | None:
        return os.fstat(self.fd).st_size if self.base == 0 else None

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class StoredFile:
    """One rank's file of a committed step, open read-only; ``read`` returns checked bytes."""

    def __init__(self, source: ByteSource, entry: manifest.FileEntry, where: Path, counter: ReadCounter) -> None:
        self.source = source
        self.entry = entry
        self.where = where
        self._counter = counter
        self._pieces = entry.checked_pieces
        self._whole: bytearray | None = None
        # Checked pieces read in part for an earlier range, by index, oldest first.
        self._kept: dict[int, bytes] = {}

    def close(self) -> None:
        self.source.close()

    @property
    def header_bytes(self) -> int:
        """How many bytes to read for the safetensors header: its piece, or (without pieces) all of the file."""
        return self._pieces.header_bytes if self._pieces is not None else self.entry.bytes

    def read(self, begin: int, end: int, into: memoryview | None = None) -> memoryview:
        """The checked bytes ``[begin, end)`` of the file, in ``into`` (of that length) when given."""
        if not 0 <= begin <= end <= self.entry.bytes:
            raise CheckpointCorrupt(f"{self.where}: bytes {begin}..{end} lie outside its {self.entry.bytes} bytes")
        target = memoryview(bytearray(end - begin)) if into is None else into
        if self._pieces is None:
            whole = self._read_whole()
            target[:] = memoryview(whole)[begin:end]
            return target
        covering = self._pieces.covering(begin, end) if end > begin else range(0)
        if not covering:
            return target
        if all(index in self._kept for index in covering):
            for index in covering:
                first, last = self._pieces.bounds(index, self.entry.bytes)
                start, stop = max(begin, first), min(end, last)
                target[start - begin : stop - begin] = self._kept[index][start - first : stop - first]
            return target
        low = self._pieces.bounds(covering[0], self.entry.bytes)[0]
        high = self._pieces.bounds(covering[-1], self.entry.bytes)[1]
        head, tail = memoryview(bytearray(begin - low)), memoryview(bytearray(high - end))
        self._preadv([head, target, tail], low)
        for index in covering:
            first, last = self._pieces.bounds(index, self.entry.bytes)
            partial = first < begin or last > end
            piece = self._check(index, low, [head, target, tail], partial)
            if partial:
                self._keep(index, piece)
        return target

    def peek(self, begin: int, end: int) -> bytes:
        """The bytes ``[begin, end)`` as stored, unchecked: for comparing with checked ones, which ``read`` then
        checks where they differ. A file checked whole is read whole anyway, and served from that copy."""
        if self._pieces is None:
            return bytes(self.read(begin, end))
        data = memoryview(bytearray(end - begin))
        count = self.source.readv([data], begin)
        self._counter.bytes += count
        return bytes(data[:count])

    def _keep(self, index: int, piece: bytes) -> None:
        self._kept.pop(index, None)
        self._kept[index] = piece
        while len(self._kept) > KEPT_PIECES:
            del self._kept[next(iter(self._kept))]

    def _preadv(self, buffers: list[memoryview], offset: int) -> None:
        total = sum(len(buffer) for buffer in buffers)
        done = 0
        while done < total:
            pending, skip = [], done
            for buffer in buffers:
                if skip >= len(buffer):
                    skip -= len(buffer)
                    continue
                pending.append(buffer[skip:])
                skip = 0
            count = self.source.readv(pending, offset + done)
            if count == 0:
                raise CheckpointCorrupt(f"{self.where} ends at byte {offset + done}, where the manifest says it "
                                        f"holds {self.entry.bytes}")
            done += count
        self._counter.bytes += total

    def _check(self, index: int, low: int, buffers: list[memoryview], wanted: bool) -> bytes:
        """Check piece ``index``, whose bytes lie in ``buffers`` (read from ``low`` on); return them if
        ``wanted`` (to keep), else nothing."""
        assert self._pieces is not None
        begin, end = self._pieces.bounds(index, self.entry.bytes)
        parts = []
        cursor = low
        hasher = checksum.new()
        for buffer in buffers:
            start, stop = max(begin, cursor), min(end, cursor + len(buffer))
            if start < stop:
                parts.append(buffer[start - cursor : stop - cursor])
                hasher.update(parts[-1])
            cursor += len(buffer)
        if hasher.hexdigest() != self._pieces.digests[index]:
            raise CheckpointCorrupt(f"{self.where}: bytes {begin}..{end} do not match the manifest's xxh3-64 "
                                    f"checksum of that piece; `stowaway verify` names what differs")
        return b"".join(parts) if wanted else b""

    def _read_whole(self) -> bytearray:
        if self._whole is None:
            whole = bytearray(self.entry.bytes)
            self._preadv([memoryview(whole)], 0)
            digest = checksum.of_bytes(memoryview(whole))
            size = self.source.size()
            if (size is not None and size != self.entry.bytes) or digest != self.entry.xxh3_64:
                raise CheckpointCorrupt(f"{self.where} does not match the manifest's size and xxh3-64 checksum; "
                                        "`stowaway verify` names what differs")
            self._whole = whole
        return self._whole


class ReadCounter:
    """Bytes read by one restore, from storage (what ``Restore.bytes_read`` reports) or from slots."""

    def __init__(self) -> None:
        self.bytes = 0


def read_manifest(fd: int, where: Path) -> manifest.Manifest:
    """The manifest behind ``fd`` (the sidecar opened it; it is written whole before it is renamed into place)."""
    size = os.fstat(fd).st_size
    data = os.pread(fd, size, 0)
    return manifest.manifest_from_bytes(where, data)
