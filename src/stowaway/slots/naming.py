"""Where a rank's slot files, and the pod's pooled spares, live.

The sidecar derives every path from (job, rank, slot index) itself; no path
ever crosses the socket, so a peer cannot point the sidecar at a file outside
its shared-memory directory. A slot index from ``POOLED_SLOT_BASE`` up names
one of the job's pooled spares, whichever rank writes it.
"""

from __future__ import annotations

from pathlib import Path

from stowaway.protocol.messages import POOLED_SLOT_BASE


def is_pooled(slot: int) -> bool:
    return slot >= POOLED_SLOT_BASE


def slot_path(shm_dir: str | Path, job: str, rank: int, slot: int) -> Path:
    if is_pooled(slot):
        return Path(shm_dir) / f"{job}.pool.slot{slot - POOLED_SLOT_BASE:02d}"
    return Path(shm_dir) / f"{job}.rank{rank:05d}.slot{slot:02d}"


def job_slot_glob(job: str) -> str:
    """The job's ranks' own slot files."""
    return f"{job}.rank*.slot*"


def pooled_slot_glob(job: str) -> str:
    return f"{job}.pool.slot*"


def rank_slot_glob(job: str, rank: int) -> str:
    return f"{job}.rank{rank:05d}.slot*"
