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

# The safetensors metadata entry that holds the state tree.
TREE_METADATA_KEY = "stowaway.tree"


def describe(metadata: dict[str, str]) -> dict[str, str]:
    """For each DTensor's local shard, by its tensor name: the DTensor's global shape, placements and mesh."""
    try:
        tree = json.loads(metadata[TREE_METADATA_KEY])
        meshes = tree.get("meshes") or []
        return {node["D"]["T"]: _shown(node, meshes[node["m"]]) for node in dtensor_nodes(tree["root"])}
    except (KeyError, IndexError, TypeError, AttributeError, json.JSONDecodeError):
        return {}


def dtensor_nodes(root: Any) -> Iterator[dict[str, Any]]:
    """Every DTensor node of a state tree, once per place it appears."""
    pending = [root]
    while pending:
        node = pending.pop()
        if isinstance(node, dict):
            if isinstance(node.get("D"), dict):
                yield node
            pending.extend(node.values())
        elif isinstance(node, list):
            pending.extend(node)


def _shown(node: dict[str, Any], mesh: dict[str, Any]) -> str:
    shape = "x".join(str(dim) for dim in node["sh"]) or "scalar"
    placements = ", ".join(_placement(item) for item in node["pl"])
    sizes, level = [], mesh["ranks"]
    while isinstance(level, list):
        sizes.append(len(level))
        level = level[0] if level else None
    names = mesh.get("names") or [f"dim{index}" for index in range(len(sizes))]
    layout = ", ".join(f"{name}={size}" for name, size in zip(names, sizes, strict=False))
    return f"shard of {shape} ({placements}) on a {mesh['device']} mesh ({layout})"


def _placement(encoded: dict[str, Any]) -> str:
    if "sf" in encoded:
        return f"_StridedShard({encoded['s']}, split_factor={encoded['sf']})"
    if "s" in encoded:
        return f"Shard({encoded['s']})"
    if "r" in encoded:
        return "Replicate()"
    return f"Partial({encoded.get('p')})"
