"""DTensors (FSDP2, tensor parallelism): each rank stores its own shard, and ``load`` rebuilds the DTensor.

A DTensor's bytes are spread over the ranks of its device mesh, and every rank
writes a file of its own anyway: so a rank stores its local shard as a plain
tensor, with what ``DTensor.from_local`` needs to rebuild it without talking
to any other rank: the placements, the global shape and stride, and the mesh
as the layout of its ranks (once per mesh, in the tree). A mesh carries
process groups, which no checkpoint can hold, so ``load`` takes the caller's
mesh and checks that its layout is the saved one. On the number of ranks that
saved it, loading onto another layout is refused: each rank reads only its
own file. On another number of ranks, DTensors are resharded from ranges of
every saved rank's file (``client.resharder``, planned by ``format.reshard``).

``torch.distributed.tensor`` is looked up in ``sys.modules``, never imported
on a save: a process that has not imported it holds no DTensor, and a rank
that does not use it should not pay for importing it.
"""

from __future__ import annotations

import functools
import sys
from typing import Any

import torch

from stowaway.errors import UnsupportedState
from stowaway.format import nodes


def dtensor_type() -> type | None:
    module = sys.modules.get("torch.distributed.tensor")
    return getattr(module, "DTensor", None)


def _mesh_type() -> type | None:
    module = sys.modules.get("torch.distributed.device_mesh")
    return getattr(module, "DeviceMesh", None)


def given_meshes(device_mesh: Any) -> tuple[Any, ...]:
    """``load``'s ``device_mesh`` argument as a tuple: None, one mesh, or a list or tuple of them (one per mesh
    the state's DTensors live on, e.g. a model's and its experts')."""
    if device_mesh is None:
        return ()
    mesh_type = _mesh_type()
    if mesh_type is not None and isinstance(device_mesh, mesh_type):
        return (device_mesh,)
    meshes = tuple(device_mesh) if isinstance(device_mesh, list | tuple) else ()
    if not meshes or mesh_type is None or not all(isinstance(mesh, mesh_type) for mesh in meshes):
        raise TypeError(
            "device_mesh must be a torch.distributed.device_mesh.DeviceMesh or a non-empty list or tuple of them "
            f"(the meshes the checkpoint's DTensors were saved on), got {device_mesh!r}"
        )
    return meshes


class MeshTable:
    """The meshes a save's DTensors live on, each stored once and referenced by index."""

    def __init__(self) -> None:
        self.encoded: list[dict[str, Any]] = []
        self._by_object: dict[int, tuple[Any, int]] = {}

    def index(self, mesh: Any) -> int:
        known = self._by_object.get(id(mesh))
        if known is not None:
            return known[1]
        description = _describe(mesh)
        if description not in self.encoded:
            self.encoded.append(description)
        index = self.encoded.index(description)
        # The mesh is kept alive with its index, so its id cannot be reused by another mesh meanwhile.
        self._by_object[id(mesh)] = (mesh, index)
        return index


def split(value: Any) -> tuple[torch.Tensor, tuple[Any, ...]]:
    """A DTensor's local shard, and everything else its tree node holds (what ``format.template`` compares).

    Called with autograd off (``Encoder.encode``): ``to_local`` is then an
    attribute read instead of a call through an autograd function, paid for
    every DTensor on every save.
    """
    is_parameter = isinstance(value, torch.nn.Parameter)
    placements = value.placements
    facts = (placements, value.shape, value.stride(), value.device_mesh, is_parameter,
             is_parameter and value.requires_grad, _in_default_order(value, placements))
    return value.to_local(), facts


def _in_default_order(value: Any, placements: tuple[Any, ...]) -> bool:
    """Whether a tensor dimension sharded over several mesh dimensions is split in their left-to-right order.

    That order is all ``from_local`` can rebuild; torch may record another in the DTensor's spec (private,
    so looked up defensively). It only matters when one tensor dimension is sharded more than once.
    """
    dims = [placement.dim for placement in placements if hasattr(placement, "dim")]
    if len(dims) == len(set(dims)):
        return True
    spec = getattr(value, "_spec", None)
    order = getattr(spec, "shard_order", None)
    default = getattr(type(spec), "compute_default_shard_order", None)
    return order is None or default is None or order == default(tuple(placements))


def encode(facts: tuple[Any, ...], local_node: nodes.Node, shown_path: str, meshes: MeshTable) -> nodes.Node:
    """The tree node of a DTensor: its local shard's node and how to rebuild the DTensor from it."""
    placements, shape, stride, mesh, is_parameter, requires_grad, default_order = facts
    if not default_order:
        raise UnsupportedState(
            f"DTensor at {shown_path} shards one tensor dimension over several mesh dimensions in an "
            "order other than theirs, which DTensor.from_local cannot rebuild; redistribute it first, or store "
            "its full_tensor()"
        )
    node: nodes.Node = {
        nodes.DTENSOR: local_node,
        nodes.DTENSOR_PLACEMENTS: [encode_placement(placement, shown_path) for placement in placements],
        nodes.DTENSOR_SHAPE: list(shape),
        nodes.DTENSOR_STRIDE: list(stride),
        nodes.DTENSOR_MESH: meshes.index(mesh),
    }
    if is_parameter:
        node[nodes.DTENSOR_PARAMETER] = int(requires_grad)
    return node


