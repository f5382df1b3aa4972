"""The stored state tree's vocabulary: one name for every key it uses. Pure: no torch, no I/O.

The tree (grammar in ``docs/storage-format.md``, JSON Schema in
``docs/schemas/tree.schema.json``) is walked by four pieces of code that
must agree: ``tree`` writes it (``_Flattener``) and reads it
(``_Unflattener``), ``template`` re-renders it for an unchanged structure,
and ``in_place`` walks it beside the caller's state; ``dtensors``,
``full_tensors`` and ``shards`` read its DTensor nodes. All of them name
its keys through this module, never as literals.

A node is a JSON object tagged by exactly one key, its kind (``KINDS``);
its other keys are that kind's fields, named here with the kind as prefix.
The letters on disk are the ones the first release wrote, short because a
state of thousands of tensors writes each many times, and some are reused
by different kinds with different meanings (``m`` is a mapping's
``_metadata`` and a DTensor's mesh index): the names tell them apart, and
each name means one thing.

Plain module constants rather than an enum: every save and restore reads
them once per node, and looking up an enum member is slower than reading
a module attribute.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

# The safetensors ``__metadata__`` entry that holds the tree, as JSON text.
METADATA_KEY: Final = "stowaway.tree"

# A node as JSON decodes it (or as the flattener builds it): a tag, fields, and child nodes.
Node = dict[str, Any]

# The tree itself, the object the metadata entry holds.
TREE_VERSION: Final = "version"
TREE_ROOT: Final = "root"
# Only in a VERSION_WITH_DTENSORS tree: each device mesh its DTensors live on, once.
TREE_MESHES: Final = "meshes"

VERSION_PLAIN: Final = 1
# A tree holding DTensors: a reader that does not know them says to upgrade instead of failing on a node.
VERSION_WITH_DTENSORS: Final = 2
VERSIONS: Final = (VERSION_PLAIN, VERSION_WITH_DTENSORS)

# The kinds of node, by the key that tags each.
# A tensor of the file, by name.
TENSOR: Final = "T"
# A DTensor: its local shard's TENSOR node, and how to rebuild it.
DTENSOR: Final = "D"
# None, a bool, an int, a string or a finite float, as JSON.
VALUE: Final = "v"
# A NaN or infinite float, as Python's repr of it.
NON_FINITE: Final = "f"
# A dict or OrderedDict: [key node, value node] pairs in order.
MAPPING: Final = "d"
LIST: Final = "l"
TUPLE: Final = "t"
# A torch.Size, as its dimensions.
SIZE: Final = "S"
# A torch.dtype, as its attribute name in torch.
DTYPE: Final = "dt"
# A numpy array: a tensor of the file holding its bytes, by name.
NUMPY: Final = "N"
# A pickled object (opt-in only): a uint8 tensor of the file holding the pickle, by name.
PICKLED: Final = "pk"
# Every kind, in the order readers look for the tag.
KINDS: Final = (TENSOR, DTENSOR, VALUE, NON_FINITE, MAPPING, LIST, TUPLE, SIZE, DTYPE, NUMPY, PICKLED)

# Present when the tensor was an nn.Parameter: its requires_grad, as 0 or 1.
TENSOR_PARAMETER: Final = "P"

# 1 when the mapping was an OrderedDict.
MAPPING_ORDERED: Final = "o"
# The node of an OrderedDict's ``_metadata`` attribute (a module's state_dict has one).
MAPPING_METADATA: Final = "m"

# The array's numpy dtype, as ``dtype.str``: the tensor holds its bytes only.
NUMPY_DTYPE: Final = "nd"
NUMPY_SHAPE: Final = "sh"

# One placement per mesh dimension.
DTENSOR_PLACEMENTS: Final = "pl"
# The DTensor's global shape and stride; the local shard's are its tensor's.
DTENSOR_SHAPE: Final = "sh"
DTENSOR_STRIDE: Final = "st"
# An index into the tree's TREE_MESHES.
DTENSOR_MESH: Final = "m"
# Present when the DTensor was an nn.Parameter: its requires_grad, as 0 or 1.
DTENSOR_PARAMETER: Final = "P"

# A placement, as an object with the keys of one of: Shard(dim), the tensor dimension it splits;
PLACEMENT_SHARD: Final = "s"
# with PLACEMENT_SHARD, a _StridedShard and its split_factor;
PLACEMENT_SPLIT_FACTOR: Final = "sf"
# Replicate(), as 1;
PLACEMENT_REPLICATE: Final = "r"
# Partial(reduce_op), by its reduce op's name.
PLACEMENT_PARTIAL: Final = "p"

# A mesh: its global ranks, as a nested list of the mesh's shape;
MESH_RANKS: Final = "ranks"
# its dimension names, or null;
MESH_NAMES: Final = "names"
# its device type.
MESH_DEVICE: Final = "device"


def kind_of(node: Mapping[str, Any]) -> str | None:
    """The kind (one of ``KINDS``) of a stored node; None when it carries no tag this release knows."""
    for kind in KINDS:
        if kind in node:
            return kind
    return None
