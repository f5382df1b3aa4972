"""Serving ``load()``: what a rank can restore, staging a stored file (or a range of one) into its slot, and
opening stored files.

The storage volume is mounted only into the sidecar, so a rank restoring from
storage onto the CPU has the sidecar open its file read-only and pass the
descriptor (``open_step``), and reads and checks the file itself; a rank
that reshards a step saved by another number of ranks does the same with
byte ranges of several ranks' files, or of the old ranks' slots where the
sidecar's shared memory still holds them (``MemorySource``). A rank
restoring onto a GPU, or one that
found its file corrupt, hands a slot to the sidecar instead, which reads the
file into it while checking the manifest's checksum (``stage``), and sets a
corrupt step aside; the rank then restores from memory as usual. Where the
storage passes no files (a bucket alone), a resharding rank has the ranges
it reads staged into its slot one after another (``stage_range``).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from stowaway.protocol import messages
from stowaway.sidecar.persister import PersistError
from stowaway.sidecar.ranks import RankState
from stowaway.slots import header, naming
from stowaway.storage import checksum, layout, manifest, step_store

MAX_LISTED_STEPS = 64


def inventory(store: step_store.StepStore, state: RankState) -> messages.Inventory:
    """Committed steps with this rank's file size, which of them its slots hold intact, and those saved by
    another number of ranks.

    The last are listed so that ``load`` can refuse them by name: left out
    silently, a job restarted on fewer or more ranks would find nothing to
    restore and train from scratch.
    """
    committed: list[messages.StoredStep] = []
    memory: list[messages.StepInSlot] = []
    other_world: list[messages.OtherWorldStep] = []
    for step in reversed(store.committed_steps(state.job)[-MAX_LISTED_STEPS:]):
        try:
            found = store.read_manifest(state.job, step)
        except manifest.ManifestError:
            continue
        if found.world_size != state.world_size:
            other_world.append(messages.OtherWorldStep(step=step, world_size=found.world_size))
            continue
        try:
            entry = found.file_for(state.rank)
        except manifest.ManifestError:
            continue
        committed.append(messages.StoredStep(step=step, nbytes=entry.bytes))
        slot = _slot_holding(state, step, entry)
        if slot is not None:
            memory.append(messages.StepInSlot(step=step, slot=slot))
    return messages.Inventory(committed=tuple(committed), memory=tuple(memory), other_world=tuple(other_world),
                              files_passed=store.passes_files)


def _slot_holding(state: RankState, step: int, entry: manifest.FileEntry) -> int | None:
    for index, slot in state.slots.items():
        if index in state.busy or naming.is_pooled(index):  # a spare's header does not say whose step it holds
            continue
        slot.refresh()
        try:
            found = slot.read_header()
        except header.SlotHeaderError:
            continue
        if not found.complete or found.step != step or found.payload_nbytes != entry.bytes:
            continue
        known = state.memory_digests.get(index)
        if known is not None and known[:2] == (found.generation, step):
            digest = known[2]
        else:
            digest = checksum.of_bytes(slot.payload(found.payload_nbytes))
            if slot.read_header().generation != found.generation:
                continue
            state.memory_digests[index] = (found.generation, step, digest)
        if digest == entry.xxh3_64:
            return index
    return None


@contextlib.contextmanager
def _reading(where: str) -> Iterator[None]:
    """A read of ``where`` from storage, whose failure (a directory's or a bucket's) is a ``restore_io``."""
    try:
        yield
    except OSError as exc:
        raise PersistError("restore_io", f"cannot read {where}: {exc.strerror}") from exc
    except step_store.StoreError as exc:
        raise PersistError("restore_io", str(exc)) from exc


def stage(store: step_store.StepStore, state: RankState, index: int, step: int) -> tuple[int, int]:
    """Fill the rank's slot ``index`` with its stored file of ``step``; return (generation, nbytes)."""
    slot = state.slots[index]
    try:
        entry = store.read_manifest(state.job, step).file_for(state.rank)
    except manifest.ManifestError as exc:
        raise PersistError("restore_missing", f"step {step} cannot be restored: {exc}") from exc
    if entry.bytes > slot.capacity:
        raise PersistError(
            "restore_slot_small", f"slot {slot.path} holds {slot.capacity} bytes, step {step} needs {entry.bytes}"
        )
    where = store.where(state.job, step, entry.name)
    current = slot.read_header()
    generation = current.generation + 1
    header.begin_write(slot.header_view, generation)
    with _reading(where):
        offset, digest = store.read_into(state.job, step, entry, slot.payload())
    if offset != entry.bytes or digest != entry.xxh3_64:
        raise PersistError(
            "restore_corrupt",
            f"{where} is corrupt: {offset} bytes with xxh3-64 {digest}, the manifest says {entry.bytes} "
            f"bytes with {entry.xxh3_64}; run `stowaway verify {store.where(state.job)}` for details",
        )
    header.finish_write(slot.header_view, step, generation, entry.bytes)
    state.memory_digests[index] = (generation, step, digest)
    return generation, entry.bytes


