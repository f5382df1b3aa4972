"""Allocating a rank's slots in the background, once a save or ``reserve`` has shown how big a slot must be.

A fresh slot costs the save that first uses it the allocation and a page
fault per page, which a steady save does not pay. The first slot pays it
unless ``Checkpointer.reserve`` gave the state's size ahead of the first
save; the others are prepared once the first save has shown it, so that a
save made while the previous one is still in flight also writes at memcpy
speed. The allocator holds the slots it prepares (``SlotState.ALLOCATING``
in the ledger), so no save takes a slot half allocated; a failure leaves the
slot to be allocated, and the error raised, by the save that needs it.
"""

from __future__ import annotations

import logging
import threading

from stowaway.client.ledger import SlotLedger
from stowaway.client.pool import ClientSlot, SlotPool
from stowaway.errors import ShmCapacityError

log = logging.getLogger("stowaway")


class SpareSlots:
    def __init__(self, pool: SlotPool, ledger: SlotLedger) -> None:
        self._pool = pool
        self._ledger = ledger
        self._thread: threading.Thread | None = None

    def prepare(self, capacity: int, every: bool = False) -> None:
        """Start allocating every idle slot smaller than ``capacity``, unless a preparation is still running.

        With ``every``, the idle slots already large enough are faulted into
        this process's mapping too: a slot a previous process of the rank
        left holds its pages, but a new mapping still faults on each. Call
        with the shared lock held, so that the slots chosen are lent before
        anything else can take them.
        """
        if self._thread is not None and self._thread.is_alive():
            return
        chosen = [self._pool.slots[index] for index in self._ledger.idle()
                  if every or self._pool.slots[index].capacity < capacity]
        if not chosen:
            return
        for slot in chosen:
            self._ledger.lend(slot.index)
        self._thread = threading.Thread(target=self._allocate, args=(chosen, capacity),
                                        name="stowaway-spare-slots", daemon=True)
        self._thread.start()

    def join(self, timeout: float | None = None) -> None:
        """Wait for a preparation in progress; the pool must not be closed under it."""
        if self._thread is not None:
            self._thread.join(timeout)

    def _allocate(self, slots: list[ClientSlot], capacity: int) -> None:
        for slot in slots:
            try:
                self._pool.ensure_capacity(slot, capacity)
                assert slot.file is not None
                slot.file.prefault()
            except (OSError, ShmCapacityError) as exc:
                log.warning("rank %d: could not allocate slot %d ahead of its first use (%s); the save that "
                            "needs it will try again", self._pool.rank, slot.index, exc)
            finally:
                self._ledger.allocated(slot.index)
