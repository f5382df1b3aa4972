"""A new rank's shard is assembled exactly from the regions the planner names, whatever the two layouts.

The oracle is ``shard_indices`` (itself checked against torch's own
splitting in ``test_full_tensors``): applied to a tensor of its own
positions, it gives each saved rank's stored shard and each new rank's
wanted one. The regions are applied as ``client.resharder`` applies them.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from stowaway.format import reshard
from stowaway.format.full_tensors import shard_indices

PLACEMENTS = {"R": {"r": 1}, "S0": {"s": 0}, "S1": {"s": 1}, "SS0": {"s": 0, "sf": 2}}
LAYOUTS = [((4,), ("S0",)), ((3,), ("S0",)), ((2,), ("S1",)), ((1,), ("S0",)), ((2, 2), ("SS0", "S0")),
           ((2, 2), ("S0", "R")), ((2, 2), ("R", "S0")), ((1, 2), ("SS0", "S1")), ((2, 1), ("S0", "S1")),
           ((3, 2), ("S0", "S1"))]


def node(global_shape: tuple[int, ...], placements: tuple[str, ...]) -> dict:
    return {"D": {"T": "w"}, "pl": [PLACEMENTS[name] for name in placements], "sh": list(global_shape),
            "st": [], "m": 0}


def assembled(positions: np.ndarray, saved: tuple, new: tuple, new_rank: int) -> tuple[np.ndarray, np.ndarray]:
    (saved_shape, saved_names), (new_shape, new_names) = saved, new
    ranks = np.arange(int(np.prod(saved_shape))).reshape(saved_shape)
    stored, shapes = {}, {}
    for coordinate in itertools.product(*(range(size) for size in saved_shape)):
        rank = int(ranks[coordinate])
        indices = shard_indices(list(positions.shape), saved_shape, list(coordinate),
                                [PLACEMENTS[name] for name in saved_names])
        stored[rank] = positions[np.ix_(*indices)]
        shapes[rank] = list(stored[rank].shape)
    coordinate = list(np.argwhere(np.arange(int(np.prod(new_shape))).reshape(new_shape) == new_rank)[0])
    target = reshard.Target(new_shape, coordinate, [PLACEMENTS[name] for name in new_names])
    wanted = positions[np.ix_(*shard_indices(list(positions.shape), new_shape, coordinate, target.placements))]
    local = np.full(reshard.new_local_shape(list(positions.shape), target), -1)
    filled = np.zeros(local.shape, dtype=int)
    regions = reshard.regions(node(positions.shape, saved_names), [{"ranks": ranks.tolist()}], target, new_rank)
    reshard.check_shapes(node(positions.shape, saved_names), regions, lambda rank: shapes[rank])
    for region in regions:
        rows = stored[region.rank][region.rows[0] : region.rows[1]]
        if region.whole_rows is not None:
            assert np.array_equal(rows, rows[np.ix_(*region.source)]), "whole rows must be the rows as stored"
            local[region.whole_rows[0] : region.whole_rows[1]] = rows
            filled[region.whole_rows[0] : region.whole_rows[1]] += 1
        else:
            local[np.ix_(*region.target)] = rows[np.ix_(*region.source)]
            filled[np.ix_(*region.target)] += 1
    assert (filled == 1).all(), "every element of the new shard comes from exactly one region"
    return local, wanted


@pytest.mark.parametrize("global_shape", [(13, 6), (8, 4), (2, 3)])
@pytest.mark.parametrize("saved", LAYOUTS, ids=str)
@pytest.mark.parametrize("new", LAYOUTS, ids=str)
def test_every_new_shard_is_assembled_from_the_saved_shards_exactly(global_shape, saved, new):
    positions = np.arange(int(np.prod(global_shape))).reshape(global_shape)
    for new_rank in range(int(np.prod(new[0]))):
        local, wanted = assembled(positions, saved, new, new_rank)
        assert np.array_equal(local, wanted), (new_rank, local, wanted)


def test_fsdp_rows_are_read_whole_and_only_from_the_saved_ranks_that_hold_them():
    target = reshard.Target((3,), [1], [{"s": 0}])
    regions = reshard.regions(node((640, 4), ("S0",)), [{"ranks": [0, 1, 2, 3]}], target, 1)
    # New rank 1 of 3 holds rows 214..427: the end of saved rank 1's shard and the start of rank 2's.
    assert [(region.rank, region.rows, region.whole_rows) for region in regions] == [
        (1, (54, 160), (0, 106)), (2, (0, 108), (106, 214))]


def test_replicas_are_read_from_one_saved_rank_spread_over_the_new_ranks():
    regions = [reshard.regions(node((8,), ("R", "S0")), [{"ranks": [[0, 1], [2, 3]]}],
                               reshard.Target((1,), [0], [{"s": 0}]), new_rank) for new_rank in range(2)]
    assert [[region.rank for region in found] for found in regions] == [[0, 1], [2, 3]]


def test_what_cannot_be_mapped_is_refused_with_the_tensor_and_the_reason():
    target = reshard.Target((2,), [0], [{"s": 0}])
    with pytest.raises(reshard.Unmappable, match=r"'w' is placed \{'p': 'sum'\}: a Partial is a sum"):
        reshard.regions({**node((4,), ("S0",)), "pl": [{"p": "sum"}]}, [{"ranks": [0]}], target, 0)
    shapes = {0: [2], 1: [3]}
    # New rank 0 reads only saved rank 0's shard, whose shape is right; new rank 1 reads rank 1's.
    first = reshard.regions(node((4,), ("S0",)), [{"ranks": [0, 1]}], target, 0)
    reshard.check_shapes(node((4,), ("S0",)), first, shapes.get)
    second = reshard.regions(node((4,), ("S0",)), [{"ranks": [0, 1]}], reshard.Target((2,), [1], [{"s": 0}]), 1)
    with pytest.raises(reshard.Unmappable, match=r"saved rank 1's shard of the DTensor stored as 'w' has shape "
                                                 r"\[3\], but placements .* give it \[2\]"):
        reshard.check_shapes(node((4,), ("S0",)), second, shapes.get)
    with pytest.raises(reshard.Unmappable, match=r"saved rank 1's shard .* has shape None"):
        reshard.check_shapes(node((4,), ("S0",)), second, {0: [2]}.get)


def test_values_that_differ_between_saved_ranks_are_named_with_both_values():
    def tree(rank: int, seed: float) -> dict:
        return {"version": 1, "root": {"d": [[{"v": "epoch"}, {"v": 3}], [{"v": "rng"},
                {"d": [[{"v": "seed"}, {"v": seed}], [{"v": "rank"}, {"v": rank}]]}], [{"v": "w"}, {"T": "w"}]]}}

    assert reshard.differences({0: tree(0, 1.0), 1: tree(0, 1.0)}) == []
    assert reshard.differences({0: tree(0, 1.0), 1: tree(1, 2.0)}) == [
        "state['rng']['seed'] is 1.0 in saved rank 0's file and 2.0 in rank 1's",
        "state['rng']['rank'] is 0 in saved rank 0's file and 1 in rank 1's"]


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_inspect_shows_the_indices_each_saved_shard_holds_as_the_planner_computes_them(layout):
    from stowaway.format import shards

    mesh_shape, names = layout
    ranks = np.arange(int(np.prod(mesh_shape))).reshape(mesh_shape)[..., ::-1]
    placements = [PLACEMENTS[name] for name in names]
    for coordinate in itertools.product(*(range(size) for size in mesh_shape)):
        rank = int(ranks[coordinate])
        expected = shard_indices([13, 6], mesh_shape, list(coordinate), placements)
        held = shards.held([13, 6], ranks.tolist(), rank, placements)
        assert held == [[int(index) for index in ix] for ix in expected]
