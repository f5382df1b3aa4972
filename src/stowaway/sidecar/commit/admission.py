"""Admission: whether a rank's persist of a step may start, and the failures that refuse it.

A step is refused when it has failed already, when another run of the job
saves it, when it is committed or older than the newest committed step, or
when another node has failed it. Each refusal is remembered, so the job's
other ranks get the same answer without another look at the storage, and so
that persists of a failed step stop rather than write in vain.
"""

from __future__ import annotations

import logging

from stowaway.sidecar.commit import gathering, notices, publishing
from stowaway.sidecar.stats import Stats
from stowaway.storage import manifest, step_store

log = logging.getLogger(__name__)
_REMEMBERED_FAILURES = 256


class Admission:
    def __init__(self, publisher: publishing.Publisher, board: notices.NoticeBoard, stats: Stats) -> None:
        self._publisher = publisher
        self._board = board
        self._stats = stats
        self._failed: dict[tuple[str, int, str], str] = {}

    def refusal(self, job: str, run: str, step: int, pending: gathering.PendingStep | None) -> str | None:
        """Why a rank may not persist ``step`` as far as this node knows (``pending``: the step as this node
        gathers it), or None; no storage is looked at."""
        failure = self.abandoned(job, run, step)
        if failure is not None:
            return failure
        if pending is not None and pending.run != run:
            return f"step {step} is being saved by another run ({pending.run}) of job {job}"
        return None

    def stored_refusal(self, job: str, run: str, step: int, world_size: int, local_world_size: int) -> str | None:
        """Why storage says a rank may not persist ``step`` that this node does not gather yet, or None.

        Blocking (a listing, a read of a manifest or a notice; requests to a
        bucket), so the sidecar asks from a worker thread. Storage that
        cannot be read refuses the step, uncounted as a refusal of the step
        itself: the next step asks again.
        """
        try:
            return self._behind_committed(job, run, step) or self._failed_before_admission(
                job, run, step, world_size, local_world_size)
        except (OSError, step_store.StoreError) as exc:
            kind = exc.kind if isinstance(exc, step_store.StoreError) else "storage_io"
            self._stats.failed(kind)
            reason = f"cannot admit step {step} of job {job}: reading the storage failed: {exc}"
            log.warning("%s", reason)
            return reason

    def abandoned(self, job: str, run: str, step: int) -> str | None:
        """Why the step has failed, if it has: its persists still running stop rather than write in vain.

        Called from persist threads between chunks; a dictionary lookup.
        """
        return self._failed.get((job, step, run))

    def remember(self, job: str, step: int, run: str, reason: str) -> None:
        """Remember that the step failed, for a bounded number of steps: a daemon lives for weeks."""
        self._failed[(job, step, run)] = reason
        while len(self._failed) > _REMEMBERED_FAILURES:
            self._failed.pop(next(iter(self._failed)))

    def _behind_committed(self, job: str, run: str, step: int) -> str | None:
        """Refuse a step already committed, or older than the newest committed one.

        ``load()`` resumes from the newest step and retention keeps the newest
        steps, so a job's steps must grow: an older step saved by a run that
        started over under the job's name, without loading, would commit, be
        deleted by the retention of its own commit, and never be restored.
        Counted and remembered once per step, so the job's other ranks get the
        same answer without another listing.
        """
        store = self._publisher.store
        job_path = store.where(job)
        if self._is_committed(job, step):
            reason = (f"step {step} of job {job} is already committed at {store.where(job, step)}; a checkpoint is "
                      "never overwritten: save a later step (load() returns the step to continue from), or, to go back "
                      f"to an older step, stop the job and run `stowaway rollback {job_path} --to STEP`")
        else:
            known = self._publisher.newest_known(job)
            if known is not None and step > known:
                return None
            newest = self._publisher.newest_committed(job)
            if step > newest:
                return None
            reason = (f"step {step} is older than step {newest}, the newest committed checkpoint of job {job}: "
                      "load() resumes from the newest step and retention keeps the newest steps, so this one would "
                      "never be restored. Continue from the step load() returns; to start a new run, give it "
                      "another job name (STOWAWAY_JOB); to go back to an older step, stop the job and run "
                      f"`stowaway rollback {job_path} --to STEP`")
        self.remember(job, step, run, reason)
        self._stats.failed("step_refused")
        log.warning("step %d of job %s refused: %s", step, job, reason)
        return reason

    def _is_committed(self, job: str, step: int) -> bool:
        """Whether ``step``'s manifest is there: the one look at storage that needs no listing."""
        try:
            self._publisher.store.read_manifest(job, step)
        except manifest.ManifestError:
            return False
        return True

    def _failed_before_admission(self, job: str, run: str, step: int, world_size: int,
                                 local_world_size: int) -> str | None:
        """Another node's notice for a step this node has not started: refuse it rather than persist in vain.

        Counted and remembered as a failure learnt later would be, so this
        node's other ranks are refused without reading the notice again. An
        unreadable notice admits the step, and the commit's poll reports it.
        """
        if not gathering.spans_nodes(world_size, local_world_size):
            return None
        reason = self._board.readable_failure_elsewhere(job, run, step)
        if reason is not None:
            self.remember(job, step, run, reason)
            self._stats.failed(notices.OTHER_NODE_FAILED)
            log.warning("step %d of job %s refused: %s", step, job, reason)
        return reason
