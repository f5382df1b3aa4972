"""xxh3-64 checksums, computed while writing and checked while reading.

xxh3 runs at tens of GB/s per core, so checking every byte costs little next
to the write itself; a cryptographic hash would not.
"""

from __future__ import annotations

from pathlib import Path

import xxhash

CHUNK_BYTES = 16 * 2**20


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
