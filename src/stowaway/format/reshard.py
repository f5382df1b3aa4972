"""Planning a restore onto another number of ranks: which bytes of which saved rank's file each new shard needs.

Pure: no torch, no I/O; numpy for index arithmetic. ``client.resharder``
reads what the plan names and writes it where the plan says.

A stored DTensor shard carries its placements, its global shape and its
mesh as the layout of the ranks that saved it (``format.dtensors``), so the
indices of the whole tensor that each saved rank holds are computable
(``full_tensors.shard_indices``); so are those a new rank's shard holds, on
its own mesh and placements. A new shard is assembled from the overlaps of
the two, dimension by dimension. Of a saved rank's shard, the rows (of its
first dimension) that hold an overlap are read as one contiguous byte range:
exact for ``Shard(0)`` (FSDP), whole rows for a shard of another dimension.
Where a mesh dimension replicates, one replica is read: the one whose
position is the new rank's modulo the replicas, so new ranks spread their
reads over the saved files.

What cannot be mapped is refused with a reason (``Unmappable``): a
``Partial`` placement (a sum over ranks that only they could reduce), or a
stored shard whose shape does not match its placements.

Plain tensors and other values are not sharded, so the rule for them is
about which saved rank they come from; ``differences`` finds the values that
differ between saved ranks, which no rule can assign to a new rank.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from stowaway.format import full_tensors, nodes, shards


class Unmappable(ValueError):
    """A stored tensor that cannot be resharded, and why; the message names it."""


@dataclass(frozen=True)
class Region:
    """Part of a new local tensor, taken from one saved rank's shard of the same tensor.

    ``rows`` are the rows of the saved shard (its first dimension) read as
    one byte range; ``source`` indexes, per dimension, into those rows
    (the first dimension counted from ``rows[0]``), and ``target`` into the
    new local tensor. ``whole_rows`` is set when the rows land unchanged,
    in order, as rows ``whole_rows`` of the new local tensor: they can then
    be read straight into it. ``shard_shape`` is the shape the saved rank's
    shard has under the saved placements: its file must agree
    (``check_shapes``) before any of these rows are read.
    """

    rank: int
    shard_shape: tuple[int, ...]
    rows: tuple[int, int]
    source: tuple[full_tensors.Indices, ...]
    target: tuple[full_tensors.Indices, ...]
    whole_rows: tuple[int, int] | None


@dataclass(frozen=True)
class Target:
    """Where a new rank's shard of a DTensor lies: its mesh's shape, the rank's coordinate, its placements."""

    mesh_shape: tuple[int, ...]
    coordinate: list[int]
    placements: list[dict[str, Any]]


def new_local_shape(global_shape: list[int], target: Target) -> list[int]:
    return [len(ix) for ix in full_tensors.shard_indices(global_shape, target.mesh_shape, target.coordinate,
                                                         target.placements)]


def regions(node: nodes.Node, saved_meshes: list[dict[str, Any]], target: Target, new_rank: int) -> list[Region]:
    """The regions that make up the new rank's shard of the DTensor stored as ``node``.

    They depend on the layouts only, not on the files, so that DTensors laid out alike (a parameter and its
    optimizer states, a model's repeated layers) share one plan; each file is checked against it with
    ``check_shapes``.
    """
    name = node[nodes.DTENSOR][nodes.TENSOR]
    global_shape = list(node[nodes.DTENSOR_SHAPE])
    placements = node[nodes.DTENSOR_PLACEMENTS]
    for placement in [*placements, *target.placements]:
        if nodes.PLACEMENT_SHARD not in placement and nodes.PLACEMENT_REPLICATE not in placement:
            raise Unmappable(f"the DTensor stored as {name!r} is placed {placement}: a Partial is a sum over the "
                             "ranks that saved it, which only they can reduce")
    wanted = full_tensors.shard_indices(global_shape, target.mesh_shape, target.coordinate, target.placements)
    if any(not len(ix) for ix in wanted) or not global_shape:
        return _scalar_region(global_shape, saved_meshes[node[nodes.DTENSOR_MESH]], wanted)
    saved_ranks = np.array(saved_meshes[node[nodes.DTENSOR_MESH]][nodes.MESH_RANKS])
    coordinates = {int(rank): list(coordinate) for coordinate, rank in np.ndenumerate(saved_ranks)}
    found: list[Region] = []
    for rank in _readers(saved_ranks, placements, new_rank):
        coordinate = coordinates[rank]
        held = full_tensors.shard_indices(global_shape, saved_ranks.shape, coordinate, placements)
        region = _overlap(rank, held, wanted)
        if region is not None:
            found.append(region)
    return found


