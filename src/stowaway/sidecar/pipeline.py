"""One persist, start to finish: slot → file → release → durable → commit.

(On a bucket the file is whole, and durable, before the slot is released:
``persister``.)

Every persist ends in exactly one ``released`` or ``failed`` carrying its slot,
sent on the rank's current connection, whatever goes wrong.
"""

from __future__ import annotations

import asyncio
import logging
import time

from stowaway.protocol import messages
from stowaway.sidecar import persister
from stowaway.sidecar.commit import Committer
from stowaway.sidecar.config import SidecarConfig
from stowaway.sidecar.ranks import RankState
from stowaway.sidecar.stats import Stats
from stowaway.slots import naming
from stowaway.storage import layout, manifest

log = logging.getLogger(__name__)


class SavePipeline:
    def __init__(self, config: SidecarConfig, committer: Committer, stats: Stats) -> None:
        self._config = config
        self._committer = committer
        self._stats = stats
        self._workers = asyncio.Semaphore(config.persist_workers)
        self._limiter = persister.RateLimiter(config.write_rate_limit)
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self, state: RankState, request: messages.Persist) -> None:
        """Take ownership of the slot and persist it in the background."""
        slot, step = request.slot, request.step
        refusal = await asyncio.to_thread(self._committer.stored_refusal, state.job, request.run, step,
                                          state.world_size, state.local_world_size)
        if refusal is None:
            refusal = self._committer.admit(state.job, request.run, step, state.rank, state.world_size,
                                            state.local_world_size)
        if refusal is None and not state.hold(slot):
            refusal = (f"slot {slot} is a pooled spare another process holds the write lock of: "
                       "a rank persists a spare only while it has borrowed it")
        if refusal is not None:
            state.send(messages.Failed(step=step, slot=slot, reason=refusal))
            return
        self._stats.save_reported(request.blocking_seconds, request.slot_wait_seconds)
        if naming.is_pooled(slot):
            self._stats.pooled_spare_saved()
        self._stats.staging_reported(request)
        task = asyncio.create_task(self._persist(state, request), name=f"persist {state.job}/{state.rank}/{step}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _persist(self, state: RankState, request: messages.Persist) -> None:
        slot_index, step = request.slot, request.step
        name = layout.rank_file_name(state.rank, state.world_size)
        target = self._committer.store.rank_file(state.job, step, name)
        try:
            async with self._workers:
                started = time.monotonic()
                written = await asyncio.to_thread(
                    persister.copy_out, state.slots[slot_index], step, request.generation, request.nbytes, target,
                    self._limiter, lambda: self._committer.abandoned(state.job, request.run, step),
                )
                state.memory_digests[slot_index] = (request.generation, step, written.digest)
                state.let_go(slot_index)
                state.send(messages.Released(slot=slot_index, step=step, generation=request.generation))
                await asyncio.to_thread(persister.make_durable, written)
                self._stats.persist_finished(written.nbytes, time.monotonic() - started)
        except persister.StepAbandoned as exc:
            self._hand_back(state, slot_index, step, str(exc))
            return
        except persister.PersistError as exc:
            self._answer_failure(state, slot_index, step, exc.kind, str(exc))
            return
        except Exception as exc:
            log.exception("persist of step %d rank %d failed unexpectedly", step, state.rank)
            self._answer_failure(state, slot_index, step, "internal", f"internal error: {exc!r}")
            return
        state.send(messages.Persisted(step=step))
        entry = manifest.FileEntry.written(state.rank, name, written.nbytes, written.digest, written.pieces)
        await self._committer.durable(state.job, step, entry)

    def _answer_failure(self, state: RankState, slot: int, step: int, kind: str, reason: str) -> None:
        self._hand_back(state, slot, step, reason)
        self._committer.fail(state.job, step, kind, f"rank {state.rank}: {reason}")

    @staticmethod
    def _hand_back(state: RankState, slot: int, step: int, reason: str) -> None:
        """Give the rank its slot back, unless the persist had already released it."""
        if slot in state.busy:
            state.let_go(slot)
            state.send(messages.Failed(step=step, slot=slot, reason=reason))

    async def drain(self, timeout: float) -> bool:
        """Wait for in-flight persists; True when all finished within ``timeout``."""
        if not self._tasks:
            return True
        _, pending = await asyncio.wait(set(self._tasks), timeout=timeout)
        return not pending
