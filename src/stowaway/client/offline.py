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
from typing import Any

import torch

from stowaway.errors import CheckpointCorrupt, UnsupportedState
from stowaway.format import codec, dtensors, full_tensors, in_place, nodes
from stowaway.format import tree as tree_mod
from stowaway.storage import catalog, direct_io, layout, manifest


def read_checkpoint(path: str | os.PathLike[str], step: int | None = None, *, rank: int = 0,
                    map_location: Any = "cpu", allow_pickle: bool = False, into: Any = None) -> tuple[int, Any]:
    """``(step, state)`` of rank ``rank`` in the committed ``step`` (default: the newest) of the job at ``path``.

    ``path`` is a job's directory: the sidecar's storage followed by the job
    name. Each DTensor comes back as a plain tensor of its global shape,
    gathered from every rank's file: all of them are read, one at a time, and
    the gathered tensors are held in memory (on ``map_location``) together.
    A checkpoint without DTensors reads only the one rank's file.

    ``into`` (a state shaped as the one returned, e.g. ``{"model":
    model.state_dict()}`` of a model built whole) receives the bytes in its
    own tensors, which come back in place of new ones, as with ``load``: the
    weights are not held twice. It is checked against the rank's file before
    anything is written; a file of another rank found corrupt while DTensors
    are gathered may leave some of its tensors written, and the error says so.
    """
    job_path = Path(path)
    committed = catalog.committed_steps(job_path)
    if not committed:
        raise ValueError(f"{job_path} holds no committed checkpoint: pass a job's directory (the sidecar's "
                         "storage followed by the job name), as `stowaway ls` lists them")
    if step is None:
        step = committed[-1]
    elif step not in committed:
        raise ValueError(f"step {step} is not a committed checkpoint of {job_path}; committed: "
                         f"{', '.join(map(str, committed[-10:]))}{' (the newest ten)' if len(committed) > 10 else ''}")
    step_path = layout.step_dir(job_path, step)
    found = manifest.read_manifest(step_path)
    if not 0 <= rank < found.world_size:
        raise ValueError(f"rank {rank} is not one of the {found.world_size} ranks of step {step}")
    tree, views = _parsed(step_path, found.file_for(rank))
    sharded = bool(tree.get(nodes.TREE_MESHES))
    if sharded:
        full_tensors.check_gatherable(tree)
    destinations = None if into is None else in_place.match(tree, views, into, whole_dtensors=True)
    builder: tree_mod.DTensorBuilder = (
        _gathered(step_path, found, rank, tree, views, map_location, destinations) if sharded
        else dtensors.Rebuilder(tree, ())
    )
    if destinations is not None:
        destinations.fill(views)
    return step, codec.rebuilt(tree, views, map_location, builder, allow_pickle, destinations)


def _gathered(step_path: Path, found: manifest.Manifest, rank: int, tree: dict[str, Any],
              views: dict[str, torch.Tensor], map_location: Any,
              destinations: in_place.Destinations | None) -> full_tensors.Gatherer:
    """Every DTensor whole, from every rank's file (``rank``'s is parsed already), into ``destinations`` where given."""
    gatherer = full_tensors.Gatherer(torch.device(map_location), None if destinations is None else destinations.wholes)
    try:
        for entry in found.files:
            gatherer.add(entry.rank, *((tree, views) if entry.rank == rank else _parsed(step_path, entry)))
        gatherer.complete()
    except (CheckpointCorrupt, UnsupportedState) as exc:
        if destinations is None or not destinations.wholes:
            raise
        raise type(exc)(f"{exc}. Tensors of into may have been written before this was found: reload them") from exc
    return gatherer


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
