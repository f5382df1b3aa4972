"""A rank's slots are allocated and faulted in behind its back once a save, or ``reserve``, has sized them.

Otherwise the save that first uses a slot, the first save or one made while
the previous save is still persisting, pays the allocation and a page fault
per page: several times a steady save.
"""

from __future__ import annotations

import logging
import mmap
import os
import threading
from pathlib import Path

import pytest
import torch

from data_path.processes import wait_for
from stowaway import Checkpointer
from stowaway.client import spare_slots
from stowaway.client.ledger import SlotLedger, SlotState
from stowaway.client.pool import SlotPool
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
    ledger = SlotLedger(len(pool.slots), cond)
    spares = spare_slots.SpareSlots(pool, ledger)
    pool.ensure_capacity(pool.slots[0], CAPACITY)
    with cond:
        spares.prepare(pool.slots[0].capacity)
        # No save can take a slot while the allocator works on it: the allocator needs this lock to give it back.
        assert ledger.states() == [SlotState.IDLE, SlotState.ALLOCATING, SlotState.ALLOCATING]
    spares.join(timeout=60)

    assert ledger.states() == [SlotState.IDLE] * 3
    for slot in pool.slots[1:]:
        assert slot.file is not None and slot.capacity >= CAPACITY
        assert os.stat(slot.file.path).st_blocks * 512 >= shm.file_size_for(CAPACITY), "pages not reserved"
        assert resident_bytes(slot.file.path) >= CAPACITY, "pages not faulted into the rank's mapping"
    assert resident_bytes(pool.slots[0].file.path) < CAPACITY, "the first slot was faulted in at allocation"


def test_faulting_a_slot_in_lets_the_rank_map_memory_meanwhile_and_leaves_every_page_resident(short_tmp):
    """The prefault holds the process's mmap lock while it faults a range in; an allocation of the training
    thread that maps memory must not wait for a whole slot (a save right after the first waited seconds)."""
    path = Path("/dev/shm") / f"{short_tmp.name}-prefault"
    size = 64 * shm.POPULATE_CHUNK_BYTES + 3 * 4096  # many chunks, and a tail shorter than one
    slot = shm.SlotFile.create(path, size)
    try:
        worker = threading.Thread(target=slot.prefault)
        worker.start()
        wait_for(lambda: resident_bytes(path) > 0, "the prefault to start")
        with mmap.mmap(-1, 2**20):  # takes the mmap lock for writing, as a large tensor allocation does
            mapped_at = resident_bytes(path)
        worker.join(timeout=120)
        assert not worker.is_alive(), "faulting 512 MiB in took more than 2 minutes"
        assert mapped_at < size, "mapping memory waited for the whole slot to be faulted in"
        # Polled: the kernel may be migrating a page (compaction, which this VM's free page reporting runs
        # often), and a page being migrated is briefly out of the process's page tables.
        wait_for(lambda: resident_bytes(path) >= size, "every page of the slot, the tail included, to be resident",
                 timeout=10)
    finally:
        slot.close()
        path.unlink()


def test_reserve_makes_every_slot_resident_before_the_first_save_which_then_lands_in_one_of_them(
    start_sidecar, caplog
):
    caplog.set_level(logging.INFO, logger="stowaway")
    state = {"w": torch.randn(2**21), "step": 7}
    sidecar = start_sidecar()
    with Checkpointer(job="reserve", socket=sidecar.socket, rank=0, world_size=1, slots=2, timeout=30) as ckpt:
        ckpt.reserve(state)
        paths = [naming.slot_path(sidecar.shm_dir, "reserve", 0, index) for index in range(2)]
        wait_for(lambda: all(path.exists() and resident_bytes(path) >= 2**23 for path in paths),
                 "both slots allocated and faulted into the rank's mapping before any save")
        files = {path: (path.stat().st_ino, path.stat().st_size) for path in paths}
        ckpt.save(1, state).wait(30)
        assert {path: (path.stat().st_ino, path.stat().st_size) for path in paths} == files, \
            "the first save allocated or grew a slot of its own"
        step, restored = ckpt.load()
    assert step == 1 and torch.equal(restored["w"], state["w"]) and restored["step"] == 7

    # A restarted rank finds its slots in shared memory, but its new mapping of them would still fault.
    with Checkpointer(job="reserve", socket=sidecar.socket, rank=0, world_size=1, slots=2, timeout=30) as ckpt:
        ckpt.reserve(state, wait=True)
        assert any(resident_bytes(path) >= 2**23 for path in paths), "reserve(wait=True) returned with no slot ready"
        wait_for(lambda: all(resident_bytes(path) >= 2**23 for path in paths),
                 "both slots left by the last process faulted into the new mapping")
        caplog.clear()
        step, restored = ckpt.load()
        assert "restored step 1 from memory" in caplog.text
        assert step == 1 and torch.equal(restored["w"], state["w"]), "reserving changed the step the slot held"
        ckpt.save(2, state).wait(30)
        assert {path: (path.stat().st_ino, path.stat().st_size) for path in paths} == files


