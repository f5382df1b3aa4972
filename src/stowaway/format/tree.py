"""Flatten a state dict into named tensors plus a JSON tree, and back.

The walk carries a path of keys and indices (never a parsed string), records
every container's exact type (dict, OrderedDict with its ``_metadata``, list,
tuple, torch.Size) and every non-tensor leaf, and names each distinct tensor
once, so tied tensors are stored once and come back as one object. A
DTensor is stored as this rank's shard (``format.dtensors``).
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
from stowaway.format import dtensors

TREE_VERSION = 1
# A tree holding DTensors: a reader that does not know them says to upgrade instead of failing on a node.
DTENSOR_TREE_VERSION = 2
Path = tuple[str | int, ...]

_STORABLE_DTYPES = {
    torch.float64, torch.float32, torch.float16, torch.bfloat16,
    torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
    torch.float8_e4m3fn, torch.float8_e5m2,
    torch.uint16, torch.uint32, torch.uint64,
}


@dataclass
class Flat:
    tree: Any
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    # For format.template: the name of every tensor occurrence and every scalar leaf's node, in walk order.
    occurrences: list[str] = field(default_factory=list)
    scalar_nodes: list[dict[str, Any]] = field(default_factory=list)


class _Flattener:
    def __init__(self, allow_pickle: bool) -> None:
        self.allow_pickle = allow_pickle
        self.tensors: dict[str, torch.Tensor] = {}
        self.occurrences: list[str] = []
        self.scalar_nodes: list[dict[str, Any]] = []
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
            stored = self._tensor(numpy_as_tensor(value, path), path)["T"]
            return {"N": stored, "nd": value.dtype.str, "sh": list(value.shape)}
        if isinstance(value, bool | int | str | float):
            return _scalar_node(value)
        if isinstance(value, torch.Size):
            return {"S": list(value)}
        if isinstance(value, torch.dtype):
            return {"dt": str(value).removeprefix("torch.")}
        if kind in (list, tuple):
            tag = "l" if kind is list else "t"
            return {tag: [self.node(item, (*path, index)) for index, item in enumerate(value)]}
        if self.allow_pickle:
            blob = np.frombuffer(pickle.dumps(value), dtype=np.uint8).copy()
            return {"pk": self._tensor(torch.from_numpy(blob), path)["T"]}
        raise UnsupportedState(
            f"state at {show_path(path)} is a {type(value).__module__}.{type(value).__qualname__}, which "
            "Stowaway stores only as tensors, numbers, strings, None, lists, tuples and dicts; "
            "convert it (for example to its state_dict()) or pass allow_pickle=True to "
            "Checkpointer to store it pickled"
        )

    def _mapping(self, value: dict[Any, Any], path: Path) -> Any:
        items = []
        for key, item in value.items():
            if type(key) is str:
                encoded_key: Any = {"v": key}
            elif key is None or isinstance(key, str | int | float | bool):
                encoded_key = _scalar_node(key)
            else:
                raise UnsupportedState(f"state at {show_path(path)} has a key of type {type(key).__name__}")
            items.append([encoded_key, self.node(item, (*path, key))])
        encoded: dict[str, Any] = {"d": items}
        if type(value) is OrderedDict:
            encoded["o"] = 1
            metadata = getattr(value, "_metadata", None)
            if metadata is not None:
                encoded["m"] = self.node(metadata, (*path, "_metadata"))
        return encoded

    def _tensor(self, tensor: torch.Tensor, path: Path) -> dict[str, Any]:
        if tensor.layout != torch.strided:
            raise UnsupportedState(
                f"tensor at {show_path(path)} has layout {tensor.layout}; store it dense (tensor.to_dense()) "
                "or as its components"
            )
        if tensor.dtype not in _STORABLE_DTYPES:
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
        encoded: dict[str, Any] = {"T": name}
        if type(tensor) is not torch.Tensor and isinstance(tensor, torch.nn.Parameter):
            encoded["P"] = int(tensor.requires_grad)
        return encoded

    def _scalar(self, value: Any) -> dict[str, Any]:
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
    tree: dict[str, Any] = {"version": TREE_VERSION, "root": root}
    if flattener.meshes.encoded:
        tree = {"version": DTENSOR_TREE_VERSION, "root": root, "meshes": flattener.meshes.encoded}
    return Flat(tree, flattener.tensors, flattener.occurrences, flattener.scalar_nodes)


def unflatten(tree: dict[str, Any], tensors: dict[str, torch.Tensor], dtensor_builder: DTensorBuilder,
              allow_pickle: bool = False, replaced: dict[int, Any] | None = None) -> Any:
    """The state ``flatten`` was given; ``dtensor_builder`` makes what each DTensor node becomes.

    ``replaced`` maps the ``id`` of tensor and DTensor nodes to what comes back there instead: the
    caller's own tensors, which ``load(into=...)`` filled (``format.in_place``).
    """
    if tree.get("version") not in (TREE_VERSION, DTENSOR_TREE_VERSION):
        raise UnsupportedState(
            f"state tree version {tree.get('version')} is not readable by this release "
            f"(reads {TREE_VERSION} and {DTENSOR_TREE_VERSION}); upgrade Stowaway"
        )
    return _Unflattener(tensors, allow_pickle, dtensor_builder, replaced or {}).node(tree["root"])


class DTensorBuilder(Protocol):
    """What a DTensor node comes back as: a DTensor on the caller's mesh (``dtensors.Rebuilder``), or the
    whole tensor gathered from every rank's file (``full_tensors.Gatherer``)."""

    def rebuild(self, node: dict[str, Any], local: torch.Tensor) -> Any: ...


