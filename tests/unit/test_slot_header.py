"""The slot header: a slot is complete only after a whole publish."""

from __future__ import annotations

import pytest

from stowaway.slots import header


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
