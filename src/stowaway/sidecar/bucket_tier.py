"""The bucket tier: steps committed on the claim, uploaded in the background; the claim refilled from it.

Order of an upload (one step, one worker thread):
1. read the claim's manifest of the step (the step may have been dropped
   by the claim's retention meanwhile: then it is skipped, not failed);
2. upload each rank file as a streamed multipart upload, several parts in
   flight, checked against the manifest before its last part is sent;
3. upload the manifest, last: from then on the step is committed in the
   bucket;
4. apply the bucket's own retention (manifest first), and sweep torn
   uploads below the newest committed step.

The tier never holds a slot and never delays a save: it reads committed
files only, and the claim commits whatever the bucket does. A failure is
logged, counted by reason, and retried after ``--upload-retry-interval``
with the newest committed step. On start the tier looks at every job on the
claim whose newest step this node committed (its receipt holds rank 0's
file), so a sidecar killed mid-upload resumes where the bucket stands, and
of several nodes sharing the claim only that one uploads.

When a rank asks what it can restore and the bucket holds a newer committed
step of its job than the claim (a new cluster, a lost volume, a claim
restored from an older backup, its newest step set aside as corrupt), that
step is first copied onto the claim (rank files, then the manifest), and
restored from there as usual.

``stowaway rollback`` runs on the claim and leaves a record there
(``storage.rollbacks``): the bucket's copies of the steps it abandoned are
never restored, and are set aside in the bucket at the next upload or start,
so that the steps saved again are uploaded under their own names.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from pathlib import Path

from stowaway.sidecar import tier_plan
from stowaway.sidecar.config import SidecarConfig
from stowaway.sidecar.metrics import BucketMetrics
from stowaway.storage import bucket, catalog, durable, layout, manifest, rollbacks

log = logging.getLogger(__name__)


class BucketTier:
    def __init__(self, config: SidecarConfig, claim: Path, metrics: BucketMetrics) -> None:
        self._config = config
        self._claim = claim
        self._metrics = metrics
        self._location = bucket.Location.parse(config.bucket)
        self._settings = config.bucket_settings()
        self._bucket: bucket.Bucket | None = None
        self._wanted: set[str] = set()
        # Per job, the steps committed in the bucket as this sidecar last listed or made them.
        self._known: dict[str, list[int]] = {}
        # Jobs this sidecar committed a step of since it started: it hosts their global rank 0.
        self._committing: set[str] = set()
        self._wake = asyncio.Event()
        self._stopping = threading.Event()
        self._task: asyncio.Task[None] | None = None
        self._filling: dict[str, asyncio.Lock] = {}
        # Per job, the claim's newest step when the bucket last had nothing newer for it: ranks asking after
        # one another then cost the bucket one listing, not one each.
        self._claim_current: dict[str, int] = {}
        # The manifests of bucket steps read or uploaded by this sidecar (their only writer), by (job, step): the
        # rollback records need each step's commit time, and setting a step aside its files.
        self._manifests: dict[tuple[str, int], manifest.Manifest] = {}

    @property
    def location(self) -> bucket.Location:
        return self._location

    def _job_path(self, job: str) -> Path:
        return layout.job_dir(self._claim, job)

    def _open(self) -> bucket.Bucket:
        """The client, made on first use in a worker thread: importing obstore takes a moment."""
        if self._bucket is None:
            self._bucket = bucket.Bucket(self._location, self._settings)
        return self._bucket

    def start(self) -> None:
        """Resume: every job on the claim is compared with the bucket once, then on each commit."""
        storage = self._claim
        if storage.is_dir():
            self._wanted.update(child.name for child in storage.iterdir() if layout.is_job_dir(child))
        self._wake.set()
        self._task = asyncio.create_task(self._run(), name=f"bucket tier {self._location}")

    def committed(self, job: str, step: int) -> None:
        """A step committed on the claim (by this node, which hosts global rank 0): upload it."""
        self._metrics.newest("claim", step)
        self._committing.add(job)
        self._wanted.add(job)
        self._wake.set()

    async def stop(self, timeout: float) -> bool:
        """Abandon uploads in progress (their multipart uploads are aborted; the next start redoes them).

        True when the worker stopped within ``timeout``: a part in flight
        ends when its request does.
        """
        self._stopping.set()
        self._wake.set()
        if self._task is None:
            return True
        _, pending = await asyncio.wait({self._task}, timeout=timeout)
        return not pending

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while not self._stopping.is_set():
            await self._wake.wait()
            self._wake.clear()
            jobs, self._wanted = self._wanted, set()
            for job in sorted(jobs):
                if self._stopping.is_set():
                    return
                try:
                    await asyncio.to_thread(self._sync, job)
                except bucket.Stopped:
                    return
                except (bucket.BucketError, OSError, manifest.ManifestError) as exc:
                    kind = exc.kind if isinstance(exc, bucket.BucketError) else "claim_io"
                    self._metrics.upload_failed(kind)
                    log.warning("upload of job %s to %s failed, retrying in %.0f s: %s", job, self._location,
                                self._config.upload_retry_interval, exc)
                    self._wanted.add(job)
                    loop.call_later(self._config.upload_retry_interval, self._wake.set)
                except Exception:
                    log.exception("upload of job %s to %s failed unexpectedly", job, self._location)
                    self._metrics.upload_failed("bucket_io")
                    self._wanted.add(job)
                    loop.call_later(self._config.upload_retry_interval, self._wake.set)

    def _sync(self, job: str) -> None:
        """Bring the bucket up to the claim for ``job``, then apply the bucket's retention (worker thread).

        The bucket's committed steps are listed once and then remembered
        (this sidecar is their only writer), so an upload starts without a
        request first; a failure forgets them, and the next try lists again.
        """
        claim = catalog.committed_steps(self._job_path(job))
        if not claim or (job not in self._committing and not self._hosts_rank_zero(job, claim[-1])):
            return
        self._metrics.newest("claim", claim[-1])
        store = self._open()
        known = self._known.pop(job, None)
        if known is None:
            known = store.committed_steps(job)
        known = self._set_rolled_back_aside(store, job, known)
        for step in tier_plan.to_upload(claim, known, self._config.bucket_keep_every):
            if self._upload_step(store, job, step):
                known.append(step)
        listing = store.step_listing(job)
        present = {step: [found.key for found in objects] for step, objects in listing.items()}
        committed = bucket.committed_in(listing)
        if committed:
            self._metrics.newest("bucket", committed[-1])
        dropped = tier_plan.to_delete(committed, self._config.bucket_keep_last, self._config.bucket_keep_every)
        for step in dropped:
            store.remove_step(job, present[step])
            log.info("bucket retention: removed step %d of job %s from %s", step, job, self._location)
        for step in tier_plan.to_sweep(sorted(present), committed):
            store.remove_step(job, present[step])
            log.info("removed the torn upload of step %d of job %s from %s", step, job, self._location)
        self._known[job] = [step for step in committed if step not in dropped]
        # Only the steps the bucket still holds: a long job's manifests would otherwise pile up here. (A copy of the
        # keys: a rank's restore may add one from its own thread meanwhile.)
        for key in list(self._manifests):
            if key[0] == job and key[1] not in self._known[job]:
                self._manifests.pop(key, None)

    def _rolled_back(self, store: bucket.Bucket, job: str, committed: list[int]) -> dict[int, rollbacks.Rollback]:
        """The bucket's steps of ``job`` that a rollback on the claim abandoned, each with its rollback."""
        recorded = self._rollbacks_in_force(job)
        times = {step: self._bucket_manifest(store, job, step).created_unix
                 for step in tier_plan.may_be_rolled_back(committed, recorded)}
        return tier_plan.rolled_back(times, recorded)

    def _bucket_manifest(self, store: bucket.Bucket, job: str, step: int) -> manifest.Manifest:
        if (job, step) not in self._manifests:
            self._manifests[(job, step)] = store.read_manifest(job, step)
        return self._manifests[(job, step)]

    def _rollbacks_in_force(self, job: str) -> list[rollbacks.Rollback]:
        """The job's rollback records, less those the claim has undone (it holds a step one abandoned again)."""
        job_path = self._job_path(job)
        recorded = rollbacks.recorded(job_path)
        if not recorded:
            return []
        claim = {step: manifest.read_manifest(layout.step_dir(job_path, step)).created_unix
                 for step in tier_plan.may_be_rolled_back(catalog.committed_steps(job_path), recorded)}
        return tier_plan.in_force(recorded, claim)

    def _set_rolled_back_aside(self, store: bucket.Bucket, job: str, committed: list[int]) -> list[int]:
        """Set the bucket's copies of rolled-back steps aside; the committed steps that stay."""
        abandoned = self._rolled_back(store, job, committed)
        if not abandoned:
            return committed
        present = store.step_listing(job)
        for step, rollback in sorted(abandoned.items()):
            where = store.set_aside_step(job, step, rollback.stamp_ns, present.get(step, []))
            self._manifests.pop((job, step), None)
            log.info("step %d of job %s was rolled back to step %d on the claim: set aside in the bucket as %s",
                     step, job, rollback.to, where)
        return [step for step in committed if step not in abandoned]

    def _hosts_rank_zero(self, job: str, step: int) -> bool:
        """Whether this node's receipt of ``step`` holds rank 0's file: on a restart of several nodes sharing
        the claim, only the node that commits (and so uploads) resumes the job's uploads."""
        receipts = manifest.read_receipts(layout.step_dir(self._job_path(job), step))
        return any(receipt.node == self._config.node and any(entry.rank == 0 for entry in receipt.files)
                   for receipt in receipts)

    def _upload_step(self, store: bucket.Bucket, job: str, step: int) -> bool:
        """Upload one committed step, manifest last; False when the claim's retention dropped it meanwhile."""
        step_path = layout.step_dir(self._job_path(job), step)
        try:
            found = manifest.read_manifest(step_path)
            manifest_bytes = (step_path / layout.MANIFEST).read_bytes()
        except (manifest.ManifestError, FileNotFoundError):
            log.info("step %d of job %s left the claim before its upload; a newer one goes instead", step, job)
            return False
        log.info("uploading step %d of job %s (%d bytes) to %s", step, job, found.total_bytes, store.url(job))
        started = time.monotonic()
        for entry in found.files:
            try:
                store.upload_file(store.step_key(job, step, entry.name), step_path / entry.name, entry,
                                  self._stopping, self._metrics.uploaded_bytes.inc)
            except FileNotFoundError:
                log.info("step %d of job %s left the claim during its upload; a newer one goes instead", step, job)
                return False
        store.put(store.step_key(job, step, layout.MANIFEST), manifest_bytes)
        self._manifests[(job, step)] = found
        seconds = time.monotonic() - started
        self._metrics.upload_duration.observe(seconds)
        self._metrics.uploads.inc()
        self._metrics.last_upload_timestamp.set(time.time())
        self._metrics.newest("bucket", step)
        log.info("uploaded step %d of job %s (%d bytes) to %s in %.3f s", step, job, found.total_bytes,
                 store.url(job), seconds)
        return True

    async def fill_claim(self, job: str) -> None:
        """If the bucket holds a newer committed step of ``job`` than the claim, copy it onto the claim first.

        Ranks ask one after another; a lock per job makes the first do the
        copy and the others find it done. A failure is logged and counted:
        the ranks then see what the claim holds, as without a bucket.
        """
        lock = self._filling.setdefault(job, asyncio.Lock())
        async with lock:
            try:
                await asyncio.to_thread(self._fill, job)
            except (bucket.BucketError, OSError, manifest.ManifestError) as exc:
                self._metrics.upload_failed(exc.kind if isinstance(exc, bucket.BucketError) else "claim_io")
                log.error("job %s could not be restored from %s, the ranks see what the claim holds: %s",
                          job, self._location, exc)

    def _fill(self, job: str) -> None:
        job_path = self._job_path(job)
        claim = catalog.committed_steps(job_path)
        newest = claim[-1] if claim else -1
        if self._claim_current.get(job) == newest:
            return
        store = self._open()
        committed = store.committed_steps(job)
        abandoned = self._rolled_back(store, job, committed)
        newer = [step for step in committed if step > newest and step not in abandoned]
        for step in reversed(newer):
            found = self._bucket_manifest(store, job, step)
            started = time.monotonic()
            try:
                self._download_step(store, job_path, found)
            except bucket.Mismatch as exc:
                self._metrics.upload_failed("restore_corrupt")
                log.error("step %d of job %s in %s is corrupt, trying the next older one: %s",
                          step, job, self._location, exc)
                continue
            log.info("copied step %d of job %s (%d bytes) from %s to the claim in %.3f s: the claim's newest "
                     "was %s", step, job, found.total_bytes, store.url(job), time.monotonic() - started,
                     "none" if newest < 0 else f"step {newest}")
            newest = step
            break
        self._claim_current[job] = newest

    def _download_step(self, store: bucket.Bucket, job_path: Path, found: manifest.Manifest) -> None:
        step_path = layout.step_dir(job_path, found.step)
        durable.make_dirs(step_path)
        for entry in found.files:
            store.download_file(store.step_key(job_path.name, found.step, entry.name), step_path / entry.name,
                                entry, self._metrics.downloaded_bytes.inc)
        # Last, as on any tier: the copy counts as committed on the claim once the manifest is there.
        raw = store.read(store.step_key(job_path.name, found.step, layout.MANIFEST))
        durable.write_atomic(step_path / layout.MANIFEST, raw)
        durable.write_atomic(job_path / layout.LATEST, f"{found.step}\n".encode())
