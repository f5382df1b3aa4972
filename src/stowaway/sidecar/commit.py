"""Turning durable rank files into a committed checkpoint.

Per step, this sidecar waits until every local rank's file is durable, writes
its node's receipt, and then:
- if it hosts global rank 0 (the coordinator), waits until receipts of this
  run cover every rank, writes the manifest (the commit) and applies retention;
- otherwise waits until the coordinator's manifest for this run appears.
Both waits end at the commit timeout, or as soon as another node's failure
notice for this run appears: a node that fails a step of a multi-node job
writes one, since the sidecars share nothing but the storage; a node whose
ranks hand the step over only after the notice appeared refuses it at once,
and one that is still persisting the step watches for notices and stops.
Every rank that persisted the step gets exactly one ``committed`` or
``failed`` for it.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from stowaway.protocol import messages
from stowaway.sidecar import retention
from stowaway.sidecar.config import SidecarConfig
from stowaway.sidecar.ranks import Registry
from stowaway.sidecar.stats import Stats
from stowaway.storage import catalog, durable, layout, manifest, set_aside

log = logging.getLogger(__name__)
_REMEMBERED_FAILURES = 256
# The failure kind of a step another node gave up on: counted apart, so that summing the
# other kinds across sidecars counts each failure once.
_OTHER_NODE_FAILED = "other_node_failed"


def _spans_nodes(world_size: int, local_world_size: int) -> bool:
    """Other sidecars hold some of the job's ranks: their receipts and failure notices come through storage."""
    return world_size > local_world_size


@dataclass
class PendingStep:
    job: str
    run: str
    step: int
    world_size: int
    local_world_size: int
    started_unix: float = field(default_factory=time.time)
    started: float = field(default_factory=time.monotonic)
    admitted: set[int] = field(default_factory=set)
    entries: dict[int, manifest.FileEntry] = field(default_factory=dict)
    task: asyncio.Task[None] | None = None
    expiry: asyncio.TimerHandle | None = None
    watcher: asyncio.Task[None] | None = None
    # Set once the step is committed or failed.
    resolved: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def multi_node(self) -> bool:
        return _spans_nodes(self.world_size, self.local_world_size)

    @property
    def committing(self) -> bool:
        """Every rank of a single-node job has handed the step over: it commits or fails without any rank's help."""
        return not self.multi_node and len(self.admitted) >= self.local_world_size


