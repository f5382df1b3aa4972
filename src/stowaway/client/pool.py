"""The rank's slot files: found, allocated, grown, mapped, and allocated anew when the sidecar lost them; and the
pod's pooled spares, borrowed and given back.

Which of them the rank may write at a given moment is the ledger's to say
(``ledger``); this module only ever touches a slot the caller has been
given by it.

The sidecar opens a slot by its path in its own shared-memory directory
(``register``), so a mapping is of use only while that path names its file.
A sidecar that comes back with an emptied directory, or with another one,
cannot open the files the rank still maps: such a slot is forgotten and
allocated again, in the sidecar's directory, before it is next registered.

A pooled spare is written only under its write lock (``slots.pooled_lock``):
``borrow`` takes it, ``hand_over`` turns it into a read lock for the
persist, ``give_back`` lets go once the ledger says the rank has given the
spare up. The file stays open and mapped between loans, so a rank that
borrows it again pays no page faults, unless another rank grew it meanwhile.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from stowaway.client import pinned
from stowaway.format import codec
from stowaway.format.safetensors_header import Layout, Placed
from stowaway.protocol.messages import POOLED_SLOT_BASE
from stowaway.slots import header, naming, shm

log = logging.getLogger("stowaway")

HEADROOM = 1.10


@dataclass
class ClientSlot:
    index: int
    file: shm.SlotFile | None = None
    # The generation this rank last wrote (or the sidecar last staged), so that the next write's is newer.
    generation: int = 0
    # Whether the sidecar has opened this mapping of the file on the current connection.
    registered: bool = False
    # When this rank last took the slot, in takes (0: never): the least recent is written next, so the newest step
    # stays in memory while the next save writes.
    taken_at: int = 0
    _tensor: torch.Tensor | None = None
    _views_placement: list[Placed] | None = None
    _views_start: int = 0
    _views: list[torch.Tensor] | None = None
    _pinned_at: int | None = None

    @property
    def capacity(self) -> int:
        return self.file.capacity if self.file is not None else 0

    def payload(self) -> torch.Tensor:
        """A uint8 tensor over the slot's payload (shares memory with the mapping)."""
        assert self.file is not None
        if self._tensor is None:
            self._tensor = torch.frombuffer(self.file.payload(), dtype=torch.uint8)
        return self._tensor

    def views_for(self, layout: Layout) -> list[torch.Tensor]:
        """The payload views ``layout`` writes into, cached while the plan and the mapping stay the same.

        Each view costs Python work per tensor, and a state has thousands;
        the cache holds the placement itself, so an identity check cannot
        match a different plan.
        """
        if self._views is None or self._views_placement is not layout.tensors or self._views_start != layout.data_start:
            self._views = codec.targets(layout, self.payload())
            self._views_placement, self._views_start = layout.tensors, layout.data_start
        return self._views

    def pin(self) -> None:
        """Register the payload as pinned host memory for CUDA, once per mapping."""
        if self._pinned_at is None:
            address = self.payload().data_ptr()
            if pinned.register(address, self.capacity):
                self._pinned_at = address

    def drop_view(self) -> None:
        """Forget every view of the mapping (and unpin it) before it is remapped or closed."""
        if self._pinned_at is not None:
            pinned.unregister(self._pinned_at)
            self._pinned_at = None
        self._tensor = None
        self._views = self._views_placement = None

    def next_generation(self) -> int:
        self.generation += 1
        return self.generation


