"""A rank's other slots are allocated and faulted in behind its back once the first save has sized them.

Otherwise the save that first uses a slot, typically one made while the
previous save is still persisting, pays the allocation and a page fault per
page: several times a steady save.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

import pytest

from stowaway.client.pool import Owner, SlotPool
from stowaway.client.spare_slots import SpareSlots
from stowaway.slots import naming, shm
from stowaway.storage import layout

CAPACITY = 8 * 2**20


def resident_bytes(path: Path) -> int:
    """Bytes of ``path`` mapped into this process and backed by pages: what a save would not fault in."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if "-" in fields[0] and ":" not in fields[0]:
            inside = fields[-1] == str(path)
        elif inside and fields[0] == "Rss:":
            total += int(fields[1]) * 1024
    return total


@pytest.fixture
def pool(short_tmp: Path):
    shm_dir = Path("/dev/shm") / short_tmp.name
    shm_dir.mkdir()
    pool = SlotPool(shm_dir, "spare", rank=0, count=3, local_world_size=1)
    yield pool
    pool.close()


def test_the_other_slots_are_allocated_and_resident_before_a_save_uses_them(pool):
    cond = threading.Condition()
    spares = SpareSlots(pool, cond)
    pool.ensure_capacity(pool.slots[0], CAPACITY)
    with cond:
        spares.prepare(pool.slots[0].capacity)
        # No save can take a slot while the allocator works on it: the allocator needs this lock to give it back.
        assert [slot.owner for slot in pool.slots] == [Owner.RANK, Owner.ALLOCATOR, Owner.ALLOCATOR]
    spares.join(timeout=60)

    assert [slot.owner for slot in pool.slots] == [Owner.RANK] * 3
    for slot in pool.slots[1:]:
        assert slot.file is not None and slot.capacity >= CAPACITY
        assert os.stat(slot.file.path).st_blocks * 512 >= shm.file_size_for(CAPACITY), "pages not reserved"
        assert resident_bytes(slot.file.path) >= CAPACITY, "pages not faulted into the rank's mapping"
    assert resident_bytes(pool.slots[0].file.path) < CAPACITY, "the first slot was faulted in at allocation"


def test_a_slot_that_cannot_be_allocated_ahead_is_left_to_the_save_that_needs_it(pool, caplog):
    cond = threading.Condition()
    spares = SpareSlots(pool, cond)
    pool.ensure_capacity(pool.slots[0], CAPACITY)
    stats = os.statvfs(pool.shm_dir)
    too_big = stats.f_bavail * stats.f_frsize
    with caplog.at_level(logging.WARNING, logger="stowaway"), cond:
        spares.prepare(too_big)
    spares.join(timeout=60)

    assert [slot.owner for slot in pool.slots] == [Owner.RANK] * 3
    assert pool.slots[1].file is None and pool.slots[2].file is None
    assert not naming.slot_path(pool.shm_dir, "spare", 0, 1).exists()
    assert "could not allocate slot 1 ahead of its first use" in caplog.text
    assert "shared memory at" in caplog.text, "the warning does not say why"


def test_a_save_racing_the_allocation_of_the_spare_slot_lands_in_it_and_both_steps_commit(
    start_sidecar, start_rank, storage
):
    sidecar = start_sidecar(extra=["--write-rate-limit", str(2 * 2**20)])
    rank = start_rank(sidecar, job="spare")
    rank.save(1, numel=2**20)
    rank.save(2, numel=2**20)
    assert not (layout.step_dir(storage / "spare", 1) / layout.MANIFEST).exists(), \
        "step 1 committed before step 2 was saved; the test proves nothing"

    assert rank.wait(1, timeout=60)["committed"] and rank.wait(2, timeout=60)["committed"]
    slots = sorted(sidecar.shm_dir.glob(naming.job_slot_glob("spare")))
    assert len(slots) == 2 and slots[0].stat().st_size == slots[1].stat().st_size
    restored = rank.call(op="load", timeout=60)
    assert restored == {"step": 2, "intact": True, "numel": 2**20}
    rank.exit()
