"""A job's checkpoints in a bucket, read the way the tools read a claim: ``ls``, ``verify``, ``inspect`` and
``read_checkpoint`` on ``s3://`` URLs.

A URL names either one job (``s3://bucket/prefix/job``, whose folder holds
``step-*`` folders) or the location of a sidecar's ``--bucket``, whose folders
are jobs. Reads of headers are range reads; nothing here reads an object
whole unless its bytes are wanted.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from stowaway.storage import bucket, checksum, layout, manifest


@dataclass(frozen=True)
class BucketJob:
    store: bucket.Bucket
    job: str

    @property
    def url(self) -> str:
        return self.store.url(self.job)

    def committed_steps(self) -> list[int]:
        return self.store.committed_steps(self.job)

    def set_aside(self) -> list[str]:
        """URLs of the job's steps set aside (by a rollback on its claim), by name."""
        return [self.store.url(self.job, name) for name in self.store.folders(self.job) if layout.is_set_aside(name)]

    def read_manifest(self, step: int) -> manifest.Manifest:
        return self.store.read_manifest(self.job, step)

    def where(self, step: int, name: str) -> str:
        return self.store.key_url(self.store.step_key(self.job, step, name))

    def read_file(self, step: int, entry: manifest.FileEntry) -> tuple[bytearray, str | None]:
        """A rank's file whole, and what is wrong with it (None if it matches ``entry``)."""
        buffer = bytearray(entry.bytes)
        view = memoryview(buffer)
        hasher = checksum.new()
        offset = 0
        for chunk in self.store.chunks(self.store.step_key(self.job, step, entry.name)):
            if offset + len(chunk) > entry.bytes:
                return buffer, f"larger than the manifest's {entry.bytes} bytes"
            view[offset:offset + len(chunk)] = chunk
            hasher.update(chunk)
            offset += len(chunk)
        return buffer, problem(offset, hasher.hexdigest(), entry)

    def verify_file(self, step: int, entry: manifest.FileEntry) -> str | None:
        """What is wrong with a rank's object (streamed, never held whole), or None."""
        hasher = checksum.new()
        offset = 0
        try:
            for chunk in self.store.chunks(self.store.step_key(self.job, step, entry.name)):
                hasher.update(chunk)
                offset += len(chunk)
        except bucket.BucketError as exc:
            return f"missing or unreadable: {exc}"
        return problem(offset, hasher.hexdigest(), entry)

    def head(self, step: int, entry: manifest.FileEntry, length: int) -> bytes:
        """The first ``length`` bytes of a rank's object (a range read)."""
        return self.store.read_range(self.store.step_key(self.job, step, entry.name), 0, min(length, entry.bytes))


def problem(size: int, digest: str, entry: manifest.FileEntry) -> str | None:
    if size != entry.bytes:
        return f"size {size} differs from the manifest's {entry.bytes}"
    if digest != entry.xxh3_64:
        return f"xxh3-64 {digest} differs from the manifest's {entry.xxh3_64}"
    return None


def jobs_at(url: str, settings: bucket.Settings | None = None) -> list[BucketJob]:
    """The jobs at ``url``: the job it names, or every job of the sidecar location it names."""
    location = bucket.Location.parse(url)
    settings = settings or bucket.Settings()
    here = bucket.Bucket(location, settings)
    if any(layout.step_of(Path(name)) is not None or layout.is_set_aside(name) for name in here.folders()):
        parent, _, job = location.prefix.rpartition("/")
        return [BucketJob(bucket.Bucket(bucket.Location(location.bucket, parent), settings), job)]
    return [BucketJob(here, job) for job in here.folders()]
