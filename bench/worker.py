"""One benchmark configuration, run by every rank under torchrun.

Every measurement starts after a barrier and is reported as the slowest
rank's time, because a job waits for its slowest rank. A run measures one
phase (``--phase``): the pooled spare; Stowaway, each measurement paired with
its physical references, then the peers torch.save and DCP, in the same
processes on the same tensors and storage; or DLRover
(``bench.dlrover_peer``). ``python -m bench`` runs the phases one after
another, each in ranks of its own that build the same tensors, so that no
phase's memory is still held under the next. With ``--device cuda`` the state lives on the GPU
and every restore goes back onto it; each timed action ends with a device
synchronize, so no copy still in flight escapes the clock.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import mmap
import os
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from bench import first_touch, references, state, system
from stowaway import Checkpointer

Results = dict[str, list[float]]
MAPPING_BYTES = 64 * 2**20
# A rank's private memory moves with whole tensors and buffers; sampled less often than the
# harness samples the sidecar, so that the sampling thread takes little from the saves it measures.
PRIVATE_SAMPLE_SECONDS = 0.01
# The pooled spare, then Stowaway with the references, torch.save and DCP, then DLRover.
PHASES = ("pooled", "stowaway", "dlrover")


class Run:
    def __init__(self, reps: int, scratch: Path, device: torch.device) -> None:
        self.reps = reps
        self.scratch = scratch
        self.device = device
        self.rank = dist.get_rank()
        self.results: Results = {}

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def slowest(self, seconds: float) -> float:
        return across_ranks(seconds, dist.ReduceOp.MAX)

    def record(self, name: str, seconds: float) -> None:
        self.results.setdefault(name, []).append(self.slowest(seconds))

    def record_cpu(self, name: str, seconds: float) -> None:
        """A CPU time: the slowest rank's as ``name.cpu``, and all ranks' together as ``name.cpu_all``.

        All ranks' CPU time over the machine's cores is the least wall time
        the measurement could take on it; the report sets each against it.
        """
        self.record(f"{name}.cpu", seconds)
        self.results.setdefault(f"{name}.cpu_all", []).append(across_ranks(seconds, dist.ReduceOp.SUM))

    def start(self, fresh_heap: bool = False) -> float:
        """Line every rank up for a measurement with no collection due, and return its start time.

        A full collection of the cyclic garbage collector walks the whole
        process, 0.25-0.7 s here on 8 ranks, whenever enough objects have
        survived since the last; it used to land in whichever measurement
        was running, Stowaway's or a peer's. Collecting first (``timeit``
        goes further and turns the collector off) leaves each measurement
        only the collections its own allocations start.
        """
        gc.collect()
        if fresh_heap:
            system.release_free_heap()
        dist.barrier()
        return time.perf_counter()

    def timed(self, name: str, action: Callable[[], Any], fresh_heap: bool = False, cpu: bool = False) -> Any:
        """Time ``action`` on every rank; with ``cpu``, also record its CPU time (``record_cpu``).

        CPU time tells a save or restore bound by per-tensor work from one
        bound by memory, which matters most where ranks outnumber the cores.
        """
        started, cpu_started = self.start(fresh_heap), time.process_time()
        result = action()
        self.sync()
        wall, cpu_time = time.perf_counter() - started, time.process_time() - cpu_started
        self.record(name, wall)
        if cpu:
            self.record_cpu(name, cpu_time)
        return result


def across_ranks(value: float, op: dist.ReduceOp) -> float:
    """``value`` reduced with ``op`` over every rank, each getting the result."""
    reduced = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(reduced, op=op)
    return float(reduced.item())


@contextlib.contextmanager
def ranks_private_peak(extra: dict[str, Any], key: str) -> Iterator[None]:
    """The ranks' private memory (RssAnon) at its peak during the block, summed over the ranks, as ``extra[key]``.

    Issue 23 counts a save phase's footprint as the ranks' private memory
    plus shared memory: the state itself, and whatever a checkpointer keeps
    in the rank beside it, count alongside its shared memory. Each rank's own
    peak is summed, so the sum may exceed the ranks' peak at any one moment,
    for Stowaway and DLRover alike.
    """
    peak = system.Peak(lambda: system.status_bytes("self", "RssAnon"), PRIVATE_SAMPLE_SECONDS)
    yield
    extra[key] = across_ranks(peak.stop(), dist.ReduceOp.SUM)


def measure_stowaway_and_references(run: Run, training: dict[str, Any], extra: dict[str, Any]) -> None:
    """Stowaway, each repetition paired with its physical references.

    A reference runs right after the Stowaway measurement it bounds, so both
    see the same machine. Measured in separate passes, they drifted apart: in
    one run the copy reference at 4 GiB on 8 ranks went from 947 to 703 ms
    within its pass, while Stowaway's saves before it did not.
    """
    sources = state.tensors(training)
    padded = sum(tensor.numel() * tensor.element_size() + 8 for tensor in sources)
    buffer = references.ResidentBuffer(Path(f"/dev/shm/stw-bench-ref-{run.rank}"), padded)
    target = run.scratch / f"ref-{run.rank}.bin"
    torch_file = run.scratch / f"torch-{run.rank}.pt"
    views = buffer.views(sources)

    def copy_and_write() -> None:
        run.timed("reference.copy", lambda: references.copy_into(views, sources), cpu=True)
        if run.device.type == "cuda":
            with buffer.registered_with_cuda():
                run.timed("reference.copy_pinned", lambda: references.copy_into_pinned(views, sources))
        for name, direct in (("reference.write_buffered", False), ("reference.write_direct", True)):
            run.timed(name, lambda direct=direct: references.write_file(buffer, target, direct))

    try:
        with Checkpointer(slots=1, timeout=1800) as ckpt:
            _measure_saves(run, ckpt, training, extra, after_each_steady=copy_and_write)

            def restore_from_memory() -> None:
                restored = run.timed("stowaway.restore.memory", lambda: ckpt.load(map_location=run.device),
                                     fresh_heap=True, cpu=True)
                assert restored is not None and restored[0] == run.reps, f"restored {restored and restored[0]}"

            def copy_out() -> None:
                run.timed("reference.copy_out_fresh", lambda: references.copy_out_fresh(views, run.device),
                          fresh_heap=True, cpu=True)

            for rep in range(run.reps):
                in_turn(rep, restore_from_memory, copy_out)
            for _ in range(run.reps):
                # Into the state's own tensors, resident since the saves: what a resume of a model that is
                # already built does, with no allocation, and no page fault to pay.
                restored = run.timed("stowaway.restore.memory_into", lambda: ckpt.load(into=training), cpu=True)
                assert restored is not None and restored[0] == run.reps, f"restored {restored and restored[0]}"
                del restored
                run.timed("reference.copy_back", lambda: references.copy_into(sources, views), cpu=True)
            # torch.load takes turns with the restore from storage it bounds, under the same resident memory: at
            # 4 GiB the state, the slots and the reference buffer hold 16 GiB of this VM's 24, and torch.load
            # measured later, with the buffer gone, saw a machine with 4 GiB more to spare.
            torch.save(training, torch_file)
            sync_and_drop(torch_file)
            for step in range(run.reps):

                def restore_from_storage(step: int = step) -> None:
                    restored = run.timed("stowaway.restore.storage",
                                         lambda: ckpt.load(step=step, map_location=run.device), fresh_heap=True)
                    assert restored is not None and restored[0] == step

                def torch_load() -> None:
                    sync_and_drop(torch_file)
                    run.timed("torch.load", lambda: torch.load(torch_file, weights_only=True), fresh_heap=True)

                in_turn(step, restore_from_storage, torch_load)
                run.timed("reference.read_direct", lambda: references.read_file(buffer, target))
            if run.device.type == "cpu":
                # Straight into the state's own tensors. On a GPU this restore is staged through the slot, after
                # which the slot holds the step and the next load of it would be from memory.
                for step in range(run.reps):
                    restored = run.timed("stowaway.restore.storage_into",
                                         lambda step=step: ckpt.load(step=step, into=training))
                    assert restored is not None and restored[0] == step
                    assert ckpt.last_restore is not None and ckpt.last_restore.source == "storage"
                    del restored
        # The reference buffer is resident throughout, so it adds exactly its size to the peak.
        extra["rank_peak_rss_bytes"] = run.slowest(system.status_bytes("self", "VmHWM") - buffer.nbytes)
    finally:
        target.unlink(missing_ok=True)
        torch_file.unlink(missing_ok=True)
        buffer.close()


def in_turn(rep: int, first: Callable[[], None], second: Callable[[], None]) -> None:
    """Run a measurement and its reference, the one first in even repetitions and the other in odd ones.

    On this VM the first of two measurements of fresh memory in a row often
    pays more for its page faults than the second (1 GiB on one rank, rounds
    of a restore, a copy-out, a copy-out and a restore: the restore from
    memory took 883 ms in first place and 276 ms in fourth, the copy-out
    reference 621 ms in second and 261 ms in third), so a measurement always
    run first looked slower than its reference.
    """
    for measure in (first, second) if rep % 2 == 0 else (second, first):
        measure()


def _measure_saves(run: Run, ckpt: Checkpointer, training: dict[str, Any], extra: dict[str, Any],
                   after_each_steady: Callable[[], None]) -> None:
    """The first save, then ``run.reps`` steady ones, each followed by ``after_each_steady``."""
    for step in range(run.reps + 1):
        kind = "first" if step == 0 else "steady"
        growth = system.cache_growth() if run.rank == 0 and step == 1 else None
        started, cpu_started = run.start(), time.process_time()
        handle = ckpt.save(step, training)
        run.sync()
        wall, cpu_time = time.perf_counter() - started, time.process_time() - cpu_started
        run.record(f"stowaway.save.{kind}", wall)
        if step > 0:
            run.record_cpu("stowaway.save.steady", cpu_time)
        handle.wait()
        run.record(f"stowaway.committed.{kind}", time.perf_counter() - started)
        if growth is not None:
            extra["page_cache_growth_bytes"] = growth.stop()
        if step > 0:
            after_each_steady()


def measure_pooled_spare(run: Run, training: dict[str, Any], extra: dict[str, Any], shm_dir: Path) -> None:
    """One slot per rank and one spare pooled by them all: what that holds in shared memory, and saves made
    while the previous one persists.

    A phase of its own, under a sidecar of its own (``python -m bench``
    stops it and removes its files and checkpoints before the next phase),
    so that its slots are not resident under the other phases'. Each rank
    saves twice in a row, as the ranks of a job do when they all save at one
    step: the first rank to make its second save borrows the spare, the
    others wait for their own slots, and the slowest rank's time is what the
    job waits. The shared memory is counted once every rank has saved.
    """
    job = f"{os.environ['STOWAWAY_JOB']}-pooled"
    with (ranks_private_peak(extra, "stowaway_pooled_ranks_private_bytes"),
          Checkpointer(job=job, slots=1, pooled_spares=1, timeout=1800) as ckpt):
        for rep in range(run.reps + 1):
            run.start()
            first = ckpt.save(2 * rep, training)
            started = time.perf_counter()
            second = ckpt.save(2 * rep + 1, training)
            run.sync()
            run.record(f"stowaway.save.pooled.{'first' if rep == 0 else 'steady'}", time.perf_counter() - started)
            first.wait()
            second.wait()
        dist.barrier()
        if run.rank == 0:
            extra["stowaway_pooled_shm_bytes"] = system.shm_bytes(shm_dir, f"{job}.")


def measure_overlapped_saves(run: Run, training: dict[str, Any]) -> None:
    """A first save after ``reserve``, then saves made while the previous one still persists, into a second slot.

    ``reserve`` faults both slots into this checkpointer's mapping (the one
    of the phase before is reused, so the rank holds two slots at most,
    never three) and encodes the state once, while the rank maps and unmaps
    memory (``_mappings_during``); with ``wait`` it returns once the first
    save's slot is ready, the spare going on at the lowest priority. The
    first-touch reference for the state's bytes, what the cold first save
    that ``reserve`` replaces pays at least, is measured just before it.
    The first save then shows what it costs a job that reserved ahead. The
    first overlapped save is the first into the second slot.
    """
    nbytes = state.nbytes_of(training)
    # Before, not after: the spare still being allocated in the background would slow the reference down.
    run.timed("reference.first_touch.first", lambda: first_touch.touch(nbytes))
    with Checkpointer(slots=2, timeout=1800) as ckpt:
        _mappings_during(run, lambda: ckpt.reserve(training, wait=True))
        step = run.reps + 1
        started = run.start()
        handle = ckpt.save(step, training)
        run.sync()
        run.record("stowaway.save.reserved.first", time.perf_counter() - started)
        handle.wait()
        for rep in range(run.reps + 1):
            run.start()
            persisting = ckpt.save(step + 1, training)
            started = time.perf_counter()
            overlapped = ckpt.save(step + 2, training)
            run.sync()
            run.record(f"stowaway.save.overlapped.{'first' if rep == 0 else 'steady'}", time.perf_counter() - started)
            persisting.wait()
            overlapped.wait()
            step += 2


def _mappings_during(run: Run, reserve: Callable[[], None]) -> None:
    """The longest of the rank's memory mappings while ``reserve`` faults its slots in, and without it.

    A training process maps and unmaps memory (a large tensor the heap
    cannot serve, pinned buffers, shared memory of data loaders), and each
    mmap or munmap waits for whatever holds the process's mmap lock: faulting
    a slot in does. The longest wait shows how long the training loop may
    stall meanwhile; with a slot faulted in as one call, it was a whole slot.
    The mappings are made directly: a tensor may come from free heap memory
    and map nothing.
    """
    run.start()
    started = time.perf_counter()
    reserving = threading.Thread(target=reserve, name="bench-reserve")
    reserving.start()
    during = _mappings(until=lambda: not reserving.is_alive())
    reserving.join()
    run.record("stowaway.reserve.first", time.perf_counter() - started)
    run.record("stowaway.mmap_during_reserve.first", max(during))
    run.start()
    run.record("reference.mmap.first", max(_mappings(until=lambda: True, at_least=len(during))))


def _mappings(until: Callable[[], bool], at_least: int = 1) -> list[float]:
    """Times of ``MAPPING_BYTES`` of anonymous memory mapped and unmapped one after another, until ``until()``."""
    times: list[float] = []
    while len(times) < at_least or not until():
        started = time.perf_counter()
        mmap.mmap(-1, MAPPING_BYTES).close()
        times.append(time.perf_counter() - started)
    return times


def measure_torch_save(run: Run, training: dict[str, Any]) -> None:
    """torch.save, and then an fsync; torch.load is measured in turn with Stowaway's restore from storage."""
    path = run.scratch / f"torch-{run.rank}.pt"
    for _ in range(run.reps):
        started = run.start()
        torch.save(training, path)
        run.record("torch.save", time.perf_counter() - started)
        sync_and_drop(path)
        run.record("torch.save_fsync", time.perf_counter() - started)
    path.unlink()


