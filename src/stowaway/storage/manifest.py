"""The manifest, per-node receipts and failure notices: what a checkpoint contains, or why it never will.

All are JSON written with ``durable.write_atomic``. The manifest is written
last, after every rank's file is durable, and its presence is the commit. A
failure notice tells the other nodes' sidecars, which only share the storage,
that a step of a run cannot commit, so their ranks hear why at once instead of
at the commit timeout.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from stowaway.storage import checksum, durable, layout

FORMAT = "stowaway-checkpoint"
# 2: each file entry may carry piece checksums (``header_bytes``, ``piece_bytes``, ``pieces``).
FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)


class ManifestError(ValueError):
    """A manifest or receipt is unreadable or inconsistent."""


@dataclass(frozen=True)
class FileEntry:
    """One rank's file: its size and checksum, and (format version 2) the checksums of its pieces.

    The pieces let a rank verify the byte ranges it reads of a file without
    reading all of it (a resharding restore); a file of version 1 has none,
    and is read and checked whole.
    """

    rank: int
    name: str
    bytes: int
    xxh3_64: str
    header_bytes: int = 0
    piece_bytes: int = 0
    pieces: list[str] = field(default_factory=list)

    @classmethod
    def written(cls, rank: int, name: str, nbytes: int, digest: str, pieces: checksum.Pieces | None) -> FileEntry:
        if pieces is None:
            return cls(rank, name, nbytes, digest)
        return cls(rank, name, nbytes, digest, pieces.header_bytes, pieces.piece_bytes, pieces.digests)

    @property
    def checked_pieces(self) -> checksum.Pieces | None:
        """The piece checksums, when the entry has them and they cover the file exactly; else None."""
        if not self.pieces or self.piece_bytes <= 0 or not 0 < self.header_bytes <= self.bytes:
            return None
        found = checksum.Pieces(self.header_bytes, self.piece_bytes, self.pieces)
        if len(self.pieces) != 1 + -(-(self.bytes - self.header_bytes) // self.piece_bytes):
            return None
        return found


@dataclass(frozen=True)
class Receipt:
    node: str
    run: str
    step: int
    world_size: int
    files: list[FileEntry]
    written_unix: float = field(default_factory=time.time)


@dataclass(frozen=True)
class Failure:
    node: str
    run: str
    step: int
    reason: str
    written_unix: float = field(default_factory=time.time)


@dataclass(frozen=True)
class Manifest:
    job: str
    run: str
    step: int
    world_size: int
    files: list[FileEntry]
    nodes: list[str]
    timings: dict[str, float]
    created_unix: float = field(default_factory=time.time)
    format: str = FORMAT
    format_version: int = FORMAT_VERSION

    @property
    def total_bytes(self) -> int:
        return sum(entry.bytes for entry in self.files)

    def file_for(self, rank: int) -> FileEntry:
        for entry in self.files:
            if entry.rank == rank:
                return entry
        raise ManifestError(f"manifest of step {self.step} has no file for rank {rank}")


def encoded(record: Manifest | Receipt | Failure) -> bytes:
    """What a manifest, receipt or notice is stored as, in a file or an object."""
    return _dump(asdict(record))


def write_receipt(step_path: Path, receipt: Receipt) -> None:
    durable.write_atomic(step_path / layout.receipt_name(receipt.node), encoded(receipt))


def read_receipts(step_path: Path) -> list[Receipt]:
    return [receipt_from_bytes(path, _read(path)) for path in sorted(step_path.glob(layout.receipt_name("*")))]


def receipt_from_bytes(where: Path | str, data: bytes) -> Receipt:
    raw = _parsed(where, data)
    try:
        return Receipt(
            node=str(raw["node"]), run=str(raw["run"]), step=int(raw["step"]), world_size=int(raw["world_size"]),
            files=[FileEntry(**entry) for entry in raw["files"]], written_unix=float(raw["written_unix"]),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise ManifestError(f"{where} is not a valid receipt: {exc}") from exc


def write_failure(step_path: Path, failure: Failure) -> None:
    """Announce ``failure``; the step directory may not exist yet when no file of it was written."""
    durable.make_dirs(step_path)
    durable.write_atomic(step_path / layout.failure_name(failure.node), encoded(failure))


def read_failures(step_path: Path) -> list[Failure]:
    return [failure_from_bytes(path, _read(path)) for path in sorted(step_path.glob(layout.failure_name("*")))]


def failure_from_bytes(where: Path | str, data: bytes) -> Failure:
    raw = _parsed(where, data)
    try:
        return Failure(node=str(raw["node"]), run=str(raw["run"]), step=int(raw["step"]),
                       reason=str(raw["reason"]), written_unix=float(raw["written_unix"]))
    except (KeyError, TypeError, ValueError) as exc:
        raise ManifestError(f"{where} is not a valid failure notice: {exc}") from exc


def write_manifest(step_path: Path, manifest: Manifest) -> None:
    durable.write_atomic(step_path / layout.MANIFEST, encoded(manifest))


def read_manifest(step_path: Path) -> Manifest:
    path = step_path / layout.MANIFEST
    return manifest_from_bytes(path, _read(path))


def manifest_from_bytes(where: Path | str, data: bytes) -> Manifest:
    """A manifest read by whoever holds its bytes: from a file, through a descriptor the sidecar passed a rank,
    or from a bucket's object; ``where`` names it in errors."""
    return _checked(_parsed(where, data), where)


def _checked(raw: dict[str, Any], path: Path | str) -> Manifest:
    if raw.get("format") != FORMAT:
        raise ManifestError(f"{path} is not a Stowaway manifest (format {raw.get('format')!r})")
    if raw.get("format_version") not in READABLE_VERSIONS:
        raise ManifestError(
            f"{path} has format version {raw.get('format_version')}; this release reads "
            f"versions {', '.join(map(str, READABLE_VERSIONS))}: upgrade Stowaway to read it"
        )
    try:
        manifest = Manifest(
            job=str(raw["job"]), run=str(raw["run"]), step=int(raw["step"]), world_size=int(raw["world_size"]),
            files=[FileEntry(**entry) for entry in raw["files"]], nodes=list(raw["nodes"]),
            timings=dict(raw["timings"]), created_unix=float(raw["created_unix"]),
            format_version=int(raw["format_version"]),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise ManifestError(f"{path} is not a valid manifest: {exc}") from exc
    if sorted(entry.rank for entry in manifest.files) != list(range(manifest.world_size)):
        raise ManifestError(f"{path} does not list exactly one file per rank 0..{manifest.world_size - 1}")
    for entry in manifest.files:
        if Path(entry.name).name != entry.name or entry.name.startswith("."):
            raise ManifestError(f"{path} names a file outside its directory: {entry.name!r}")
    return manifest


def _dump(value: dict[str, Any]) -> bytes:
    return (json.dumps(value, indent=1, sort_keys=True) + "\n").encode()


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise ManifestError(f"cannot read {path}: {exc}") from exc


def _parsed(where: Path | str, data: bytes) -> dict[str, Any]:
    try:
        raw = json.loads(data)
    except ValueError as exc:
        raise ManifestError(f"cannot read {where}: {exc}") from exc
    if not isinstance(raw, dict):
        raise ManifestError(f"{where} does not hold a JSON object")
    return raw
