"""Flatten a state dict into named tensors plus a JSON tree, and back.

The walk carries a path of keys and indices (never a parsed string), records
every container's exact type (dict, OrderedDict with its ``_metadata``, list,
tuple, torch.Size) and every non-tensor leaf, and names each distinct tensor
once, so tied tensors are stored once and come back as one object. A
DTensor is stored as this rank's shard (``format.dtensors``). The tree's
keys are named in ``format.nodes``; its grammar is in
``docs/storage-format.md``.
"""

from __future__ import annotations

import json
import math
import pickle
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch

from stowaway.errors import UnsupportedState
from stowaway.format import dtensors, dtypes, nodes

Path = tuple[str | int, ...]

# The dtypes a payload stores, each with its safetensors name: ``format.dtypes`` seen from torch.
SAFETENSORS_NAMES: dict[torch.dtype, str] = {getattr(torch, dtype.torch): dtype.safetensors for dtype in dtypes.TABLE}
# And back: the torch dtype of each safetensors name, for reading a payload.
TORCH_DTYPES: dict[str, torch.dtype] = {name: dtype for dtype, name in SAFETENSORS_NAMES.items()}


@dataclass
class Flat:
    tree: Any
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    # For format.template: the name of every tensor occurrence and every scalar leaf's node, in walk order.
    occurrences: list[str] = field(default_factory=list)
    scalar_nodes: list[nodes.Node] = field(default_factory=list)


class _Flattener:
    def __init__(self, allow_pickle: bool) -> None:
        self.allow_pickle = allow_pickle
        self.tensors: dict[str, torch.Tensor] = {}
        self.occurrences: list[str] = []
        self.scalar_nodes: list[nodes.Node] = []
        self._names_by_identity: dict[tuple[Any, ...], str] = {}
        self.meshes = dtensors.MeshTable()

    def node(self, value: Any, path: Path) -> Any:
        # Exact-type checks first: a training state is mostly dicts, tensors and ints, and save()
        # walks it every time, so the common cases must not pay for the whole chain below.
        kind = type(value)
        if kind is torch.Tensor:
            return self._tensor(value, path)
        if kind is dict or kind is OrderedDict:
            return self._mapping(value, path)
        if kind is int or kind is str or kind is bool or kind is float or value is None:
            return self._scalar(value)
        if isinstance(value, torch.Tensor):
            dtensor = dtensors.dtensor_type()
            if dtensor is not None and isinstance(value, dtensor):
                local, facts = dtensors.split(value)
                return dtensors.encode(facts, self._tensor(local, path), show_path(path), self.meshes)
            return self._tensor(value, path)
        if isinstance(value, np.ndarray):
            stored = self._tensor(numpy_as_tensor(value, path), path)[nodes.TENSOR]
            return {nodes.NUMPY: stored, nodes.NUMPY_DTYPE: value.dtype.str, nodes.NUMPY_SHAPE: list(value.shape)}
        if isinstance(value, bool | int | str | float):
            return _scalar_node(value)
        if isinstance(value, torch.Size):
            return {nodes.SIZE: list(value)}
        if isinstance(value, torch.dtype):
            return {nodes.DTYPE: str(value).removeprefix("torch.")}
        if kind in (list, tuple):
            tag = nodes.LIST if kind is list else nodes.TUPLE
            return {tag: [self.node(item, (*path, index)) for index, item in enumerate(value)]}
        if self.allow_pickle:
            blob = np.frombuffer(pickle.dumps(value), dtype=np.uint8).copy()
            return {nodes.PICKLED: self._tensor(torch.from_numpy(blob), path)[nodes.TENSOR]}
        raise UnsupportedState(
            f"state at {show_path(path)} is a {type(value).__module__}.{type(value).__qualname__}, which "
            "Stowaway stores only as tensors, numbers, strings, None, lists, tuples and dicts; "
            "convert it (for example to its state_dict()) or pass allow_pickle=True to "
            "Checkpointer to store it pickled"
        )

    def _mapping(self, value: dict[Any, Any], path: Path) -> nodes.Node:
        items = []
        for key, item in value.items():
            if type(key) is str:
                encoded_key: nodes.Node = {nodes.VALUE: key}
            elif key is None or isinstance(key, str | int | float | bool):
                encoded_key = _scalar_node(key)
            else:
                raise UnsupportedState(f"state at {show_path(path)} has a key of type {type(key).__name__}")
            items.append([encoded_key, self.node(item, (*path, key))])
        encoded: nodes.Node = {nodes.MAPPING: items}
        if type(value) is OrderedDict:
            encoded[nodes.MAPPING_ORDERED] = 1
            metadata = getattr(value, "_metadata", None)
            if metadata is not None:
                encoded[nodes.MAPPING_METADATA] = self.node(metadata, (*path, "_metadata"))
        return encoded

    def _tensor(self, tensor: torch.Tensor, path: Path) -> nodes.Node:
        if tensor.layout != torch.strided:
            raise UnsupportedState(
                f"tensor at {show_path(path)} has layout {tensor.layout}; store it dense (tensor.to_dense()) "
                "or as its components"
            )
        if tensor.dtype not in SAFETENSORS_NAMES:
            raise UnsupportedState(f"tensor at {show_path(path)} has dtype {tensor.dtype}, which Stowaway cannot store")
        if not _has_own_data(tensor):
            # Copying from one fails deep inside torch ("got mixed torch.Tensor and DTensor"), after the slot is taken.
            raise UnsupportedState(
                f"tensor at {show_path(path)} is a {type(tensor).__module__}.{type(tensor).__qualname__} on "
                f"{tensor.device} with no data of its own: a meta tensor, or a subclass that wraps other tensors. "
                "Store plain tensors or DTensors (for a wrapper, the tensors it wraps)"
            )
        # data_ptr() already includes the storage offset; with shape, strides and dtype it tells
        # tied tensors (one object, or two views of the same elements) from distinct ones.
        identity = (tensor.data_ptr(), tensor.device, tensor.dtype, tensor.shape, tensor.stride())
        name = self._names_by_identity.get(identity)
        if name is None:
            name = self._unique_name(path)
            self._names_by_identity[identity] = name
            self.tensors[name] = tensor
        self.occurrences.append(name)
        encoded: nodes.Node = {nodes.TENSOR: name}
        if type(tensor) is not torch.Tensor and isinstance(tensor, torch.nn.Parameter):
            encoded[nodes.TENSOR_PARAMETER] = int(tensor.requires_grad)
        return encoded

    def _scalar(self, value: Any) -> nodes.Node:
        encoded = _scalar_node(value)
        self.scalar_nodes.append(encoded)
        return encoded

    def _unique_name(self, path: Path) -> str:
        base = ".".join(map(str, path)) or "tensor"
        name, counter = base, 1
        while name in self.tensors or name == "__metadata__":
            counter += 1
            name = f"{base}#{counter}"
        return name


