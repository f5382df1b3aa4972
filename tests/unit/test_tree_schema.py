"""The grammar of stored state trees (``docs/storage-format.md``): its schema, the code's names, broken trees.

The trees a real save stores, for the whole test corpus, are checked in
``data_path/test_stored_trees.py``. Here, in milliseconds: the schema and
``format.nodes`` name the same kinds and fields, the one dtype table agrees
with torch, any state ``test_encoder_reuse`` draws is encoded (first
flattened, then rendered from the template) as a tree the grammar accepts,
and every way of breaking a tree is refused, so those checks can fail.
"""

from __future__ import annotations

import copy
import json
import struct
from typing import Any

import jsonschema
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from stowaway.format import codec, dtypes, nodes
from unit import tree_grammar
from unit.test_encoder_reuse import states, with_new_scalars


def stored_tree(encoded: codec.Encoded) -> tuple[Any, list[str]]:
    """The tree and tensor names of an encoded payload's header, read with nothing but json."""
    header = encoded.layout.header
    (length,) = struct.unpack_from("<Q", header)
    entries = json.loads(header[8 : 8 + length])
    metadata = entries.pop("__metadata__")
    return tree_grammar.tree_of(metadata), list(entries)


def test_the_schema_is_a_valid_json_schema():
    jsonschema.Draft202012Validator.check_schema(tree_grammar.schema())


def test_the_schema_the_tests_and_format_nodes_name_the_same_kinds_in_the_same_order():
    definitions = tree_grammar.schema()["$defs"]
    kinds = [definitions[choice["$ref"].rsplit("/", 1)[-1]] for choice in definitions["node"]["oneOf"]]
    assert tuple(kind["required"][0] for kind in kinds) == nodes.KINDS == tree_grammar.TAGS


def test_the_schema_and_format_nodes_name_the_same_fields():
    schema = tree_grammar.schema()
    definitions = schema["$defs"]

    def fields(name: str) -> set[str]:
        return set(definitions[name]["properties"])

    assert set(schema["properties"]) == {nodes.TREE_VERSION, nodes.TREE_ROOT, nodes.TREE_MESHES}
    assert schema["properties"]["version"]["enum"] == list(nodes.VERSIONS)
    assert fields("tensor") == {nodes.TENSOR, nodes.TENSOR_PARAMETER}
    assert fields("dtensor") == {nodes.DTENSOR, nodes.DTENSOR_PLACEMENTS, nodes.DTENSOR_SHAPE, nodes.DTENSOR_STRIDE,
                                 nodes.DTENSOR_MESH, nodes.DTENSOR_PARAMETER}
    assert fields("mapping") == {nodes.MAPPING, nodes.MAPPING_ORDERED, nodes.MAPPING_METADATA}
    assert fields("numpy") == {nodes.NUMPY, nodes.NUMPY_DTYPE, nodes.NUMPY_SHAPE}
    for kind, name in [(nodes.VALUE, "value"), (nodes.NON_FINITE, "non_finite"), (nodes.LIST, "list"),
                       (nodes.TUPLE, "tuple"), (nodes.SIZE, "size"), (nodes.DTYPE, "dtype"),
                       (nodes.PICKLED, "pickled")]:
        assert fields(name) == {kind}
    assert fields("mesh") == {nodes.MESH_RANKS, nodes.MESH_NAMES, nodes.MESH_DEVICE}
    placements = [set(choice["properties"]) for choice in definitions["placement"]["oneOf"]]
    assert placements == [{nodes.PLACEMENT_SHARD}, {nodes.PLACEMENT_SHARD, nodes.PLACEMENT_SPLIT_FACTOR},
                          {nodes.PLACEMENT_REPLICATE}, {nodes.PLACEMENT_PARTIAL}]


def test_the_dtype_table_names_each_dtype_once_with_torchs_element_size():
    for dtype in dtypes.TABLE:
        assert getattr(torch, dtype.torch).itemsize == dtype.element_bytes, dtype
    assert len({dtype.safetensors for dtype in dtypes.TABLE}) == len({dtype.torch for dtype in dtypes.TABLE}) == len(
        dtypes.TABLE)


@settings(max_examples=200, deadline=None)
@given(state=states, data=st.data())
def test_any_state_is_encoded_first_and_from_the_template_as_trees_the_grammar_accepts(state, data):
    encoder = codec.Encoder()
    assert tree_grammar.problems(*stored_tree(encoder.encode({"root": state}))) == []
    assert tree_grammar.problems(*stored_tree(encoder.encode({"root": with_new_scalars(state, data.draw)}))) == []


