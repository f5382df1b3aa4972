"""One rank of an FSDP2 (or DDP, 2-D FSDP x TP, HSDP) job that saves on one world size and loads on another.

    reshard_worker.py save|load|load_into <out dir> <layout> [<step load() must return>]

``layout`` is ``fsdp``, ``ddp``, ``2d:<dp>x<tp>`` (FSDP over tensor parallelism) or
``hsdp:<replicas>x<shards>``. ``save`` trains two steps and saves steps 1 and 2; the load modes restore
the newest step they can (``load`` onto the mesh, ``load_into`` into the model's and optimizer's own
tensors) and train one more step. Each writes, from rank 0, the full parameters and optimizer states it
saved or restored to ``<out>/<mode>.pt``, and every rank its ``last_restore`` to ``<out>/<mode>-<rank>.json``.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from stowaway import Checkpointer


def built(layout: str, world: int) -> tuple[nn.Module, object]:
    torch.manual_seed(0)
    # 640 rows: 4 ranks hold 160 each, 3 ranks 214 + 214 + 212; 256 KiB per shard of the first weight on 4 ranks.
    model = nn.Sequential(nn.Linear(400, 640), nn.ReLU(), nn.Linear(640, 7))
    if layout == "ddp":
        return model, None
    if layout.startswith("2d:"):
        dp, tp = (int(size) for size in layout[3:].split("x"))
        mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
        parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
        fully_shard(model, mesh=mesh["dp"])
        return model, mesh
    if layout.startswith("hsdp:"):
        replicas, shards = (int(size) for size in layout[5:].split("x"))
        mesh = init_device_mesh("cpu", (replicas, shards), mesh_dim_names=("replicate", "shard"))
        fully_shard(model, mesh=mesh)  # placements (Replicate(), Shard(0))
        return model, mesh
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",))
    fully_shard(model, mesh=mesh)
    return model, mesh


def trained_step(model: nn.Module, optimizer: torch.optim.Optimizer, seed: int) -> None:
    torch.manual_seed(seed)
    model(torch.randn(4, 400)).sum().backward()
    optimizer.step()
    optimizer.zero_grad()


def full(value: object) -> object:
    # Cloned: a full_tensor() that needs no communication shares the memory that the next step changes.
    return (value.full_tensor() if isinstance(value, DTensor) else value).clone()


def gathered(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    state = optimizer.state_dict()["state"]
    return {"model": {name: full(tensor) for name, tensor in model.state_dict().items()},
            "optimizer": {index: {key: full(value) for key, value in entries.items()}
                          for index, entries in state.items()}}


def train(ckpt: Checkpointer, model: nn.Module, optimizer: torch.optim.Optimizer, mesh: object, out: Path,
          steps: int, killed_after: int) -> None:
    """Train to ``steps``, saving each step, from where the newest committed step left off; the last rank
    kills itself once step ``killed_after`` is committed, taking the job down as a lost node would."""
    restored = ckpt.load(device_mesh=mesh)
    start = 0
    if restored is not None:
        step, state = restored
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start = step + 1
    rank = dist.get_rank()
    (out / f"train-{rank}.json").write_text(json.dumps({"start": start, "world": dist.get_world_size()}))
    for step in range(start, steps):
        trained_step(model, optimizer, step)
        ckpt.save(step, {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "epoch": 5}).wait()
        if step == killed_after and rank == dist.get_world_size() - 1:
            os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    mode, out, layout = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
    expected = int(sys.argv[4]) if len(sys.argv) > 4 else 2
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model, mesh = built(layout, world)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    with Checkpointer() as ckpt:
        if mode == "train":
            train(ckpt, model, optimizer, mesh, out, int(sys.argv[4]), int(sys.argv[5]))
            dist.destroy_process_group()
            return
        if mode == "save":
            for step in (1, 2):
                trained_step(model, optimizer, step)
                ckpt.save(step, {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "epoch": 5}).wait()
        elif mode == "load":
            step, state = ckpt.load(device_mesh=mesh)
            assert step == expected and state["epoch"] == 5, step
            model.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
        else:
            trained_step(model, optimizer, 99)  # the optimizer's state exists from its first step on
            # The parameters themselves (they require grad), not the detached tensors of state_dict().
            into = {"model": dict(model.named_parameters()), "optimizer": optimizer.state_dict()}
            step, state = ckpt.load(into=into)
            assert step == expected and state["model"]["0.weight"] is into["model"]["0.weight"], step
            optimizer.load_state_dict(state["optimizer"])
        restore = ckpt.last_restore
        (out / f"{mode}-{rank}.json").write_text(json.dumps(
            None if restore is None else {"saved_by": restore.saved_by, "bytes_read": restore.bytes_read,
                                          "source": restore.source}))
    whole = gathered(model, optimizer)
    if mode != "save":
        trained_step(model, optimizer, 3)
    if rank == 0:
        torch.save(whole, out / f"{mode}.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # Everything is written and the process group destroyed. At interpreter exit, a rank of the save job was
    # aborted twice in many runs by a C++ destructor ("terminate called without an active exception"): leave
    # without running them, so that the test judges the restore, not torch's teardown.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
