"""A ``StepStore`` in a directory: a claim's mount, shared by the nodes of a job.

Rank files are written under a temporary name with ``O_DIRECT`` straight from
the slot's mapping (``storage.direct_io``), then made durable (fdatasync,
rename, directory fsync) once the slot is back with its rank. Receipts,
notices, manifests and ``latest`` are small files written atomically
(``storage.durable``).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from stowaway.storage import catalog, checksum, direct_io, durable, layout, manifest, retention, set_aside, step_store


@dataclass
class DirectoryFile:
    """A rank file written beside its final name, published by ``finish``."""

    final: Path
    direct: bool
    tmp: Path = field(init=False)
    fd: int = field(init=False, default=-1)

    def __post_init__(self) -> None:
        self.tmp = self.final.with_name(self.final.name + layout.TMP_SUFFIX)

    @property
    def where(self) -> str:
        return str(self.final)

    def write(self, payload: memoryview, nbytes: int, before_chunk: Callable[[int], None],
              verify: Callable[[], None]) -> tuple[str, checksum.Pieces]:
        durable.make_dirs(self.final.parent)
        self.fd = direct_io.open_file(self.tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, durable.FILE_MODE,
                                      self.direct)
        try:
            digests = direct_io.write_from(self.fd, payload, nbytes, before_chunk)
            verify()
        except BaseException:
            os.close(self.fd)
            self.fd = -1
            self.tmp.unlink(missing_ok=True)
            raise
        return digests

    def finish(self) -> None:
        fd, self.fd = self.fd, -1
        durable.publish(fd, self.tmp, self.final)


class DirectoryStore:
    """Every job's steps below ``root``; ``direct`` moves rank files with ``O_DIRECT`` where the filesystem
    allows it."""

    passes_files = True

    def __init__(self, root: Path, direct: bool = True) -> None:
        self.root = root
        self._direct = direct

    def job_path(self, job: str) -> Path:
        return layout.job_dir(self.root, job)

    def step_path(self, job: str, step: int) -> Path:
        return layout.step_dir(self.job_path(job), step)

    def where(self, job: str, step: int | None = None, name: str = "") -> str:
        path = self.job_path(job) if step is None else self.step_path(job, step)
        return str(path / name if name else path)

    def probe(self) -> str | None:
        return None if os.access(self.root, os.W_OK) else f"storage {self.root} is not writable"

    def rank_file(self, job: str, step: int, name: str) -> DirectoryFile:
        return DirectoryFile(self.step_path(job, step) / name, self._direct)

    def committed_steps(self, job: str) -> list[int]:
        return catalog.committed_steps(self.job_path(job))

    def read_manifest(self, job: str, step: int) -> manifest.Manifest:
        return manifest.read_manifest(self.step_path(job, step))

    def write_manifest(self, job: str, step: int, found: manifest.Manifest) -> None:
        manifest.write_manifest(self.step_path(job, step), found)

    def point_latest(self, job: str, step: int) -> None:
        durable.write_atomic(self.job_path(job) / layout.LATEST, f"{step}\n".encode())

    def write_receipt(self, job: str, step: int, receipt: manifest.Receipt) -> None:
        manifest.write_receipt(self.step_path(job, step), receipt)

    def read_notices(self, job: str, step: int) -> step_store.Notices:
        path = self.step_path(job, step)
        return step_store.Notices(manifest.read_receipts(path), manifest.read_failures(path))

    def write_failure(self, job: str, step: int, failure: manifest.Failure) -> None:
        manifest.write_failure(self.step_path(job, step), failure)

    def read_failures(self, job: str, step: int) -> list[manifest.Failure]:
        return manifest.read_failures(self.step_path(job, step))

    def retain(self, job: str, keep_last: int, keep_every: int, abandoned_after: float, busy: set[int]) -> list[int]:
        return retention.apply(self.job_path(job), keep_last, keep_every, abandoned_after, busy)

    def set_aside(self, job: str, step: int, why: str) -> str | None:
        target = set_aside.set_aside(self.job_path(job), step, why)
        return None if target is None else str(target)

    def read_into(self, job: str, step: int, entry: manifest.FileEntry, payload: memoryview) -> tuple[int, str]:
        fd = direct_io.open_file(self.step_path(job, step) / entry.name, os.O_RDONLY, direct=self._direct)
        try:
            return direct_io.read_into(fd, payload, entry.bytes)
        finally:
            os.close(fd)

    def read_range(self, job: str, step: int, name: str, begin: int, into: memoryview) -> int:
        fd = os.open(self.step_path(job, step) / name, os.O_RDONLY | os.O_CLOEXEC)
        try:
            done = 0
            while done < len(into):
                count = os.preadv(fd, [into[done:]], begin + done)
                if count == 0:
                    break
                done += count
            return done
        finally:
            os.close(fd)

    def open_files(self, job: str, step: int, names: list[str]) -> list[int]:
        opened: list[int] = []
        try:
            for name in names:
                opened.append(os.open(self.step_path(job, step) / name, os.O_RDONLY | os.O_CLOEXEC))
        except BaseException:
            for fd in opened:
                os.close(fd)
            raise
        return opened
