"""Train a small transformer with Stowaway checkpoints every step; resume where it stopped.

Run it through the local launcher (see the README):

    stowaway run --storage demo-out/checkpoints -- torchrun --nproc-per-node 2 examples/train.py

Interrupt it and run it again: it resumes at the next step with parameters,
optimizer, LR scheduler and RNG states exactly as an uninterrupted run has them.
``--fingerprints`` prints a digest of the model after every step, so two runs
can be compared step by step; ``--pace`` stands in for the compute of a bigger
model, leaving time to watch a run or interrupt it (examples/kubernetes/).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import random
import statistics
import time

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from stowaway import Checkpointer

VOCAB, CONTEXT = 256, 32


class TinyLM(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, width)
        layer = nn.TransformerEncoderLayer(width, nhead=4, dim_feedforward=4 * width, dropout=0.1, batch_first=True)
        self.body = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        self.head = nn.Linear(width, VOCAB, bias=False)
        self.head.weight = self.embed.weight  # tied: stored once, restored as one tensor
        nn.init.normal_(self.embed.weight, std=0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.embed(tokens)))


def training_state(model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: object) -> dict:
    return {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),  # type: ignore[attr-defined]
        "rng": {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()},
    }


def restore(model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: object, state: dict) -> None:
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])  # type: ignore[attr-defined]
    torch.set_rng_state(state["rng"]["torch"])
    np.random.set_state(state["rng"]["numpy"])
    random.setstate(state["rng"]["python"])


def fingerprint(model: nn.Module) -> str:
    """A digest of every parameter's bytes: equal only when the models are bit-identical."""
    digest = hashlib.sha256()
    for name, value in sorted(model.state_dict().items()):
        digest.update(name.encode())
        digest.update(value.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:16]


def batch() -> torch.Tensor:
    """Draws from all three RNGs, so a resume is bit-identical only if all three are restored."""
    offset = random.randrange(VOCAB) + int(np.random.randint(VOCAB))
    return (torch.randint(0, VOCAB, (8, CONTEXT + 1)) + offset) % VOCAB


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--width", type=int, default=64,
                        help="the model's width, a multiple of 4: checkpoints grow with its square")
    parser.add_argument("--pace", type=float, default=0.0, metavar="SECONDS",
                        help="wait this long after each step, as a bigger model's compute would")
    parser.add_argument("--fingerprints", action="store_true",
                        help="print the loss and a digest of the model after every step (rank 0)")
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(1234 + rank)
    np.random.seed(1234 + rank)
    random.seed(1234 + rank)
    torch.use_deterministic_algorithms(True)

    model = nn.parallel.DistributedDataParallel(TinyLM(args.width))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    warmup = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.1, total_iters=5)
    cosine = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=max(args.steps, 1))
    scheduler = torch.optim.lr_scheduler.SequentialLR(optimizer, [warmup, cosine], milestones=[5])

    with Checkpointer() as ckpt:
        # Into the model's own parameters: the restore does not hold a second copy of the model.
        restored = ckpt.load(into={"model": model.module.state_dict()})
        start = 0
        if restored is not None:
            step, state = restored
            restore(model.module, optimizer, scheduler, state)
            start = step + 1
            if rank == 0:
                print(f"resumed from step {step}; continuing at step {start}", flush=True)
        handles = []
        for step in range(start, args.steps):
            tokens = batch()
            logits = model(tokens[:, :-1])
            loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            scheduler.step()
            handles.append(ckpt.save(step, training_state(model.module, optimizer, scheduler)))
            if rank == 0 and args.fingerprints:
                print(f"step {step:4d}  loss {loss.item()!r}  model {fingerprint(model.module)}", flush=True)
            elif rank == 0 and (step % 10 == 0 or step == args.steps - 1):
                print(f"step {step:4d}  loss {loss.item():.4f}", flush=True)
            time.sleep(args.pace)
        committed = []
        for handle in handles:
            handle.wait()
            committed.append(handle.step)
        report(ckpt.blocking_seconds, committed, rank)
    # Every rank leaves the group together: gloo aborts a process whose peer closes the
    # connection while it is still tearing its own side down.
    del model
    dist.barrier()
    dist.destroy_process_group()


def report(blocking: list[float], committed: list[int], rank: int) -> None:
    gathered: list[list[float]] = [[] for _ in range(dist.get_world_size())]
    dist.all_gather_object(gathered, blocking)
    if rank != 0 or not committed:
        return
    every = sorted(value for values in gathered for value in values)
    quantiles = statistics.quantiles(every, n=100) if len(every) > 1 else every * 99
    print(
        f"saves: {len(every)} across {len(gathered)} ranks; blocking time p50 {quantiles[49] * 1e3:.2f} ms, "
        f"p99 {quantiles[98] * 1e3:.2f} ms; committed steps {committed[0]}..{committed[-1]}; "
        f"files under {os.environ.get('STOWAWAY_STORAGE', 'the sidecar storage')}",
        flush=True,
    )


if __name__ == "__main__":
    main()
