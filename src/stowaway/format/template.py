"""Re-encode a state whose structure has not changed since the last save, without flattening it again.

A training loop saves the same structure every time: the same keys, the same
tensor shapes and dtypes; only tensor contents and a few scalars (step
counters, learning rates) change. Flattening it (``tree.flatten``) and
serializing its tree cost Python time per tensor, which ``save`` blocks on.
Here a cheaper walk collects the containers' keys, the tensors and the
scalars; if they fit the previous save's, the tree JSON is that save's with
only the scalars rendered anew. Anything the walk does not know (tensor
subclasses, pickled objects) sends the encoder back to ``tree.flatten``,
which is always correct.

The walk must visit values in ``tree._Flattener``'s order and tell apart
every difference that changes the tree; the holes are VALUE nodes
(``format.nodes``), written here as ``tree`` writes them.
"""

from __future__ import annotations

import json
import math
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from stowaway.format import dtensors, nodes
from stowaway.format import tree as tree_mod

_TENSOR = 0
_SCALAR = 1
_SCALAR_TYPES = frozenset({int, float, str, bool, type(None)})
# A JSON string no state can produce by accident: a state holding it only loses the fast path.
_HOLE_VALUE = "\x00stowaway-scalar\x00"
_HOLE = json.dumps({nodes.VALUE: _HOLE_VALUE}, separators=(",", ":"))
_encode_string = json.encoder.encode_basestring_ascii
# A scalar's node, escaped as the metadata holds it, is one of these openings, the scalar, and a closing.
_VALUE_OPENING = _encode_string('{"' + nodes.VALUE + '":')[1:-1]
_NON_FINITE_OPENING = _encode_string('{"' + nodes.NON_FINITE + '":"')[1:-1]
_NON_FINITE_CLOSING = _encode_string('"}')[1:-1]


class _Unknown(Exception):
    """The walk met a value only ``tree.flatten`` knows how to encode."""


@dataclass
class Walk:
    """What a save must match: container tokens, tensors and scalars, in ``tree.flatten``'s order."""

    tokens: list[Any]
    tensors: list[torch.Tensor]
    scalars: list[Any]


def walk(state: Any) -> Walk | None:
    """Collect ``state``'s structure, or None when it holds something only the full flattener encodes."""
    found = Walk([], [], [])
    try:
        _walk_items((state,), found.tokens.append, found.tensors.append, found.scalars.append)
    except _Unknown:
        return None
    return found


def _walk(value: Any, token: Any, tensor: Any, scalar: Any) -> None:
    """Everything but plain tensors and scalars, which ``_walk_items`` handles."""
    kind = type(value)
    if kind is dict or kind is OrderedDict:
        keys = tuple(value)
        # Key types too: 1, 1.0 and True are equal keys but are stored differently.
        metadata = getattr(value, "_metadata", None) if kind is OrderedDict else None
        token((kind, keys, tuple(map(type, keys)), metadata is not None))
        _walk_items(value.values(), token, tensor, scalar)
        if metadata is not None:
            _walk_items((metadata,), token, tensor, scalar)
    elif kind is list or kind is tuple:
        token((kind, len(value)))
        _walk_items(value, token, tensor, scalar)
    elif kind is torch.nn.Parameter:
        token((kind, value.requires_grad))
        tensor(value)
    elif kind is np.ndarray and not value.dtype.hasobject:
        token((kind, value.dtype.str, value.shape))
        tensor(tree_mod.numpy_as_tensor(value))
    elif kind is torch.Size or isinstance(value, torch.dtype):
        token((kind, value))
    elif kind is dtensors.dtensor_type():
        local, facts = dtensors.split(value)
        token((kind, facts))
        tensor(local)
    else:
        raise _Unknown


def _walk_items(items: Iterable[Any], token: Any, tensor: Any, scalar: Any) -> None:
    # Leaves are handled here rather than by a call each: most of a state is leaves.
    for item in items:
        kind = type(item)
        if kind is torch.Tensor:
            token(_TENSOR)
            tensor(item)
        elif kind in _SCALAR_TYPES:
            token(_SCALAR)
            scalar(item)
        else:
            _walk(item, token, tensor, scalar)