class Committer:
    def __init__(self, config: SidecarConfig, registry: Registry, stats: Stats) -> None:
        self._config = config
        self._registry = registry
        self._stats = stats
        self._pending: dict[tuple[str, int], PendingStep] = {}
        self._failed: dict[tuple[str, int, str], str] = {}
        # The newest committed step per job as last seen: a step above it is admitted without listing the
        # job's directory in the event loop. It may lag (other nodes commit, steps are set aside), so a step
        # at or below it is checked against the storage before it is refused.
        self._newest_committed: dict[str, int] = {}
        # Commits of one job run in worker threads; the manifest, `latest` and retention
        # of one job are changed by one thread at a time.
        self._storage_lock = threading.Lock()
        self._notices: set[asyncio.Task[None]] = set()

    def job_path(self, job: str) -> Path:
        return layout.job_dir(self._config.storage, job)

    def admit(self, job: str, run: str, step: int, rank: int, world_size: int, local_world_size: int) -> str | None:
        """Register a rank's persist of a step; return why it must be refused, if it must."""
        failure = self.abandoned(job, run, step)
        if failure is not None:
            return failure
        step_path = layout.step_dir(self.job_path(job), step)
        pending = self._pending.get((job, step))
        if pending is not None and pending.run != run:
            return f"step {step} is being saved by another run ({pending.run}) of job {job}"
        if pending is None:
            behind = self._behind_committed(job, run, step, step_path)
            if behind is not None:
                return behind
            elsewhere = self._failed_before_admission(job, run, step, world_size, local_world_size, step_path)
            if elsewhere is not None:
                return elsewhere
            pending = PendingStep(job, run, step, world_size, local_world_size)
            self._pending[(job, step)] = pending
            pending.expiry = asyncio.get_running_loop().call_later(
                self._config.commit_timeout, self._expire_local_wait, pending
            )
            if pending.multi_node:
                pending.watcher = asyncio.create_task(self._watch_notices(pending), name=f"notices {job}/{step}")
        pending.admitted.add(rank)
        pending.local_world_size = max(pending.local_world_size, local_world_size)
        return None

    def abandoned(self, job: str, run: str, step: int) -> str | None:
        """Why the step has failed, if it has: its persists still running stop rather than write in vain.

        Called from persist threads between chunks; a dictionary lookup.
        """
        return self._failed.get((job, step, run))

    def busy_steps(self, job: str) -> set[int]:
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
        pending = self._pending.get((job, step))
        if pending is None:
            return
        pending.entries[entry.rank] = entry
        if len(pending.entries) < pending.local_world_size or pending.task is not None:
            return
        receipt = manifest.Receipt(
            self._config.node, pending.run, step, pending.world_size,
            sorted(pending.entries.values(), key=lambda item: item.rank),
        )
        step_path = layout.step_dir(self.job_path(job), step)
        try:
            await asyncio.to_thread(manifest.write_receipt, step_path, receipt)
        except OSError as exc:
            self.fail(job, step, "storage_io", f"cannot write the receipt of node {self._config.node}: {exc}")
            return
        pending.task = asyncio.create_task(self._await_commit(pending), name=f"commit {job}/{step}")

    async def _watch_notices(self, pending: PendingStep) -> None:
        """While this node persists a multi-node step, fail it as soon as another node's notice appears.

        Persisting gigabytes takes a while, and the commit's own poll starts
        only once every local file is durable; until then this watch lets the
        persists stop at their next chunk and hand their slots back.
        """
        step_path = layout.step_dir(self.job_path(pending.job), pending.step)
        while pending.task is None and not pending.resolved.is_set():
            elsewhere = await asyncio.to_thread(self._readable_failure_elsewhere, pending.run, pending.step, step_path)
            if elsewhere is not None and pending.task is None and not pending.resolved.is_set():
                self.fail(pending.job, pending.step, _OTHER_NODE_FAILED, elsewhere)
                return
            await asyncio.sleep(self._config.commit_poll_interval)

    def _expire_local_wait(self, pending: PendingStep) -> None:
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
            f"(ranks {_ranges(persisted) if persisted else 'none'}); every local rank must save every "
            "checkpointed step, and storage must keep up (see the persist metrics)",
        )

    def fail(self, job: str, step: int, kind: str, reason: str) -> None:
        """Fail the whole step for every local rank that persisted it, and tell the other nodes."""
        pending = self._pending.get((job, step))
        if pending is None:
            return
        self._resolve(pending)
        if pending.task is not None and pending.task is not asyncio.current_task():
            pending.task.cancel()
        self._remember_failure(job, step, pending.run, reason)
        self._stats.failed(kind)
        log.warning("step %d of job %s failed: %s", step, job, reason)
        for rank in sorted(pending.admitted):
            self._send(job, rank, messages.Failed(step=step, slot=None, reason=reason))
        # A failure learnt from another node's notice is not announced again.
        if pending.multi_node and kind != _OTHER_NODE_FAILED:
            notice = asyncio.create_task(self._announce(pending, reason), name=f"failure notice {job}/{step}")
            self._notices.add(notice)
            notice.add_done_callback(self._notices.discard)

    async def _announce(self, pending: PendingStep, reason: str) -> None:
        failure = manifest.Failure(self._config.node, pending.run, pending.step, reason)
        step_path = layout.step_dir(self.job_path(pending.job), pending.step)
        try:
            await asyncio.to_thread(manifest.write_failure, step_path, failure)
        except OSError as exc:
            log.warning("cannot tell the other nodes that step %d of job %s failed (they will time out "
                        "instead): %s", pending.step, pending.job, exc)

    def _remember_failure(self, job: str, step: int, run: str, reason: str) -> None:
        self._failed[(job, step, run)] = reason
        while len(self._failed) > _REMEMBERED_FAILURES:
            self._failed.pop(next(iter(self._failed)))

    async def _await_commit(self, pending: PendingStep) -> None:
        step_path = layout.step_dir(self.job_path(pending.job), pending.step)
        deadline = pending.started + self._config.commit_timeout
        coordinator = 0 in pending.entries
        while True:
            try:
                elsewhere, missing = await asyncio.to_thread(self._poll, pending, step_path, coordinator)
            except (OSError, manifest.ManifestError) as exc:
                self.fail(pending.job, pending.step, "storage_io", f"commit of step {pending.step} failed: {exc}")
                return
            if elsewhere is not None:
                self.fail(pending.job, pending.step, _OTHER_NODE_FAILED, elsewhere)
                return
            if missing is None:
                self._finish(pending)
                if coordinator:
                    await self._apply_retention(pending)
                return
            if time.monotonic() >= deadline:
                self.fail(
                    pending.job, pending.step, "commit_timeout",
                    f"commit of step {pending.step} timed out after {self._config.commit_timeout:.0f} s "
                    f"waiting for {missing}; check that every node's sidecar is running and shares "
                    f"the storage at {self._config.storage}",
                )
                return
            await asyncio.sleep(self._config.commit_poll_interval)

    def _poll(self, pending: PendingStep, step_path: Path, coordinator: bool) -> tuple[str | None, str | None]:
        """Why another node failed the step (None if none did), and what the commit still waits for (None once
        committed).

        The coordinator reads the notices before it commits, so it never commits a step another node has
        failed for its ranks; other nodes read them after the manifest, which stands even if a notice came
        too late to stop it.
        """
        if not coordinator:
            missing = self._missing_manifest(pending, step_path)
            return (None if missing is None else self._failure_elsewhere(pending.run, pending.step, step_path)), missing
        elsewhere = self._failure_elsewhere(pending.run, pending.step, step_path)
        return elsewhere, (None if elsewhere is not None else self._commit_if_complete(pending, step_path))

    def _behind_committed(self, job: str, run: str, step: int, step_path: Path) -> str | None:
        """Refuse a step already committed, or older than the newest committed one.

        ``load()`` resumes from the newest step and retention keeps the newest
        steps, so a job's steps must grow: an older step saved by a run that
        started over under the job's name, without loading, would commit, be
        deleted by the retention of its own commit, and never be restored.
        Counted and remembered once per step, so the job's other ranks get the
        same answer without another listing.
        """
        if (step_path / layout.MANIFEST).exists():
            reason = (f"step {step} of job {job} is already committed at {step_path}; a checkpoint is never "
                      "overwritten: save a later step (load() returns the step to continue from), or, to go back "
                      f"to an older step, stop the job and run `stowaway rollback {self.job_path(job)} --to STEP`")
        else:
            known = self._newest_committed.get(job)
            if known is not None and step > known:
                return None
            newest = max(catalog.committed_steps(self.job_path(job)), default=-1)
            self._newest_committed[job] = newest
            if step > newest:
                return None
            reason = (f"step {step} is older than step {newest}, the newest committed checkpoint of job {job}: "
                      "load() resumes from the newest step and retention keeps the newest steps, so this one would "
                      "never be restored. Continue from the step load() returns; to start a new run, give it "
                      "another job name (STOWAWAY_JOB); to go back to an older step, stop the job and run "
                      f"`stowaway rollback {self.job_path(job)} --to STEP`")
        self._remember_failure(job, step, run, reason)
        self._stats.failed("step_refused")
        log.warning("step %d of job %s refused: %s", step, job, reason)
        return reason

    def _failed_before_admission(self, job: str, run: str, step: int, world_size: int, local_world_size: int,
                                 step_path: Path) -> str | None:
        """Another node's notice for a step this node has not started: refuse it rather than persist in vain.

        Counted and remembered as a failure learnt later would be, so this
        node's other ranks are refused without reading the notice again. An
        unreadable notice admits the step, and the commit's poll reports it.
        """
        if not _spans_nodes(world_size, local_world_size):
            return None
        reason = self._readable_failure_elsewhere(run, step, step_path)
        if reason is not None:
            self._remember_failure(job, step, run, reason)
            self._stats.failed(_OTHER_NODE_FAILED)
            log.warning("step %d of job %s refused: %s", step, job, reason)
        return reason

    def _readable_failure_elsewhere(self, run: str, step: int, step_path: Path) -> str | None:
        """``_failure_elsewhere``, where an unreadable notice counts as none: the commit's poll reports it."""
        try:
            return self._failure_elsewhere(run, step, step_path)
        except (OSError, manifest.ManifestError):
            return None

    def _failure_elsewhere(self, run: str, step: int, step_path: Path) -> str | None:
        for failure in manifest.read_failures(step_path):
            if failure.run == run and failure.node != self._config.node:
                return f"step {step} failed on node {failure.node}: {failure.reason}"
        return None

    def _commit_if_complete(self, pending: PendingStep, step_path: Path) -> str | None:
        receipts = [r for r in manifest.read_receipts(step_path) if r.run == pending.run]
        entries = {entry.rank: entry for receipt in receipts for entry in receipt.files}
        missing = sorted(set(range(pending.world_size)) - set(entries))
        if missing:
            return f"receipts of ranks {_ranges(missing)}"
        with self._storage_lock:
            self._write_commit(pending, step_path, receipts, entries)
        return None

    def _write_commit(self, pending: PendingStep, step_path: Path, receipts: list[manifest.Receipt],
                      entries: dict[int, manifest.FileEntry]) -> None:
        committed_unix = time.time()
        manifest.write_manifest(
            step_path,
            manifest.Manifest(
                job=pending.job, run=pending.run, step=pending.step, world_size=pending.world_size,
                files=[entries[rank] for rank in range(pending.world_size)],
                nodes=sorted({receipt.node for receipt in receipts}),
                timings={
                    "first_persist_unix": pending.started_unix,
                    "commit_seconds": committed_unix - pending.started_unix,
                },
                created_unix=committed_unix,
            ),
        )
        job_path = self.job_path(pending.job)
        newest = max(catalog.committed_steps(job_path), default=-1)
        self._newest_committed[pending.job] = newest
        if pending.step >= newest:
            durable.write_atomic(job_path / layout.LATEST, f"{pending.step}\n".encode())

    def set_aside(self, job: str, step: int) -> Path | None:
        """Set committed ``step`` aside as corrupt (``storage.set_aside``), under the lock commits take to
        move ``latest``."""
        with self._storage_lock:
            return set_aside.set_aside(self.job_path(job), step, layout.CORRUPT)

    async def _apply_retention(self, pending: PendingStep) -> None:
        """Delete what retention drops, after the ranks heard of the commit: deleting gigabytes takes a while."""
        busy = self.busy_steps(pending.job)

        def apply() -> None:
            with self._storage_lock:
                retention.apply(self.job_path(pending.job), self._config.keep_last, self._config.keep_every,
                                self._config.commit_timeout, busy)

        try:
            await asyncio.to_thread(apply)
        except OSError as exc:
            log.warning("retention after step %d of job %s failed, will retry after the next commit: %s",
                        pending.step, pending.job, exc)

    def _missing_manifest(self, pending: PendingStep, step_path: Path) -> str | None:
        try:
            found = manifest.read_manifest(step_path)
        except manifest.ManifestError:
            return "the manifest written by the sidecar that hosts rank 0"
        if found.run != pending.run:
            return f"a manifest of run {pending.run} (found one of run {found.run})"
        return None

    def _resolve(self, pending: PendingStep) -> None:
        """Forget a step that has committed or failed, and wake whoever waits for it to settle."""
        self._pending.pop((pending.job, pending.step), None)
        pending.resolved.set()
        if pending.expiry is not None:
            pending.expiry.cancel()
        if pending.watcher is not None and pending.watcher is not asyncio.current_task():
            pending.watcher.cancel()

    def _finish(self, pending: PendingStep) -> None:
        self._resolve(pending)
        seconds = time.monotonic() - pending.started
        self._stats.committed(pending.step, seconds, time.time())
        log.info("committed step %d of job %s in %.3f s", pending.step, pending.job, seconds)
        for rank in sorted(pending.admitted):
            self._send(pending.job, rank, messages.Committed(step=pending.step))

    def _send(self, job: str, rank: int, message: messages.ToClient) -> None:
        for state in self._registry.job_ranks(job):
            if state.rank == rank:
                state.send(message)

    def pending_tasks(self) -> list[asyncio.Task[None]]:
        """Commits in progress and failure notices being written: a graceful stop waits for both."""
        return [p.task for p in self._pending.values() if p.task is not None] + list(self._notices)

    def pending_count(self) -> int:
        return len(self._pending)


def _ranges(ranks: list[int]) -> str:
    shown = ", ".join(str(rank) for rank in ranks[:16])
    return shown + (f" and {len(ranks) - 16} more" if len(ranks) > 16 else "")
