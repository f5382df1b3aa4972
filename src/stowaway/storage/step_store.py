"""Where a sidecar keeps its jobs' steps: a directory (a claim's mount) or a bucket, behind one interface.

The persist of a rank file, the commit (receipts, failure notices, the
manifest whose presence is the commit, ``latest``, retention, setting a step
aside) and the restore need the same few operations of either, in the
layout of ``storage.layout``. ``directory_store`` and ``bucket_store``
implement them; the sidecar picks one at start and never asks which.

Errors: an implementation raises ``OSError`` (a directory) or ``StoreError``
(anything else, with a metric label); ``manifest.ManifestError`` for a
manifest, receipt or notice that is missing or unreadable.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple, Protocol

from stowaway.storage import checksum, manifest


class StoreError(Exception):
    """A store operation failed; ``kind`` is the metric label, the message says what to check."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


class ManifestExists(StoreError):
    """A manifest was written where one already is: another coordinator committed the step first."""

    def __init__(self, message: str) -> None:
        super().__init__("manifest_exists", message)


class FilesNotPassed(StoreError):
    """The store passes no rank files to ranks (a bucket alone): not a failure, the rank reads ranges instead."""

    KIND = "files_not_passed"

    def __init__(self, message: str) -> None:
        super().__init__(self.KIND, message)


class Notices(NamedTuple):
    """What the nodes of a step have said: which files they hold (receipts), and which gave up (failures)."""

    receipts: list[manifest.Receipt]
    failures: list[manifest.Failure]


class RankFileWrite(Protocol):
    """One rank file being written: ``write`` moves the bytes, ``finish`` makes them durable under their name.

    Until ``finish`` returns nothing of the file counts; a ``write`` that
    raises leaves nothing behind.
    """

    @property
    def where(self) -> str:
        """The file, as a user finds it."""
        ...

    def write(self, payload: memoryview, nbytes: int, before_chunk: Callable[[int], None],
              verify: Callable[[], None]) -> tuple[str, checksum.Pieces]:
        """Write the first ``nbytes`` of ``payload``; their checksum, whole and piece by piece.

        ``before_chunk`` runs before each chunk (the rate limit, the check
        for a failed step); ``verify`` runs once every byte was read from
        ``payload`` and before any of it can become visible, so that a source
        found changed (it raises) is never stored.
        """
        ...

    def finish(self) -> None: ...


class StepStore(Protocol):
    """A sidecar's storage: every job's steps below one directory or bucket prefix."""

    # Whether ``open_files`` passes rank files to ranks (a directory); a bucket stages a rank's own file into its
    # slot instead (``read_into``), and ranges of other ranks' files for a resharding rank (``read_range``).
    passes_files: bool

    def where(self, job: str, step: int | None = None, name: str = "") -> str:
        """A job, a step or a file of it, as a user finds it (a path, or an ``s3://`` URL)."""
        ...

    def probe(self) -> str | None:
        """Why ranks cannot be served from this store right now (not writable, unreachable), or None."""
        ...

    # Persisting.

    def rank_file(self, job: str, step: int, name: str) -> RankFileWrite: ...

    # Committing.

    def committed_steps(self, job: str) -> list[int]:
        """Steps whose manifest exists, oldest first."""
        ...

    def read_manifest(self, job: str, step: int) -> manifest.Manifest: ...

    def write_manifest(self, job: str, step: int, found: manifest.Manifest) -> None:
        """Commit: write the manifest, last. ``ManifestExists`` where the store can tell that one is there."""
        ...

    def point_latest(self, job: str, step: int) -> None:
        """Name ``step`` as the job's newest in ``latest``, a convenience for people and scripts."""
        ...

    def write_receipt(self, job: str, step: int, receipt: manifest.Receipt) -> None: ...

    def read_notices(self, job: str, step: int) -> Notices:
        """Every receipt and failure notice of ``step``, read in one listing: what a commit's poll needs."""
        ...

    def write_failure(self, job: str, step: int, failure: manifest.Failure) -> None: ...

    def read_failures(self, job: str, step: int) -> list[manifest.Failure]: ...

    def retain(self, job: str, keep_last: int, keep_every: int, abandoned_after: float, busy: set[int]) -> list[int]:
        """Delete the committed steps retention drops (manifest first) and the partial steps abandoned below the
        newest committed one; the steps removed."""
        ...

    def set_aside(self, job: str, step: int, why: str) -> str | None:
        """Move committed ``step`` out of the step names (``why``: ``layout.CORRUPT`` or ``ROLLED_BACK``); where
        it went, or None when it is no longer there."""
        ...

    # Restoring.

    def read_into(self, job: str, step: int, entry: manifest.FileEntry, payload: memoryview) -> tuple[int, str]:
        """Read ``entry``'s file into ``payload``; how many bytes it held (up to ``entry.bytes``) and their
        checksum. The caller compares both with ``entry``."""
        ...

    def read_range(self, job: str, step: int, name: str, begin: int, into: memoryview) -> int:
        """Read ``len(into)`` bytes of file ``name`` of ``step`` from ``begin`` into ``into``; how many it held
        (fewer where the file ends first). The rank that asked checks them against the manifest's pieces."""
        ...

    def open_files(self, job: str, step: int, names: list[str]) -> list[int]:
        """Read-only descriptors of the named files of ``step``, in order, to pass to a rank; on failure none
        stays open."""
        ...