class _Unflattener:
    def __init__(self, tensors: dict[str, torch.Tensor], allow_pickle: bool, rebuilder: DTensorBuilder,
                 replaced: dict[int, Any]) -> None:
        self.tensors = tensors
        self.allow_pickle = allow_pickle
        self.rebuilder = rebuilder
        self.replaced = replaced
        self._parameters: dict[str, torch.nn.Parameter] = {}
        self._arrays: dict[str, np.ndarray] = {}
        self._dtensors: dict[str, Any] = {}

    def node(self, encoded: dict[str, Any]) -> Any:
        if "T" in encoded:
            return self._tensor(encoded)
        if "D" in encoded:
            return self._dtensor(encoded)
        if "v" in encoded:
            return encoded["v"]
        if "f" in encoded:
            return float(encoded["f"])
        if "d" in encoded:
            return self._mapping(encoded)
        if "l" in encoded:
            return [self.node(item) for item in encoded["l"]]
        if "t" in encoded:
            return tuple(self.node(item) for item in encoded["t"])
        if "S" in encoded:
            return torch.Size(encoded["S"])
        if "dt" in encoded:
            return getattr(torch, encoded["dt"])
        if "N" in encoded:
            return self._array(encoded)
        if "pk" in encoded:
            return self._unpickle(encoded["pk"])
        raise UnsupportedState(f"state tree holds an unknown node {sorted(encoded)}")

    def _tensor(self, encoded: dict[str, Any]) -> torch.Tensor:
        if self.replaced and id(encoded) in self.replaced:
            return self.replaced[id(encoded)]
        tensor = self.tensors[encoded["T"]]
        if "P" not in encoded:
            return tensor
        if encoded["T"] not in self._parameters:
            self._parameters[encoded["T"]] = torch.nn.Parameter(tensor, requires_grad=bool(encoded["P"]))
        return self._parameters[encoded["T"]]

    def _dtensor(self, encoded: dict[str, Any]) -> Any:
        if self.replaced and id(encoded) in self.replaced:
            return self.replaced[id(encoded)]
        # One DTensor object per stored one, as tied plain tensors come back as one object.
        key = json.dumps(encoded, sort_keys=True)
        if key not in self._dtensors:
            self._dtensors[key] = self.rebuilder.rebuild(encoded, self.tensors[encoded["D"]["T"]])
        return self._dtensors[key]

    def _array(self, encoded: dict[str, Any]) -> np.ndarray:
        name = encoded["N"]
        if name not in self._arrays:
            raw = self.tensors[name].cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
            typed = raw.view(np.dtype(encoded["nd"])).reshape(tuple(encoded["sh"]))
            self._arrays[name] = typed.copy()
        return self._arrays[name]

    def _mapping(self, encoded: dict[str, Any]) -> dict[Any, Any]:
        result: dict[Any, Any] = OrderedDict() if encoded.get("o") else {}
        for key, value in encoded["d"]:
            result[self.node(key)] = self.node(value)
        if "m" in encoded:
            result._metadata = self.node(encoded["m"])  # type: ignore[attr-defined]
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


def key_of(encoded: dict[str, Any]) -> Any:
    """A mapping key as stored by ``_Flattener._mapping``: a scalar node."""
    return float(encoded["f"]) if "f" in encoded else encoded["v"]


def _scalar_node(value: Any) -> dict[str, Any]:
    if isinstance(value, float) and not math.isfinite(value):
        return {"f": repr(value)}
    return {"v": value}


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
