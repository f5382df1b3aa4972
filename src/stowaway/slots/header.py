"""The control header at the start of every slot file.

The header makes a slot self-describing, so that a restarted rank or sidecar
can tell a complete slot from a torn one without trusting anybody's memory of
what happened. A writer marks the slot WRITING with a new generation, writes
the payload, then stores the generation again in ``commit_generation`` and
only then sets READY: a slot is complete iff it is READY and both generations
agree. A crash anywhere in between leaves it WRITING, which nothing persists
or restores.
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass

MAGIC = b"STOWSLOT"
LAYOUT_VERSION = 1
# The payload starts on a page boundary so that it can be written with O_DIRECT.
HEADER_BYTES = 4096

_FIELDS = struct.Struct("<8sIIqQQQQ")
_STATE_OFFSET = 12


class SlotState(enum.IntEnum):
    EMPTY = 0
    WRITING = 1
    READY = 2


class SlotHeaderError(ValueError):
    """The bytes at the start of a slot file are not a slot header of this version."""


@dataclass(frozen=True)
class SlotHeader:
    state: SlotState
    step: int
    generation: int
    commit_generation: int
    payload_nbytes: int
    capacity: int

    @property
    def complete(self) -> bool:
        return self.state is SlotState.READY and self.generation == self.commit_generation


def read(buffer: memoryview | bytearray | bytes) -> SlotHeader:
    # A slot file is created empty and sized after: a reader that finds it in between (or left so by a kill)
    # must see "no header yet", as for a file of other bytes, not a struct error.
    if len(buffer) < _FIELDS.size:
        raise SlotHeaderError(f"{len(buffer)} bytes are too short for a slot header ({_FIELDS.size})")
    magic, version, state, step, generation, commit_gen, nbytes, capacity = _FIELDS.unpack_from(buffer)
    if magic != MAGIC:
        raise SlotHeaderError(f"not a Stowaway slot (magic {magic!r})")
    if version != LAYOUT_VERSION:
        raise SlotHeaderError(f"slot layout version {version}, this release reads {LAYOUT_VERSION}")
    try:
        slot_state = SlotState(state)
    except ValueError:
        raise SlotHeaderError(f"slot state {state} is not a known state") from None
    return SlotHeader(slot_state, step, generation, commit_gen, nbytes, capacity)


def write_empty(buffer: memoryview, capacity: int, generation: int = 0) -> None:
    _FIELDS.pack_into(buffer, 0, MAGIC, LAYOUT_VERSION, SlotState.EMPTY, -1, generation, 0, 0, capacity)


def begin_write(buffer: memoryview, generation: int) -> None:
    """Mark the slot torn before the first payload byte changes."""
    current = read(buffer)
    _set_state(buffer, SlotState.WRITING)
    _FIELDS.pack_into(
        buffer, 0, MAGIC, LAYOUT_VERSION, SlotState.WRITING, -1, generation, 0, 0, current.capacity
    )


def finish_write(buffer: memoryview, step: int, generation: int, payload_nbytes: int) -> None:
    """Publish the payload: every field first, READY last."""
    current = read(buffer)
    _FIELDS.pack_into(
        buffer, 0, MAGIC, LAYOUT_VERSION, SlotState.WRITING, step, generation, generation,
        payload_nbytes, current.capacity,
    )
    _set_state(buffer, SlotState.READY)


def _set_state(buffer: memoryview, state: SlotState) -> None:
    struct.pack_into("<I", buffer, _STATE_OFFSET, state)
