"""xxh3-64 checksums, computed while writing and checked while reading.

xxh3 runs at tens of GB/s per core, so checking every byte costs little next
to the write itself; a cryptographic hash would not.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import xxhash

CHUNK_BYTES = 16 * 2**20
# Pieces checked on their own, so a rank can verify the byte ranges it reads without reading the whole file:
# at least this large (a page multiple, so every piece boundary suits O_DIRECT), and at most this many per file.
MIN_PIECE_BYTES = 64 * 2**10
MAX_PIECES = 1024
_PAGE = 4096


def new() -> xxhash.xxh3_64:
    return xxhash.xxh3_64()


def of_bytes(data: bytes | memoryview) -> str:
    return xxhash.xxh3_64_hexdigest(data)


def of_file(path: Path) -> str:
    hasher = new()
    with path.open("rb", buffering=0) as handle:
        buffer = bytearray(CHUNK_BYTES)
        view = memoryview(buffer)
        while count := handle.readinto(buffer):
            hasher.update(view[:count])
    return hasher.hexdigest()


@dataclass(frozen=True)
class Pieces:
    """A file's checksums piece by piece: its safetensors header, then its data in ``piece_bytes`` pieces.

    The header is a piece of its own, so that reading the header of every
    saved rank (which a resharding restore does) costs the header only.
    """

    header_bytes: int
    piece_bytes: int
    digests: list[str]

    def bounds(self, index: int, nbytes: int) -> tuple[int, int]:
        """The file offsets ``[begin, end)`` of piece ``index`` of a file of ``nbytes``."""
        if index == 0:
            return 0, self.header_bytes
        begin = self.header_bytes + (index - 1) * self.piece_bytes
        return begin, min(begin + self.piece_bytes, nbytes)

    def covering(self, begin: int, end: int) -> range:
        """The indices of the pieces that hold the bytes ``[begin, end)``."""
        first = 0 if begin < self.header_bytes else 1 + (begin - self.header_bytes) // self.piece_bytes
        last = 0 if end <= self.header_bytes else 1 + (end - 1 - self.header_bytes) // self.piece_bytes
        return range(first, last + 1)


def piece_bytes_for(data_bytes: int) -> int:
    """The piece size for ``data_bytes`` of tensor data: at least ``MIN_PIECE_BYTES``, at most ``MAX_PIECES``."""
    wanted = max(MIN_PIECE_BYTES, -(-data_bytes // MAX_PIECES))
    return -(-wanted // _PAGE) * _PAGE


def digests_of(payload: memoryview, nbytes: int) -> tuple[str, Pieces]:
    """The checksum of the first ``nbytes`` of ``payload`` whole and piece by piece: what a manifest's entry
    records of a file written from a slot."""
    return of_bytes(payload[:nbytes]), pieces_of(payload, nbytes)


def pieces_of(payload: memoryview, nbytes: int) -> Pieces:
    """The piece checksums of a safetensors image of ``nbytes`` at the start of ``payload``."""
    header_bytes = min(nbytes, 8 + struct.unpack_from("<Q", payload)[0]) if nbytes >= 8 else nbytes
    pieces = Pieces(header_bytes, piece_bytes_for(nbytes - header_bytes), [])
    count = 1 + -(-(nbytes - header_bytes) // pieces.piece_bytes)
    for index in range(count):
        begin, end = pieces.bounds(index, nbytes)
        pieces.digests.append(of_bytes(payload[begin:end]))
    return pieces