def _readers(saved_ranks: np.ndarray, placements: list[dict[str, Any]], new_rank: int) -> list[int]:
    """The saved ranks to read from: all of them, but one replica along each mesh dimension that replicates."""
    chosen = saved_ranks
    for mesh_dim in reversed(range(saved_ranks.ndim)):
        if nodes.PLACEMENT_REPLICATE in placements[mesh_dim]:
            chosen = np.take(chosen, [new_rank % saved_ranks.shape[mesh_dim]], axis=mesh_dim)
    return sorted(chosen.reshape(-1).tolist())


def check_shapes(node: nodes.Node, regions: list[Region], shape_of: Callable[[int], Sequence[int] | None]) -> None:
    """Refuse a saved rank's file whose shard of the DTensor ``node`` (``shape_of(rank)``: its shape, None if
    the file lacks it) is not the shape the regions read from it assume."""
    for region in regions:
        shape = shape_of(region.rank)
        if shape is None or tuple(shape) != region.shard_shape:
            raise Unmappable(
                f"saved rank {region.rank}'s shard of the DTensor stored as {node[nodes.DTENSOR][nodes.TENSOR]!r} "
                f"has shape {None if shape is None else list(shape)}, but placements "
                f"{node[nodes.DTENSOR_PLACEMENTS]} of a {node[nodes.DTENSOR_SHAPE]} tensor give it "
                f"{list(region.shard_shape)}")


def _overlap(rank: int, held: list[full_tensors.Indices], wanted: list[full_tensors.Indices]) -> Region | None:
    if all(_contiguous(ix) for ix in (*held, *wanted) if len(ix)):
        return _overlap_of_runs(rank, held, wanted)
    source, target = [], []
    for have, want in zip(held, wanted, strict=True):
        if not len(have) or not len(want):
            return None
        if _contiguous(have) and _contiguous(want):
            # The common case (Shard, Replicate): two runs, whose overlap is arithmetic, not a set operation.
            first, last = max(have[0], want[0]), min(have[-1], want[-1]) + 1
            if first >= last:
                return None
            source.append(np.arange(first - have[0], last - have[0]))
            target.append(np.arange(first - want[0], last - want[0]))
            continue
        common, in_have, in_want = np.intersect1d(have, want, assume_unique=True, return_indices=True)
        if not len(common):
            return None
        source.append(in_have)
        target.append(in_want)
    first, last = int(source[0].min()), int(source[0].max()) + 1
    source[0] = source[0] - first
    rows_contiguous = bool(np.array_equal(source[0], np.arange(last - first)))
    rest_whole = all(len(s) == len(h) and np.array_equal(s, np.arange(len(h))) and np.array_equal(t, s)
                     for s, t, h in zip(source[1:], target[1:], held[1:], strict=True))
    rest_whole = rest_whole and all(len(t) == len(w) for t, w in zip(target[1:], wanted[1:], strict=True))
    target_first = int(target[0][0])
    target_contiguous = bool(np.array_equal(target[0], np.arange(target_first, target_first + last - first)))
    whole = (target_first, target_first + last - first) if rows_contiguous and rest_whole and target_contiguous \
        else None
    return Region(rank, tuple(len(ix) for ix in held), (first, last), tuple(source), tuple(target), whole)


def _overlap_of_runs(rank: int, held: list[full_tensors.Indices], wanted: list[full_tensors.Indices]) -> Region | None:
    """``_overlap`` where every dimension on both sides is a run (Shard, Replicate): arithmetic on the ends."""
    source, target = [], []
    for have, want in zip(held, wanted, strict=True):
        if not len(have) or not len(want):
            return None
        first, last = max(have[0], want[0]), min(have[-1], want[-1]) + 1
        if first >= last:
            return None
        source.append(range(first - have[0], last - have[0]))
        target.append(range(first - want[0], last - want[0]))
    rows = (source[0].start, source[0].stop)
    source[0] = range(rows[1] - rows[0])
    # Every other dimension whole on both sides, and the same: the rows land unchanged.
    rest_whole = all(s.start == 0 and len(s) == len(h) and t == s and len(t) == len(w)
                     for s, t, h, w in zip(source[1:], target[1:], held[1:], wanted[1:], strict=True))
    whole = (target[0].start, target[0].stop) if rest_whole else None
    return Region(rank, tuple(len(ix) for ix in held), rows, tuple(source), tuple(target), whole)


