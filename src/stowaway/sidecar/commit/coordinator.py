"""The commit of each step, start to end: admitted, gathered, committed or failed, and the ranks told.

Everything a step leaves running is started and stopped here, at most four
things: the commit timeout while local ranks persist (``expiry``), the watch
for other nodes' notices meanwhile (``watcher``), the wait for the commit once
every local file is durable (``task``), and the writing of this node's own
failure notice. Every rank that persisted the step gets exactly one
``committed`` or ``failed`` for it.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable

from stowaway.protocol import messages
from stowaway.sidecar.commit import admission, gathering, notices, publishing, timing
from stowaway.sidecar.config import SidecarConfig
from stowaway.sidecar.ranks import Registry
from stowaway.sidecar.stats import Stats
from stowaway.storage import manifest, step_store

log = logging.getLogger(__name__)


class Committer:
    def __init__(self, config: SidecarConfig, registry: Registry, stats: Stats, store: step_store.StepStore,
                 clock: timing.Clock | None = None, on_commit: Callable[[str, int], None] | None = None) -> None:
        self._config = config
        # Told of each step this node committed (it hosts global rank 0): the next tier's cue.
        self._on_commit = on_commit
        self._registry = registry
        self._stats = stats
        self._clock = clock if clock is not None else timing.SystemClock()
        self.store = store
        self._publisher = publishing.Publisher(config, self._clock, store)
        self._board = notices.NoticeBoard(config.node, self._clock, config.commit_poll_interval, store)
        self._admission = admission.Admission(self._publisher, self._board, stats)
        self._pending: dict[tuple[str, int], gathering.PendingStep] = {}
        self._announcing: set[asyncio.Task[None]] = set()

    def stored_refusal(self, job: str, run: str, step: int, world_size: int, local_world_size: int) -> str | None:
        """What storage says against a rank's persist of ``step`` (committed already, older than the newest,
        failed on another node): blocking, so asked from a worker thread before ``admit``, and only while this
        node does not gather the step yet."""
        if (job, step) in self._pending or self.abandoned(job, run, step) is not None:
            return None
        return self._admission.stored_refusal(job, run, step, world_size, local_world_size)

    def admit(self, job: str, run: str, step: int, rank: int, world_size: int, local_world_size: int) -> str | None:
        """Register a rank's persist of a step, once ``stored_refusal`` found nothing against it; return why it
        must be refused, if it must."""
        pending = self._pending.get((job, step))
        refusal = self._admission.refusal(job, run, step, pending)
        if refusal is not None:
            return refusal
        if pending is None:
            pending = self._start(job, run, step, world_size, local_world_size)
        pending.admit(rank, local_world_size)
        return None

    def _start(self, job: str, run: str, step: int, world_size: int, local_world_size: int) -> gathering.PendingStep:
        pending = gathering.PendingStep(job, run, step, world_size, local_world_size,
                                        started_unix=self._clock.wall(), started=self._clock.monotonic())
        self._pending[(job, step)] = pending
        pending.expiry = self._clock.call_later(
            self._config.commit_timeout, functools.partial(self._expire_local_wait, pending)
        )
        if pending.multi_node:
            pending.watcher = asyncio.create_task(
                self._board.watch(pending, functools.partial(self.fail, job, step, notices.OTHER_NODE_FAILED)),
                name=f"notices {job}/{step}",
            )
        return pending

    def abandoned(self, job: str, run: str, step: int) -> str | None:
        """Why the step has failed, if it has: its persists still running stop rather than write in vain.

        Called from persist threads between chunks; a dictionary lookup.
        """
        return self._admission.abandoned(job, run, step)

    def _busy_steps(self, job: str) -> set[int]:
        return {step for (name, step) in self._pending if name == job}

    async def settled(self, job: str) -> None:
        """Return once no step of ``job`` is between every rank's hand-over and its commit or failure.

        Ranks that call ``load()`` without a process group ask one after
        another; a commit landing between two questions would send them to
        different steps. Waiting for such a commit first gives them all the
        same answer. The wait ends at the commit timeout at the latest, and
        only single-node jobs wait: on several nodes the commit also waits for
        other sidecars, which may be gone for good.
        """
        while committing := [p for (name, _), p in self._pending.items() if name == job and p.committing]:
            await committing[0].resolved.wait()

    async def durable(self, job: str, step: int, entry: manifest.FileEntry) -> None:
        """A local rank's file is durable: once all are, write this node's receipt and wait for the commit."""
        pending = self._pending.get((job, step))
        if pending is None or not pending.add_durable(entry):
            return
        try:
            await asyncio.to_thread(self.store.write_receipt, job, step, pending.receipt(self._config.node))
        except (OSError, step_store.StoreError) as exc:
            kind = exc.kind if isinstance(exc, step_store.StoreError) else "storage_io"
            self.fail(job, step, kind, f"cannot write the receipt of node {self._config.node}: {exc}")
            return
        if pending.resolved.is_set():
            # Failed while the receipt was written (the commit timeout, another node's notice): its ranks
            # have had their one answer, and a commit now would send them a second.
            return
        pending.task = asyncio.create_task(self._await_commit(pending), name=f"commit {job}/{step}")

    def _expire_local_wait(self, pending: gathering.PendingStep) -> None:
        """The commit timeout, while this node's ranks are still persisting (or one never saved the step).

        Once every local file is durable, ``_await_commit`` watches the same
        deadline and names the other nodes it waits for instead.
        """
        if self._pending.get((pending.job, pending.step)) is not pending or pending.task is not None:
            return
        persisted = sorted(pending.entries)
        self.fail(
            pending.job, pending.step, "commit_timeout",
            f"commit of step {pending.step} timed out after {self._config.commit_timeout:.0f} s: "
            f"{len(persisted)} of this node's {pending.local_world_size} ranks made their file durable "
            f"(ranks {gathering.describe_ranks(persisted) if persisted else 'none'}); every local rank must save "
            "every checkpointed step, and storage must keep up (see the persist metrics)",
        )

    def fail(self, job: str, step: int, kind: str, reason: str) -> None:
        """Fail the whole step for every local rank that persisted it, and tell the other nodes."""
        pending = self._pending.get((job, step))
        if pending is None:
            return
        self._resolve(pending)
        if pending.task is not None and pending.task is not asyncio.current_task():
            pending.task.cancel()
        self._admission.remember(job, step, pending.run, reason)
        self._stats.failed(kind)
        log.warning("step %d of job %s failed: %s", step, job, reason)
        for rank in sorted(pending.admitted):
            self._send(job, rank, messages.Failed(step=step, slot=None, reason=reason))
        # A failure learnt from another node's notice is not announced again.
        if pending.multi_node and kind != notices.OTHER_NODE_FAILED:
            notice = asyncio.create_task(
                self._board.announce(pending, reason),
                name=f"failure notice {job}/{step}",
            )
            self._announcing.add(notice)
            notice.add_done_callback(self._announcing.discard)

    async def _await_commit(self, pending: gathering.PendingStep) -> None:
        deadline = pending.started + self._config.commit_timeout
        coordinator = pending.hosts_rank_zero
        while True:
            try:
                elsewhere, missing = await asyncio.to_thread(self._poll, pending, coordinator)
            except (OSError, step_store.StoreError, manifest.ManifestError) as exc:
                kind = exc.kind if isinstance(exc, step_store.StoreError) else "storage_io"
                self.fail(pending.job, pending.step, kind, f"commit of step {pending.step} failed: {exc}")
                return
            if elsewhere is not None:
                self.fail(pending.job, pending.step, notices.OTHER_NODE_FAILED, elsewhere)
                return
            if missing is None:
                self._finish(pending)
                if coordinator:
                    if self._on_commit is not None:
                        self._on_commit(pending.job, pending.step)
                    await self._apply_retention(pending)
                return
            if self._clock.monotonic() >= deadline:
                self.fail(
                    pending.job, pending.step, "commit_timeout",
                    f"commit of step {pending.step} timed out after {self._config.commit_timeout:.0f} s "
                    f"waiting for {missing}; check that every node's sidecar is running and shares "
                    f"the storage at {self.store.where(pending.job)}",
                )
                return
            await self._clock.sleep(self._config.commit_poll_interval)

    def _poll(self, pending: gathering.PendingStep, coordinator: bool) -> tuple[str | None, str | None]:
        """Why another node failed the step (None if none did), and what the commit still waits for (None once
        committed).

        The coordinator reads the notices before it commits, so it never commits a step another node has
        failed for its ranks; other nodes read them after the manifest, which stands even if a notice came
        too late to stop it.
        """
        if not coordinator:
            missing = self._publisher.missing_manifest(pending)
            return (None if missing is None else self._board.failure_elsewhere(pending.job, pending.run,
                                                                              pending.step)), missing
        # One listing serves both: on a bucket, each is a request, and a commit polls for a while.
        said = self.store.read_notices(pending.job, pending.step)
        elsewhere = self._board.failure_among(said.failures, pending.run, pending.step)
        return elsewhere, (None if elsewhere is not None else self._publisher.commit_if_complete(pending,
                                                                                                 said.receipts))

    def set_aside(self, job: str, step: int) -> str | None:
        """Set committed ``step`` aside as corrupt, so that the job can save it again."""
        return self._publisher.set_aside(job, step)

    async def _apply_retention(self, pending: gathering.PendingStep) -> None:
        """Delete what retention drops, after the ranks heard of the commit: deleting gigabytes takes a while."""
        try:
            await asyncio.to_thread(self._publisher.retain, pending.job, self._busy_steps(pending.job))
        except (OSError, step_store.StoreError) as exc:
            log.warning("retention after step %d of job %s failed, will retry after the next commit: %s",
                        pending.step, pending.job, exc)

    def _resolve(self, pending: gathering.PendingStep) -> None:
        """Forget a step that has committed or failed, and wake whoever waits for it to settle."""
        self._pending.pop((pending.job, pending.step), None)
        pending.resolved.set()
        if pending.expiry is not None:
            pending.expiry.cancel()
        if pending.watcher is not None and pending.watcher is not asyncio.current_task():
            pending.watcher.cancel()

    def _finish(self, pending: gathering.PendingStep) -> None:
        self._resolve(pending)
        seconds = self._clock.monotonic() - pending.started
        self._stats.committed(pending.step, seconds, self._clock.wall())
        log.info("committed step %d of job %s in %.3f s", pending.step, pending.job, seconds)
        for rank in sorted(pending.admitted):
            self._send(pending.job, rank, messages.Committed(step=pending.step))

    def _send(self, job: str, rank: int, message: messages.ToClient) -> None:
        for state in self._registry.job_ranks(job):
            if state.rank == rank:
                state.send(message)

    def pending_tasks(self) -> list[asyncio.Task[None]]:
        """Commits in progress and failure notices being written: a graceful stop waits for both."""
        return [p.task for p in self._pending.values() if p.task is not None] + list(self._announcing)
