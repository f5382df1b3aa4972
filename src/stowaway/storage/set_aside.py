"""Setting a step aside, so that the job can save that step again.

A committed step is never overwritten, and no step older than the newest
committed one is accepted. A corrupt step used to stay committed: the job
fell back to the step before it, and its next save of the corrupt step was
refused as already committed; a job that waits for each save then failed,
restarted, fell back again, and never got past it. Going back to an older
step on purpose (`stowaway rollback`) needs the newer ones out of the way
likewise. Renaming a step's directory out of the step names ends the
checkpoint (one exists only while its manifest sits in a step directory) and
keeps every byte for inspection.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from stowaway.storage import catalog, durable, layout


def set_aside(job_path: Path, step: int, why: str) -> Path | None:
    """Move ``step``'s directory aside (``why``: ``layout.CORRUPT`` or ``ROLLED_BACK``); None when it is no
    longer there (set aside or deleted meanwhile).

    The caller holds the job's storage lock, or the job is stopped:
    ``latest`` moves back to the newest step still committed only if it
    named this one.
    """
    target = layout.set_aside_dir(job_path, step, time.time_ns(), why)
    try:
        os.rename(layout.step_dir(job_path, step), target)
    except FileNotFoundError:
        return None
    durable.fsync_dir(job_path)
    latest = job_path / layout.LATEST
    try:
        named = int(latest.read_text().strip())
    except (OSError, ValueError):
        return target
    if named == step:
        newest = max(catalog.committed_steps(job_path), default=None)
        if newest is None:
            latest.unlink(missing_ok=True)
            durable.fsync_dir(job_path)
        else:
            durable.write_atomic(latest, f"{newest}\n".encode())
    return target
