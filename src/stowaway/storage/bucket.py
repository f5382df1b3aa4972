"""A job's checkpoints in an S3-compatible bucket, in the same layout as on a claim.

    s3://<bucket>/<prefix>/<job>/step-000000000042/rank-00003-of-00008.safetensors
    s3://<bucket>/<prefix>/<job>/step-000000000042/manifest.json   (uploaded last)

A step is committed in the bucket if and only if its manifest object exists;
rank files are uploaded first, each as one streamed multipart upload whose
bytes are checked against the claim's manifest before the upload completes,
so an object that does not match is never made visible.

Rules of this module: ``obstore`` (a Rust client: signing, multipart, retries
of single requests) is imported only when a bucket is opened, so that a
sidecar without a bucket never loads it; credentials come from the
environment (``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``, or the pod's
web identity) and never pass through this code or its messages.
"""

from __future__ import annotations

import asyncio
import os
import re
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

from stowaway.storage import checksum, durable, layout, manifest, step_store

if TYPE_CHECKING:
    from obstore.store import S3Store

SCHEME = "s3://"
_BUCKET_NAME = re.compile(r"^[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9]$")
_STEP_KEY = re.compile(r"^step-(\d{12})/(.+)$")
MiB = 2**20
GiB = 2**30
READ_CHUNK_BYTES = 1 * MiB
# A ranged read (a resharding rank's) goes in parts of this size, ``Settings.concurrency`` at a time.
READ_PART_BYTES = 16 * MiB


class BucketError(step_store.StoreError):
    """A bucket operation failed; ``kind`` is the metric label, the message says what to check."""


class NotFound(BucketError):
    """The object asked for is not there."""

    def __init__(self, message: str) -> None:
        super().__init__("bucket_io", message)


class Exists(BucketError):
    """An object written only if absent was there already."""

    def __init__(self, message: str) -> None:
        super().__init__("bucket_io", message)


class Mismatch(Exception):
    """An object does not match the manifest that lists it."""


class Stopped(Exception):
    """The sidecar is stopping: an upload in progress is abandoned (and its multipart upload aborted)."""


# Every kind a BucketError may carry: the metric's label values.
KINDS = ("bucket_denied", "bucket_missing", "bucket_full", "bucket_unreachable", "bucket_io", "source_changed")


def is_url(text: str | os.PathLike[str]) -> bool:
    return str(text).startswith(SCHEME)


@dataclass(frozen=True)
class Location:
    """``s3://bucket/prefix``: where a sidecar's storage lives in a bucket (jobs are folders below it)."""

    bucket: str
    prefix: str = ""

    @classmethod
    def parse(cls, url: str) -> Location:
        if not is_url(url):
            raise ValueError(f"{url!r} is not a bucket URL: write s3://BUCKET or s3://BUCKET/PREFIX")
        bucket, _, prefix = url[len(SCHEME):].partition("/")
        if not _BUCKET_NAME.match(bucket):
            raise ValueError(f"{url!r} names no valid bucket: a bucket name is 3-63 lower-case letters, "
                             "digits, dots and hyphens")
        return cls(bucket, prefix.strip("/"))

    def key(self, *parts: str) -> str:
        return "/".join(part for part in (self.prefix, *parts) if part)

    def __str__(self) -> str:
        return f"{SCHEME}{self.bucket}/{self.prefix}" if self.prefix else f"{SCHEME}{self.bucket}"


@dataclass(frozen=True)
class Settings:
    """How to reach the bucket and how to move bytes; none of it is secret."""

    endpoint: str | None = None
    region: str | None = None
    virtual_hosted: bool = False
    ca_bundle: Path | None = None
    part_bytes: int = 16 * MiB
    concurrency: int = 8
    # Each request (one part) is retried with backoff until this many seconds have passed.
    retry_seconds: float = 60.0
    # Objects up to this size are copied by the server in one request (S3's limit for CopyObject); larger ones
    # are streamed through the sidecar.
    server_copy_bytes: int = 5 * GiB


