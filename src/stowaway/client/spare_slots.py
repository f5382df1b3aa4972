"""Allocating a rank's slots in the background, once a save or ``reserve`` has shown how big a slot must be.

A fresh slot costs the save that first uses it the allocation and a page
fault per page, which a steady save does not pay. The first slot pays it
unless ``Checkpointer.reserve`` gave the state's size ahead of the first
save; the others are prepared once the first save has shown it, so that a
save made while the previous one is still in flight also writes at memcpy
speed. The allocator holds the slots it prepares (``SlotState.ALLOCATING``
in the ledger), so no save takes a slot half allocated; a failure leaves the
slot to be allocated, and the error raised, by the save that needs it.

The first slot ``reserve`` prepares is the one the first save will write,
and may be waiting for; every other is a spare, for a save made while the
previous one still persists, and the saves meanwhile write another slot. So
the allocator runs at the lowest priority for the spares: its page zeroing
and faulting then yield the cores to the saves and the training loop
instead of slowing them (docs/benchmarks.md, "Allocation at the
first-touch reference").
"""

from __future__ import annotations

import logging
import os
import threading

from stowaway.client.ledger import SlotLedger
from stowaway.client.pool import ClientSlot, SlotPool
from stowaway.errors import ShmCapacityError

log = logging.getLogger("stowaway")
# The lowest priority a thread may give itself without privileges.
BACKGROUND_NICE = 19


class SpareSlots:
    def __init__(self, pool: SlotPool, ledger: SlotLedger) -> None:
        self._pool = pool
        self._ledger = ledger
        self._thread: threading.Thread | None = None

    def prepare(self, capacity: int, every: bool = False) -> int | None:
        """Start allocating every idle slot smaller than ``capacity``, unless a preparation is still running.

        With ``every`` (``reserve``), the idle slots already large enough are
        faulted into this process's mapping too (a slot a previous process of
        the rank left holds its pages, but a new mapping still faults on
        each), and the first slot is prepared at the process's priority, for
        the first save. Call with the shared lock held, so that the slots
        chosen are lent before anything else can take them. Returns the slot
        prepared first (the ledger moves it back to idle once it is ready),
        or None when nothing was started: one already large enough, the
        cheapest, else the next a save would take.
        """
        if self._thread is not None and self._thread.is_alive():
            return None
        chosen = [self._pool.slots[index] for index in self._ledger.idle()
                  if every or self._pool.slots[index].capacity < capacity]
        if not chosen:
            return None
        chosen.sort(key=lambda slot: (slot.capacity < capacity, slot.taken_at))
        for slot in chosen:
            self._ledger.lend(slot.index)
        self._thread = threading.Thread(target=self._allocate, args=(chosen, capacity, 1 if every else 0),
                                        name="stowaway-spare-slots", daemon=True)
        self._thread.start()
        return chosen[0].index

    def join(self, timeout: float | None = None) -> None:
        """Wait for a preparation in progress; the pool must not be closed under it."""
        if self._thread is not None:
            self._thread.join(timeout)

    def _allocate(self, slots: list[ClientSlot], capacity: int, urgent: int) -> None:
        """Allocate and fault in ``slots`` in order, the first ``urgent`` of them at the process's priority."""
        for position, slot in enumerate(slots):
            if position == urgent:
                _lower_priority()
            try:
                self._pool.ensure_capacity(slot, capacity)
                assert slot.file is not None
                slot.file.prefault()
            except (OSError, ShmCapacityError) as exc:
                log.warning("rank %d: could not allocate slot %d ahead of its first use (%s); the save that "
                            "needs it will try again", self._pool.rank, slot.index, exc)
            finally:
                self._ledger.allocated(slot.index)


def _lower_priority() -> None:
    """Give the calling thread (on Linux, the nice value is per thread) the lowest priority; it cannot be undone.

    Only this thread: the allocator ends with its preparation, and the next
    one starts at the process's own priority.
    """
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), BACKGROUND_NICE)
    except OSError as exc:  # a seccomp profile may refuse it; the spares are then allocated at full priority
        log.debug("could not lower the priority of the slot allocator: %s", exc)