def measure_dcp(run: Run, training: dict[str, Any]) -> None:
    """DCP's save, async_save and load of every rank's whole state.

    DCP writes a plain tensor that several ranks hold under one name once, as
    replicated: given the same names on every rank, it wrote one rank's share
    of the bytes and loaded that share into every rank. Each rank's state is
    its own shard here, so it goes under a name of its own, as a sharded
    state's shards are written: all of them are, which each save checks.
    """
    nbytes = int(across_ranks(state.nbytes_of(training), dist.ReduceOp.SUM))
    training = {f"rank{run.rank}": training}
    for rep in range(run.reps):
        directory = run.scratch / f"dcp-{rep}"
        run.timed("dcp.save", lambda directory=directory: dcp.save(training, checkpoint_id=directory))
        check_holds(run, directory, nbytes)
        remove(run, directory)
    for rep in range(run.reps):
        directory = run.scratch / f"dcp-async-{rep}"
        started = run.start()
        future = dcp.async_save(training, checkpoint_id=directory)
        run.record("dcp.async_save", time.perf_counter() - started)
        future.result()
        run.record("dcp.async_save_done", time.perf_counter() - started)
        check_holds(run, directory, nbytes)
        if rep < run.reps - 1:
            remove(run, directory)
    for _ in range(run.reps):
        if run.rank == 0:
            for path in directory.iterdir():
                sync_and_drop(path)
        run.timed("dcp.load", lambda: dcp.load(training, checkpoint_id=directory))
    remove(run, directory)


