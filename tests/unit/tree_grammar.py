"""Checking a stored state tree against ``docs/storage-format.md``, without the code under test.

The JSON Schema (``docs/schemas/tree.schema.json``) checks each node; the
rules it cannot state (every tensor name is a tensor of the file and every
tensor is named, the version matches the DTensors, mesh indices and
placement counts fit the meshes) are checked here by a walk that follows
the grammar with the on-disk tags written out, so that renaming a tag in the
code fails the tests instead of changing the format.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import jsonschema

SCHEMA_PATH = Path(__file__).resolve().parents[2] / "docs" / "schemas" / "tree.schema.json"
TREE_METADATA_KEY = "stowaway.tree"
# The node tags, in the order the grammar says readers look for them.
TAGS = ("T", "D", "v", "f", "d", "l", "t", "S", "dt", "N", "pk")


@functools.cache
def schema() -> dict[str, Any]:
    return json.loads(SCHEMA_PATH.read_text())


@functools.cache
def _validator() -> jsonschema.Draft202012Validator:
    return jsonschema.Draft202012Validator(schema())


def tree_of(metadata: dict[str, str]) -> Any:
    return json.loads(metadata[TREE_METADATA_KEY])


class Walk:
    """A valid tree's tensor names, DTensor nodes, and features: its tags, optional fields and placements."""

    def __init__(self, root: dict[str, Any]) -> None:
        self.names: set[str] = set()
        self.dtensors: list[dict[str, Any]] = []
        self.features: set[str] = set()
        self._node(root)

    def _node(self, node: dict[str, Any]) -> None:
        tag = next(tag for tag in TAGS if tag in node)
        self.features.add(tag)
        self.features.update(f"{tag}.{field}" for field in node if field != tag)
        if tag in ("T", "N", "pk"):
            self.names.add(node[tag])
        elif tag == "D":
            self.dtensors.append(node)
            self.features.update(f"pl.{'.'.join(sorted(placement))}" for placement in node["pl"])
            self._node(node["D"])
        elif tag == "d":
            for key, value in node["d"]:
                self._node(key)
                self._node(value)
            if "m" in node:
                self._node(node["m"])
        elif tag in ("l", "t"):
            for item in node[tag]:
                self._node(item)


def problems(tree: Any, tensor_names: Iterable[str]) -> list[str]:
    """What makes ``tree`` not a state tree of a file holding ``tensor_names``; empty when it is one."""
    # Of the schema's errors the most telling: a node that fits none of the kinds names the field that is wrong.
    error = jsonschema.exceptions.best_match(_validator().iter_errors(tree))
    if error is not None:
        return [f"/{'/'.join(map(str, error.absolute_path))}: {error.message}"]
    found = []
    walked = Walk(tree["root"])
    stored = set(tensor_names)
    if walked.names - stored:
        found.append(f"names no tensor of the file: {sorted(walked.names - stored)}")
    if stored - walked.names:
        found.append(f"tensors of the file no node names: {sorted(stored - walked.names)}")
    if (tree["version"] == 2) != bool(walked.dtensors):
        found.append(f"version {tree['version']} with {len(walked.dtensors)} DTensor node(s)")
    meshes = tree.get("meshes", [])
    for node in walked.dtensors:
        if node["m"] >= len(meshes):
            found.append(f"DTensor {node['D']['T']!r} names mesh {node['m']} of {len(meshes)}")
        elif len(node["pl"]) != _dimensions(meshes[node["m"]]["ranks"]):
            found.append(f"DTensor {node['D']['T']!r} has {len(node['pl'])} placements for its mesh's dimensions")
    return found


def _dimensions(ranks: Any) -> int:
    count = 0
    while isinstance(ranks, list):
        count += 1
        ranks = ranks[0] if ranks else None
    return count
