"""Train a small MLP sharded with FSDP2, checkpointing every step; resume where it stopped.

    stowaway run --storage demo-out/fsdp2 -- torchrun --nproc-per-node 2 examples/train_fsdp2.py --steps 20

Each rank saves its own shards: the model's and the optimizer's states are
DTensors, stored as this rank's local shard with their placements. ``load``
writes the model's shards straight into its parameters (``into``), and
rebuilds the optimizer's, which do not exist before its first step, on the
mesh passed as ``device_mesh``, the one given to ``fully_shard``. Run it
again with more ``--steps`` and it continues from the last committed step;
on CPUs (gloo, the default) exactly as an uninterrupted run would.
``--device cuda`` runs it on GPUs (NCCL), where kernels need not be
deterministic.
"""

from __future__ import annotations

import argparse
import os
import random

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from stowaway import Checkpointer

WIDTH, CLASSES = 64, 5  # 5 classes: the last layer's shards differ in size on 2 ranks, as a vocabulary's often do


def build_model(mesh: object) -> nn.Module:
    torch.manual_seed(1234)  # the same initial weights on every rank, before sharding
    model = nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH), nn.LayerNorm(WIDTH),
                          nn.Linear(WIDTH, CLASSES))
    for layer in (model[0], model[2], model[4]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def training_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    return {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "rng": {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()},
    }


def restore(model: nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> None:
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    torch.set_rng_state(state["rng"]["torch"])
    np.random.set_state(state["rng"]["numpy"])
    random.setstate(state["rng"]["python"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    args = parser.parse_args()

    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    rank = dist.get_rank()
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    mesh = init_device_mesh(args.device, (dist.get_world_size(),), mesh_dim_names=("fsdp",))
    model = build_model(mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    torch.manual_seed(99 + rank)
    np.random.seed(99 + rank)
    random.seed(99 + rank)

    with Checkpointer() as ckpt:
        # The model's state is loaded into its own parameters, so it is never held twice on the device.
        restored = ckpt.load(map_location=args.device, device_mesh=mesh, into={"model": model.state_dict()})
        start = 0
        if restored is not None:
            step, state = restored
            restore(model, optimizer, state)
            start = step + 1
            if rank == 0:
                print(f"resumed from step {step}; continuing at step {start}", flush=True)
        handles = []
        for step in range(start, args.steps):
            # Draws from all three host RNGs, which the checkpoint holds: a resume is bit-identical only if all
            # three are restored. Drawn on the host, then moved to the device.
            inputs = (torch.randn(16, WIDTH) + random.random() + float(np.random.rand())).to(args.device)
            labels = (inputs.sum(dim=1) > 0).long() + 2
            loss = nn.functional.cross_entropy(model(inputs), labels)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            handles.append(ckpt.save(step, training_state(model, optimizer)))
            if rank == 0 and (step % 10 == 0 or step == args.steps - 1):
                print(f"step {step:4d}  loss {loss.item():.6f}", flush=True)
        for handle in handles:
            handle.wait()
        if rank == 0 and handles:
            print(f"committed steps {handles[0].step}..{handles[-1].step}", flush=True)
    del model, optimizer
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
