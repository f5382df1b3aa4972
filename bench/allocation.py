"""``python -m bench.allocation``: what allocating memory costs Stowaway, against touching as much fresh memory.

A quick probe for deciding about slot allocation and restores into new
tensors, on one rank and without torchrun, DCP or DLRover: each repetition
starts a sidecar of its own and measures, in this one process,

- the first-touch reference (``bench.first_touch``) for the state's bytes,
  the cold first save, ``reserve(state, wait=True)`` with the first slot
  left by a checkpointer before (as the full harness measures it) and with
  no slot at all;
- with three slots, the saves made while the spares are still being
  allocated in the background (each after the previous commit, so none
  needs a spare), against steady saves once they are allocated;
- restores from memory into new tensors, each paired with the copy-out
  reference on a fresh heap;
- restores from storage into new tensors (the step no longer in the slot,
  and in a new pod, with no slot at all), each paired with ``torch.load`` of
  the same state, both with the files dropped from the page cache.

Each restore takes turns with its reference in going first
(``worker.in_turn``): on this VM the first of two fresh-memory measurements
in a row often pays more.

Medians and ratios of medians are printed; the full harness (``python -m
bench``) stays the place for recorded results.
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from bench import first_touch, references, state, system, worker
from stowaway import Checkpointer
from stowaway.cli import run_cmd
from stowaway.client.ledger import SlotState

Results = dict[str, list[float]]


@contextmanager
def sidecar(storage: Path | None = None) -> Iterator[tuple[Path, Path]]:
    """A sidecar of its own, with its own shared memory and storage (or ``storage``); yields its socket and
    its storage."""
    dirs = [Path(tempfile.mkdtemp(prefix="stwa-", dir=parent)) for parent in ("/tmp", "/dev/shm", "/var/tmp")]
    socket_path = dirs[0] / "s.sock"
    process = subprocess.Popen(
        [sys.executable, "-m", "stowaway", "sidecar", "--storage", str(storage or dirs[2]), "--socket",
         str(socket_path), "--shm-dir", str(dirs[1]), "--keep-last", "3", "--log-level", "WARNING"],
        start_new_session=True,
    )
    try:
        run_cmd.wait_for_socket(process, socket_path)
        yield socket_path, storage or dirs[2]
    finally:
        run_cmd.stop_sidecar(process, 60)
        for directory in dirs:
            shutil.rmtree(directory, ignore_errors=True)


def timed(results: Results, name: str, action: Callable[[], Any]) -> None:
    gc.collect()
    system.release_free_heap()
    started = time.perf_counter()
    action()
    results.setdefault(name, []).append(time.perf_counter() - started)


def measure_slots(results: Results, training: dict[str, Any], socket_path: Path, job: str) -> None:
    nbytes = state.nbytes_of(training)

    def checkpointer(name: str, slots: int) -> Checkpointer:
        return Checkpointer(job=name, socket=socket_path, rank=0, world_size=1, slots=slots, timeout=600)

    timed(results, "reference.first_touch", lambda: first_touch.touch(nbytes))
    with checkpointer(job, 1) as ckpt:
        timed(results, "save.first", lambda: ckpt.save(0, training))
    with checkpointer(job, 2) as ckpt:
        timed(results, "reserve.first_slot_left_before", lambda: ckpt.reserve(training, wait=True))
    with checkpointer(f"{job}-new", 2) as ckpt:
        timed(results, "reserve.no_slot_yet", lambda: ckpt.reserve(training, wait=True))
    with checkpointer(f"{job}-spares", 3) as ckpt:
        ckpt.save(0, training).wait()  # its persist starts allocating the two spares
        for step in range(1, 6):
            if SlotState.ALLOCATING not in ckpt._ledger.states():
                break
            handle = ckpt.save(step, training)
            if SlotState.ALLOCATING in ckpt._ledger.states():  # still allocating when the save returned
                results.setdefault("save.while_spares_allocate", []).append(handle.blocking_seconds)
            handle.wait()
        ckpt._slots.join_spares()
        for step in range(10, 13):
            handle = ckpt.save(step, training)
            results.setdefault("save.steady", []).append(handle.blocking_seconds)
            handle.wait()


def measure_restores(results: Results, training: dict[str, Any], socket_path: Path, job: str, reps: int) -> None:
    sources = state.tensors(training)
    buffer = references.ResidentBuffer(Path(f"/dev/shm/stwa-ref-{os.getpid()}"),
                                       sum(tensor.numel() * tensor.element_size() + 8 for tensor in sources))
    try:
        views = buffer.views(sources)
        references.copy_into(views, sources)
        with Checkpointer(job=f"{job}-restore", socket=socket_path, rank=0, world_size=1, slots=1,
                          timeout=600) as ckpt:
            ckpt.save(0, training).wait()
            for rep in range(reps):
                worker.in_turn(rep, lambda: timed(results, "restore.memory", ckpt.load),
                               lambda: timed(results, "reference.copy_out_fresh",
                                             lambda: references.copy_out_fresh(views, torch.device("cpu"))))
    finally:
        buffer.close()


def measure_storage_restores(results: Results, training: dict[str, Any], socket_path: Path, storage: Path,
                             job: str, reps: int) -> None:
    """Restores from storage into new tensors, each paired with ``torch.load`` of the same state, cold cache.

    Two kinds, as the harness measures the first: a checkpointer whose one slot holds a newer step (saved
    before each load, which reads the step before), and a new pod's (a sidecar of its own on the same
    storage, with empty shared memory).
    """
    reference = storage / "torch-save.pt"
    torch.save(training, reference)

    def dropped_from_cache() -> None:
        for path in storage.rglob("*"):
            if path.is_file():
                worker.sync_and_drop(path)

    with Checkpointer(job=f"{job}-storage", socket=socket_path, rank=0, world_size=1, slots=1,
                      timeout=600) as ckpt:
        ckpt.save(0, training).wait()
        for rep in range(reps):
            ckpt.save(1 + rep, training).wait()

            def restore(rep: int = rep) -> None:
                dropped_from_cache()
                timed(results, "restore.storage", lambda: ckpt.load(step=rep))
                assert ckpt.last_restore is not None and ckpt.last_restore.source == "storage", ckpt.last_restore

            def torch_load() -> None:
                dropped_from_cache()
                timed(results, "reference.torch_load", lambda: torch.load(reference, weights_only=True))

            worker.in_turn(rep, restore, torch_load)
    for _ in range(reps):
        with sidecar(storage) as (new_socket, _), Checkpointer(job=f"{job}-storage", socket=new_socket, rank=0,
                                                                world_size=1, slots=1, timeout=600) as fresh:
            dropped_from_cache()
            timed(results, "restore.storage_new_pod", fresh.load)
            assert fresh.last_restore is not None and fresh.last_restore.source == "storage", fresh.last_restore
        dropped_from_cache()
        timed(results, "reference.torch_load", lambda: torch.load(reference, weights_only=True))
    reference.unlink()


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.allocation", description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=1024, help="state size in MiB")
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    training = state.build(args.mib * 2**20, seed=0)
    results: Results = {}
    for rep in range(args.reps):
        with sidecar() as (socket_path, _):
            measure_slots(results, training, socket_path, f"alloc{rep}")
    with sidecar() as (socket_path, storage):
        measure_restores(results, training, socket_path, "alloc", args.reps)
        measure_storage_restores(results, training, socket_path, storage, "alloc", args.reps)
    medians = {name: statistics.median(values) for name, values in results.items()}
    for name, values in results.items():
        print(f"{name:34s} median {medians[name] * 1e3:8.1f} ms  ({', '.join(f'{v * 1e3:.0f}' for v in values)})")
    ratios = [("reserve(wait=True), first slot left before / first touch", "reserve.first_slot_left_before",
               "reference.first_touch"),
              ("reserve(wait=True), no slot yet / first touch", "reserve.no_slot_yet", "reference.first_touch"),
              ("cold first save / first touch", "save.first", "reference.first_touch"),
              ("save while spares allocate / steady save", "save.while_spares_allocate", "save.steady"),
              ("restore from memory / copy-out", "restore.memory", "reference.copy_out_fresh"),
              ("restore from storage / torch.load, cold cache", "restore.storage", "reference.torch_load"),
              ("restore from storage in a new pod / torch.load, cold cache", "restore.storage_new_pod",
               "reference.torch_load")]
    for label, numerator, denominator in ratios:
        if numerator in medians:
            print(f"{label}: {medians[numerator] / medians[denominator]:.2f}")
    if "save.while_spares_allocate" in results:
        print(f"longest save while spares allocate / steady save: "
              f"{max(results['save.while_spares_allocate']) / medians['save.steady']:.2f}")


if __name__ == "__main__":
    main()
