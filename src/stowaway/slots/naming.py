"""Where a rank's slot files live.

The sidecar derives every path from (job, rank, slot index) itself; no path
ever crosses the socket, so a peer cannot point the sidecar at a file outside
its shared-memory directory.
"""

from __future__ import annotations

from pathlib import Path


def slot_path(shm_dir: str | Path, job: str, rank: int, slot: int) -> Path:
    return Path(shm_dir) / f"{job}.rank{rank:05d}.slot{slot:02d}"


def job_slot_glob(job: str) -> str:
    return f"{job}.rank*.slot*"


def rank_slot_glob(job: str, rank: int) -> str:
    return f"{job}.rank{rank:05d}.slot*"
