"""What a stored state tree says about its DTensors, read without torch: for ``stowaway inspect``.

``format.dtensors`` writes and rebuilds DTensors; its node format is in
``docs/storage-format.md``. The CLI runs where there is no torch (the
sidecar's image), so it reads those nodes here, as plain JSON, and only to
show them: anything it does not understand is left out, never an error.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator
from typing import Any

from stowaway.format import nodes


def describe(metadata: dict[str, str], rank: int | None = None) -> dict[str, str]:
    """For each DTensor's local shard, by its tensor name: the DTensor's global shape, placements and mesh, and
    with ``rank`` (the rank whose file it is) which indices of the whole tensor the shard holds: what a load on
    another number of ranks reads of it."""
    try:
        tree = json.loads(metadata[nodes.METADATA_KEY])
        meshes = tree.get(nodes.TREE_MESHES) or []
        return {
            node[nodes.DTENSOR][nodes.TENSOR]: _shown(node, meshes[node[nodes.DTENSOR_MESH]], rank)
            for node in dtensor_nodes(tree[nodes.TREE_ROOT])
        }
    except (KeyError, IndexError, TypeError, AttributeError, ValueError, json.JSONDecodeError):
        return {}


def held(global_shape: list[int], mesh_ranks: Any, rank: int, placements: list[dict[str, Any]]) -> list[list[int]]:
    """Per dimension, the indices of the whole tensor that ``rank``'s shard holds, as ``full_tensors.shard_indices``
    computes them, in plain Python (the CLI runs without numpy)."""
    sizes: list[int] = []
    coordinate: list[int] = []
    level = mesh_ranks
    flat = _flat(mesh_ranks)
    position = flat.index(rank)
    while isinstance(level, list):
        sizes.append(len(level))
        level = level[0] if level else None
    for size in reversed(sizes):
        coordinate.insert(0, position % size)
        position //= size
    indices = [list(range(size)) for size in global_shape]
    for mesh_dim, placement in enumerate(placements):
        if nodes.PLACEMENT_SHARD not in placement:
            continue
        dim = placement[nodes.PLACEMENT_SHARD] % len(global_shape)
        parts, index = sizes[mesh_dim], coordinate[mesh_dim]
        if nodes.PLACEMENT_SPLIT_FACTOR in placement:
            split = placement[nodes.PLACEMENT_SPLIT_FACTOR]
            indices[dim] = [kept for cut in range(split) for kept in _piece(_piece(indices[dim], split, cut),
                                                                             parts, index)]
        else:
            indices[dim] = _piece(indices[dim], parts, index)
    return indices


def _piece(indices: list[int], parts: int, index: int) -> list[int]:
    full = -(-len(indices) // parts)
    return indices[full * index : full * (index + 1)]


def _flat(level: Any) -> list[int]:
    return [rank for item in level for rank in _flat(item)] if isinstance(level, list) else [level]


def _ranges(indices: list[int]) -> str:
    """``[0, 1, 2, 6, 7]`` as ``0:3+6:8``."""
    if not indices:
        return "-"
    runs, start = [], indices[0]
    for previous, current in itertools.pairwise(indices):
        if current != previous + 1:
            runs.append(f"{start}:{previous + 1}")
            start = current
    runs.append(f"{start}:{indices[-1] + 1}")
    return "+".join(runs)


def tensor_nodes(root: Any) -> Iterator[nodes.Node]:
    """Every node of a state tree that names a stored tensor (DTensors, tensors, arrays, pickles), once per place
    it appears.

    Only the nodes that hold others (mappings, lists, tuples) are entered:
    entering every node, a DTensor's lists of dimensions included, was half
    of what walking a state of thousands of DTensors cost.
    """
    pending = [root]
    while pending:
        node = pending.pop()
        if nodes.MAPPING in node:
            for pair in node[nodes.MAPPING]:
                pending.extend(pair)
            if nodes.MAPPING_METADATA in node:
                pending.append(node[nodes.MAPPING_METADATA])
        elif nodes.LIST in node:
            pending.extend(node[nodes.LIST])
        elif nodes.TUPLE in node:
            pending.extend(node[nodes.TUPLE])
        elif nodes.DTENSOR in node or nodes.TENSOR in node or nodes.NUMPY in node or nodes.PICKLED in node:
            yield node


def dtensor_nodes(root: Any) -> Iterator[nodes.Node]:
    """Every DTensor node of a state tree, once per place it appears."""
    return (node for node in tensor_nodes(root) if nodes.DTENSOR in node)


def _shown(node: nodes.Node, mesh: dict[str, Any], rank: int | None) -> str:
    shape = "x".join(str(dim) for dim in node[nodes.DTENSOR_SHAPE]) or "scalar"
    placements = ", ".join(_placement(item) for item in node[nodes.DTENSOR_PLACEMENTS])
    sizes, level = [], mesh[nodes.MESH_RANKS]
    while isinstance(level, list):
        sizes.append(len(level))
        level = level[0] if level else None
    names = mesh.get(nodes.MESH_NAMES) or [f"dim{index}" for index in range(len(sizes))]
    layout = ", ".join(f"{name}={size}" for name, size in zip(names, sizes, strict=False))
    shown = f"shard of {shape} ({placements}) on a {mesh[nodes.MESH_DEVICE]} mesh ({layout})"
    if rank is None or not node[nodes.DTENSOR_SHAPE] or any(nodes.PLACEMENT_PARTIAL in item
                                                           for item in node[nodes.DTENSOR_PLACEMENTS]):
        return shown
    indices = held(node[nodes.DTENSOR_SHAPE], mesh[nodes.MESH_RANKS], rank, node[nodes.DTENSOR_PLACEMENTS])
    return f"{shown}, holds [{', '.join(_ranges(dim) for dim in indices)}]"


def _placement(encoded: dict[str, Any]) -> str:
    if nodes.PLACEMENT_SPLIT_FACTOR in encoded:
        return f"_StridedShard({encoded[nodes.PLACEMENT_SHARD]}, split_factor={encoded[nodes.PLACEMENT_SPLIT_FACTOR]})"
    if nodes.PLACEMENT_SHARD in encoded:
        return f"Shard({encoded[nodes.PLACEMENT_SHARD]})"
    if nodes.PLACEMENT_REPLICATE in encoded:
        return "Replicate()"
    return f"Partial({encoded.get(nodes.PLACEMENT_PARTIAL)})"
