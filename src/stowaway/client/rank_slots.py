"""This rank's slots as ``save`` and ``load`` use them: taken when free, sized, registered, handed over.

The slot files are the pool's (``pool``), created at the sidecar's first
welcome, which says where shared memory is; who holds each slot is the
ledger's (``ledger``), and every change of holder goes through it. A slot
taken here is back in the ledger as idle when the caller does not hand it
over, whatever went wrong while it was being written.

A save that finds none of the rank's own slots idle borrows one of the
pod's pooled spares, if it has any and one is free; a load never does
(it reads the slot after the sidecar's answer, when a spare is no longer
the rank's).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from stowaway.client.ledger import SlotLedger, SlotState
from stowaway.client.link import Link
from stowaway.client.pool import ClientSlot, SlotPool
from stowaway.client.spare_slots import SpareSlots
from stowaway.errors import SlotWaitTimeout
from stowaway.format import codec
from stowaway.protocol import messages
from stowaway.slots import header, naming


class RankSlots:
    def __init__(self, job: str, rank: int, count: int, local_world_size: int, link: Link, ledger: SlotLedger,
                 lock: threading.Condition, pooled: int = 0) -> None:
        self._job, self._rank, self._count, self._local_world_size = job, rank, count, local_world_size
        self._pooled = pooled
        self._link = link
        self._ledger = ledger
        self._lock = lock
        self._pool: SlotPool | None = None
        self._spares: SpareSlots | None = None
        self._takes = 0

    @property
    def pool(self) -> SlotPool:
        """The slot files; there from the first welcome, which ``Checkpointer`` waits for before returning."""
        with self._lock:
            assert self._pool is not None
            return self._pool

    def welcomed(self, welcome: messages.Welcome) -> None:
        """A (new) connection: the sidecar has no slot open on it, and says which it still holds (lock held).

        A restarted sidecar may name another directory than the last one:
        slots are allocated there from now on, and each slot whose file it
        would not find is allocated anew once the rank holds it
        (``SlotPool.forget_if_lost``), not here, where another thread may be
        writing it or the sidecar may still be reading it.
        """
        if self._pool is None:
            self._pool = SlotPool(Path(welcome.shm_dir), self._job, self._rank, self._count, self._local_world_size,
                                  self._pooled)
            self._pool.adopt_existing()
            self._spares = SpareSlots(self._pool, self._ledger)
        self._pool.shm_dir = Path(welcome.shm_dir)
        for slot in self._pool.slots + self._pool.pooled:
            slot.registered = False
        self._ledger.welcomed(set(welcome.busy))

    @contextmanager
    def taken(self, step: int, borrow: bool = False) -> Iterator[ClientSlot]:
        """An idle slot for writing ``step`` (see ``take``): waits (bounded) for one; idle again unless handed over."""
        slot = self.take(step, borrow)
        try:
            yield slot
        finally:
            self.give_back_unsent(slot)

    def take(self, step: int, borrow: bool = False) -> ClientSlot:
        """The largest idle slot, of those the least recently taken, for ``step`` (waits, bounded); the caller hands
        it over or gives it back. With ``borrow`` (a save), a free pooled spare when no slot of the rank's is idle.

        Least recently taken: when storage keeps up, every slot is idle at each save, and always writing the
        same one would overwrite the newest committed step in memory with the next; a rank killed in the middle
        of that write could then only restore from storage.
        """
        return self._take(step, borrow)

    def spare_returned(self, index: int) -> None:
        """The ledger's word that this rank gave the pooled spare ``index`` up (lock held): let go of its lock."""
        if self._pool is not None:
            SlotPool.give_back(self._pool.slot(index))

    def give_back_unsent(self, slot: ClientSlot) -> None:
        """The taken ``slot`` is idle again unless it was handed over: whatever happened while it was written."""
        with self._lock:
            if self._ledger.state(slot.index) is SlotState.WRITING:
                self._ledger.abandon(slot.index)

    def write(self, slot: ClientSlot, step: int, encoded: codec.Encoded) -> int:
        """Copy ``encoded`` into the taken ``slot`` as ``step``, published in its header; return its generation."""
        generation = self.begin(slot, encoded)
        codec.write_into(encoded, slot.payload(), slot.views_for(encoded.layout))
        self.finish(slot, step, generation, encoded.nbytes)
        return generation

    def begin(self, slot: ClientSlot, encoded: codec.Encoded) -> int:
        """Size, register (and for device sources pin) the taken ``slot``, and mark it being written; its generation."""
        self.fit(slot, encoded.nbytes)
        assert slot.file is not None
        if encoded.cuda_devices:
            slot.pin()
        generation = slot.next_generation()
        header.begin_write(slot.file.header_view, generation)
        return generation

    def finish(self, slot: ClientSlot, step: int, generation: int, nbytes: int) -> None:
        """Publish the written ``slot`` as ``step`` in its header: complete from now on."""
        assert slot.file is not None
        header.finish_write(slot.file.header_view, step, generation, nbytes)

    def fit(self, slot: ClientSlot, nbytes: int) -> None:
        """Make the taken ``slot`` hold ``nbytes`` and have the sidecar open it."""
        self.pool.ensure_capacity(slot, nbytes)
        self.register(slot)

    def register(self, slot: ClientSlot) -> None:
        if slot.registered:
            return
        self._link.request(("register", slot.index), messages.Register(slot=slot.index, capacity=slot.capacity))
        with self._lock:
            slot.registered = True

    def register_idle(self) -> None:
        """Have the sidecar open every idle slot with a file, so that it can tell which steps they hold.

        Only the training thread takes or lends slots, and ``load`` calls this
        on it, so the idle slots stay idle meanwhile. One whose file the
        sidecar would not find is forgotten instead: registering it would fail.
        """
        pool = self.pool
        for index in self._ledger.idle():
            slot = pool.slots[index]
            pool.forget_if_lost(slot)
            if slot.file is not None:
                self.register(slot)

    def persist(self, slot: ClientSlot, request: messages.Persist) -> bool:
        """Hand the taken ``slot`` to the sidecar to persist (lock held); False when the connection is down."""
        if not (self._link.connected and slot.registered):
            return False
        if naming.is_pooled(slot.index):
            SlotPool.hand_over(slot)
        if not self._link.send(request):
            return False
        self._ledger.persisting(slot.index, request.step, request.generation)
        assert self._spares is not None
        # For the state just saved, not for this slot's capacity: that has headroom, which a spare grown to it
        # would add again, and slots written in turn would then grow by it at every save.
        self._spares.prepare(request.nbytes)
        return True

    def stage(self, slot: ClientSlot, step: int, span: tuple[int, int, int] | None = None) -> messages.ToClient:
        """Hand the taken ``slot`` to the sidecar to fill with ``step`` from storage (or with ``span``: bytes
        ``begin``.. ``begin + nbytes`` of saved rank ``rank``'s file); its ``staged`` or ``failed``."""
        with self._lock:
            self._ledger.staging(slot.index, step)
        rank, begin, nbytes = span if span is not None else (None, None, None)
        return self._link.request(("stage", slot.index), messages.Stage(step=step, slot=slot.index, rank=rank,
                                                                        begin=begin, nbytes=nbytes))

    def reserve(self, nbytes: int, wait: bool) -> None:
        """Allocate every slot for ``nbytes`` in the background; raise at once when shared memory is too small.

        With ``wait``, return once the slot the first save will write is
        ready; the spares go on in the background, as after any first save.
        """
        spares = self._require_spares()
        # A preparation a save started may still run, and a second cannot start alongside it.
        spares.join(self._link.timeout)
        with self._lock:
            self.pool.check_room(nbytes)
            first = spares.prepare(nbytes, every=True)
        if wait and first is not None:
            self._link.wait_until(lambda: self._ledger.state(first) is not SlotState.ALLOCATING,
                                  f"slot {first} to be allocated and faulted in by reserve()", SlotWaitTimeout)

    def join_spares(self) -> None:
        """Wait (bounded) for the background allocation, which may be growing a slot a load is about to read."""
        self._require_spares().join(self._link.timeout)

    def in_flight(self) -> int:
        return len(self._ledger.held_by_sidecar())

    def close(self) -> None:
        if self._spares is not None:
            self._spares.join(self._link.timeout)
        with self._lock:
            if self._pool is not None:
                self._pool.close()

    def _take(self, step: int, borrow: bool) -> ClientSlot:
        taken: list[ClientSlot] = []

        def found() -> bool:
            """Take the largest idle slot, else borrow a spare (lock held); whether one is taken."""
            if taken:
                return True
            if not self._link.connected or self._pool is None:
                return False
            idle = [self._pool.slots[index] for index in self._ledger.idle()]
            if idle:
                slot = max(idle, key=lambda slot: (slot.capacity, -slot.taken_at))
                self._ledger.take(slot.index)
                taken.append(slot)
            elif borrow and (spare := self._borrow()) is not None:
                taken.append(spare)
            return bool(taken)

        def describe() -> str:
            flights = [owned.step for owned in self._ledger.held_by_sidecar()]
            own = sum(state.sidecar_may_hold for state in self._ledger.states()[:self._count])
            held = (f"all {own} slots in flight" if own == self._count else
                    f"{own} of {self._count} slots in flight, the others still being allocated")
            pooled = (f", and the pod's {self._pooled} pooled spare(s) taken by other ranks" if self._pooled and borrow
                      else "")
            return (f"a free slot for step {step} ({held}, steps {flights}{pooled}): the sidecar persists slower "
                    "than this rank saves; save less often, add slots, or check storage throughput")

        try:
            self._link.wait_until(found, describe, SlotWaitTimeout)
        except BaseException:
            # A protocol violation may be raised after the slot was taken: nobody is left to give it back, and a
            # borrowed spare would stay locked for as long as this process lives.
            with self._lock:
                for slot in taken:
                    self._ledger.abandon(slot.index)
            raise
        with self._lock:
            slot = taken[0]
            self._takes += 1
            slot.taken_at = self._takes
            return slot

    def _borrow(self) -> ClientSlot | None:
        """A pooled spare whose write lock this rank could take, borrowed (lock held); None while all are taken."""
        assert self._pool is not None
        for index in self._ledger.pooled():
            spare = self._pool.slot(index)
            if self._pool.borrow(spare):
                self._ledger.borrow(index)
                return spare
        return None

    def _require_spares(self) -> SpareSlots:
        with self._lock:
            assert self._spares is not None
            return self._spares

