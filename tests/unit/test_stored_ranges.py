"""Ranges of a stored file are read through its descriptor and checked piece by piece, or whole for old files."""

from __future__ import annotations

import os
import struct
from pathlib import Path

import pytest

from stowaway.client.stored_files import Descriptor, ReadCounter, StoredFile
from stowaway.errors import CheckpointCorrupt
from stowaway.storage import checksum, manifest

HEADER = 4096


def image(data_bytes: int) -> bytes:
    """A file shaped like a saved one: an 8-byte length and a header padded to a page, then the data."""
    header = struct.pack("<Q", HEADER - 8) + b"{" + b" " * (HEADER - 10) + b"}"
    return header + bytes((index * 7) % 251 for index in range(data_bytes))


def opened(tmp_path: Path, data: bytes, pieces: bool = True) -> tuple[StoredFile, ReadCounter, Path]:
    path = tmp_path / "rank-00000-of-00001.safetensors"
    path.write_bytes(data)
    found = checksum.pieces_of(memoryview(data), len(data)) if pieces else None
    entry = manifest.FileEntry.written(0, path.name, len(data), checksum.of_bytes(data), found)
    counter = ReadCounter()
    return StoredFile(Descriptor(os.open(path, os.O_RDONLY)), entry, path, counter), counter, path


def test_pieces_split_the_header_from_the_data_and_stay_few_for_large_files():
    data = image(5 * checksum.MIN_PIECE_BYTES + 3)
    found = checksum.pieces_of(memoryview(data), len(data))
    assert (found.header_bytes, found.piece_bytes, len(found.digests)) == (HEADER, checksum.MIN_PIECE_BYTES, 7)
    assert found.bounds(0, len(data)) == (0, HEADER)
    assert found.bounds(6, len(data)) == (HEADER + 5 * checksum.MIN_PIECE_BYTES, len(data))
    assert list(found.covering(HEADER - 1, HEADER + 1)) == [0, 1]
    assert checksum.piece_bytes_for(8 * 2**30) == 8 * 2**20, "an 8 GiB file has 1024 pieces, not 131072"


def test_a_range_is_read_with_the_pieces_it_touches_and_checked(tmp_path):
    data = image(4 * checksum.MIN_PIECE_BYTES)
    stored, counter, _ = opened(tmp_path, data)
    begin, end = HEADER + 100, HEADER + checksum.MIN_PIECE_BYTES + 5
    into = bytearray(end - begin)
    assert stored.read(begin, end, memoryview(into)) is not None and bytes(into) == data[begin:end]
    assert counter.bytes == 2 * checksum.MIN_PIECE_BYTES, "two pieces touched, two pieces read"
    # The partly read pieces are kept: a range inside them costs nothing more.
    assert bytes(stored.read(HEADER + 5, HEADER + 50)) == data[HEADER + 5 : HEADER + 50]
    assert counter.bytes == 2 * checksum.MIN_PIECE_BYTES
    assert bytes(stored.read(0, HEADER)) == data[:HEADER] and counter.bytes == 2 * checksum.MIN_PIECE_BYTES + HEADER
    stored.close()


def test_a_flipped_byte_is_found_by_a_range_that_touches_its_piece_only(tmp_path):
    data = bytearray(image(3 * checksum.MIN_PIECE_BYTES))
    stored, _, path = opened(tmp_path, bytes(data))
    data[HEADER + 2 * checksum.MIN_PIECE_BYTES + 9] ^= 1
    path.write_bytes(bytes(data))
    assert bytes(stored.read(HEADER, HEADER + 10)) == data[HEADER : HEADER + 10]
    with pytest.raises(CheckpointCorrupt, match=r"do not match the manifest's xxh3-64 checksum of that piece"):
        stored.read(HEADER + 2 * checksum.MIN_PIECE_BYTES, HEADER + 2 * checksum.MIN_PIECE_BYTES + 1)
    assert stored.peek(HEADER + 2 * checksum.MIN_PIECE_BYTES + 9, HEADER + 2 * checksum.MIN_PIECE_BYTES + 10) \
        == bytes([data[HEADER + 2 * checksum.MIN_PIECE_BYTES + 9]]), "peek reads as stored, unchecked"
    stored.close()


def test_a_file_without_pieces_is_read_and_checked_whole_once(tmp_path):
    data = bytearray(image(2 * checksum.MIN_PIECE_BYTES))
    stored, counter, path = opened(tmp_path, bytes(data), pieces=False)
    assert stored.header_bytes == len(data)
    assert bytes(stored.read(HEADER, HEADER + 3)) == data[HEADER : HEADER + 3]
    assert bytes(stored.read(10, 20)) == data[10:20] and counter.bytes == len(data)
    stored.close()
    data[-1] ^= 1
    path.write_bytes(bytes(data))
    corrupt, _, _ = opened(tmp_path, bytes(data), pieces=False)
    corrupt.entry.__dict__["xxh3_64"] = checksum.of_bytes(bytes(image(2 * checksum.MIN_PIECE_BYTES)))
    with pytest.raises(CheckpointCorrupt, match=r"does not match the manifest's size and xxh3-64 checksum"):
        corrupt.read(0, 8)
    corrupt.close()
