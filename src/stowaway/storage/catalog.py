"""Reading a job's storage: committed checkpoints, verification, retention candidates."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from stowaway.storage import checksum, layout, manifest


@dataclass(frozen=True)
class Problem:
    path: Path
    reason: str

    def __str__(self) -> str:
        return f"{self.path}: {self.reason}"


def committed_steps(job_path: Path) -> list[int]:
    """Steps whose manifest exists, oldest first."""
    return sorted(
        step for step, path in layout.step_dirs(job_path).items() if (path / layout.MANIFEST).is_file()
    )


def verify_step(job_path: Path, step: int, ranks: list[int] | None = None) -> list[Problem]:
    """Check files of a committed step against its manifest; an empty list means intact."""
    step_path = layout.step_dir(job_path, step)
    try:
        found = manifest.read_manifest(step_path)
    except manifest.ManifestError as exc:
        return [Problem(step_path / layout.MANIFEST, str(exc))]
    problems = []
    for entry in found.files:
        if ranks is not None and entry.rank not in ranks:
            continue
        problem = verify_file(step_path / entry.name, entry)
        if problem is not None:
            problems.append(problem)
    return problems


def verify_file(path: Path, entry: manifest.FileEntry) -> Problem | None:
    try:
        size = path.stat().st_size
    except OSError as exc:
        return Problem(path, f"missing or unreadable: {exc.strerror}")
    if size != entry.bytes:
        return Problem(path, f"size {size} differs from the manifest's {entry.bytes}")
    actual = checksum.of_file(path)
    if actual != entry.xxh3_64:
        return Problem(path, f"xxh3-64 {actual} differs from the manifest's {entry.xxh3_64}")
    return None
