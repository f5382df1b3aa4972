"""``read_checkpoint``: a committed checkpoint read straight from storage, outside the job that wrote it.

For evaluating, converting or inspecting a checkpoint where there is no
sidecar, no process group and perhaps not the job's number of GPUs: one
rank's state comes back as ``load()`` would return it, except that each
DTensor is gathered whole from every rank's file (``format.full_tensors``).
Every file read is checked against the manifest's size and checksum first.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Protocol

import torch

from stowaway.errors import CheckpointCorrupt, UnsupportedState
from stowaway.format import codec, dtensors, full_tensors, in_place, nodes
from stowaway.format import tree as tree_mod
from stowaway.storage import bucket, bucket_jobs, catalog, direct_io, layout, manifest


def read_checkpoint(path: str | os.PathLike[str], step: int | None = None, *, rank: int = 0,
                    map_location: Any = "cpu", allow_pickle: bool = False, into: Any = None) -> tuple[int, Any]:
    """``(step, state)`` of rank ``rank`` in the committed ``step`` (default: the newest) of the job at ``path``.

    ``path`` is a job's directory: the sidecar's storage followed by the job
    name, or its URL in the bucket tier (``s3://BUCKET/PREFIX/JOB``, reached
    with the ``AWS_*`` variables, as ``stowaway ls`` does). Each DTensor
    comes back as a plain tensor of its global shape, gathered from every
    rank's file: all of them are read, one at a time, and the gathered
    tensors are held in memory (on ``map_location``) together. A checkpoint
    without DTensors reads only the one rank's file.

    ``into`` (a state shaped as the one returned, e.g. ``{"model":
    model.state_dict()}`` of a model built whole) receives the bytes in its
    own tensors, which come back in place of new ones, as with ``load``: the
    weights are not held twice. It is checked against the rank's file before
    anything is written; a file of another rank found corrupt while DTensors
    are gathered may leave some of its tensors written, and the error says so.
    """
    source: _Source = _BucketSource(str(path)) if bucket.is_url(path) else _DirectorySource(Path(path))
    job_path = source.name  # for messages
    committed = source.committed_steps()
    if not committed:
        raise ValueError(f"{job_path} holds no committed checkpoint: pass a job's directory (the sidecar's "
                         "storage followed by the job name) or its s3:// URL, as `stowaway ls` lists them")
    if step is None:
        step = committed[-1]
    elif step not in committed:
        raise ValueError(f"step {step} is not a committed checkpoint of {job_path}; committed: "
                         f"{', '.join(map(str, committed[-10:]))}{' (the newest ten)' if len(committed) > 10 else ''}")
    found = source.read_manifest(step)
    if not 0 <= rank < found.world_size:
        raise ValueError(f"rank {rank} is not one of the {found.world_size} ranks of step {step}")
    stored = source.at(step)
    tree, views = stored.parsed(found.file_for(rank))
    sharded = bool(tree.get(nodes.TREE_MESHES))
    if sharded:
        full_tensors.check_gatherable(tree)
    destinations = None if into is None else in_place.match(tree, views, into, whole_dtensors=True)
    builder: tree_mod.DTensorBuilder = (
        _gathered(stored, found, rank, tree, views, map_location, destinations) if sharded
        else dtensors.Rebuilder(tree, ())
    )
    if destinations is not None:
        destinations.fill(views)
    return step, codec.rebuilt(tree, views, map_location, builder, allow_pickle, destinations)


def _gathered(stored: _Step, found: manifest.Manifest, rank: int, tree: dict[str, Any],
              views: dict[str, torch.Tensor], map_location: Any,
              destinations: in_place.Destinations | None) -> full_tensors.Gatherer:
    """Every DTensor whole, from every rank's file (``rank``'s is parsed already), into ``destinations`` where given."""
    gatherer = full_tensors.Gatherer(torch.device(map_location), None if destinations is None else destinations.wholes)
    try:
        for entry in found.files:
            gatherer.add(entry.rank, *((tree, views) if entry.rank == rank else stored.parsed(entry)))
        gatherer.complete()
    except (CheckpointCorrupt, UnsupportedState) as exc:
        if destinations is None or not destinations.wholes:
            raise
        raise type(exc)(f"{exc}. Tensors of into may have been written before this was found: reload them") from exc
    return gatherer


class _Step(Protocol):
    def parsed(self, entry: manifest.FileEntry) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        """One rank's file, checked against the manifest, as its state tree and views of its tensors."""


class _Source(Protocol):
    """Where a job's checkpoints are: a directory, or a bucket (``storage.bucket_jobs``)."""

    name: str

    def committed_steps(self) -> list[int]: ...

    def read_manifest(self, step: int) -> manifest.Manifest: ...

    def at(self, step: int) -> _Step: ...


class _DirectorySource:
    def __init__(self, job_path: Path) -> None:
        self._job_path = job_path
        self.name = str(job_path)

    def committed_steps(self) -> list[int]:
        return catalog.committed_steps(self._job_path)

    def read_manifest(self, step: int) -> manifest.Manifest:
        return manifest.read_manifest(layout.step_dir(self._job_path, step))

    def at(self, step: int) -> _Step:
        return _DirectoryStep(layout.step_dir(self._job_path, step))


class _DirectoryStep:
    def __init__(self, step_path: Path) -> None:
        self._step_path = step_path

    def parsed(self, entry: manifest.FileEntry) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        return _parsed(self._step_path, entry)


class _BucketSource:
    def __init__(self, url: str) -> None:
        jobs = bucket_jobs.jobs_at(url)
        if len(jobs) != 1:
            raise ValueError(f"{url} holds {len(jobs)} jobs; pass one job's URL, as `stowaway ls {url}` lists them")
        self._job = jobs[0]
        self.name = url

    def committed_steps(self) -> list[int]:
        return self._job.committed_steps()

    def read_manifest(self, step: int) -> manifest.Manifest:
        return self._job.read_manifest(step)

    def at(self, step: int) -> _Step:
        return _BucketStep(self._job, step)


class _BucketStep:
    def __init__(self, job: bucket_jobs.BucketJob, step: int) -> None:
        self._job = job
        self._step = step

    def parsed(self, entry: manifest.FileEntry) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        buffer, problem = self._job.read_file(self._step, entry)
        if problem is not None:
            raise CheckpointCorrupt(f"{self._job.where(self._step, entry.name)}: {problem}; "
                                    "`stowaway verify` names what differs")
        return codec.parsed(torch.frombuffer(buffer, dtype=torch.uint8), entry.bytes)


def _parsed(step_path: Path, entry: manifest.FileEntry) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """One rank's file, checked against the manifest, as its state tree and views of its tensors."""
    path = step_path / entry.name
    buffer = bytearray(entry.bytes)
    fd = direct_io.open_file(path, os.O_RDONLY, direct=False)
    try:
        size = os.fstat(fd).st_size
        count, digest = direct_io.read_into(fd, memoryview(buffer), entry.bytes)
    finally:
        os.close(fd)
    if size != entry.bytes or count != entry.bytes or digest != entry.xxh3_64:
        raise CheckpointCorrupt(f"{path} does not match the manifest's size and xxh3-64 checksum; "
                                "`stowaway verify` names what differs")
    return codec.parsed(torch.frombuffer(buffer, dtype=torch.uint8), entry.bytes)