VALID = {
    "version": 2,
    "root": {"d": [
        [{"v": "w"}, {"T": "w", "P": 1}],
        [{"v": "tied"}, {"T": "w"}],
        [{"v": "sharded"}, {"D": {"T": "shard"}, "pl": [{"s": 0, "sf": 2}, {"r": 1}], "sh": [4, 2], "st": [2, 1],
                            "m": 0, "P": 0}],
        [{"f": "nan"}, {"d": [[{"v": 1}, {"t": [{"S": [2, -1]}, {"dt": "bfloat16"}, {"f": "-inf"}]}]], "o": 1,
                        "m": {"d": [[{"v": ""}, {"d": [[{"v": "version"}, {"v": 2}]]}]]}}],
        [{"v": 2.5}, {"N": "array", "nd": "<i2", "sh": [3]}],
        [{"v": None}, {"l": [{"pk": "pickled"}, {"v": 1.5}, {"v": True}, {"v": 2**70}]}],
    ]},
    "meshes": [{"ranks": [[0, 1]], "names": ["dp", "tp"], "device": "cuda"}],
}
NAMES = ["w", "shard", "array", "pickled"]


def test_a_tree_holding_every_kind_of_node_is_accepted():
    assert tree_grammar.problems(VALID, NAMES) == []


def broken(edit):
    tree, names = copy.deepcopy(VALID), list(NAMES)
    edit(tree["root"]["d"], tree, names)
    return tree, names


@pytest.mark.parametrize(("tree", "names"), [
    broken(lambda pairs, tree, names: pairs[0][1].update(l=[])),
    broken(lambda pairs, tree, names: pairs.append([{"v": "x"}, {"x": 1}])),
    broken(lambda pairs, tree, names: pairs[0][1].update(Q=1)),
    broken(lambda pairs, tree, names: pairs[0][1].update(P=2)),
    broken(lambda pairs, tree, names: pairs[3][1].pop("o")),
    broken(lambda pairs, tree, names: pairs[3][1].update(o=0)),
    broken(lambda pairs, tree, names: pairs[3].__setitem__(0, {"f": "NaN"})),
    broken(lambda pairs, tree, names: pairs[4].__setitem__(0, {"l": []})),
    broken(lambda pairs, tree, names: pairs[4].append({"v": 3})),
    broken(lambda pairs, tree, names: pairs[4][1].pop("nd")),
    broken(lambda pairs, tree, names: pairs[4][1].update(sh=[-1])),
    broken(lambda pairs, tree, names: pairs[5][1]["l"].append({"v": [1]})),
    broken(lambda pairs, tree, names: pairs[2][1]["pl"].__setitem__(1, {"s": 0, "r": 1})),
    broken(lambda pairs, tree, names: pairs[2][1]["pl"].pop()),
    broken(lambda pairs, tree, names: pairs[2][1].update(m=1)),
    broken(lambda pairs, tree, names: pairs[2][1].pop("st")),
    broken(lambda pairs, tree, names: tree.update(version=3)),
    broken(lambda pairs, tree, names: tree.pop("meshes")),
    broken(lambda pairs, tree, names: tree.update(version=1)),
    broken(lambda pairs, tree, names: (tree.update(version=1), tree.pop("meshes"))),
    broken(lambda pairs, tree, names: (pairs.pop(2), names.remove("shard"))),
    broken(lambda pairs, tree, names: tree.update(extra=1)),
    broken(lambda pairs, tree, names: tree["meshes"][0].pop("device")),
    broken(lambda pairs, tree, names: pairs[0][1].update(T="missing")),
    broken(lambda pairs, tree, names: names.append("unnamed")),
    broken(lambda pairs, tree, names: (pairs[0][1].update(T="__metadata__"), names.append("__metadata__"))),
], ids=[
    "two tags", "unknown tag", "unknown field", "parameter flag not 0 or 1", "metadata without ordered",
    "ordered not 1", "misspelt non-finite float", "key not a scalar", "pair of three", "array without dtype",
    "negative array shape", "value not a scalar", "placement of two kinds", "too few placements for the mesh",
    "mesh index out of range", "dtensor without stride", "unknown version", "version 2 without meshes",
    "version 1 with meshes", "dtensor in a version 1 tree", "version 2 without dtensors", "unknown tree key",
    "mesh without device", "name of no tensor", "tensor no node names", "metadata key as a name",
])
def test_a_tree_that_breaks_the_grammar_is_refused(tree, names):
    assert tree_grammar.problems(tree, names) != []
