"""Publishing a commit: the manifest (whose presence is the commit), ``latest``, and then retention.

Commits of one job run in worker threads; the manifest, ``latest``,
retention and setting a step aside change a job's storage (a directory or a
bucket: ``storage.step_store``) one thread at a time, under one lock. Other
nodes only read here: they wait for the manifest that the node hosting
global rank 0 writes.
"""

from __future__ import annotations

import threading

from stowaway.sidecar.commit import gathering, timing
from stowaway.sidecar.config import SidecarConfig
from stowaway.storage import layout, manifest, step_store


class Publisher:
    def __init__(self, config: SidecarConfig, clock: timing.Clock, store: step_store.StepStore) -> None:
        self._config = config
        self.store = store
        self._clock = clock
        self._storage_lock = threading.Lock()
        # The newest committed step per job as last seen: a step above it is admitted without listing the
        # job's directory in the event loop. It may lag (other nodes commit, steps are set aside), so a step
        # at or below it is checked against the storage before it is refused.
        self._newest_committed: dict[str, int] = {}

    def newest_known(self, job: str) -> int | None:
        """The newest committed step of ``job`` as last seen, without touching storage; None if never looked."""
        return self._newest_committed.get(job)

    def newest_committed(self, job: str) -> int:
        """List the job's committed steps and remember the newest (-1 when none)."""
        newest = max(self.store.committed_steps(job), default=-1)
        self._newest_committed[job] = newest
        return newest

    def commit_if_complete(self, pending: gathering.PendingStep, found: list[manifest.Receipt]) -> str | None:
        """Commit when this run's receipts among ``found`` (the step's) cover every rank; else say whose receipts
        are missing."""
        receipts = [r for r in found if r.run == pending.run]
        entries = {entry.rank: entry for receipt in receipts for entry in receipt.files}
        missing = sorted(set(range(pending.world_size)) - set(entries))
        if missing:
            return f"receipts of ranks {gathering.describe_ranks(missing)}"
        with self._storage_lock:
            self._write_commit(pending, receipts, entries)
        return None

    def _write_commit(self, pending: gathering.PendingStep, receipts: list[manifest.Receipt],
                      entries: dict[int, manifest.FileEntry]) -> None:
        committed_unix = self._clock.wall()
        written = manifest.Manifest(
            job=pending.job, run=pending.run, step=pending.step, world_size=pending.world_size,
            files=[entries[rank] for rank in range(pending.world_size)],
            nodes=sorted({receipt.node for receipt in receipts}),
            timings={
                "first_persist_unix": pending.started_unix,
                "commit_seconds": committed_unix - pending.started_unix,
            },
            created_unix=committed_unix,
        )
        try:
            self.store.write_manifest(pending.job, pending.step, written)
        except step_store.ManifestExists:
            # A bucket refuses a second manifest: this coordinator's own, written by a request retried after
            # its answer was lost, stands; another run's means two coordinators saved the step.
            if self.store.read_manifest(pending.job, pending.step).run != pending.run:
                raise
        newest = self.newest_committed(pending.job)
        if pending.step >= newest:
            self.store.point_latest(pending.job, pending.step)

    def missing_manifest(self, pending: gathering.PendingStep) -> str | None:
        """What a node without global rank 0 still waits for: None once the coordinator's manifest is there."""
        try:
            found = self.store.read_manifest(pending.job, pending.step)
        except manifest.ManifestError:
            return "the manifest written by the sidecar that hosts rank 0"
        if found.run != pending.run:
            return f"a manifest of run {pending.run} (found one of run {found.run})"
        return None

    def retain(self, job: str, busy: set[int]) -> None:
        """Delete what retention drops; ``busy`` steps are being saved and are never swept as stale."""
        with self._storage_lock:
            # Partial directories untouched for longer than a commit may take are stale.
            self.store.retain(job, self._config.keep_last, self._config.keep_every,
                              abandoned_after=self._config.commit_timeout, busy=busy)

    def set_aside(self, job: str, step: int) -> str | None:
        """Set committed ``step`` aside as corrupt, under the lock commits take to move ``latest``; where it
        went."""
        with self._storage_lock:
            return self.store.set_aside(job, step, layout.CORRUPT)
