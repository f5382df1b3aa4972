"""Gathering a DTensor's shards, one in each rank's file, into the whole tensor.

For reading a checkpoint outside the job that wrote it (to evaluate, convert
or load onto another mesh): there is no mesh to rebuild a DTensor on, and the
caller wants each one whole. Every rank stored its shard (``format.dtensors``);
a shard goes where torch's sharding put it: mesh dimension by mesh dimension
from the left, each ``Shard(dim)`` splits what is left of that tensor
dimension as ``torch.chunk`` does (``dtensors`` refuses other orders at
save). Every shard's shape is checked against its region.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from stowaway.errors import UnsupportedState
from stowaway.format.shards import dtensor_nodes


def mesh_position(mesh_ranks: Any, rank: int) -> tuple[tuple[int, ...], list[int]] | None:
    """The mesh's shape and ``rank``'s coordinate in it; None when the rank is not in the mesh."""
    layout = np.array(mesh_ranks)
    found = np.argwhere(layout == rank)
    return (layout.shape, found[0].tolist()) if len(found) else None


def shard_region(global_shape: list[int], mesh_shape: tuple[int, ...], coordinate: list[int],
                 placements: list[dict[str, Any]]) -> tuple[slice, ...]:
    """Where the shard of the rank at ``coordinate`` lies in the whole tensor."""
    begin, extent = [0] * len(global_shape), list(global_shape)
    for mesh_dim, placement in enumerate(placements):
        if "r" in placement:
            continue
        if "s" not in placement or "sf" in placement:
            raise UnsupportedState(
                f"placement {placement} cannot be gathered into a whole tensor: only Shard and Replicate can "
                "(a Partial is a sum over ranks, a _StridedShard interleaves them); load the checkpoint in the "
                "job's layout with load(device_mesh=...) and call full_tensor() instead"
            )
        dim = placement["s"] % len(global_shape)
        size, offset = _chunk(extent[dim], mesh_shape[mesh_dim], coordinate[mesh_dim])
        begin[dim] += offset
        extent[dim] = size
    return tuple(slice(start, start + size) for start, size in zip(begin, extent, strict=True))


def _chunk(length: int, parts: int, index: int) -> tuple[int, int]:
    """Size and offset of part ``index`` when ``torch.chunk`` splits ``length`` into ``parts``."""
    full = -(-length // parts)
    start = full * index
    if start >= length:
        return 0, length
    return min(full, length - start), start


class Gatherer:
    """Collects every rank's shards into whole tensors, then hands them to ``tree.unflatten``.

    Each whole tensor is allocated on ``device`` at its first shard, so only
    one rank's file need be held in memory at a time.
    """

    def __init__(self, device: torch.device) -> None:
        self._device = device
        self._whole: dict[str, torch.Tensor] = {}
        # Per whole tensor, the ranks of its mesh whose shard has not been placed yet.
        self._awaited: dict[str, set[int]] = {}
        self._parameters: dict[str, torch.nn.Parameter] = {}

    def add(self, rank: int, tree: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
        """Place ``rank``'s shards: ``tree`` and ``tensors`` are its file's, as ``codec.decode`` returns them."""
        meshes = tree.get("meshes", [])
        positions = {index: mesh_position(mesh["ranks"], rank) for index, mesh in enumerate(meshes)}
        for node in dtensor_nodes(tree["root"]):
            name = node["D"]["T"]
            position = positions[node["m"]]
            if position is None or rank not in self._awaited.setdefault(name, _ranks_of(meshes[node["m"]])):
                continue
            shard = tensors[name]
            whole = self._whole.get(name)
            if whole is None:
                whole = self._whole[name] = torch.empty(node["sh"], dtype=shard.dtype, device=self._device)
            target = whole[shard_region(node["sh"], *position, node["pl"])]
            if target.shape != shard.shape:
                raise UnsupportedState(
                    f"rank {rank}'s shard of the DTensor stored as {name!r} has shape {list(shard.shape)}, but "
                    f"placements {node['pl']} of a {list(node['sh'])} tensor give it {list(target.shape)}; load "
                    "the checkpoint in the job's layout with load(device_mesh=...) and call full_tensor() instead"
                )
            target.copy_(shard)
            self._awaited[name].discard(rank)

    def rebuild(self, node: dict[str, Any], local: torch.Tensor) -> Any:
        name = node["D"]["T"]
        if self._awaited[name]:
            missing = sorted(self._awaited[name])
            raise UnsupportedState(
                f"the DTensor stored as {name!r} has no shard in the files of ranks {missing[:16]} of its mesh, "
                "so it cannot be gathered whole; load the checkpoint in the job's layout with "
                "load(device_mesh=...) instead"
            )
        whole = self._whole[name]
        if "P" not in node:
            return whole
        if name not in self._parameters:
            self._parameters[name] = torch.nn.Parameter(whole, requires_grad=bool(node["P"]))
        return self._parameters[name]


def _ranks_of(mesh: dict[str, Any]) -> set[int]:
    return set(np.array(mesh["ranks"]).reshape(-1).tolist())