def _contiguous(indices: full_tensors.Indices) -> bool:
    return bool(indices[-1] - indices[0] + 1 == len(indices))


def _scalar_region(global_shape: list[int], mesh: dict[str, Any], wanted: list[full_tensors.Indices]) -> list[Region]:
    """A 0-d DTensor (replicated by nature) comes from the first saved rank; an empty new shard needs nothing."""
    if global_shape and any(not len(ix) for ix in wanted):
        return []
    first = min(np.array(mesh[nodes.MESH_RANKS]).reshape(-1).tolist())
    return [Region(first, (), (0, 1), (), (), (0, 1))]


def differences(trees: dict[int, dict[str, Any]]) -> list[str]:
    """Where the saved ranks' state trees differ (non-tensor values, structure), as paths with two ranks' values.

    The trees name each tensor by its path, so tensors do not show here; DTensor nodes are the same on every
    rank by construction.
    """
    ranks = sorted(trees)
    first = trees[ranks[0]][nodes.TREE_ROOT]
    found: list[str] = []
    for rank in ranks[1:]:
        _diff(first, trees[rank][nodes.TREE_ROOT], "state", ranks[0], rank, found)
        if found:
            break
    return found


def _diff(left: Any, right: Any, path: str, left_rank: int, right_rank: int, found: list[str]) -> None:
    if left == right or len(found) >= 5:
        return
    if isinstance(left, dict) and isinstance(right, dict) and nodes.MAPPING in left and nodes.MAPPING in right:
        lefts = {json.dumps(key): value for key, value in left[nodes.MAPPING]}
        rights = {json.dumps(key): value for key, value in right[nodes.MAPPING]}
        if lefts.keys() == rights.keys():
            for key, item in lefts.items():
                _diff(item, rights[key], f"{path}[{_shown_key(key)}]", left_rank, right_rank, found)
            return
    for tag in (nodes.LIST, nodes.TUPLE):
        if isinstance(left, dict) and isinstance(right, dict) and tag in left and tag in right \
                and len(left[tag]) == len(right[tag]):
            for index, (one, other) in enumerate(zip(left[tag], right[tag], strict=True)):
                _diff(one, other, f"{path}[{index}]", left_rank, right_rank, found)
            return
    found.append(f"{path} is {_shown(left)} in saved rank {left_rank}'s file and {_shown(right)} in rank "
                 f"{right_rank}'s")


def _shown_key(encoded_key: str) -> str:
    key = json.loads(encoded_key)
    return repr(key.get(nodes.VALUE, key.get(nodes.NON_FINITE)))


def _shown(node: Any) -> str:
    if isinstance(node, dict) and nodes.VALUE in node:
        return repr(node[nodes.VALUE])
    text = json.dumps(node)
    return text if len(text) <= 60 else text[:57] + "..."


def split_tensors(tree: dict[str, Any]) -> tuple[list[nodes.Node], list[str]]:
    """The tree's DTensor nodes, one per stored shard, by stored name; and the stored names of its tensors that
    are not DTensor shards (plain tensors, arrays, pickles), sorted.

    One walk of the tree for both: a state of thousands of DTensors made
    the walks a sixth of a resharding restore's time when each asked its
    own.
    """
    found: dict[str, nodes.Node] = {}
    stored: set[str] = set()
    for node in shards.tensor_nodes(tree[nodes.TREE_ROOT]):
        if nodes.DTENSOR in node:
            found.setdefault(node[nodes.DTENSOR][nodes.TENSOR], node)
            continue
        for tag in (nodes.TENSOR, nodes.NUMPY, nodes.PICKLED):
            if tag in node:
                stored.add(node[tag])
    return [found[name] for name in sorted(found)], sorted(stored - found.keys())