def open_store(location: Location, settings: Settings) -> S3Store:
    """An obstore client for ``location``; credentials and anything not set here come from the environment."""
    from obstore.store import S3Store

    config: dict[str, Any] = {"virtual_hosted_style_request": settings.virtual_hosted}
    # The AWS tools' variables, so that the CLI and a sidecar reach the bucket the same way.
    endpoint = settings.endpoint or os.environ.get("AWS_ENDPOINT_URL")
    if endpoint:
        config["endpoint"] = endpoint
    if settings.region:
        config["region"] = settings.region
    client: dict[str, Any] = {"allow_http": bool(endpoint and endpoint.startswith("http://"))}
    ca_bundle = settings.ca_bundle or os.environ.get("AWS_CA_BUNDLE")
    if ca_bundle:
        try:
            client["root_certificate"] = Path(ca_bundle).read_bytes()
        except OSError as exc:
            raise BucketError("bucket_io", f"cannot read the CA bundle {ca_bundle}: {exc.strerror}") from exc
    retry = {"max_retries": 10, "retry_timeout": timedelta(seconds=settings.retry_seconds),
             "backoff": {"init_backoff": timedelta(milliseconds=100), "max_backoff": timedelta(seconds=5),
                         "base": 2}}
    return S3Store(location.bucket, config=config, client_options=client,  # type: ignore[arg-type]
                   retry_config=retry)  # type: ignore[arg-type]