def layout_mismatch(node: nodes.Node, value: Any, saved_meshes: list[dict[str, Any]]) -> str | None:
    """Why the DTensor stored as ``node`` cannot be loaded into the caller's DTensor ``value``; None if it can.

    Each rank's file holds its own shard only, so the two must be laid out
    alike: the same placements and global shape, over the same ranks.
    """
    try:
        placements = [encode_placement(placement, "") for placement in value.placements]
    except UnsupportedState:
        placements = None
    ranks = value.device_mesh.mesh.tolist()
    saved_ranks = saved_meshes[node[nodes.DTENSOR_MESH]][nodes.MESH_RANKS]
    saved_shape = node[nodes.DTENSOR_SHAPE]
    if placements == node[nodes.DTENSOR_PLACEMENTS] and list(value.shape) == saved_shape and ranks == saved_ranks:
        return None
    saved_placements = tuple(decode_placement(item) for item in node[nodes.DTENSOR_PLACEMENTS])
    return (f"a DTensor of shape {list(value.shape)} placed {tuple(value.placements)} over ranks {ranks}, where "
            f"the checkpoint holds one of shape {saved_shape} placed {saved_placements} over ranks {saved_ranks}")


class Rebuilder:
    """Rebuilds a load's DTensors on the caller's meshes, each mesh matched to a saved one once."""

    def __init__(self, tree: dict[str, Any], given: tuple[Any, ...]) -> None:
        self._saved = tree.get(nodes.TREE_MESHES, [])
        self._given = given
        self._matched: dict[int, Any] = {}

    def rebuild(self, node: nodes.Node, local: torch.Tensor) -> Any:
        from torch.distributed.tensor import DTensor

        dtensor = DTensor.from_local(
            local, self._mesh(node[nodes.DTENSOR_MESH], node[nodes.DTENSOR][nodes.TENSOR]),
            [decode_placement(item) for item in node[nodes.DTENSOR_PLACEMENTS]],
            run_check=False, shape=torch.Size(node[nodes.DTENSOR_SHAPE]),
            stride=tuple(node[nodes.DTENSOR_STRIDE]),
        )
        if nodes.DTENSOR_PARAMETER in node:
            return torch.nn.Parameter(dtensor, requires_grad=bool(node[nodes.DTENSOR_PARAMETER]))
        return dtensor

    def _mesh(self, index: int, name: str) -> Any:
        mesh = self._matched.get(index)
        if mesh is not None:
            return mesh
        saved = self._saved[index]
        same_layout = [mesh for mesh in self._given if mesh.mesh.tolist() == saved[nodes.MESH_RANKS]]
        same_names = [mesh for mesh in same_layout if _names(mesh) == saved[nodes.MESH_NAMES]]
        if not same_layout:
            raise UnsupportedState(self._no_match(saved, name))
        mesh = self._matched[index] = (same_names or same_layout)[0]
        return mesh

    def _no_match(self, saved: dict[str, Any], name: str) -> str:
        names = saved[nodes.MESH_NAMES]
        where = f"a {saved[nodes.MESH_DEVICE]} device mesh over ranks {saved[nodes.MESH_RANKS]}" + (
            f" named {tuple(names)}" if names else ""
        )
        if not self._given:
            return (
                f"the checkpoint holds DTensors (the first stored as {name!r}) saved on {where}: pass "
                "load(device_mesh=...) the mesh they were saved on (for FSDP2, the mesh given to fully_shard)"
            )
        passed = ", ".join(str(mesh.mesh.tolist()) for mesh in self._given)
        return (
            f"the DTensor stored as {name!r} was saved on {where}, and no mesh passed to load() has that layout "
            f"(passed: {passed}). On the number of ranks that saved it, each rank reads only its own file, so a "
            "checkpoint loads only onto the layout it was saved on; save full tensors (full_tensor()) to load onto "
            "another one"
        )


@functools.cache
def _placement_kinds() -> Any:
    from torch.distributed.tensor import placement_types

    return placement_types


def _describe(mesh: Any) -> dict[str, Any]:
    return {nodes.MESH_RANKS: mesh.mesh.tolist(), nodes.MESH_NAMES: _names(mesh),
            nodes.MESH_DEVICE: mesh.device_type}


def _names(mesh: Any) -> list[str] | None:
    return list(mesh.mesh_dim_names) if mesh.mesh_dim_names else None


def encode_placement(placement: Any, shown_path: str) -> dict[str, Any]:
    kinds = _placement_kinds()
    kind = type(placement)
    if kind is kinds.Shard:
        return {nodes.PLACEMENT_SHARD: placement.dim}
    if kind is kinds._StridedShard:
        return {nodes.PLACEMENT_SHARD: placement.dim, nodes.PLACEMENT_SPLIT_FACTOR: placement.split_factor}
    if kind is kinds.Replicate:
        return {nodes.PLACEMENT_REPLICATE: 1}
    if kind is kinds.Partial:
        return {nodes.PLACEMENT_PARTIAL: placement.reduce_op}
    raise UnsupportedState(
        f"DTensor at {shown_path} has placement {placement!r}, which Stowaway cannot store: it stores Shard, "
        "Replicate and Partial; redistribute it to one of those, or store its full_tensor()"
    )


def decode_placement(encoded: dict[str, Any]) -> Any:
    kinds = _placement_kinds()
    if nodes.PLACEMENT_SPLIT_FACTOR in encoded:
        return kinds._StridedShard(encoded[nodes.PLACEMENT_SHARD], split_factor=encoded[nodes.PLACEMENT_SPLIT_FACTOR])
    if nodes.PLACEMENT_SHARD in encoded:
        return kinds.Shard(encoded[nodes.PLACEMENT_SHARD])
    if nodes.PLACEMENT_REPLICATE in encoded:
        return kinds.Replicate()
    if nodes.PLACEMENT_PARTIAL in encoded:
        return kinds.Partial(encoded[nodes.PLACEMENT_PARTIAL])
    raise UnsupportedState(f"state tree holds an unknown DTensor placement {sorted(encoded)}")
