"""``load()``: the newest step every rank can restore, from this rank's slot or through the sidecar from storage.

In order: ask the sidecar which committed steps exist and which a slot of
this rank still holds intact (``inventory``); agree with the other ranks on
the candidates (``agreement``); then try the candidates newest first, each
from memory if a slot holds it, else from storage: read by the rank from its
own stored file through a descriptor the sidecar passes (``file_restore``),
or staged into a slot by the sidecar where the state goes onto a GPU, or, for
a step saved by another number of ranks, resharded from ranges of the stored
files (``resharder``); and fall back to the next older
one, on every rank alike, when any rank fails to restore it. A step that
cannot be resharded at all is refused on every rank (``WorldSizeChanged``).
Once a step is restored, keep where it came from and how long ``load()``
took (``Restore``, the checkpointer's ``last_restore``), log it, and tell
the sidecar: a restore from memory involves no request the sidecar would
otherwise see, and its log and metrics are where an operator looks.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from stowaway.client import agreement, env, file_restore, resharder
from stowaway.client.link import Link
from stowaway.client.pool import ClientSlot
from stowaway.client.rank_slots import RankSlots
from stowaway.errors import (
    CheckpointCorrupt,
    ConfigurationError,
    SaveFailed,
    SidecarUnavailable,
    StowawayError,
    UnsupportedState,
    WorldSizeChanged,
)
from stowaway.format import codec, dtensors
from stowaway.format.safetensors_header import HeaderError
from stowaway.protocol import messages
from stowaway.slots import header

log = logging.getLogger("stowaway")


@dataclass(frozen=True)
class Restore:
    """What a ``load()`` restored: the step, where this rank read it from, and how long the whole call took.

    ``source`` is ``"memory"`` when a slot still held the step (a trainer
    restarted next to its sidecar), ``"storage"`` when it came from storage
    (a new pod, or a step no slot held any more): the two differ
    in speed by orders of magnitude, and ``load()``'s own return value
    cannot say which without breaking every caller that unpacks it.
    """

    step: int
    source: messages.RestoreSource
    seconds: float
    # Saved by this many ranks; another number than the job's means it was resharded.
    saved_by: int = 0
    # Bytes this rank read from storage itself (its own file, or ranges when resharded); 0 where the sidecar staged
    # the step.
    bytes_read: int = 0


class Restorer:
    def __init__(self, job: str, rank: int, world_size: int, local_world_size: int, allow_pickle: bool,
                 run: env.RunId, link: Link, slots: RankSlots) -> None:
        self._job, self._rank = job, rank
        self._world_size, self._local_world_size = world_size, local_world_size
        self._allow_pickle = allow_pickle
        self._run = run
        self._link = link
        self._slots = slots
        self._resharder = resharder.Resharder(job, rank, world_size, allow_pickle, link, slots)
        # The restore the last load() made; None before the first, and after one that restored nothing or raised.
        self.last: Restore | None = None

    def load(self, step: int | None, map_location: Any, device_mesh: Any, into: Any) -> tuple[int, Any] | None:
        started = time.monotonic()
        self.last = None
        meshes = dtensors.given_meshes(device_mesh)
        if self._world_size > self._local_world_size and not agreement.active(self._world_size):
            # Each node's sidecar answers alone, and a commit landing between two nodes' questions (as
            # happens on a restart, while the last incarnation's steps still commit) would split the job.
            raise ConfigurationError(
                f"rank {self._rank}: load() in a job spanning several nodes ({self._world_size} ranks, "
                f"{self._local_world_size} on this node) needs a torch.distributed process group of all "
                f"{self._world_size} ranks, through which the ranks agree on the step to restore: call "
                "torch.distributed.init_process_group() before load()"
            )
        self._link.wait_until(lambda: self._link.connected, "a connection to the sidecar", SidecarUnavailable)
        # The allocator may be growing a slot that holds the step this load reads.
        self._slots.join_spares()
        self._slots.register_idle()
        inventory = self._link.request(("query", 0), messages.Query())
        assert isinstance(inventory, messages.Inventory)
        sizes = {item.step: item.nbytes for item in inventory.committed}
        in_memory = {item.step: item.slot for item in inventory.memory}
        wanted = [found for found in sizes if step is None or found == step]
        other_world = {item.step: item.world_size for item in inventory.other_world}
        agreed_run, same_world, other_world = agreement.candidates(self._run.current(), wanted, other_world,
                                                                   self._world_size)
        self._run.agree(agreed_run)
        candidates = sorted({*same_world, *(found for found in other_world if step is None or found == step)},
                            reverse=True)
        problems = []
        for candidate in candidates:
            error, refused, state = None, None, None
            source: messages.RestoreSource = "memory"
            bytes_read = 0
            try:
                slot = self._slots.pool.slots[in_memory[candidate]] if candidate in in_memory else None
                if candidate in other_world:
                    state, bytes_read, all_in_memory = self._resharder.load(candidate, map_location, meshes, into,
                                                                             inventory.files_passed)
                    source = "memory" if all_in_memory else "storage"
                elif slot is not None and _header_holding(slot, candidate) is not None:
                    state = self._read_slot(slot, candidate, map_location, meshes, into)
                else:
                    # Also when the slot held it at the inventory but a newer candidate was staged into it since.
                    source = "storage"
                    state, bytes_read = self._from_storage(candidate, sizes[candidate], map_location, meshes, into,
                                                           inventory.files_passed)
            except WorldSizeChanged as exc:
                refused = (True, str(exc))
            except UnsupportedState as exc:
                refused = (False, str(exc))
            except (StowawayError, HeaderError) as exc:
                error = str(exc)
            refusals, failures = agreement.restore_outcomes(refused, error, self._rank, self._world_size)
            # An older step would be refused for the same reason: every rank raises it instead.
            for rank, (resharding, reason) in refusals:
                shown = reason if reason.startswith(f"rank {rank}:") else f"rank {rank}: {reason}"
                if not resharding:
                    raise UnsupportedState(shown)
                older = [found for found in same_world if found < candidate]
                if step is None and older:
                    shown += (f"; or pass step={older[0]} to load() to resume from the newest step saved by "
                              f"{self._world_size} ranks")
                raise WorldSizeChanged(shown)
            if not failures:
                self.last = Restore(candidate, source, time.monotonic() - started,
                                    other_world.get(candidate, self._world_size), bytes_read)
                self._report(self.last)
                return candidate, state
            for rank, reason in failures:
                problems.append(f"step {candidate} rank {rank}: {reason}")
                log.warning("step %d cannot be restored on rank %d (%s); trying the next older committed "
                            "checkpoint", candidate, rank, reason)
        if step is not None:
            detail = "; ".join(problems) or "it is not committed in storage"
            raise SaveFailed(f"rank {self._rank}: step {step} of job {self._job} cannot be restored: {detail}")
        if into is not None and problems:
            # None would mean "start from scratch", with tensors that some step may already have been copied into.
            raise SaveFailed(
                f"rank {self._rank}: no committed step of job {self._job} can be restored ({'; '.join(problems)}), "
                "and load(into=...) may have written one of them into the given tensors on some ranks before "
                "that was known; re-initialise them before training from scratch"
            )
        return None

    def _report(self, restore: Restore) -> None:
        log.info("rank %d restored step %d from %s in %.3f s", self._rank, restore.step, restore.source,
                 restore.seconds)
        if not self._link.send(messages.Restored(step=restore.step, source=restore.source, seconds=restore.seconds)):
            # The step is restored all the same; only the sidecar's count of restores misses it.
            log.warning("rank %d could not report its restore of step %d to the sidecar, so the sidecar's log "
                        "and stowaway_restores_total miss it: %s", self._rank, restore.step, self._link.last_error)

    def _from_storage(self, step: int, nbytes: int, map_location: Any, meshes: tuple[Any, ...],
                      into: Any, files_passed: bool) -> tuple[Any, int]:
        """Read this rank's stored file where every destination is on the CPU and the sidecar passes stored files,
        else (and where that read finds the file corrupt or cannot read it) have the sidecar stage it into a slot
        and restore from the slot."""
        if files_passed and file_restore.suits(map_location, into):
            try:
                return file_restore.load(self._link, self._job, self._rank, step, self._allow_pickle, meshes, into)
            except (CheckpointCorrupt, SaveFailed, OSError, HeaderError) as exc:
                # The sidecar checks it again, and counts and sets aside a corrupt step.
                log.warning("rank %d could not read step %d from storage itself (%s); the sidecar stages it",
                            self._rank, step, exc)
        return self._staged(step, nbytes, map_location, meshes, into), 0

    def _staged(self, step: int, nbytes: int, map_location: Any, meshes: tuple[Any, ...], into: Any) -> Any:
        """Have the sidecar stage the stored file into a slot, then restore from the slot."""
        with self._slots.taken(step) as slot:
            self._slots.fit(slot, nbytes)
            answer = self._slots.stage(slot, step)
        if isinstance(answer, messages.Failed):
            raise SaveFailed(answer.reason)
        assert isinstance(answer, messages.Staged)
        slot.generation = max(slot.generation, answer.generation)
        return self._read_slot(slot, step, map_location, meshes, into)

    def _read_slot(self, slot: ClientSlot, step: int, map_location: Any, meshes: tuple[Any, ...], into: Any) -> Any:
        before = _header_holding(slot, step)
        if before is None:
            raise SaveFailed(f"slot {slot.index} no longer holds step {step}")
        assert slot.file is not None
        slot.drop_view()
        state = codec.read_from(slot.payload(), before.payload_nbytes, map_location, self._allow_pickle, meshes, into)
        if slot.file.read_header().generation != before.generation:
            raise SaveFailed(f"slot {slot.index} changed while step {step} was read from it")
        return state


def _header_holding(slot: ClientSlot, step: int) -> header.SlotHeader | None:
    """The slot's header if the slot holds ``step`` whole, else None."""
    if slot.file is None:
        return None
    slot.file.refresh()
    found = slot.file.read_header()
    return found if found.complete and found.step == step else None
