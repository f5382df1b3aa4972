"""``stowaway ls``, ``verify``, ``inspect`` and ``rollback`` on ``s3://`` URLs: the same output as on a directory.

The bucket is reached as the sidecar reaches it: ``AWS_ENDPOINT_URL``,
``AWS_REGION``, ``AWS_CA_BUNDLE`` and the credentials from the environment.
``inspect`` reads each rank's header with two range reads; ``verify``
streams each object through the checksum.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

from stowaway.cli import catalog_cmds
from stowaway.cli.errors import CommandError
from stowaway.storage import bucket, bucket_jobs, layout, manifest


def _jobs(url: str) -> list[bucket_jobs.BucketJob]:
    try:
        return bucket_jobs.jobs_at(url)
    except (ValueError, bucket.BucketError) as exc:
        raise CommandError(str(exc)) from None


def _single(url: str) -> bucket_jobs.BucketJob:
    jobs = _jobs(url)
    if len(jobs) != 1:
        names = ", ".join(job.job for job in jobs) or "none"
        raise CommandError(f"{url} holds {len(jobs)} jobs ({names}); pass one job's URL, e.g. {url}/<job>")
    return jobs[0]


def run_ls(url: str) -> int:
    jobs = _jobs(url)
    if not jobs:
        print(f"no checkpoints under {url}")
    for job in jobs:
        print(f"job {job.job} ({job.url})")
        print_listing(job, sys.stdout)
    return 0


def print_listing(job: bucket_jobs.BucketJob, out: TextIO) -> None:
    """The job's committed steps and the steps set aside, as ``catalog_cmds.print_listing`` shows a claim's."""
    catalog_cmds.print_steps(job.committed_steps(), job.read_manifest, (manifest.ManifestError, bucket.BucketError),
                             job.set_aside(), out)


def run_verify(url: str, only: int | None) -> int:
    job = _single(url)
    committed = job.committed_steps()
    steps = [only] if only is not None else committed
    if not steps:
        raise CommandError(f"{job.url} holds no committed checkpoint to verify")
    bad = 0
    for step in steps:
        problems: list[str] = []
        if step not in committed:
            problems.append(f"{job.where(step, '')}: not committed (no manifest)")
        else:
            try:
                found = job.read_manifest(step)
            except (manifest.ManifestError, bucket.BucketError) as exc:
                found, problems = None, [str(exc)]
            for entry in found.files if found is not None else []:
                problem = job.verify_file(step, entry)
                if problem is not None:
                    problems.append(f"{job.where(step, entry.name)}: {problem}")
        bad += catalog_cmds.print_verdict(step, problems)
    return catalog_cmds.verify_status(bad)


def run_inspect(url: str, step: int) -> int:
    job = _single(url)
    try:
        found = job.read_manifest(step)
    except (manifest.ManifestError, bucket.BucketError) as exc:
        raise CommandError(f"step {step} is not a committed checkpoint: {exc}") from None
    catalog_cmds.print_header(found)
    for entry in found.files:
        key = job.store.step_key(job.job, step, entry.name)
        catalog_cmds.print_rank(entry, job.where(step, entry.name),
                                lambda start, length: job.store.read_range(key, start, length))  # noqa: B023
    return 0


def run_rollback(url: str, to: int) -> int:
    """Set every step of the job newer than ``to`` aside in the bucket, newest first, then point ``latest`` at
    ``to``.

    For a bucket used without a claim, where it is the only copy. Newest
    first, so that if the command is interrupted the steps still in place
    are the oldest ones, and running it again finishes the rollback; an
    interrupted step's partial copy stays as a folder set aside.
    """
    job = _single(url)
    store = job.store
    try:
        listing = store.step_listing(job.job)
        committed = bucket.committed_in(listing)
        if to not in committed:
            listed = ", ".join(str(step) for step in committed[-10:]) or "none"
            raise CommandError(f"step {to} is not committed in {job.url} (newest committed: {listed}); "
                               "nothing was set aside")
        stamp_ns = time.time_ns()
        newer = sorted((step for step in listing if step > to), reverse=True)
        for step in newer:
            where = store.set_aside_step(job.job, step, stamp_ns, listing[step], layout.ROLLED_BACK)
            print(f"step {step}: set aside as {where}")
        store.point_latest(job.job, to)
    except bucket.BucketError as exc:
        raise CommandError(f"{exc}; run the rollback again once the bucket is reachable") from None
    if not newer:
        print(f"step {to} is already the newest step of {job.url}")
    else:
        print(f"step {to} is now the newest committed step of {job.url}: load() resumes from it")
    return 0
