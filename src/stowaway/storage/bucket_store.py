"""A ``StepStore`` in a bucket alone, without a claim: the sidecar persists and commits straight to S3.

The layout is a claim's (``storage.layout``), as objects: rank files,
receipts and failure notices below each step, the manifest last. Rank files
are uploaded from the slot as multipart uploads, several parts in flight,
their checksums computed beside them; a multipart upload becomes visible only
once its last part is in, so the slot stays the sidecar's until the whole
file is stored, and saves are held back at the bucket's speed (the slots'
back-pressure).

What is assumed of the server: strong read-after-write consistency of
objects and listings (AWS S3 since 2020, MinIO, SeaweedFS), and conditional
writes (``If-None-Match: *``), so that a second coordinator of a step can
never replace a committed manifest.

Restore: a rank's own file is downloaded into the rank's slot (``read_into``)
and restored from memory; descriptors of files (``open_files``) are not
offered, since a download into memory the sidecar owns would count against
the sidecar container's memory limit.
"""

from __future__ import annotations

import fnmatch
import os
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from stowaway.storage import bucket, checksum, layout, manifest, retention, step_store

T = TypeVar("T")


class SlotUpload:
    """One rank file uploaded from a slot's mapping, whole before ``write`` returns."""

    def __init__(self, store: bucket.Bucket, key: str) -> None:
        self._bucket = store
        self._key = key
        self.where = store.key_url(key)

    def write(self, payload: memoryview, nbytes: int, before_chunk: Callable[[int], None],
              verify: Callable[[], None]) -> tuple[str, checksum.Pieces]:
        with ThreadPoolExecutor(1, thread_name_prefix="checksum") as hashing:
            digests = hashing.submit(checksum.digests_of, payload, nbytes)
            self._bucket.upload(self._key, self._parts(payload, nbytes, before_chunk, verify), nbytes,
                                f"uploading {self.where}")
            return digests.result()

    def _parts(self, payload: memoryview, nbytes: int, before_chunk: Callable[[int], None],
               verify: Callable[[], None]) -> Iterator[bytes]:
        """The payload in parts, each copied out of the slot as it is handed over: a part still in flight
        when ``verify`` runs must not read memory that a misbehaving rank could be writing."""
        part = self._bucket.settings.part_bytes
        for begin in range(0, nbytes, part):
            end = min(begin + part, nbytes)
            before_chunk(end - begin)
            data = bytes(payload[begin:end])
            if end == nbytes:
                verify()
            yield data

    def finish(self) -> None:
        """Nothing left to do: the upload completed inside ``write`` (one that failed was aborted, and never
        became visible)."""


