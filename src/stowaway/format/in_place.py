"""``into``: a checkpoint's bytes copied into the caller's own tensors instead of new ones.

A restore into new tensors holds the state twice until the caller has copied
it into the model and dropped the copy: twice the host memory, or with
``map_location="cuda"`` twice the GPU memory, which a model that fills its
GPUs does not have. Loading into the tensors the model and optimizer already
hold (``model.state_dict()`` shares the parameters' storage) writes each byte
once, where it is used, and a DTensor keeps its mesh without ``from_local``.

The caller's state is walked alongside the stored tree, by key and index.
Every pair is checked before the first byte is written, so a state that does
not fit leaves the caller's tensors as they were; and every tensor of the
caller's state must receive bytes, so a renamed or missing key cannot leave
part of a model silently untouched.

``load(into=...)`` fills a DTensor's local shard, on the mesh it lives on;
``read_checkpoint(into=...)``, which gathers each stored DTensor whole, fills
a plain tensor of its global shape (``format.full_tensors``).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from stowaway.errors import UnsupportedState
from stowaway.format import dtensors, nodes
from stowaway.format import tree as tree_mod

_PROBLEMS_SHOWN = 5
# What the checkpoint holds where ``into`` has something else, by node kind.
_DESCRIPTIONS = {
    nodes.TENSOR: "a tensor", nodes.DTENSOR: "a DTensor", nodes.VALUE: "a value",
    nodes.NON_FINITE: "a value", nodes.MAPPING: "a dict", nodes.LIST: "a list",
    nodes.TUPLE: "a tuple", nodes.SIZE: "a torch.Size", nodes.DTYPE: "a dtype",
    nodes.NUMPY: "a numpy array", nodes.PICKLED: "a pickled object",
}


@dataclass
class Destinations:
    # The caller's object that ``tree.unflatten`` returns at each matched node, by the node's id.
    by_node: dict[int, torch.Tensor] = field(default_factory=dict)
    # The stored tensor's name, and the tensor its bytes go into (a DTensor's local shard).
    targets: list[tuple[str, torch.Tensor]] = field(default_factory=list)
    # By a stored DTensor's local name, the plain tensors its whole is gathered into (more than one for a tie).
    wholes: dict[str, list[torch.Tensor]] = field(default_factory=dict)
    # By a stored DTensor's local name, the caller's DTensors of another layout that a resharding load fills.
    resharded: dict[str, list[Any]] = field(default_factory=dict)

    @property
    def filled(self) -> set[str]:
        """The stored tensors that need no copy: their bytes go into the caller's tensors."""
        return {name for name, _ in self.targets} | self.wholes.keys() | self.resharded.keys()

    def fill(self, views: dict[str, torch.Tensor]) -> None:
        """Copy each stored tensor into its destinations, all of them before returning."""
        if not self.targets:
            return
        with torch.no_grad():
            # Synchronous even into a GPU: the slot may be written again as soon as load returns.
            torch._foreach_copy_([target for _, target in self.targets], [views[name] for name, _ in self.targets])


def match(tree: dict[str, Any], views: dict[str, torch.Tensor], into: Any,
          whole_dtensors: bool = False, reshard: bool = False) -> Destinations:
    """Pair every tensor of ``into`` with the stored tensor at its path; ``views`` are the stored tensors by name.

    Raises ``UnsupportedState`` naming what does not fit (up to five paths)
    when a tensor of ``into`` has no stored counterpart, or one of another
    kind, dtype, shape or DTensor layout. With ``whole_dtensors``, a stored
    DTensor pairs with a plain tensor of its global shape, in ``wholes``;
    with ``reshard``, with a DTensor of its global shape on any mesh and
    placements, in ``resharded``.
    """
    matcher = _Matcher(tree.get(nodes.TREE_MESHES, []), views, whole_dtensors, reshard)
    with torch.no_grad():
        matcher.walk(tree[nodes.TREE_ROOT], into, ())
    problems = matcher.problems
    if problems:
        more = f"; and {len(problems) - _PROBLEMS_SHOWN} more" if len(problems) > _PROBLEMS_SHOWN else ""
        raise UnsupportedState(
            f"{'read_checkpoint' if whole_dtensors else 'load'}(into=...) was given a state that does not fit the "
            f"checkpoint, so none of its tensors was written: {'; '.join(problems[:_PROBLEMS_SHOWN])}{more}. Pass "
            f"the state as it was saved (the same keys, dtypes, shapes and "
            f"{'global shapes of DTensors' if whole_dtensors else 'DTensor layouts'}), or leave into out to get new "
            "tensors"
        )
    return matcher.destinations