def flatten(state: Any, allow_pickle: bool = False) -> Flat:
    flattener = _Flattener(allow_pickle)
    root = flattener.node(state, ())
    tree: dict[str, Any] = {nodes.TREE_VERSION: nodes.VERSION_PLAIN, nodes.TREE_ROOT: root}
    if flattener.meshes.encoded:
        tree = {nodes.TREE_VERSION: nodes.VERSION_WITH_DTENSORS, nodes.TREE_ROOT: root,
                nodes.TREE_MESHES: flattener.meshes.encoded}
    return Flat(tree, flattener.tensors, flattener.occurrences, flattener.scalar_nodes)


def unflatten(tree: dict[str, Any], tensors: dict[str, torch.Tensor], dtensor_builder: DTensorBuilder,
              allow_pickle: bool = False, replaced: dict[int, torch.Tensor] | None = None) -> Any:
    """The state ``flatten`` was given; ``dtensor_builder`` makes what each DTensor node becomes.

    ``replaced`` maps the ``id`` of tensor and DTensor nodes to what comes back there instead: the
    caller's own tensors, which ``load(into=...)`` filled (``format.in_place``).
    """
    version = tree.get(nodes.TREE_VERSION)
    if version not in nodes.VERSIONS:
        raise UnsupportedState(
            f"state tree version {version} is not readable by this release "
            f"(reads {nodes.VERSION_PLAIN} and {nodes.VERSION_WITH_DTENSORS}); upgrade Stowaway"
        )
    return _Unflattener(tensors, allow_pickle, dtensor_builder, replaced or {}).node(tree[nodes.TREE_ROOT])


class DTensorBuilder(Protocol):
    """What a DTensor node comes back as: a DTensor on the caller's mesh (``dtensors.Rebuilder``), or the
    whole tensor gathered from every rank's file (``full_tensors.Gatherer``)."""

    def rebuild(self, node: nodes.Node, local: torch.Tensor) -> Any: ...