def stage_range(store: step_store.StepStore, state: RankState, index: int, step: int, found: manifest.Manifest,
                span: tuple[int, int, int]) -> int:
    """Fill the payload of the rank's slot ``index`` with ``span`` = (saved rank, begin, nbytes) of ``found``'s
    file of that rank, leaving the slot unpublished; return its new generation.

    For a rank that reshards a step from a store that passes no files (a
    bucket alone): it reads the bytes from the payload and checks them
    against the manifest's pieces itself, as it would a passed file's. The
    header is left mid-write, so nothing takes the slot for a step in
    memory; the new generation tells the rank its bytes changed.
    """
    rank, begin, nbytes = span
    slot = state.slots[index]
    try:
        entry = found.file_for(rank)
    except manifest.ManifestError as exc:
        raise PersistError("restore_missing", f"step {step} cannot be restored: {exc}") from exc
    if begin + nbytes > entry.bytes or nbytes > slot.capacity:
        raise PersistError("restore_slot_small",
                           f"bytes {begin}..{begin + nbytes} of {entry.name} (of {entry.bytes}) do not fit in slot "
                           f"{slot.path} of {slot.capacity} bytes, or lie outside the file")
    generation = slot.read_header().generation + 1
    header.begin_write(slot.header_view, generation)
    state.memory_digests.pop(index, None)
    where = store.where(state.job, step, entry.name)
    with _reading(where):
        count = store.read_range(state.job, step, entry.name, begin, slot.payload()[:nbytes])
    if count != nbytes:
        raise PersistError("restore_corrupt", f"{where} ends before byte {begin + nbytes}, where the manifest says "
                           f"it holds {entry.bytes}; run `stowaway verify {store.where(state.job)}` for details")
    return generation


def open_step(store: step_store.StepStore, job: str, step: int, ranks: tuple[int, ...],
              memory: MemorySource | None = None) -> tuple[list[int], list[int]]:
    """Read-only descriptors of committed ``step``'s manifest and of the files of ``ranks``, in that order, and
    per rank file where its bytes begin in its descriptor.

    With ``memory``, a rank whose slot in shared memory holds the step (its
    header says so, for as many bytes as the manifest's file) is served
    from the slot, its bytes beginning after the slot header: the rank
    checks every range it reads against the manifest's piece checksums
    either way. Raises ``PersistError`` when the step is not committed,
    names no such rank, or a file cannot be opened; nothing stays open then.
    """
    try:
        found = store.read_manifest(job, step)
        entries = [found.file_for(rank) for rank in ranks]
    except manifest.ManifestError as exc:
        raise PersistError("restore_missing", f"step {step} cannot be opened: {exc}") from exc
    in_slots = [memory.slot_holding(entry, step) if memory is not None else None for entry in entries]
    stored = [layout.MANIFEST] + [entry.name for entry, fd in zip(entries, in_slots, strict=True) if fd is None]
    try:
        files = iter(store.open_files(job, step, stored))
    except (OSError, step_store.StoreError) as exc:
        for fd in in_slots:
            if fd is not None:
                os.close(fd)
        if isinstance(exc, step_store.StoreError):
            raise PersistError(exc.kind, str(exc)) from exc
        raise PersistError("restore_io", f"cannot open {exc.filename} of step {step}: {exc.strerror}") from exc
    opened = [next(files)]
    offsets: list[int] = []
    for fd in in_slots:
        opened.append(fd if fd is not None else next(files))
        offsets.append(0 if fd is None else header.HEADER_BYTES)
    return opened, offsets


@dataclass(frozen=True)
class MemorySource:
    """The slots of a job's ranks in the sidecar's shared-memory directory, whoever holds them now.

    A job restarted on the same pod with another number of ranks finds the
    old ranks' slots there; those of ranks that no longer exist have no
    connection, so they are found by name. Only files owned by the asking
    rank's user are passed (as ``register`` requires), so a peer can never
    read another user's memory through the sidecar. Nobody writes them
    meanwhile: the old ranks are gone, and the new ranks write no slot
    before every rank has finished ``load()`` (the ranks agree on its
    outcome through their process group).
    """

    shm_dir: Path
    job: str
    peer_uid: int

    def slot_holding(self, entry: manifest.FileEntry, step: int) -> int | None:
        """A read-only descriptor of a slot of ``entry``'s rank holding ``step`` whole, or None."""
        for path in sorted(self.shm_dir.glob(naming.rank_slot_glob(self.job, entry.rank))):
            try:
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            except OSError:
                continue
            try:
                owner = os.fstat(fd).st_uid
                found = header.read(os.pread(fd, header.HEADER_BYTES, 0))
            except (OSError, header.SlotHeaderError):
                os.close(fd)
                continue
            if (self.peer_uid in (0, owner) and found.complete and found.step == step
                    and found.payload_nbytes == entry.bytes):
                return fd
            os.close(fd)
        return None