def classify(exc: Exception, what: str) -> BucketError:
    """Name what went wrong in terms a user can act on; the original text is kept for the details."""
    from obstore import exceptions

    text = str(exc)
    if any(code in text for code in ("QuotaExceeded", "StorageFull", "507 Insufficient Storage")):
        kind, hint = "bucket_full", ("the bucket is over its quota or its server is out of space: raise the "
                                     "quota, free space, or lower the bucket's keepLast/keepEvery; the steps "
                                     "already in the bucket are untouched")
    elif isinstance(exc, exceptions.PermissionDeniedError | exceptions.UnauthenticatedError) or any(
        code in text for code in ("AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "403 Forbidden")
    ):
        # Some servers (SeaweedFS) deny rather than report a bucket that does not exist to a non-admin, or a
        # write to a bucket over its quota.
        kind, hint = "bucket_denied", ("check the credentials (the Secret's access key), the bucket's policy, "
                                       "that the bucket exists, and that it is not over a quota")
    elif "NoSuchBucket" in text:
        kind, hint = "bucket_missing", "create the bucket, or correct the bucket's name"
    elif any(sign in text for sign in ("error sending request", "connect", "timed out", "Connection refused")):
        kind, hint = "bucket_unreachable", "check the endpoint and that the object store is up"
    else:
        kind, hint = "bucket_io", "see the details"
    first_line = text.strip().splitlines()[0] if text.strip() else type(exc).__name__
    return BucketError(kind, f"{what} failed ({kind}): {hint}. Details: {first_line[:500]}")


@dataclass(frozen=True)
class StoredObject:
    key: str
    nbytes: int
    # When it was last written, in Unix seconds.
    unix: float


def committed_in(listing: dict[int, list[StoredObject]]) -> list[int]:
    """The steps of a ``step_listing`` that hold a manifest (are committed), oldest first."""
    return sorted(step for step, objects in listing.items()
                  if any(found.key.endswith("/" + layout.MANIFEST) for found in objects))


class Bucket:
    """One sidecar storage location in a bucket, with the operations the tiers and the tools need."""

    def __init__(self, location: Location, settings: Settings) -> None:
        self.location = location
        self.settings = settings
        self._store = open_store(location, settings)

    def url(self, *parts: str) -> str:
        return self.key_url(self.location.key(*parts))

    def key_url(self, key: str) -> str:
        """Object ``key`` as the URL a user would pass to ``stowaway``: what messages name."""
        return f"{SCHEME}{self.location.bucket}/{key}"

    def step_key(self, job: str, step: int, name: str = "") -> str:
        return self.location.key(job, layout.step_dir(Path(), step).name, name)

    # Reading.

    def folders(self, *below: str) -> list[str]:
        """Names of the folders directly under the location, or under ``below`` in it (jobs, or a job's steps)."""
        import obstore

        prefix = self.location.key(*below)
        try:
            found = obstore.list_with_delimiter(self._store, prefix or None)
        except Exception as exc:
            raise classify(exc, f"listing {self.url(*below)}") from exc
        return sorted(common.rstrip("/").rsplit("/", 1)[-1] for common in found["common_prefixes"])

    def step_listing(self, job: str) -> dict[int, list[StoredObject]]:
        """Every object below each step of ``job``, committed or not."""
        import obstore

        prefix = self.location.key(job) + "/"
        steps: dict[int, list[StoredObject]] = {}
        try:
            for chunk in obstore.list(self._store, prefix, chunk_size=1000):
                for meta in chunk:
                    match = _STEP_KEY.match(meta["path"][len(prefix):])
                    if match:
                        steps.setdefault(int(match.group(1)), []).append(
                            StoredObject(meta["path"], meta["size"], meta["last_modified"].timestamp()))
        except Exception as exc:
            raise classify(exc, f"listing {self.url(job)}") from exc
        return steps

    def keys_below(self, prefix: str) -> list[str]:
        """Every object key in folder ``prefix`` and below it (whole path segments: ``a/b`` lists ``a/b/c``, not
        ``a/bc``)."""
        import obstore

        try:
            return [meta["path"] for chunk in obstore.list(self._store, prefix, chunk_size=1000) for meta in chunk]
        except Exception as exc:
            raise classify(exc, f"listing {self.key_url(prefix)}") from exc

    def committed_steps(self, job: str) -> list[int]:
        """Steps whose manifest object exists, oldest first."""
        return committed_in(self.step_listing(job))

    def read_manifest(self, job: str, step: int) -> manifest.Manifest:
        key = self.step_key(job, step, layout.MANIFEST)
        return manifest.manifest_from_bytes(self.key_url(key), self.read(key))

    def read(self, key: str) -> bytes:
        import obstore

        try:
            return bytes(obstore.get(self._store, key).bytes())
        except FileNotFoundError as exc:
            raise NotFound(f"{self.key_url(key)} does not exist") from exc
        except Exception as exc:
            raise classify(exc, f"reading {self.key_url(key)}") from exc

    def read_range(self, key: str, start: int, length: int) -> bytes:
        """``length`` bytes from ``start``: what ``inspect`` and readers of one header need, not the object."""
        import obstore

        try:
            return bytes(obstore.get_range(self._store, key, start=start, length=length))
        except Exception as exc:
            raise classify(exc, f"reading {self.key_url(key)}") from exc

    def chunks(self, key: str, span: tuple[int, int] | None = None) -> Iterator[memoryview]:
        """Object ``key`` (or bytes ``span`` = (begin, end) of it) streamed in chunks of about 1 MiB, never whole
        in memory.

        Small enough to stay in the CPU's cache between the network, the
        checksum and the write (measured: 16 MiB chunks, each in fresh
        memory, read at half the speed).
        """
        import obstore

        options: Any = {"range": span} if span is not None else None
        try:
            for chunk in obstore.get(self._store, key, options=options).stream(min_chunk_size=READ_CHUNK_BYTES):
                yield memoryview(chunk)
        except Exception as exc:
            raise classify(exc, f"reading {self.key_url(key)}") from exc

    def read_into(self, key: str, begin: int, into: memoryview) -> int:
        """Bytes of ``key`` from ``begin`` into ``into``, in parts of ``READ_PART_BYTES`` fetched several at a
        time (one stream alone is bound by its round trips); how many the object held (fewer where it ends
        first)."""
        parts = [(start, min(start + READ_PART_BYTES, len(into))) for start in range(0, len(into), READ_PART_BYTES)]

        def fetch(part: tuple[int, int]) -> int:
            count = part[0]
            for chunk in self.chunks(key, (begin + part[0], begin + part[1])):
                fits = min(len(chunk), part[1] - count)
                into[count : count + fits] = chunk[:fits]
                count += fits
            return count - part[0]

        if len(parts) <= 1:
            return sum(fetch(part) for part in parts)
        with ThreadPoolExecutor(min(len(parts), self.settings.concurrency), thread_name_prefix="range") as pool:
            counts = list(pool.map(fetch, parts))
        total = 0
        for (start, end), count in zip(parts, counts, strict=True):
            total += count
            if count < end - start:
                break
        return total

    # Writing.

    def upload_file(self, key: str, path: Path, entry: manifest.FileEntry, stopping: threading.Event,
                    sent: Callable[[int], None]) -> None:
        """Upload the file at ``path`` as ``key`` in parts, several in flight, checked against ``entry``.

        The file is opened once, so a retention that deletes it meanwhile
        does not tear the upload. The last chunk is handed over only after
        the checksum matched: on a mismatch (or ``stopping``) the iterator
        raises, and obstore aborts the multipart upload, so nothing appears.
        """
        with path.open("rb", buffering=0) as handle:
            self.upload(key, self._chunks(handle, path, entry, stopping, sent), entry.bytes,
                        f"uploading {path} to {self.key_url(key)}")

    def upload(self, key: str, chunks: Iterator[bytes], nbytes: int, what: str) -> None:
        """Upload ``nbytes`` from ``chunks`` as ``key``: a multipart upload of several parts in flight when larger
        than a part. Whatever ``chunks`` raises is raised here, and the multipart upload is aborted, so
        nothing appears."""
        import obstore

        raised: list[BaseException] = []

        def source() -> Iterator[bytes]:
            try:
                yield from chunks
            except BaseException as exc:
                raised.append(exc)
                raise
        try:
            obstore.put(self._store, key, source(), use_multipart=nbytes > self.settings.part_bytes,
                        chunk_size=self.settings.part_bytes, max_concurrency=self.settings.concurrency)
        except Exception as exc:
            if raised:
                raise raised[0] from None
            raise classify(exc, what) from exc

    def _chunks(self, handle: Any, path: Path, entry: manifest.FileEntry, stopping: threading.Event,
                sent: Callable[[int], None]) -> Iterator[bytes]:
        hasher = checksum.new()
        total = 0
        while True:
            if stopping.is_set():
                raise Stopped(f"stopped uploading {path}")
            data = handle.read(self.settings.part_bytes)
            if not data:
                break
            hasher.update(data)
            total += len(data)
            # The last chunk goes only if the whole file is what the manifest says.
            if total >= entry.bytes and (handle.read(1) or total != entry.bytes
                                         or hasher.hexdigest() != entry.xxh3_64):
                raise BucketError("source_changed", f"{path} no longer matches its manifest (expected "
                                  f"{entry.bytes} bytes with xxh3-64 {entry.xxh3_64}); not uploaded")
            sent(len(data))
            yield data
        if total != entry.bytes:
            raise BucketError("source_changed", f"{path} holds {total} bytes, its manifest {entry.bytes}; "
                              "not uploaded")

    def put(self, key: str, data: bytes, only_new: bool = False) -> None:
        """Write object ``key``; with ``only_new``, ``Exists`` where it is there already (a conditional write,
        ``If-None-Match: *``, which the server must support: AWS S3, MinIO and SeaweedFS do)."""
        import obstore

        try:
            obstore.put(self._store, key, data, mode="create" if only_new else "overwrite")
        except Exception as exc:
            from obstore import exceptions

            if isinstance(exc, exceptions.AlreadyExistsError):
                raise Exists(f"{self.key_url(key)} exists already") from exc
            raise classify(exc, f"writing {self.key_url(key)}") from exc

    def point_latest(self, job: str, step: int) -> None:
        """Name ``step`` as the job's newest in its ``latest`` object, as on a claim."""
        self.put(self.location.key(job, layout.LATEST), f"{step}\n".encode())

    def delete(self, keys: list[str]) -> None:
        import obstore

        try:
            obstore.delete(self._store, keys)
        except Exception as exc:
            raise classify(exc, f"deleting {len(keys)} object(s) in {self.url()}") from exc

    def remove_step(self, job: str, keys: list[str]) -> None:
        """Delete a step's objects, its manifest first: a step half deleted never looks committed."""
        manifests = [key for key in keys if key.endswith("/" + layout.MANIFEST)]
        if manifests:
            self.delete(manifests)
        rest = [key for key in keys if key not in manifests]
        if rest:
            self.delete(rest)

    def copy(self, source: str, target: str, nbytes: int) -> None:
        """Copy an object within the bucket: by the server when S3 allows it in one request, else streamed."""
        import obstore

        try:
            if nbytes <= self.settings.server_copy_bytes:
                obstore.copy(self._store, source, target)
            else:
                # Asynchronous, because obstore cannot read one object inside the runtime writing another.
                asyncio.run(self._stream_copy(source, target))
        except Exception as exc:
            raise classify(exc, f"copying {self.key_url(source)} to {target}") from exc

    async def _stream_copy(self, source: str, target: str) -> None:
        import obstore

        response = await obstore.get_async(self._store, source)
        await obstore.put_async(self._store, target, response.stream(min_chunk_size=READ_CHUNK_BYTES),
                                use_multipart=True, chunk_size=self.settings.part_bytes,
                                max_concurrency=self.settings.concurrency)

    def set_aside_step(self, job: str, step: int, stamp_ns: int, objects: list[StoredObject],
                       why: str = layout.ROLLED_BACK) -> str:
        """Move ``step``'s ``objects`` (committed or partial) out of the step names, as ``stowaway rollback`` does
        on a claim; its URL.

        A bucket cannot rename: every object is copied under
        ``rolled-back-step-<step>-<stamp_ns>/``, then the originals are
        deleted, manifest first. ``stamp_ns`` comes from the rollback's
        record, so a retry after a crash writes the same names again, and
        the step stays committed under its own name until its copy is whole.
        """
        target = self.location.key(job, layout.set_aside_dir(Path(), step, stamp_ns, why).name)
        for found in sorted(objects, key=lambda found: found.key.endswith("/" + layout.MANIFEST)):
            self.copy(found.key, f"{target}/{found.key.rsplit('/', 1)[-1]}", found.nbytes)
        self.remove_step(job, [found.key for found in objects])
        return self.key_url(target)

    def download_file(self, key: str, final: Path, entry: manifest.FileEntry, received: Callable[[int], None]) -> None:
        """Copy object ``key`` to ``final`` durably (temp name, fdatasync, rename, directory fsync), checked
        against ``entry`` before it gets its name; ``Mismatch`` if it differs (nothing is left behind)."""
        tmp = final.with_name(f"{final.name}.{os.getpid()}-{threading.get_ident()}{layout.TMP_SUFFIX}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, durable.FILE_MODE)
        hasher = checksum.new()
        total = 0
        try:
            for chunk in self.chunks(key):
                hasher.update(chunk)
                total += len(chunk)
                received(len(chunk))
                while chunk:
                    chunk = chunk[os.write(fd, chunk):]
            if total != entry.bytes or hasher.hexdigest() != entry.xxh3_64:
                raise Mismatch(f"{self.key_url(key)}: {total} bytes with xxh3-64 "
                               f"{hasher.hexdigest()}, the manifest says {entry.bytes} bytes with {entry.xxh3_64}")
        except BaseException:
            os.close(fd)
            tmp.unlink(missing_ok=True)
            raise
        durable.publish(fd, tmp, final)
