"""Each rank's shard goes where torch's own sharding put it, for every mesh and uneven split.

The oracle is torch's own splitting of a tensor by each placement, mesh
dimension by mesh dimension, as ``distribute_tensor`` does: applied to a
tensor of its own indices, it gives the indices each rank's shard holds. A
DTensor cannot be built for ranks this process is not, so the comparison is
made on the indices.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from stowaway import UnsupportedState
from stowaway.format import tree as tree_mod
from stowaway.format.full_tensors import Gatherer, check_gatherable, mesh_position, shard_indices

PLACEMENTS = {
    "R": (Replicate(), {"r": 1}),
    "S0": (Shard(0), {"s": 0}),
    "S1": (Shard(1), {"s": 1}),
    "SS0": (_StridedShard(0, split_factor=2), {"s": 0, "sf": 2}),
    "SS1": (_StridedShard(1, split_factor=3), {"s": 1, "sf": 3}),
}


def torch_shard(whole: torch.Tensor, mesh_shape: tuple[int, ...], coordinate: tuple[int, ...],
                placements: list) -> torch.Tensor:
    for mesh_dim, placement in enumerate(placements):
        if not isinstance(placement, Replicate):
            pieces, _ = placement._split_tensor(whole, mesh_shape[mesh_dim], with_padding=False)
            whole = pieces[coordinate[mesh_dim]]
    return whole


@pytest.mark.parametrize("mesh_shape", [(2,), (3,), (4,), (2, 3), (4, 2), (2, 2, 2)])
@pytest.mark.parametrize("global_shape", [(12, 6), (7, 5), (5, 1), (1, 3), (0, 4), (3, 0)])
def test_every_ranks_indices_are_those_torch_puts_in_its_shard(mesh_shape, global_shape):
    ranks = np.arange(int(np.prod(mesh_shape))).reshape(mesh_shape)[..., ::-1]  # not in row-major order
    positions = torch.arange(int(np.prod(global_shape))).reshape(global_shape)
    for names in itertools.product(PLACEMENTS, repeat=len(mesh_shape)):
        torch_placements = [PLACEMENTS[name][0] for name in names]
        stored = [PLACEMENTS[name][1] for name in names]
        covered = np.zeros(global_shape, dtype=int)
        for coordinate in itertools.product(*(range(size) for size in mesh_shape)):
            position = mesh_position(ranks.tolist(), int(ranks[coordinate]))
            assert position == (mesh_shape, list(coordinate))
            indices = shard_indices(list(global_shape), *position, stored)
            expected = torch_shard(positions, mesh_shape, coordinate, torch_placements)
            assert torch.equal(positions[np.ix_(*indices)], expected), (names, coordinate)
            covered[np.ix_(*indices)] += 1
        copies = int(np.prod([size for size, name in zip(mesh_shape, names, strict=True) if name == "R"]))
        assert (covered == copies).all(), f"{names}: every element is in exactly one shard per replica"


def test_a_rank_outside_the_mesh_has_no_position_in_it():
    assert mesh_position([[0, 1]], 2) is None


def sharded_tree(placement: dict | None = None) -> dict:
    node = {"D": {"T": "w"}, "pl": [placement or {"s": 0}], "sh": [4], "st": [1], "m": 0}
    return {"version": 2, "root": {"d": [[{"v": "w"}, node]]},
            "meshes": [{"ranks": [0, 1], "names": None, "device": "cpu"}]}


def test_a_partial_is_refused_before_any_shard_is_read():
    with pytest.raises(UnsupportedState, match="a Partial is a sum over ranks"):
        shard_indices([4], (2,), [0], [{"p": "sum"}])
    with pytest.raises(UnsupportedState, match=r"placement \{'p': 'sum'\} cannot be gathered into a whole tensor"):
        check_gatherable(sharded_tree({"p": "sum"}))
    check_gatherable(sharded_tree({"r": 1}))


def test_a_dtensor_is_whole_once_every_rank_of_its_mesh_gave_its_shard():
    tree = sharded_tree()
    first = {"w": torch.tensor([0.0, 1.0])}
    gatherer = Gatherer(torch.device("cpu"))
    gatherer.add(0, tree, first)
    with pytest.raises(UnsupportedState, match=r"'w' has no shard in the files of ranks \[1\]"):
        gatherer.complete()
    gatherer.add(1, tree, {"w": torch.tensor([2.0, 3.0])})
    gatherer.complete()
    assert torch.equal(tree_mod.unflatten(tree, first, gatherer)["w"], torch.arange(4.0))


def test_shards_go_straight_into_the_callers_tensors_and_from_there_into_a_second_destination():
    tree = sharded_tree()
    mine = torch.nn.Parameter(torch.zeros(4))
    second = torch.zeros(4)
    gatherer = Gatherer(torch.device("cpu"), into={"w": [mine, second, mine]})
    gatherer.add(0, tree, {"w": torch.tensor([0.0, 1.0])})
    gatherer.add(1, tree, {"w": torch.tensor([2.0, 3.0])})
    assert torch.equal(second, torch.zeros(4)), "a second destination is filled once the whole is complete"
    gatherer.complete()
    assert torch.equal(mine, torch.arange(4.0)) and torch.equal(second, torch.arange(4.0))
    assert mine.requires_grad and mine.grad_fn is None, "the caller's parameter stays a leaf"
    assert tree_mod.unflatten(tree, {"w": torch.zeros(2)}, gatherer)["w"] is mine


def test_a_shard_of_another_shape_than_its_placements_give_is_refused():
    with pytest.raises(UnsupportedState, match=r"rank 1's shard of the DTensor stored as 'w' has shape \[3\], but"):
        Gatherer(torch.device("cpu")).add(1, sharded_tree(), {"w": torch.zeros(3)})