class _Matcher:
    def __init__(self, saved_meshes: list[dict[str, Any]], views: dict[str, torch.Tensor],
                 whole_dtensors: bool, reshard: bool) -> None:
        self.saved_meshes = saved_meshes
        self.views = views
        self.whole_dtensors = whole_dtensors
        self.reshard = reshard
        self.dtensor = dtensors.dtensor_type()
        self.destinations = Destinations()
        self.problems: list[str] = []

    def walk(self, node: nodes.Node, value: Any, path: tree_mod.Path) -> None:
        # Exact types first: a state of thousands of tensors is walked on every load(into=...).
        kind = type(value)
        if kind is torch.Tensor or isinstance(value, torch.Tensor):
            self._tensor(node, value, path)
        elif (kind is dict or kind is OrderedDict or isinstance(value, Mapping)) and nodes.MAPPING in node:
            stored = {tree_mod.key_of(key): child for key, child in node[nodes.MAPPING]}
            for key, item in value.items():
                if key in stored:
                    self.walk(stored[key], item, (*path, key))
                else:
                    self._unmatched(item, (*path, key), "nothing")
        elif isinstance(value, list | tuple) and (nodes.LIST in node or nodes.TUPLE in node):
            items = node[nodes.LIST] if nodes.LIST in node else node[nodes.TUPLE]
            for index, item in enumerate(value):
                if index < len(items):
                    self.walk(items[index], item, (*path, index))
                else:
                    self._unmatched(item, (*path, index), "nothing")
        elif isinstance(value, torch.nn.Module | torch.optim.Optimizer):
            # Its tensors are not reachable from here: without this, nothing would be written into it, silently.
            self.problems.append(f"{tree_mod.show_path(path, 'into')} is a {type(value).__name__}: pass its "
                                 "state_dict(), whose tensors are its own")
        else:
            self._unmatched(value, path, _describe(node))

    def _tensor(self, node: nodes.Node, value: torch.Tensor, path: tree_mod.Path) -> None:
        is_dtensor = self.dtensor is not None and type(value) is not torch.Tensor and isinstance(value, self.dtensor)
        if nodes.DTENSOR in node and self.whole_dtensors:
            self._whole(node, value, path, is_dtensor)
            return
        if nodes.TENSOR in node and not is_dtensor:
            name, local = node[nodes.TENSOR], value
        elif nodes.DTENSOR in node and is_dtensor and self.reshard:
            self._resharded(node, value, path)
            return
        elif nodes.DTENSOR in node and is_dtensor:
            problem = dtensors.layout_mismatch(node, value, self.saved_meshes)
            if problem is not None:
                self.problems.append(f"{tree_mod.show_path(path, 'into')} is {problem}")
                return
            # A DTensor (is_dtensor), whose class torch.Tensor's annotations do not know.
            name, local = node[nodes.DTENSOR][nodes.TENSOR], value.to_local()  # type: ignore[attr-defined]
        else:
            kind = "a DTensor" if is_dtensor else "a tensor"
            self.problems.append(f"{tree_mod.show_path(path, 'into')} is {kind}, where the checkpoint "
                                 f"holds {_describe(node)}")
            return
        stored = self.views[name]
        if local.dtype is not stored.dtype or local.shape != stored.shape:
            shard = " (this rank's shard)" if is_dtensor else ""
            self.problems.append(
                f"{tree_mod.show_path(path, 'into')}{shard} is {local.dtype} of shape {list(local.shape)}, where the "
                f"checkpoint holds {stored.dtype} of shape {list(stored.shape)}"
            )
            return
        self.destinations.by_node[id(node)] = value
        self.destinations.targets.append((name, local))

    def _whole(self, node: nodes.Node, value: torch.Tensor, path: tree_mod.Path, is_dtensor: bool) -> None:
        name = node[nodes.DTENSOR][nodes.TENSOR]
        stored_dtype, global_shape = self.views[name].dtype, list(node[nodes.DTENSOR_SHAPE])
        where = tree_mod.show_path(path, "into")
        if is_dtensor:
            self.problems.append(f"{where} is a DTensor, where read_checkpoint gathers the stored DTensor whole: "
                                 f"pass a plain tensor of its global shape {global_shape}")
        elif value.dtype is not stored_dtype or list(value.shape) != global_shape:
            self.problems.append(f"{where} is {value.dtype} of shape {list(value.shape)}, where the checkpoint holds "
                                 f"a DTensor of {stored_dtype} whose global shape is {global_shape}")
        else:
            self.destinations.by_node[id(node)] = value
            self.destinations.wholes.setdefault(name, []).append(value)

    def _resharded(self, node: nodes.Node, value: Any, path: tree_mod.Path) -> None:
        name = node[nodes.DTENSOR][nodes.TENSOR]
        stored_dtype, global_shape = self.views[name].dtype, list(node[nodes.DTENSOR_SHAPE])
        if value.dtype is not stored_dtype or list(value.shape) != global_shape:
            self.problems.append(f"{tree_mod.show_path(path, 'into')} is a DTensor of {value.dtype} whose global "
                                 f"shape is {list(value.shape)}, where the checkpoint holds one of {stored_dtype} "
                                 f"whose global shape is {global_shape}")
            return
        self.destinations.by_node[id(node)] = value
        self.destinations.resharded.setdefault(name, []).append(value)

    def _unmatched(self, value: Any, path: tree_mod.Path, stored: str) -> None:
        """A part of ``into`` the checkpoint has no tensors for: a problem if it holds a tensor."""
        found = _first_tensor(value, path)
        if found is not None:
            self.problems.append(f"{tree_mod.show_path(found, 'into')} is a tensor, where the checkpoint holds {stored}"
                                 + (f" at {tree_mod.show_path(path, 'into')}" if found != path else ""))


def _first_tensor(value: Any, path: tree_mod.Path) -> tree_mod.Path | None:
    if isinstance(value, torch.Tensor):
        return path
    if isinstance(value, Mapping):
        children: Any = value.items()
    elif isinstance(value, list | tuple):
        children = enumerate(value)
    else:
        return None
    for key, item in children:
        found = _first_tensor(item, (*path, key))
        if found is not None:
            return found
    return None


def _describe(node: nodes.Node) -> str:
    kind = nodes.kind_of(node)
    return "something else" if kind is None else _DESCRIPTIONS[kind]
