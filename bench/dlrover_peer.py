"""DLRover's flash checkpoint as a peer, measured in the ranks that measure Stowaway, on the same state and storage.

Imported by the worker only when the harness started DLRover's saver
(``bench.dlrover_saver``): this module imports DLRover, which only the
harness's own environment (``python -m bench.env``) has.

Each rank's state is its own shard, as in DLRover's own advice for a model
partitioned on every rank: a ``DdpCheckpointer`` whose local and global
shard counts are the rank counts, so that every rank writes its own shared
memory and the saver writes one file per rank. What is timed, per rank,
slowest rank reported:

- ``save_checkpoint(..., StorageType.MEMORY)``: the copy into its shared
  memory, first (which creates it) and steady;
- ``save_checkpoint(..., StorageType.DISK)``: the same copy, then the event
  to the saver (``dlrover.save_to_storage``); until the saver has written
  every rank's file with ``torch.save`` and its tracker file names the step
  (``dlrover.committed``, what DLRover calls done); and until each rank has
  also fsynced its file (``dlrover.committed_fsync``): DLRover fsyncs its
  tracker and done files but not the checkpoint's, so before that fsync the
  bytes may still be only in the page cache;
- ``load_checkpoint()`` from memory, as it returns (views of its shared
  memory, which the next save overwrites), and followed by the copy into
  the state's own tensors that ``load_state_dict`` makes;
- the load from storage on a node whose memory is gone: ``load()`` reads
  memory first whenever it holds a state, so the harness calls the method
  it falls back to, ``_load_from_storage``, which reads the tracker file and
  ``torch.load``-s the rank's file, with the file evicted from the page cache.

Every save waits for the previous commit: a save to memory while the saver
still reads it is skipped by DLRover (it returns without copying), and the
harness fails rather than time a skipped save.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import torch.distributed as dist
from dlrover.python.common.constants import CheckpointConstant
from dlrover.trainer.torch.flash_checkpoint.checkpointer import StorageType
from dlrover.trainer.torch.flash_checkpoint.ddp import DdpCheckpointer

from bench import references, state, system, worker

# DLRover's own limit for a commit (CheckpointConstant.SAVE_TIMEOUT).
COMMIT_TIMEOUT = CheckpointConstant.SAVE_TIMEOUT
POLL_SECONDS = 0.002


def measure(run: worker.Run, training: dict[str, Any], extra: dict[str, Any]) -> None:
    directory = run.scratch / "dlrover"
    system.reset_peak_rss()
    ckpt = DdpCheckpointer(str(directory), local_shard_num=int(os.environ["LOCAL_WORLD_SIZE"]),
                           global_shard_num=dist.get_world_size())
    try:
        with worker.ranks_private_peak(extra, "dlrover_ranks_private_bytes"):
            step = _saves_to_memory(run, ckpt, training)
            step = _saves_to_storage(run, ckpt, training, extra, directory, first_step=step + 1)
        _restores(run, ckpt, training, directory / str(step) / f"rank_{run.rank}.pt")
        extra["dlrover_rank_peak_rss_bytes"] = run.slowest(system.status_bytes("self", "VmHWM"))
    finally:
        ckpt._engine.close()
        worker.remove(run, directory)


def _saves_to_memory(run: worker.Run, ckpt: DdpCheckpointer, training: dict[str, Any]) -> int:
    """The first save, then ``run.reps`` steady ones; returns the last step. DLRover's steps start at 1."""
    for step in range(1, run.reps + 2):
        run.timed(f"dlrover.save.{'first' if step == 1 else 'steady'}",
                  lambda step=step: ckpt.save_checkpoint(step, training, storage_type=StorageType.MEMORY))
        _check_saved(ckpt, step)
    return run.reps + 1


def _saves_to_storage(run: worker.Run, ckpt: DdpCheckpointer, training: dict[str, Any], extra: dict[str, Any],
                      directory: Path, first_step: int) -> int:
    """``run.reps`` saves to storage, each until committed and then until durable; returns the last step."""
    nbytes = int(worker.across_ranks(state.nbytes_of(training), dist.ReduceOp.SUM))
    for step in range(first_step, first_step + run.reps):
        growth = system.cache_growth() if run.rank == 0 and step == first_step else None
        started = run.start()
        ckpt.save_checkpoint(step, training, storage_type=StorageType.DISK)
        run.sync()
        run.record("dlrover.save_to_storage", time.perf_counter() - started)
        _check_saved(ckpt, step)
        if run.rank == 0:
            _wait_for_tracker(directory, step)
        dist.barrier()
        run.record("dlrover.committed", time.perf_counter() - started)
        if growth is not None:
            extra["dlrover_page_cache_growth_bytes"] = growth.stop()
        worker.sync_and_drop(directory / str(step) / f"rank_{run.rank}.pt")
        run.record("dlrover.committed_fsync", time.perf_counter() - started)
        worker.check_holds(run, directory / str(step), nbytes)
    return first_step + run.reps - 1


def _restores(run: worker.Run, ckpt: DdpCheckpointer, training: dict[str, Any], path: Path) -> None:
    sources = state.tensors(training)
    for _ in range(run.reps):
        restored = run.timed("dlrover.restore.memory", ckpt.load_checkpoint, fresh_heap=True)
        _check_restored(restored, sources)
        del restored
    for _ in range(run.reps):
        run.timed("dlrover.restore.memory_into",
                  lambda: references.copy_into(sources, state.tensors(ckpt.load_checkpoint())))
    for _ in range(run.reps):
        worker.sync_and_drop(path)
        restored = run.timed("dlrover.restore.storage", ckpt._engine._load_from_storage, fresh_heap=True)
        _check_restored(restored, sources)
        del restored


def _check_saved(ckpt: DdpCheckpointer, step: int) -> None:
    """DLRover skips a save to memory that finds its buffer locked, and says so only in its log."""
    cached = ckpt._engine._cached_step
    if cached != step:
        raise RuntimeError(f"DLRover skipped the save of step {step} (its memory holds step {cached}); "
                           "a skipped save must not be timed as one")


def _check_restored(restored: dict[str, Any], sources: list[Any]) -> None:
    found = state.tensors(restored)
    if len(found) != len(sources) or any(a.shape != b.shape for a, b in zip(found, sources, strict=True)):
        raise RuntimeError(f"DLRover restored {len(found)} tensors of a state of {len(sources)}, or other shapes")


def _wait_for_tracker(directory: Path, step: int) -> None:
    """Until DLRover's tracker file names ``step``: its commit (DLRover's own wait polls every 3 s)."""
    tracker = directory / CheckpointConstant.TRACER_FILE_NAME
    deadline = time.monotonic() + COMMIT_TIMEOUT
    while time.monotonic() < deadline:
        try:
            if tracker.read_text().strip() == str(step):
                return
        except FileNotFoundError:
            pass
        time.sleep(POLL_SECONDS)
    raise TimeoutError(f"DLRover did not commit step {step} within {COMMIT_TIMEOUT} s: {tracker} never named it; "
                       "its saver's log (the harness's standard error) says why")
