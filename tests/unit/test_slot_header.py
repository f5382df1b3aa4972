"""The slot header: a slot is complete only after a whole publish."""

from __future__ import annotations

import os

import pytest

from stowaway.sidecar.restore import MemorySource
from stowaway.slots import header, naming
from stowaway.storage import manifest


def fresh() -> memoryview:
    buffer = memoryview(bytearray(header.HEADER_BYTES))
    header.write_empty(buffer, capacity=1024)
    return buffer


def test_an_empty_slot_is_not_complete():
    assert not header.read(fresh()).complete


def test_a_slot_being_written_is_not_complete():
    buffer = fresh()
    header.begin_write(buffer, generation=1)
    found = header.read(buffer)
    assert found.state is header.SlotState.WRITING
    assert not found.complete


def test_a_published_slot_is_complete_with_its_step_and_size():
    buffer = fresh()
    header.begin_write(buffer, generation=7)
    header.finish_write(buffer, step=42, generation=7, payload_nbytes=100)
    found = header.read(buffer)
    assert found.complete and found.step == 42 and found.payload_nbytes == 100 and found.capacity == 1024


def test_rewriting_a_published_slot_makes_it_torn_until_published_again():
    buffer = fresh()
    header.begin_write(buffer, generation=1)
    header.finish_write(buffer, step=1, generation=1, payload_nbytes=10)
    header.begin_write(buffer, generation=2)
    assert not header.read(buffer).complete


def test_foreign_bytes_are_not_a_slot():
    with pytest.raises(header.SlotHeaderError, match="not a Stowaway slot"):
        header.read(bytes(header.HEADER_BYTES))


@pytest.mark.parametrize("length", [0, 8, 55])
def test_a_slot_file_shorter_than_a_header_is_no_slot_yet(length):
    # A slot file is created empty and sized after; a kill in between leaves it so.
    with pytest.raises(header.SlotHeaderError, match="too short for a slot header"):
        header.read(bytes(length))


def test_the_sidecar_passes_over_an_empty_slot_file_to_the_slot_that_holds_the_step(tmp_path):
    job, step, payload = "j", 3, 100
    whole = bytearray(header.HEADER_BYTES)
    header.write_empty(memoryview(whole), capacity=payload)
    header.begin_write(memoryview(whole), generation=1)
    header.finish_write(memoryview(whole), step=step, generation=1, payload_nbytes=payload)
    naming.slot_path(tmp_path, job, 0, 0).write_bytes(b"")  # the first one a glob finds
    naming.slot_path(tmp_path, job, 0, 1).write_bytes(bytes(whole))
    entry = manifest.FileEntry(rank=0, name="rank-00000-of-00001.safetensors", bytes=payload, xxh3_64="0" * 16)
    fd = MemorySource(tmp_path, job, os.getuid()).slot_holding(entry, step)
    assert fd is not None
    try:
        assert os.fstat(fd).st_ino == naming.slot_path(tmp_path, job, 0, 1).stat().st_ino
    finally:
        os.close(fd)
