"""``python -m bench.training_step``: what a save costs a real training step, blocking and overlapped.

One process trains a model (an MLP and its Adam optimizer, sized to hold
``--size`` bytes of checkpointed state on ``--device``) next to a sidecar of
its own, and times, in the same run and interleaved repetition by
repetition so that all see the same machine:

1. a step with no checkpoint;
2. ``save(step, state)``, then the step (the save's own time is recorded
   too: on a GPU, the device-to-host copy into the pinned slot);
3. ``save(step, state, overlap=True)``, then the step, with
   ``Checkpointer.guard(optimizer)``: the copy runs during the forward and
   backward passes, and the optimizer's step waits for it;
4. the physical reference: the same tensors copied into pinned shared
   memory with non-blocking copies (on the CPU, a plain ``copy_`` into
   resident shared memory, as ``python -m bench`` measures).

Each timed span starts and ends with a device synchronize, so nothing still
queued escapes the clock; a save's commit is waited for outside it. The
targets (``report.STEP_TARGETS``): the overlapped step within 5% of a step
without a save, and the blocking save within 1.25x of the reference (its
copy at 80% of the reference's speed or better). The CPU run at a tiny size
is what the test suite runs (tests/benchmarks/test_training_step.py); the
GPU run is ``hack/gpu-check``'s.
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bench import __main__ as harness
from bench import references, report, state
from stowaway import Checkpointer
from stowaway.cli import run_cmd

# Checkpointed bytes per parameter: the fp32 weight and Adam's two fp32 moments.
STATE_BYTES_PER_PARAMETER = 4 + 4 + 4


class Training:
    """An MLP of ``layers`` square layers and its Adam optimizer, past a first step (the optimizer has its state)."""

    def __init__(self, nbytes: int, width: int, batch: int, device: torch.device) -> None:
        self.device = device
        self.layers = max(2, round(nbytes / STATE_BYTES_PER_PARAMETER / (width * width + width)))
        torch.manual_seed(0)
        blocks: list[torch.nn.Module] = []
        for _ in range(self.layers):
            blocks += [torch.nn.Linear(width, width, device=device), torch.nn.ReLU()]
        self.model = torch.nn.Sequential(*blocks[:-1])
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=1e-4)
        self.inputs = torch.randn(batch, width, device=device)
        self.step()

    def step(self) -> None:
        """Forward, backward and the optimizer's step: the parameters change only in the last."""
        self.optimizer.zero_grad(set_to_none=True)
        self.model(self.inputs).square().mean().backward()
        self.optimizer.step()

    def state(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "optim": self.optimizer.state_dict()}

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def measure(training: Training, ckpt: Checkpointer, reference: Callable[[], None], reps: int) -> dict[str, list[float]]:
    """Every measurement ``reps`` times, one repetition of each after the other, after one that is not recorded.

    The first repetition pays what only the first time costs (the copy
    stream's creation, the first overlapped save's copy thread, lazy
    initialisation in the libraries), which no steady step pays.
    """
    seconds: dict[str, list[float]] = {}
    warming = True

    def record(name: str, value: float) -> None:
        if not warming:
            seconds.setdefault(name, []).append(value)

    def timed(action: Callable[[], Any]) -> tuple[Any, float]:
        training.sync()
        started = time.perf_counter()
        result = action()
        training.sync()
        return result, time.perf_counter() - started

    step = 0
    for rep in range(reps + 1):
        warming = rep == 0
        _, plain = timed(training.step)
        record("step.no_save", plain)

        step += 1
        training.sync()
        started = time.perf_counter()
        handle = ckpt.save(step, training.state())
        record("save.blocking", time.perf_counter() - started)  # on a GPU, save() returns once the copy is done
        training.step()
        training.sync()
        record("step.blocking_save", time.perf_counter() - started)
        handle.wait()

        step += 1
        training.sync()
        started = time.perf_counter()
        handle = ckpt.save(step, training.state(), overlap=True)
        training.step()  # the guard makes its optimizer step wait for the copy
        training.sync()
        record("step.overlapped_save", time.perf_counter() - started)
        handle.wait()
        record("save.overlapped.staging", ckpt.staging_seconds[-1])

        _, copied = timed(reference)
        record("reference.copy_pinned" if training.device.type == "cuda" else "reference.copy", copied)
    return seconds


def run(args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True  # what a real fp32 job on a recent GPU runs with
    workdir = Path(tempfile.mkdtemp(prefix="stws-", dir="/tmp"))
    shm_dir = Path(tempfile.mkdtemp(prefix="stowaway-step-", dir="/dev/shm"))
    socket_path = workdir / "s.sock"
    sidecar = subprocess.Popen(
        [sys.executable, "-m", "stowaway", "sidecar", "--storage", str(args.storage), "--socket", str(socket_path),
         "--shm-dir", str(shm_dir), "--keep-last", "2", "--log-level", "WARNING"],
        start_new_session=True,
    )
    buffer = None
    try:
        run_cmd.wait_for_socket(sidecar, socket_path)
        training = Training(args.size, args.width, args.batch, device)
        sources = state.tensors(training.state())
        padded = sum(tensor.numel() * tensor.element_size() + 8 for tensor in sources)
        buffer = references.ResidentBuffer(shm_dir / "reference", padded)
        views = buffer.views(sources)
        with Checkpointer(job="training-step", socket=socket_path, rank=0, world_size=1, slots=1,
                          timeout=1800) as ckpt:
            ckpt.reserve(training.state(), wait=True)
            ckpt.guard(training.optimizer)
            if device.type == "cuda":
                with buffer.registered_with_cuda():
                    seconds = measure(training, ckpt, lambda: references.copy_into_pinned(views, sources), args.reps)
            else:
                seconds = measure(training, ckpt, lambda: references.copy_into(views, sources), args.reps)
            stall = sum(ckpt.stall_seconds)
        return {
            "device": str(device), "bytes": sum(t.numel() * t.element_size() for t in sources),
            "device_peak_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
            "width": args.width, "layers": training.layers, "batch": args.batch,
            "stall_seconds_total": stall, "seconds": seconds,
        }
    finally:
        if buffer is not None:
            buffer.close()
        run_cmd.stop_sidecar(sidecar, 60)
        shutil.rmtree(shm_dir, ignore_errors=True)
        shutil.rmtree(workdir, ignore_errors=True)
        shutil.rmtree(args.storage, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.training_step", description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    parser.add_argument("--size", default="4G", help="checkpointed state (weights and Adam's moments), e.g. 4G")
    parser.add_argument("--width", type=int, default=8192, help="features of each square layer")
    parser.add_argument("--batch", type=int, default=32768,
                        help="rows per step: enough that the forward and backward passes outlast the copy")
    parser.add_argument("--reps", type=int, default=5, help="repetitions of each measurement")
    parser.add_argument("--storage", type=Path, default=Path("/var/tmp/stowaway-training-step"),
                        help="durable storage for the sidecar (emptied afterwards)")
    parser.add_argument("--out", type=Path, default=None, help="directory for results.json and results.md")
    args = parser.parse_args()
    args.size = report.parse_size(args.size)
    if args.device == "cuda":
        harness.require_cuda(parser)
    if args.storage.exists() and any(args.storage.iterdir()):
        parser.error(f"--storage {args.storage} is not empty; the benchmark deletes what it writes there")
    result = run(args)
    command = shlex.join(["python", "-m", "bench.training_step", *sys.argv[1:]])
    text = report.step_markdown(result, command, harness.machine(args.device, dlrover=False))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.json").write_text(json.dumps(result, indent=1))
        (args.out / "results.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
