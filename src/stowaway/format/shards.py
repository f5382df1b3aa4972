"""What a stored state tree says about its DTensors, read without torch: for ``stowaway inspect``.

``format.dtensors`` writes and rebuilds DTensors; its node format is in
``docs/storage-format.md``. The CLI runs where there is no torch (the
sidecar's image), so it reads those nodes here, as plain JSON, and only to
show them: anything it does not understand is left out, never an error.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

from stowaway.format import nodes


def describe(metadata: dict[str, str]) -> dict[str, str]:
    """For each DTensor's local shard, by its tensor name: the DTensor's global shape, placements and mesh."""
    try:
        tree = json.loads(metadata[nodes.METADATA_KEY])
        meshes = tree.get(nodes.TREE_MESHES) or []
        return {
            node[nodes.DTENSOR][nodes.TENSOR]: _shown(node, meshes[node[nodes.DTENSOR_MESH]])
            for node in dtensor_nodes(tree[nodes.TREE_ROOT])
        }
    except (KeyError, IndexError, TypeError, AttributeError, json.JSONDecodeError):
        return {}


def dtensor_nodes(root: Any) -> Iterator[nodes.Node]:
    """Every DTensor node of a state tree, once per place it appears."""
    pending = [root]
    while pending:
        node = pending.pop()
        if isinstance(node, dict):
            if isinstance(node.get(nodes.DTENSOR), dict):
                yield node
            pending.extend(node.values())
        elif isinstance(node, list):
            pending.extend(node)


def _shown(node: nodes.Node, mesh: dict[str, Any]) -> str:
    shape = "x".join(str(dim) for dim in node[nodes.DTENSOR_SHAPE]) or "scalar"
    placements = ", ".join(_placement(item) for item in node[nodes.DTENSOR_PLACEMENTS])
    sizes, level = [], mesh[nodes.MESH_RANKS]
    while isinstance(level, list):
        sizes.append(len(level))
        level = level[0] if level else None
    names = mesh.get(nodes.MESH_NAMES) or [f"dim{index}" for index in range(len(sizes))]
    layout = ", ".join(f"{name}={size}" for name, size in zip(names, sizes, strict=False))
    return f"shard of {shape} ({placements}) on a {mesh[nodes.MESH_DEVICE]} mesh ({layout})"


def _placement(encoded: dict[str, Any]) -> str:
    if nodes.PLACEMENT_SPLIT_FACTOR in encoded:
        return f"_StridedShard({encoded[nodes.PLACEMENT_SHARD]}, split_factor={encoded[nodes.PLACEMENT_SPLIT_FACTOR]})"
    if nodes.PLACEMENT_SHARD in encoded:
        return f"Shard({encoded[nodes.PLACEMENT_SHARD]})"
    if nodes.PLACEMENT_REPLICATE in encoded:
        return "Replicate()"
    return f"Partial({encoded.get(nodes.PLACEMENT_PARTIAL)})"
