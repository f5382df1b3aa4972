"""Gathering a DTensor's shards, one in each rank's file, into the whole tensor.

For reading a checkpoint outside the job that wrote it (to evaluate, convert
or load onto another mesh): there is no mesh to rebuild a DTensor on, and the
caller wants each one whole. Every rank stored its shard (``format.dtensors``);
a shard goes where torch's sharding put it: mesh dimension by mesh dimension
from the left, each ``Shard(dim)`` splits what is left of that tensor
dimension as ``torch.chunk`` does, and a ``_StridedShard`` splits each of
its pieces so (``dtensors`` refuses other orders at save). Every shard's
shape is checked against the indices it must fill.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from stowaway.errors import UnsupportedState
from stowaway.format import nodes, shards

# Indices of a dimension of a whole tensor: a run as a range, else an array.
Indices = np.ndarray | range


def mesh_position(mesh_ranks: Any, rank: int) -> tuple[tuple[int, ...], list[int]] | None:
    """The mesh's shape and ``rank``'s coordinate in it; None when the rank is not in the mesh."""
    layout = np.array(mesh_ranks)
    found = np.argwhere(layout == rank)
    return (layout.shape, found[0].tolist()) if len(found) else None


def shard_indices(global_shape: list[int], mesh_shape: tuple[int, ...], coordinate: list[int],
                  placements: list[dict[str, Any]]) -> list[Indices]:
    """Per tensor dimension, the indices of the whole tensor that the shard of the rank at ``coordinate`` holds.

    A ``Shard`` keeps one ``torch.chunk`` piece of what is left of its
    dimension; a ``_StridedShard`` (FSDP2 over tensor parallelism) first cuts
    it into ``split_factor`` pieces and keeps the same piece of each, so its
    indices need not be contiguous.
    """
    # Ranges until a _StridedShard needs arrays: a shard's indices are a run in the common case, and an array of
    # every index of a large tensor cost a resharding restore a third of its time.
    indices: list[Indices] = [range(size) for size in global_shape]
    for mesh_dim, placement in enumerate(placements):
        if nodes.PLACEMENT_REPLICATE in placement:
            continue
        if nodes.PLACEMENT_SHARD not in placement:
            raise _not_gatherable(placement)
        dim = placement[nodes.PLACEMENT_SHARD] % len(global_shape)
        parts, index = mesh_shape[mesh_dim], coordinate[mesh_dim]
        if nodes.PLACEMENT_SPLIT_FACTOR in placement:
            split_factor = placement[nodes.PLACEMENT_SPLIT_FACTOR]
            pieces = [_piece(indices[dim], split_factor, cut) for cut in range(split_factor)]
            indices[dim] = np.concatenate([np.asarray(_piece(piece, parts, index), dtype=np.int64)
                                           for piece in pieces])
        else:
            indices[dim] = _piece(indices[dim], parts, index)
    return indices


def check_gatherable(tree: dict[str, Any]) -> None:
    """Refuse a state holding a DTensor that cannot be gathered whole, before any file is read or tensor written."""
    for node in shards.dtensor_nodes(tree[nodes.TREE_ROOT]):
        for placement in node[nodes.DTENSOR_PLACEMENTS]:
            if nodes.PLACEMENT_REPLICATE not in placement and nodes.PLACEMENT_SHARD not in placement:
                raise _not_gatherable(placement)


def _not_gatherable(placement: dict[str, Any]) -> UnsupportedState:
    return UnsupportedState(
        f"placement {placement} cannot be gathered into a whole tensor: a Partial is a sum over ranks "
        "that only they can reduce; load the checkpoint in the job's layout with load(device_mesh=...) "
        "and call full_tensor() instead"
    )


def _piece(indices: Indices, parts: int, index: int) -> Indices:
    """Piece ``index`` of ``indices`` when ``torch.chunk`` splits them into ``parts``."""
    full = -(-len(indices) // parts)
    return indices[full * index : full * (index + 1)]


def _region(indices: list[Indices]) -> tuple[Any, ...]:
    """``indices`` as an index into the whole tensor: slices where they are contiguous, as most are."""
    if all(not len(ix) or ix[-1] - ix[0] + 1 == len(ix) for ix in indices):
        return tuple(slice(int(ix[0]), int(ix[-1]) + 1) if len(ix) else slice(0, 0) for ix in indices)
    return cross_index(indices)


def cross_index(indices: list[Indices] | tuple[Indices, ...]) -> tuple[torch.Tensor, ...]:
    """Tensors that index every combination of ``indices`` (one per dimension), as ``numpy.ix_`` does."""
    return tuple(torch.from_numpy(ix) for ix in np.ix_(*(np.asarray(ix) for ix in indices)))


class Gatherer:
    """Collects every rank's shards into whole tensors, then hands them to ``tree.unflatten`` once ``complete``
    has found none missing.

    Each whole tensor is allocated on ``device`` at its first shard, so only
    one rank's file need be held in memory at a time; or it is the caller's
    own, from ``into`` (by the stored local name, as ``in_place.match`` pairs
    them), which then receives the shards directly.
    """

    def __init__(self, device: torch.device, into: dict[str, list[torch.Tensor]] | None = None) -> None:
        self._device = device
        into = into or {}
        self._whole: dict[str, torch.Tensor] = {name: tensors[0] for name, tensors in into.items()}
        # Further destinations of a whole (both halves of a tie given apart): filled from the first by complete().
        self._also = {name: tensors[1:] for name, tensors in into.items() if len(tensors) > 1}
        # Per whole tensor, the ranks of its mesh whose shard has not been placed yet.
        self._awaited: dict[str, set[int]] = {}

    def add(self, rank: int, tree: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
        """Place ``rank``'s shards: ``tree`` and ``tensors`` are its file's, as ``codec.parsed`` returns them."""
        meshes = tree.get(nodes.TREE_MESHES, [])
        positions = {index: mesh_position(mesh[nodes.MESH_RANKS], rank) for index, mesh in enumerate(meshes)}
        for node in shards.dtensor_nodes(tree[nodes.TREE_ROOT]):
            name = node[nodes.DTENSOR][nodes.TENSOR]
            mesh_index = node[nodes.DTENSOR_MESH]
            position = positions[mesh_index]
            if name not in self._awaited:
                self._awaited[name] = _ranks_of(meshes[mesh_index])
            if position is None or rank not in self._awaited[name]:
                continue
            global_shape, placements = node[nodes.DTENSOR_SHAPE], node[nodes.DTENSOR_PLACEMENTS]
            shard = tensors[name]
            whole = self._whole.get(name)
            if whole is None:
                whole = self._whole[name] = torch.empty(global_shape, dtype=shard.dtype, device=self._device)
            indices = shard_indices(global_shape, *position, placements)
            expected = [len(ix) for ix in indices]
            if list(shard.shape) != expected:
                raise UnsupportedState(
                    f"rank {rank}'s shard of the DTensor stored as {name!r} has shape {list(shard.shape)}, but "
                    f"placements {placements} of a {list(global_shape)} tensor give it {expected}; load the "
                    "checkpoint in the job's layout with load(device_mesh=...) and call full_tensor() instead"
                )
            # A caller's Parameter that requires grad refuses an in-place write that autograd would record.
            with torch.no_grad():
                whole[_region(indices)] = shard
            self._awaited[name].discard(rank)

    def complete(self) -> None:
        """Check that every whole tensor received all its shards, then fill its further destinations."""
        for name, awaited in self._awaited.items():
            if awaited:
                missing = sorted(awaited)
                raise UnsupportedState(
                    f"the DTensor stored as {name!r} has no shard in the files of ranks {missing[:16]} of its "
                    "mesh, so it cannot be gathered whole; load the checkpoint in the job's layout with "
                    "load(device_mesh=...) instead"
                )
        with torch.no_grad():
            for name, destinations in self._also.items():
                for destination in destinations:
                    if destination is not self._whole[name]:
                        destination.copy_(self._whole[name])

    def rebuild(self, node: nodes.Node, local: torch.Tensor) -> Any:
        whole = self._whole[node[nodes.DTENSOR][nodes.TENSOR]]
        # Called once per stored DTensor: tree.unflatten hands a tie the object it built the first time.
        if nodes.DTENSOR_PARAMETER in node:
            return torch.nn.Parameter(whole, requires_grad=bool(node[nodes.DTENSOR_PARAMETER]))
        return whole


def _ranks_of(mesh: dict[str, Any]) -> set[int]:
    return set(np.array(mesh[nodes.MESH_RANKS]).reshape(-1).tolist())