def sync_and_drop(path: Path) -> None:
    """fsync, then evict the file from the page cache so that a load reads the device."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def check_holds(run: Run, directory: Path, nbytes: int) -> None:
    """Fail the run if a peer's checkpoint is smaller than the state: it would be compared on fewer bytes."""
    dist.barrier()
    if run.rank == 0:
        written = sum(path.stat().st_size for path in directory.iterdir())
        assert written >= nbytes, f"{directory} holds {written} bytes of a {nbytes}-byte state"


def remove(run: Run, directory: Path) -> None:
    dist.barrier()
    if run.rank == 0:
        shutil.rmtree(directory)
    dist.barrier()


def main() -> None:
    parser = argparse.ArgumentParser(description="one benchmark configuration; run by python -m bench")
    parser.add_argument("--total-bytes", type=int, required=True, help="checkpoint size across all local ranks")
    parser.add_argument("--reps", type=int, required=True)
    parser.add_argument("--scratch", type=Path, required=True, help="directory for the references and peers")
    parser.add_argument("--out", type=Path, required=True, help="JSON file rank 0 writes")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where the training state lives")
    parser.add_argument("--shm-dir", type=Path, help="the sidecar's shared-memory directory (phase pooled)")
    parser.add_argument("--phase", choices=PHASES, required=True,
                        help="what to measure; python -m bench runs each phase in ranks of its own")
    args = parser.parse_args()
    if args.phase == "pooled" and args.shm_dir is None:
        parser.error("--phase pooled counts the pooled job's shared memory: give the sidecar's --shm-dir")
    dist.init_process_group("gloo")
    device = torch.device(args.device)
    if device.type == "cuda":
        # Local ranks share the machine's GPUs round robin; one GPU takes them all.
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]) % torch.cuda.device_count())
        torch.cuda.set_device(device)
    run = Run(args.reps, args.scratch, device)
    # The same seed in every phase: each measures the same tensors.
    training = state.build(args.total_bytes // dist.get_world_size(), seed=run.rank, device=device)
    extra: dict[str, Any] = {"bytes": run.slowest(state.nbytes_of(training)) * dist.get_world_size()}
    if args.phase == "pooled":
        measure_pooled_spare(run, training, extra, args.shm_dir)
    elif args.phase == "stowaway":
        measure_stowaway_and_references(run, training, extra)
        measure_overlapped_saves(run, training)
        measure_torch_save(run, training)
        measure_dcp(run, training)
    else:
        # Imported here: only the harness's own environment has DLRover.
        from bench import dlrover_peer

        dlrover_peer.measure(run, training, extra)
    if run.rank == 0:
        args.out.write_text(json.dumps({"seconds": run.results, **extra}, indent=1))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