@dataclass(frozen=True)
class TensorFacts:
    """Per occurrence, in walk order: what the layout plan and the copy depend on."""

    dtypes: list[torch.dtype]
    shapes: list[torch.Size]
    devices: list[torch.device]
    layouts: list[torch.layout]
    # For each occurrence, the first occurrence of the same tensor; None when no two share memory.
    ties: list[int] | None

    @classmethod
    def of(cls, tensors: list[torch.Tensor]) -> TensorFacts:
        return cls(
            [tensor.dtype for tensor in tensors], [tensor.shape for tensor in tensors],
            [tensor.device for tensor in tensors], [tensor.layout for tensor in tensors], _ties(tensors),
        )


def _ties(tensors: list[torch.Tensor]) -> list[int] | None:
    """``tree.flatten``'s notion of one tensor (same memory, dtype, shape and strides), as first occurrences.

    Only for strided tensors: others have no data pointer.
    """
    addresses = [tensor.data_ptr() for tensor in tensors]
    if len(set(addresses)) == len(addresses):
        return None
    first: dict[tuple[Any, ...], int] = {}
    return [
        first.setdefault((tensor.data_ptr(), tensor.device, tensor.dtype, tensor.shape, tensor.stride()), index)
        for index, tensor in enumerate(tensors)
    ]


def escape(text: str) -> str:
    """``text`` as the inside of a JSON string, as ``json.dumps`` writes it: the tree JSON is a metadata value."""
    return _encode_string(text)[1:-1]


class Template:
    """The previous save's tree JSON with holes where its scalars were, and the facts it was built from.

    The JSON is kept escaped, as the safetensors metadata stores it, so that a
    save escapes only its scalars.
    """

    def __init__(self, walked: Walk, flat: tree_mod.Flat) -> None:
        self.tokens = walked.tokens
        self.facts = TensorFacts.of(walked.tensors)
        for node in flat.scalar_nodes:
            node.clear()
            node[nodes.VALUE] = _HOLE_VALUE
        tree_json = json.dumps(flat.tree, separators=(",", ":"), check_circular=False)
        self.parts = [escape(part) for part in tree_json.split(_HOLE)]
        self.usable = (
            len(self.parts) == len(walked.scalars) + 1 == len(flat.scalar_nodes) + 1
            and len(flat.occurrences) == len(walked.tensors)
        )

    @classmethod
    def build(cls, walked: Walk | None, flat: tree_mod.Flat, escaped_tree: str) -> Template | None:
        """A template for the state just flattened (``escaped_tree`` is its tree), or None when it cannot
        reproduce that tree byte for byte. ``flat``'s tree is used up: its scalar nodes become the holes."""
        if walked is None:
            return None
        template = cls(walked, flat)
        return template if template.usable and template.render(walked.scalars) == escaped_tree else None

    def fits(self, walked: Walk) -> bool:
        """Whether ``walked`` has this template's structure, tensor dtypes, shapes, devices and ties."""
        if walked.tokens != self.tokens:
            return False
        tensors = walked.tensors
        facts = self.facts
        # Layouts before ties: only strided tensors have data pointers to compare.
        return (
            [tensor.dtype for tensor in tensors] == facts.dtypes
            and [tensor.shape for tensor in tensors] == facts.shapes
            and [tensor.device for tensor in tensors] == facts.devices
            and [tensor.layout for tensor in tensors] == facts.layouts
            and _ties(tensors) == facts.ties
        )

    def render(self, scalars: list[Any]) -> str:
        """The escaped tree JSON with ``scalars`` in the holes, byte for byte what ``json.dumps`` would write."""
        parts = self.parts
        pieces = [parts[0]]
        for value, part in zip(scalars, parts[1:], strict=True):
            pieces.append(_escaped_scalar_node(value))
            pieces.append(part)
        return "".join(pieces)


def _escaped_scalar_node(value: Any) -> str:
    """``tree._scalar_node(value)`` as ``json.dumps`` writes it, escaped."""
    kind = type(value)
    if kind is int:
        return _VALUE_OPENING + int.__repr__(value) + "}"
    if kind is float:
        if math.isfinite(value):
            return _VALUE_OPENING + float.__repr__(value) + "}"
        return _NON_FINITE_OPENING + repr(value) + _NON_FINITE_CLOSING
    if kind is str:
        return _VALUE_OPENING + escape(_encode_string(value)) + "}"
    if value is None:
        return _VALUE_OPENING + "null}"
    return _VALUE_OPENING + ("true}" if value else "false}")