class _Unflattener:
    def __init__(self, tensors: dict[str, torch.Tensor], allow_pickle: bool, rebuilder: DTensorBuilder,
                 replaced: dict[int, torch.Tensor]) -> None:
        self.tensors = tensors
        self.allow_pickle = allow_pickle
        self.rebuilder = rebuilder
        self.replaced = replaced
        self._parameters: dict[str, torch.nn.Parameter] = {}
        self._arrays: dict[str, np.ndarray] = {}
        self._dtensors: dict[str, Any] = {}

    def node(self, encoded: nodes.Node) -> Any:
        # Tags looked for in the order of ``nodes.KINDS``, inline rather than through a table: a restore reads
        # every node, and a lookup and a call more per node would show.
        if nodes.TENSOR in encoded:
            return self._tensor(encoded)
        if nodes.DTENSOR in encoded:
            return self._dtensor(encoded)
        if nodes.VALUE in encoded:
            return encoded[nodes.VALUE]
        if nodes.NON_FINITE in encoded:
            return float(encoded[nodes.NON_FINITE])
        if nodes.MAPPING in encoded:
            return self._mapping(encoded)
        if nodes.LIST in encoded:
            return [self.node(item) for item in encoded[nodes.LIST]]
        if nodes.TUPLE in encoded:
            return tuple(self.node(item) for item in encoded[nodes.TUPLE])
        if nodes.SIZE in encoded:
            return torch.Size(encoded[nodes.SIZE])
        if nodes.DTYPE in encoded:
            return getattr(torch, encoded[nodes.DTYPE])
        if nodes.NUMPY in encoded:
            return self._array(encoded)
        if nodes.PICKLED in encoded:
            return self._unpickle(encoded[nodes.PICKLED])
        raise UnsupportedState(f"state tree holds an unknown node {sorted(encoded)}")

    def _tensor(self, encoded: nodes.Node) -> torch.Tensor:
        if self.replaced and id(encoded) in self.replaced:
            return self.replaced[id(encoded)]
        name = encoded[nodes.TENSOR]
        tensor = self.tensors[name]
        if nodes.TENSOR_PARAMETER not in encoded:
            return tensor
        if name not in self._parameters:
            self._parameters[name] = torch.nn.Parameter(tensor, requires_grad=bool(encoded[nodes.TENSOR_PARAMETER]))
        return self._parameters[name]

    def _dtensor(self, encoded: nodes.Node) -> Any:
        if self.replaced and id(encoded) in self.replaced:
            return self.replaced[id(encoded)]
        # One DTensor object per stored one, as tied plain tensors come back as one object.
        key = json.dumps(encoded, sort_keys=True)
        if key not in self._dtensors:
            local = self.tensors[encoded[nodes.DTENSOR][nodes.TENSOR]]
            self._dtensors[key] = self.rebuilder.rebuild(encoded, local)
        return self._dtensors[key]

    def _array(self, encoded: nodes.Node) -> np.ndarray:
        name = encoded[nodes.NUMPY]
        if name not in self._arrays:
            raw = self.tensors[name].cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
            typed = raw.view(np.dtype(encoded[nodes.NUMPY_DTYPE])).reshape(tuple(encoded[nodes.NUMPY_SHAPE]))
            self._arrays[name] = typed.copy()
        return self._arrays[name]

    def _mapping(self, encoded: nodes.Node) -> dict[Any, Any]:
        result: dict[Any, Any] = OrderedDict() if encoded.get(nodes.MAPPING_ORDERED) else {}
        for key, value in encoded[nodes.MAPPING]:
            result[self.node(key)] = self.node(value)
        if nodes.MAPPING_METADATA in encoded:
            result._metadata = self.node(encoded[nodes.MAPPING_METADATA])  # type: ignore[attr-defined]
        return result

    def _unpickle(self, name: str) -> Any:
        if not self.allow_pickle:
            raise UnsupportedState(
                f"checkpoint holds a pickled object at {name!r}; load with allow_pickle=True "
                "only if you trust whoever wrote it"
            )
        return pickle.loads(self.tensors[name].cpu().numpy().tobytes())


def _has_own_data(tensor: torch.Tensor) -> bool:
    try:
        return not tensor.numel() or tensor.data_ptr() != 0
    except RuntimeError:
        # Some tensor subclasses refuse to give a data pointer at all.
        return False


def key_of(encoded: nodes.Node) -> Any:
    """A mapping key as stored by ``_Flattener._mapping``: a VALUE or NON_FINITE node."""
    return encoded[nodes.VALUE] if nodes.VALUE in encoded else float(encoded[nodes.NON_FINITE])


def _scalar_node(value: Any) -> nodes.Node:
    if isinstance(value, float) and not math.isfinite(value):
        return {nodes.NON_FINITE: repr(value)}
    return {nodes.VALUE: value}


def numpy_as_tensor(array: np.ndarray, path: Path = ()) -> torch.Tensor:
    """The array's bytes as a tensor of an integer dtype of the same width (its dtype goes into the tree)."""
    if array.dtype.hasobject:
        raise UnsupportedState(f"numpy array at {show_path(path)} holds Python objects")
    contiguous = np.ascontiguousarray(array)
    raw = torch.from_numpy(contiguous.reshape(-1).view(np.uint8))
    element = contiguous.dtype.itemsize
    if element in (1, 2, 4, 8):
        typed = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[element]
        return raw.view(typed).reshape(contiguous.shape)
    return raw


def show_path(path: Path, root: str = "state") -> str:
    return root + "".join(f"[{part!r}]" for part in path)