class SlotPool:
    def __init__(self, shm_dir: Path, job: str, rank: int, count: int, local_world_size: int,
                 pooled: int = 0) -> None:
        self.shm_dir = shm_dir
        self.job = job
        self.rank = rank
        self.local_world_size = local_world_size
        self.slots = [ClientSlot(index) for index in range(count)]
        self.pooled = [ClientSlot(POOLED_SLOT_BASE + spare) for spare in range(pooled)]

    def slot(self, index: int) -> ClientSlot:
        """The rank's own slot ``index``, or the pooled spare a slot index from ``POOLED_SLOT_BASE`` names."""
        return self.pooled[index - POOLED_SLOT_BASE] if naming.is_pooled(index) else self.slots[index]

    def borrow(self, spare: ClientSlot) -> bool:
        """Take the pooled ``spare``'s write lock; False while another rank writes it or the sidecar reads it.

        Once taken, the mapping follows the file as its last writer left it
        (grown, perhaps), and this rank's next generation of it is newer than
        any written before, whoever wrote it.
        """
        path = naming.slot_path(self.shm_dir, self.job, self.rank, spare.index)
        if spare.file is not None and not spare.file.linked_at(path):
            self._forget(spare)
        if spare.file is None:
            spare.file = shm.SlotFile.borrow_pooled(path)
            spare.registered = False
            if spare.file is None:
                return False
        elif not spare.file.try_lock(exclusive=True):
            return False
        if spare.file.stale:
            spare.drop_view()
            spare.file.refresh()
            spare.registered = False
        try:
            spare.generation = max(spare.generation, spare.file.read_header().generation)
        except header.SlotHeaderError:  # not a slot: this rank holds the write lock, and makes it one
            header.write_empty(spare.file.header_view, spare.file.capacity)
        return True

    @staticmethod
    def hand_over(spare: ClientSlot) -> None:
        """Turn the borrowed ``spare``'s write lock into a read lock, as the persist hands it to the sidecar.

        A conversion of the lock this rank holds alone: it cannot fail.
        """
        assert spare.file is not None
        spare.file.try_lock(exclusive=False)

    @staticmethod
    def give_back(spare: ClientSlot) -> None:
        """Let go of the ``spare``'s lock: another rank may borrow it from now on."""
        if spare.file is not None:
            spare.file.unlock()

    def adopt_existing(self) -> None:
        """Open slot files a previous process of this rank left, so their contents can be restored."""
        for slot in self.slots:
            path = naming.slot_path(self.shm_dir, self.job, self.rank, slot.index)
            if slot.file is not None or not path.exists():
                continue
            try:
                opened = shm.SlotFile.open(path, writable=True)
                found = opened.read_header()
            except (OSError, header.SlotHeaderError):
                continue
            slot.file = opened
            slot.generation = found.generation
            slot.registered = False

    def forget_if_lost(self, slot: ClientSlot) -> None:
        """Forget ``slot`` (which the rank holds) if the sidecar could not open its file, to register it anew.

        Checked only for a slot not registered on the current connection: a
        registered one the sidecar has opened, and both sides map the same
        file, whatever has become of its name since. A pooled spare is
        checked by ``borrow``, before its lock is taken.
        """
        if slot.registered or slot.file is None or naming.is_pooled(slot.index):
            return
        if slot.file.linked_at(naming.slot_path(self.shm_dir, self.job, self.rank, slot.index)):
            return
        log.warning("rank %d: slot %d (%s) is not in the sidecar's shared memory %s: the sidecar came back with an "
                    "emptied or another directory; the slot is allocated there anew, and the steps it held can "
                    "be restored from storage only", self.rank, slot.index, slot.file.path, self.shm_dir)
        self._forget(slot)

    def _forget(self, slot: ClientSlot) -> None:
        """Drop the mapping of ``slot``, whose file the sidecar cannot open any more.

        A file that still has its name (in a directory the sidecar left) is
        unlinked too: shared memory is freed only with the last name and
        mapping, and counts against the pod's memory until then. The slot's
        generation is kept, so its next write is still newer than any the
        sidecar saw from it.
        """
        assert slot.file is not None
        slot.drop_view()
        if slot.file.linked_at(slot.file.path):
            slot.file.path.unlink(missing_ok=True)
        slot.file.close()
        slot.file = None

    def ensure_capacity(self, slot: ClientSlot, nbytes: int) -> None:
        """Allocate or grow ``slot`` (which the rank holds: writing or allocating it) to hold ``nbytes``.

        Allocated anew, in the sidecar's directory, when the sidecar could not
        open its file (``forget_if_lost``).
        """
        self.forget_if_lost(slot)
        if slot.capacity >= nbytes:
            return
        target = int(nbytes * HEADROOM) if slot.file is not None and slot.file.sized else nbytes
        self.check_room(target)
        slot.drop_view()
        if slot.file is None:
            path = naming.slot_path(self.shm_dir, self.job, self.rank, slot.index)
            slot.file = shm.SlotFile.create(path, target)
        else:
            slot.file.grow(target)
        slot.registered = False

    def check_room(self, nbytes: int) -> None:
        """Raise ``ShmCapacityError`` unless every slot of every local rank, and every pooled spare, can hold
        ``nbytes``."""
        per_slot = shm.file_size_for(max(nbytes, *(s.capacity for s in self.slots)))
        shm.check_capacity(
            self.shm_dir, (naming.job_slot_glob(self.job), naming.pooled_slot_glob(self.job)),
            per_slot * len(self.slots), self.local_world_size, already_mine=self.allocated_bytes(),
            pooled_bytes=per_slot * len(self.pooled),
        )

    def allocated_bytes(self) -> int:
        return sum(shm.file_size_for(s.capacity) for s in self.slots if s.file is not None)

    def close(self) -> None:
        for slot in self.slots + self.pooled:
            slot.drop_view()
            if slot.file is not None:
                slot.file.close()
                slot.file = None
