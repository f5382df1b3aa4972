"""DTensors (FSDP2, tensor parallelism) come back from load() as saved: the same shard, placements and shape.

Each rank stores only its own shard; ``load(device_mesh=...)`` rebuilds the
DTensors on the caller's mesh. Checked through both restore paths with a
one-rank group, whose meshes can still have any number of dimensions, and
through a real FSDP2 job under torchrun that is stopped and resumed.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard

from data_path.processes import local_job
from data_path.stored import rank_files
from stowaway import CheckpointCorrupt, Checkpointer, UnsupportedState, read_checkpoint
from stowaway.format import codec, template

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def meshes() -> Iterator[tuple[object, object]]:
    """A one-rank gloo group, with a 1-D mesh (as FSDP2 uses) and a 2-D one (as FSDP2 with TP uses)."""
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        yield (init_device_mesh("cpu", (1,), mesh_dim_names=("fsdp",)),
               init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "tp")))
    finally:
        dist.destroy_process_group()


def sharded_state(fsdp: object, grid: object) -> dict:
    weight = nn.Parameter(distribute_tensor(torch.arange(12.0).reshape(3, 4), fsdp, [Shard(0)]))
    return {
        "model": {
            "w": weight,
            "frozen": nn.Parameter(distribute_tensor(torch.ones(5, dtype=torch.bfloat16), fsdp, [Replicate()]),
                                   requires_grad=False),
            "tp": distribute_tensor(torch.randn(4, 6), grid, [Shard(0), Shard(1)]),
            "strided": DTensor.from_local(torch.arange(6.0).reshape(2, 3), grid,
                                          [_StridedShard(0, split_factor=2), Shard(1)], run_check=False),
        },
        "optim": {"exp_avg": DTensor.from_local(torch.full((2,), 3.0), fsdp, [Partial("avg")]), "tied": weight,
                  "step": torch.tensor(7.0)},
        "epoch": 3,
    }


def assert_same_dtensors(restored: dict, original: dict, meshes: tuple[object, ...]) -> None:
    for group in ("model", "optim"):
        assert list(restored[group]) == list(original[group])
        for key, saved in original[group].items():
            got = restored[group][key]
            assert type(got) is type(saved), f"{group}.{key}: {type(got)}"
            if not isinstance(saved, DTensor):
                assert torch.equal(got, saved)
                continue
            assert got.placements == saved.placements, f"{group}.{key}"
            assert (got.shape, got.stride(), got.dtype) == (saved.shape, saved.stride(), saved.dtype)
            assert got.device_mesh is saved.device_mesh and got.device_mesh in meshes
            assert torch.equal(got.to_local(), saved.to_local())
            assert isinstance(got, nn.Parameter) == isinstance(saved, nn.Parameter), f"{group}.{key}"
            assert got.requires_grad == saved.requires_grad, f"{group}.{key}"
    assert restored["optim"]["tied"] is restored["model"]["w"], "one DTensor saved twice comes back as one"
    assert restored["epoch"] == original["epoch"]


def test_dtensors_come_back_on_their_meshes_from_memory_and_from_storage(start_sidecar, meshes, caplog):
    caplog.set_level("INFO", logger="stowaway")
    original = sharded_state(*meshes)
    first = start_sidecar("first")
    with Checkpointer(job="dt", socket=first.socket, rank=0, world_size=1, timeout=30) as ckpt:
        ckpt.save(1, original).wait(30)
        step, restored = ckpt.load(device_mesh=meshes)
    assert step == 1 and "restored step 1 from memory" in caplog.text
    assert_same_dtensors(restored, original, meshes)

    assert first.stop() == 0
    shutil.rmtree(first.shm_dir)
    second = start_sidecar("second")
    with Checkpointer(job="dt", socket=second.socket, rank=0, world_size=1, timeout=30) as ckpt:
        step, restored = ckpt.load(device_mesh=list(reversed(meshes)))
    assert step == 1 and "restored step 1 from storage" in caplog.text
    assert_same_dtensors(restored, original, meshes)


def test_a_load_without_the_saved_mesh_is_refused_and_says_which_mesh_to_pass(start_sidecar, meshes):
    fsdp, grid = meshes
    sidecar = start_sidecar()
    with Checkpointer(job="dt", socket=sidecar.socket, rank=0, world_size=1, timeout=30) as ckpt:
        ckpt.save(1, sharded_state(fsdp, grid)).wait(30)
        with pytest.raises(UnsupportedState, match=r"holds DTensors .* over ranks \[0\] named \('fsdp',\): pass "
                                                   r"load\(device_mesh=\.\.\.\)"):
            ckpt.load()
        with pytest.raises(UnsupportedState, match=r"over ranks \[\[0\]\] named \('dp', 'tp'\), and no mesh passed "
                                                   r"to load\(\) has that layout \(passed: \[0\]\)"):
            ckpt.load(device_mesh=fsdp)
        with pytest.raises(TypeError, match=r"device_mesh must be a .*DeviceMesh"):
            ckpt.load(device_mesh="fsdp")
        # The refusals changed nothing: the step still loads with the right meshes.
        assert ckpt.load(device_mesh=meshes)[0] == 1


def test_each_save_of_a_sharded_training_loop_is_encoded_from_the_template_and_restores_its_values(
        start_sidecar, meshes):
    """Saves after the first reuse the tree of the first (``format.template``); a DTensor must not defeat that."""
    state = sharded_state(*meshes)
    encoder = codec.Encoder()
    encoder.encode(state)
    state["epoch"] = 4
    walked = template.walk(state)
    assert walked is not None and encoder._template is not None and encoder._template.fits(walked)
    assert encoder.encode(state).layout.header == codec.Encoder().encode(state).layout.header

    sidecar = start_sidecar()
    with Checkpointer(job="loop", socket=sidecar.socket, rank=0, world_size=1, slots=1, timeout=30) as ckpt:
        for step in range(2, 5):
            state["epoch"] = step
            with torch.no_grad():
                state["model"]["w"].add_(1)
            ckpt.save(step, state).wait(30)
            restored = ckpt.load(step, device_mesh=meshes)[1]
            assert restored["epoch"] == step
            assert torch.equal(restored["model"]["w"].to_local(), torch.arange(12.0).reshape(3, 4) + step - 1)


def local(value: torch.Tensor) -> torch.Tensor:
    return value.to_local() if isinstance(value, DTensor) else value


def test_a_load_into_dtensors_fills_their_shards_without_a_mesh_argument(start_sidecar, meshes):
    fsdp, grid = meshes
    original = sharded_state(fsdp, grid)
    sidecar = start_sidecar()
    with Checkpointer(job="dt", socket=sidecar.socket, rank=0, world_size=1, timeout=30) as ckpt:
        ckpt.save(1, original).wait(30)
        into = sharded_state(fsdp, grid)
        with torch.no_grad():
            for group in ("model", "optim"):
                for value in into[group].values():
                    local(value).zero_()
        step, restored = ckpt.load(into=into)
        assert step == 1
        for group in ("model", "optim"):
            for key, value in into[group].items():
                assert restored[group][key] is value, f"{group}.{key} came back as a new object"
                assert torch.equal(local(value), local(original[group][key])), f"{group}.{key}"
        assert restored["epoch"] == 3

        into["model"]["tp"] = distribute_tensor(torch.zeros(4, 6), grid, [Shard(1), Shard(0)])
        into["model"]["w"] = torch.zeros(3, 4)
        with pytest.raises(UnsupportedState, match=r"into\['model'\]\['w'\] is a tensor, where the checkpoint holds a "
                                                   r"DTensor; into\['model'\]\['tp'\] is a DTensor of shape \[4, 6\] "
                                                   r"placed \(Shard\(dim=1\), Shard\(dim=0\)\) over ranks \[\[0\]\], "
                                                   r"where the checkpoint holds one of shape \[4, 6\] placed "
                                                   r"\(Shard\(dim=0\), Shard\(dim=1\)\) over ranks \[\[0\]\]"):
            ckpt.load(into=into)
        assert not into["model"]["tp"].to_local().any() and not into["model"]["w"].any()


def test_dtensors_from_local_cannot_rebuild_are_refused_with_their_path(start_sidecar, meshes):
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, ShardOrderEntry, TensorMeta
    from torch.distributed.tensor.placement_types import _MaskPartial

    fsdp, grid = meshes
    sidecar = start_sidecar()
    masked = DTensor.from_local(torch.ones(2), fsdp, [_MaskPartial()], run_check=False)
    # Dimension 0 split over mesh dimension 1, then 0: torch records such an order only in the (private) spec.
    local = torch.arange(8.0).reshape(4, 2)
    reordered = DTensor(local, DTensorSpec(grid, (Shard(0), Shard(0)), TensorMeta(local.shape, local.stride(),
                        local.dtype), shard_order=(ShardOrderEntry(tensor_dim=0, mesh_dims=(1, 0)),)),
                        requires_grad=False)
    with Checkpointer(job="dt", socket=sidecar.socket, rank=0, world_size=1, timeout=30) as ckpt:
        with pytest.raises(UnsupportedState, match=r"DTensor at state\['emb'\] has placement .*full_tensor"):
            ckpt.save(1, {"emb": masked})
        with pytest.raises(UnsupportedState, match=r"DTensor at state\['w'\] shards one tensor dimension .* order"):
            ckpt.save(1, {"w": reordered})
        in_order = DTensor.from_local(local, grid, [Shard(0), Shard(0)], run_check=False)
        ckpt.save(1, {"emb": masked.full_tensor(), "w": in_order}).wait(30)


def test_read_checkpoint_gathers_each_dtensor_whole_without_a_sidecar(start_sidecar, storage, meshes):
    fsdp, grid = meshes
    state = sharded_state(fsdp, grid)
    with Checkpointer(job="dt", socket=start_sidecar().socket, rank=0, world_size=1, timeout=30) as ckpt:
        ckpt.save(1, state).wait(30)
        del state["optim"]["exp_avg"], state["model"]["strided"]  # a sum over ranks; an interleaving of them
        ckpt.save(2, state).wait(30)

    step, whole = read_checkpoint(storage / "dt")
    assert step == 2 and whole["epoch"] == 3
    weight = whole["model"]["w"]
    assert type(weight) is nn.Parameter and weight.requires_grad and whole["optim"]["tied"] is weight
    assert torch.equal(weight, torch.arange(12.0).reshape(3, 4))
    assert type(whole["model"]["tp"]) is torch.Tensor
    assert torch.equal(whole["model"]["tp"], state["model"]["tp"].full_tensor())
    with pytest.raises(UnsupportedState, match=r"placement .* cannot be gathered into a whole tensor: .*full_tensor"):
        read_checkpoint(storage / "dt", 1)


def test_read_checkpoint_into_plain_tensors_gathers_each_dtensor_straight_into_them(start_sidecar, storage, meshes):
    fsdp, grid = meshes
    state = sharded_state(fsdp, grid)
    with Checkpointer(job="dt", socket=start_sidecar().socket, rank=0, world_size=1, timeout=30) as ckpt:
        ckpt.save(1, state).wait(30)
        partial = state["optim"].pop("exp_avg")
        ckpt.save(2, state).wait(30)
    weight, tied = nn.Parameter(torch.zeros(3, 4)), torch.zeros(3, 4)
    into = {"model": {"w": weight, "frozen": torch.zeros(5, dtype=torch.bfloat16), "tp": torch.zeros(4, 6),
                      "strided": torch.zeros(2, 3)},
            "optim": {"tied": tied, "step": torch.zeros(())}}

    refusals = [
        (1, into, r"placement \{'p': 'avg'\} cannot be gathered into a whole tensor"),
        (2, {"model": {"w": state["model"]["w"]}}, r"into\['model'\]\['w'\] is a DTensor, where read_checkpoint "
                                                   r"gathers the stored DTensor whole: pass a plain tensor of its "
                                                   r"global shape \[3, 4\]"),
        (2, {**into, "model": {**into["model"], "tp": torch.zeros(4, 3)}},
         r"into\['model'\]\['tp'\] is torch.float32 of shape \[4, 3\], where the checkpoint holds a DTensor of "
         r"torch.float32 whose global shape is \[4, 6\]"),
    ]
    for step, given, message in refusals:
        with pytest.raises(UnsupportedState, match=message):
            read_checkpoint(storage / "dt", step, into=given)
        assert not weight.any() and not tied.any(), f"{message}: refused after writing"
    assert partial.placements[0].is_partial(), "the first step lost its Partial: the test lost its point"

    step, whole = read_checkpoint(storage / "dt", into=into)
    assert step == 2 and whole["epoch"] == 3
    assert whole["model"]["w"] is weight and whole["optim"]["tied"] is tied
    assert torch.equal(weight, torch.arange(12.0).reshape(3, 4)) and torch.equal(tied, weight)
    assert weight.requires_grad and weight.grad_fn is None
    for name in ("frozen", "tp", "strided"):
        assert whole["model"][name] is into["model"][name]
        assert torch.equal(into["model"][name], state["model"][name].full_tensor()), name
    assert whole["optim"]["step"] is into["optim"]["step"] and into["optim"]["step"].item() == 7.0


def test_read_checkpoint_refuses_what_it_cannot_read_with_what_to_do(start_sidecar, storage):
    with pytest.raises(ValueError, match=r"holds no committed checkpoint: pass a job's directory"):
        read_checkpoint(storage)
    with Checkpointer(job="plain", socket=start_sidecar().socket, rank=0, world_size=1, timeout=30) as ckpt:
        ckpt.save(4, {"w": torch.ones(3)}).wait(30)
    job = storage / "plain"
    assert torch.equal(read_checkpoint(job)[1]["w"], torch.ones(3))
    with pytest.raises(ValueError, match=r"step 5 is not a committed checkpoint .*; committed: 4"):
        read_checkpoint(job, 5)
    with pytest.raises(ValueError, match="rank 1 is not one of the 1 ranks of step 4"):
        read_checkpoint(job, rank=1)
    stored = job / "step-000000000004" / "rank-00000-of-00001.safetensors"
    data = bytearray(stored.read_bytes())
    data[-1] ^= 0x01
    stored.write_bytes(bytes(data))
    with pytest.raises(CheckpointCorrupt, match=r"rank-00000-of-00001.safetensors does not match the manifest"):
        read_checkpoint(job)


def finished(command: list[str]) -> subprocess.CompletedProcess[str]:
    job = subprocess.run(command, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"),
                         timeout=240)
    assert job.returncode == 0, job.stdout[-2000:] + job.stderr[-3000:]
    return job


def fsdp2_job(storage: Path, steps: int) -> subprocess.CompletedProcess[str]:
    return finished(local_job(storage, "fsdp2", 2, ROOT / "examples" / "train_fsdp2.py", "--steps", str(steps)))


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_an_fsdp2_job_stopped_and_resumed_ends_identical_to_an_uninterrupted_one(short_tmp):
    fsdp2_job(short_tmp / "straight", 8)
    first = fsdp2_job(short_tmp / "resumed", 4)
    assert "resumed" not in first.stdout
    second = fsdp2_job(short_tmp / "resumed", 8)
    assert "resumed from step 3; continuing at step 4" in second.stdout

    expected, actual = (rank_files(short_tmp / run / "fsdp2" / f"step-{7:012d}", 2) for run in ("straight", "resumed"))
    for rank, (want, got) in enumerate(zip(expected, actual, strict=True)):
        assert got["metadata"] == want["metadata"], f"rank {rank}: RNG or other non-tensor state differs"
        assert got["tensors"].keys() == want["tensors"].keys()
        for name, tensor in want["tensors"].items():
            assert torch.equal(got["tensors"][name], tensor), f"rank {rank}: {name} differs after the resume"
    # Each rank stored its own shard only: the 5 x 64 output layer splits 3 + 2 over the two ranks.
    assert [files["tensors"]["model.4.weight"].shape for files in actual] == [(3, 64), (2, 64)]

    # Read outside the job, each DTensor is whole: FSDP2 shards dimension 0, so the ranks' shards in order.
    step, whole = read_checkpoint(short_tmp / "resumed" / "fsdp2")
    assert step == 7
    for name, tensor in [*whole["model"].items(), *whole["optimizer"]["state"][4].items()]:
        stored = [files["tensors"].get(f"model.{name}", files["tensors"].get(f"optimizer.state.4.{name}"))
                  for files in actual]
        assert torch.equal(tensor, torch.cat(stored) if tensor.dim() else stored[0]), name
    assert whole["model"]["4.weight"].shape == (5, 64)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_fsdp2_over_tensor_parallelism_restores_in_the_job_and_reads_whole_outside_it(short_tmp):
    full_path = short_tmp / "full.pt"
    finished(local_job(short_tmp / "s", "tp", 4, Path(__file__).with_name("tensor_parallel_worker.py"),
                       str(full_path)))

    job = short_tmp / "s" / "tp"
    step, whole = read_checkpoint(job)
    assert step == 1
    full = torch.load(full_path)
    for name, expected in full.items():
        assert torch.equal(whole["model"][name], expected), f"{name} differs from the job's full_tensor()"
    # Into a model built whole: each rank's shards go straight into its tensors.
    into = {"model": {name: torch.zeros_like(expected) for name, expected in full.items()}}
    _, filled = read_checkpoint(job, into=into)
    for name, expected in full.items():
        assert filled["model"][name] is into["model"][name] and torch.equal(into["model"][name], expected), name
    stored = job / f"step-{1:012d}" / "rank-00003-of-00004.safetensors"
    data = bytearray(stored.read_bytes())
    data[-1] ^= 0x01
    stored.write_bytes(bytes(data))
    with pytest.raises(CheckpointCorrupt, match=r"rank-00003-of-00004.safetensors does not match the manifest.* "
                                                r"Tensors of into may have been written before this was found: "
                                                r"reload them"):
        read_checkpoint(job, into=into)
    tree = json.loads(rank_files(short_tmp / "s" / "tp" / f"step-{1:012d}", 4)[0]["metadata"]["stowaway.tree"])
    assert '"sf": 2' in json.dumps(tree), "no parameter was a _StridedShard: the test lost its point"