class BucketStore:
    """Every job's steps below a bucket's prefix."""

    passes_files = False

    def __init__(self, store: bucket.Bucket) -> None:
        self.bucket = store

    def _step_key(self, job: str, step: int, name: str) -> str:
        return self.bucket.step_key(job, step, name)

    def where(self, job: str, step: int | None = None, name: str = "") -> str:
        if step is None:
            return self.bucket.url(job)
        return self.bucket.key_url(self._step_key(job, step, name))

    def probe(self) -> str | None:
        try:
            self.bucket.folders()
        except bucket.BucketError as exc:
            return str(exc)
        return None

    def rank_file(self, job: str, step: int, name: str) -> SlotUpload:
        return SlotUpload(self.bucket, self._step_key(job, step, name))

    def committed_steps(self, job: str) -> list[int]:
        return self.bucket.committed_steps(job)

    def _read(self, job: str, step: int, name: str) -> bytes:
        """An object of ``step``; a missing one is a ``ManifestError`` like a missing file."""
        try:
            return self.bucket.read(self._step_key(job, step, name))
        except bucket.NotFound as exc:
            raise manifest.ManifestError(str(exc)) from exc

    def read_manifest(self, job: str, step: int) -> manifest.Manifest:
        where = self.where(job, step, layout.MANIFEST)
        return manifest.manifest_from_bytes(where, self._read(job, step, layout.MANIFEST))

    def write_manifest(self, job: str, step: int, found: manifest.Manifest) -> None:
        try:
            self.bucket.put(self._step_key(job, step, layout.MANIFEST), manifest.encoded(found), only_new=True)
        except bucket.Exists as exc:
            raise step_store.ManifestExists(f"step {step} of job {job} is committed already: {exc}") from exc

    def point_latest(self, job: str, step: int) -> None:
        self.bucket.point_latest(job, step)

    def write_receipt(self, job: str, step: int, receipt: manifest.Receipt) -> None:
        self.bucket.put(self._step_key(job, step, layout.receipt_name(receipt.node)), manifest.encoded(receipt))

    def read_notices(self, job: str, step: int) -> step_store.Notices:
        names = self._names(job, step)
        return step_store.Notices(
            self._parsed(job, step, names, layout.receipt_name("*"), manifest.receipt_from_bytes),
            self._parsed(job, step, names, layout.failure_name("*"), manifest.failure_from_bytes))

    def write_failure(self, job: str, step: int, failure: manifest.Failure) -> None:
        self.bucket.put(self._step_key(job, step, layout.failure_name(failure.node)), manifest.encoded(failure))

    def read_failures(self, job: str, step: int) -> list[manifest.Failure]:
        return self._parsed(job, step, self._names(job, step), layout.failure_name("*"), manifest.failure_from_bytes)

    def _names(self, job: str, step: int) -> list[str]:
        """Names of ``step``'s objects, in one listing."""
        folder = self._step_key(job, step, "") + "/"
        return sorted(key[len(folder):] for key in self.bucket.keys_below(folder))

    def _parsed(self, job: str, step: int, names: list[str], pattern: str, parse: Callable[[str, bytes], T]) -> list[T]:
        """The objects among ``names`` that match ``pattern`` (``receipt-*.json``, ``failed-*.json``), parsed."""
        return [parse(self.where(job, step, name), self._read(job, step, name))
                for name in names if fnmatch.fnmatchcase(name, pattern)]

    def retain(self, job: str, keep_last: int, keep_every: int, abandoned_after: float, busy: set[int]) -> list[int]:
        listing = self.bucket.step_listing(job)
        committed = bucket.committed_in(listing)
        keep = retention.kept(committed, keep_last, keep_every)
        newest = max(committed, default=None)
        now = time.time()
        removed = []
        for step, found in sorted(listing.items()):
            partial = step not in committed
            if not partial and step in keep:
                continue
            if partial and (step in busy or newest is None or step > newest
                            or now - max(stored.unix for stored in found) <= abandoned_after):
                continue
            self.bucket.remove_step(job, [stored.key for stored in found])
            removed.append(step)
        return removed

    def set_aside(self, job: str, step: int, why: str) -> str | None:
        listing = self.bucket.step_listing(job)
        if step not in listing:
            return None
        target = self.bucket.set_aside_step(job, step, time.time_ns(), listing.pop(step), why)
        newest = max(bucket.committed_in(listing), default=None)
        if newest is None:
            self.bucket.delete([self.bucket.location.key(job, layout.LATEST)])
        else:
            self.bucket.point_latest(job, newest)
        return target

    def read_into(self, job: str, step: int, entry: manifest.FileEntry, payload: memoryview) -> tuple[int, str]:
        hasher = checksum.new()
        count = 0
        for chunk in self.bucket.chunks(self._step_key(job, step, entry.name)):
            hasher.update(chunk)
            fits = max(0, min(len(chunk), entry.bytes - count))
            payload[count:count + fits] = chunk[:fits]
            count += len(chunk)
        return count, hasher.hexdigest()

    def read_range(self, job: str, step: int, name: str, begin: int, into: memoryview) -> int:
        return self.bucket.read_into(self._step_key(job, step, name), begin, into)

    def open_files(self, job: str, step: int, names: list[str]) -> list[int]:
        """The manifest only, in memory of its own (it is small); a rank's own file is staged into its slot, and a
        resharding rank has ranges of the files it needs staged (``read_range``)."""
        if names[1:] or names[:1] != [layout.MANIFEST]:
            raise step_store.FilesNotPassed(
                f"{self.where(job, step)} is in a bucket without a claim, whose rank files the sidecar does not "
                "pass to ranks: a rank reads the ranges it needs through its slot instead")
        fd = os.memfd_create(layout.MANIFEST, os.MFD_CLOEXEC)
        try:
            data = memoryview(self._read(job, step, layout.MANIFEST))
            while data:
                data = data[os.write(fd, data):]
            os.lseek(fd, 0, os.SEEK_SET)
        except BaseException:
            os.close(fd)
            raise
        return [fd]


def open_bucket(url: str, settings: bucket.Settings) -> BucketStore:
    """The store for ``--bucket`` given without ``--storage``."""
    return BucketStore(bucket.Bucket(bucket.Location.parse(url), settings))
