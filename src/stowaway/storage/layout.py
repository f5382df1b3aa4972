"""Names of things in a job's storage directory.

    <storage>/<job>/step-000000000042/rank-00003-of-00008.safetensors
    <storage>/<job>/step-000000000042/receipt-<node>.json
    <storage>/<job>/step-000000000042/failed-<node>.json   (a node gave up on the step)
    <storage>/<job>/step-000000000042/manifest.json     (written last)
    <storage>/<job>/latest                              (convenience pointer)
    <storage>/<job>/corrupt-step-000000000042-<ns>/...  (a committed step found corrupt, set aside)
    <storage>/<job>/rolled-back-step-000000000042-<ns>/...  (set aside by `stowaway rollback`)
    <storage>/<job>/rollback-<ns>.json                  (what `stowaway rollback` went back to, and when)

A checkpoint exists if and only if its manifest exists.
"""

from __future__ import annotations

import re
from pathlib import Path

MANIFEST = "manifest.json"
LATEST = "latest"
TMP_SUFFIX = ".tmp"
_STEP_DIR = re.compile(r"^step-(\d{12})$")
# Why a step was set aside: found corrupt by a restore, or rolled back by hand.
CORRUPT = "corrupt"
ROLLED_BACK = "rolled-back"
_SET_ASIDE_DIR = re.compile(rf"^({CORRUPT}|{ROLLED_BACK})-step-(\d{{12}})-\d+$")


def job_dir(storage: Path, job: str) -> Path:
    return storage / job


def step_dir(job_path: Path, step: int) -> Path:
    return job_path / f"step-{step:012d}"


def set_aside_dir(job_path: Path, step: int, stamp_ns: int, why: str) -> Path:
    """Where a step set aside goes (``why`` is CORRUPT or ROLLED_BACK): out of the step names, so it is no
    checkpoint any more."""
    return job_path / f"{why}-step-{step:012d}-{stamp_ns}"


def set_aside_dirs(job_path: Path) -> list[Path]:
    """Steps set aside, by step."""
    if not job_path.is_dir():
        return []
    found = [(int(match.group(2)), entry.name, entry) for entry in job_path.iterdir()
             if (match := _SET_ASIDE_DIR.match(entry.name)) and entry.is_dir()]
    return [entry for *_, entry in sorted(found)]


def is_set_aside(name: str) -> bool:
    """Whether ``name`` is a set-aside step's folder (on a claim, or in a bucket)."""
    return _SET_ASIDE_DIR.match(name) is not None


def step_of(path: Path) -> int | None:
    match = _STEP_DIR.match(path.name)
    return int(match.group(1)) if match else None


def rank_file_name(rank: int, world_size: int) -> str:
    return f"rank-{rank:05d}-of-{world_size:05d}.safetensors"


def receipt_name(node: str) -> str:
    return f"receipt-{node}.json"


def failure_name(node: str) -> str:
    return f"failed-{node}.json"


def step_dirs(job_path: Path) -> dict[int, Path]:
    """Every step directory, committed or not."""
    if not job_path.is_dir():
        return {}
    found = {}
    for entry in job_path.iterdir():
        step = step_of(entry)
        if step is not None and entry.is_dir():
            found[step] = entry
    return found


def is_job_dir(path: Path) -> bool:
    return bool(step_dirs(path)) or (path / LATEST).exists() or bool(set_aside_dirs(path))
