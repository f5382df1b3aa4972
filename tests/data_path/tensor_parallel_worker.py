"""One rank of a 4-rank job training a model sharded by FSDP2 over tensor parallelism (a 2 x 2 mesh).

Its parameters are DTensors placed (_StridedShard(0), Shard(0)) or (Shard(0), Replicate()).
It saves step 1, checks that load() rebuilds every DTensor as it was, and rank 0 writes
each parameter's full_tensor() to argv[1] for the test to compare with read_checkpoint.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from stowaway import Checkpointer


def main() -> None:
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 10), nn.ReLU(), nn.Linear(10, 7))  # 7: uneven over tp
    parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    fully_shard(model, mesh=mesh["dp"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(3, 6)).sum().backward()
    optimizer.step()
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
    full = {name: tensor.full_tensor() for name, tensor in state["model"].items()}
    with Checkpointer() as ckpt:
        ckpt.save(1, state).wait()
        step, restored = ckpt.load(device_mesh=mesh)
    assert step == 1
    for name, saved in state["model"].items():
        got = restored["model"][name]
        assert got.placements == saved.placements and got.shape == saved.shape, name
        assert torch.equal(got.to_local(), saved.to_local()), name
    if dist.get_rank() == 0:
        torch.save(full, sys.argv[1])
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