def test_spares_are_allocated_at_the_lowest_priority_so_that_saves_meanwhile_keep_the_cores(pool):
    cond = threading.Condition()
    ledger = SlotLedger(len(pool.slots), cond)
    spares = spare_slots.SpareSlots(pool, ledger)
    pool.ensure_capacity(pool.slots[0], CAPACITY)
    with cond:
        spares.prepare(pool.slots[0].capacity)
        allocator = spares._thread
        assert allocator is not None
        # The allocator cannot hand the spare back while this test holds the lock, so it is still alive here.
        wait_for(lambda: pool.slots[1].file is not None and resident_bytes(pool.slots[1].file.path) >= CAPACITY,
                 "the first spare allocated and faulted in")
        assert allocator.is_alive() and allocator.native_id is not None
        assert os.getpriority(os.PRIO_PROCESS, allocator.native_id) == spare_slots.BACKGROUND_NICE
        assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) < spare_slots.BACKGROUND_NICE, \
            "the priority of the training thread changed too"
    spares.join(timeout=60)
    assert ledger.states() == [SlotState.IDLE] * 3


def test_reserve_prepares_the_slot_already_large_enough_first_and_hands_it_back_resident(pool):
    cond = threading.Condition()
    ledger = SlotLedger(len(pool.slots), cond)
    spares = spare_slots.SpareSlots(pool, ledger)
    pool.ensure_capacity(pool.slots[2], CAPACITY)
    with cond:
        first = spares.prepare(CAPACITY, every=True)
        assert first == 2, "the slot already large enough, the cheapest to make ready, is not prepared first"
        assert ledger.states() == [SlotState.ALLOCATING] * 3
        assert cond.wait_for(lambda: ledger.state(2) is SlotState.IDLE, timeout=60)
        assert resident_bytes(pool.slots[2].file.path) >= CAPACITY, "handed back before it was faulted in"
    spares.join(timeout=60)
    assert ledger.states() == [SlotState.IDLE] * 3
    assert all(slot.capacity >= CAPACITY for slot in pool.slots)


def test_a_slot_that_cannot_be_allocated_ahead_is_left_to_the_save_that_needs_it(pool, caplog):
    cond = threading.Condition()
    ledger = SlotLedger(len(pool.slots), cond)
    spares = spare_slots.SpareSlots(pool, ledger)
    pool.ensure_capacity(pool.slots[0], CAPACITY)
    stats = os.statvfs(pool.shm_dir)
    too_big = stats.f_bavail * stats.f_frsize
    with caplog.at_level(logging.WARNING, logger="stowaway"), cond:
        spares.prepare(too_big)
    spares.join(timeout=60)

    assert ledger.states() == [SlotState.IDLE] * 3
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


def test_slots_grown_for_a_bigger_state_stop_growing_once_they_hold_it(start_sidecar):
    """A spare is prepared for the state just saved, not for the slot it was saved in, which has headroom.

    Prepared for the slot's capacity, each save grew the other slot by the
    headroom (10%) again, since the two slots are written in turn: after a
    state grew once, the slots grew without end, and a long run's ranks were
    killed for memory (the kill campaign found it, at its 40th trial).
    """
    sidecar = start_sidecar()
    with Checkpointer(job="grows", socket=sidecar.socket, rank=0, world_size=1, slots=2, timeout=60) as ckpt:
        ckpt.save(1, {"w": torch.ones(2**16)}).wait(60)
        ckpt._slots.join_spares()
        big = {"w": torch.ones(2**18)}
        for step in range(2, 14):
            ckpt.save(step, big).wait(60)
            ckpt._slots.join_spares()
        capacities = [slot.capacity for slot in ckpt._slots.pool.slots]
    nbytes = 2**18 * 4
    assert all(nbytes <= capacity <= nbytes * 1.25 for capacity in capacities), capacities
