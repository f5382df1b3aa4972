"""``python -m bench.reshard``: restoring onto another number of ranks, against DCP and a plain read.

A job of ``--saved`` ranks saves an FSDP2-like state (every tensor a
``Shard(0)`` DTensor: parameters and two Adam moments, the sizes of
``bench.state``) with Stowaway and with DCP, each under ``stowaway run``
(a sidecar of its own, as a new pod has). Then, for each count in
``--onto``, a job of that many ranks, next to a new sidecar on the same
storage, restores it ``--reps`` times, each repetition with every file
dropped from the page cache first:

- Stowaway's ``load(device_mesh=...)`` into new tensors, and
  ``load(into=...)`` into the state's own (resident) tensors;
- DCP's ``load`` of the same state into the same tensors;
- the reference: an ``O_DIRECT`` read, into a resident buffer in 16 MiB
  requests, of as many bytes as the rank's Stowaway restore read, from the
  stored files (whole files, the rank's number picking the first).

Each time is the slowest rank's. Medians and ratios of medians are printed
(issue 24's targets: into the state ≤ 1.3x the reference, and below DCP).

Then the same pod: a job of ``--saved`` ranks saves next to a sidecar that
outlives it, and a job of each ``--onto`` count restores next to the same
sidecar, from the old ranks' slots in shared memory (``load`` into new
tensors and ``into`` the state's own), against the copy-out reference: a
``pread`` of the rank's share of the saved bytes from the slot files into a
resident buffer.

With ``--bucket`` (``local``: a SeaweedFS started here for the run, as
``bench.bucket`` does), last a bucket alone, without a claim: a job of
``--saved`` ranks saves next to a sidecar with only ``--bucket``, and a job
of each ``--onto`` count restores next to a new one (a new pod: nothing in
shared memory), the sidecar staging the ranges each rank reads into its
slots, against the download reference: obstore's ``get`` of as many bytes
as the rank's restore staged, streamed into a resident buffer (whole
objects, the rank's number picking the first). The job's objects are
deleted afterwards.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import mmap
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from bench import bucket, system, worker
from bench import state as state_mod
from stowaway.cli import run_cmd

ROOT = Path(__file__).resolve().parents[1]
JOB = "reshard"
CHUNK_BYTES = 16 * 2**20


def sharded_state(total: int, mesh: Any) -> dict[str, Any]:
    """Parameters and two Adam moments, each a ``Shard(0)`` DTensor on ``mesh``, about ``total`` bytes."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor import empty as dtensor_empty

    def sharded(count: int) -> Any:
        value = dtensor_empty(count, device_mesh=mesh, placements=[Shard(0)])
        value.to_local().uniform_(-1, 1)
        return value

    counts = state_mod.parameter_sizes(total * 14 // 12)  # fp32 weight and moments: 12 bytes an element
    return {"model": {f"layers.{index}.weight": sharded(count) for index, count in enumerate(counts)},
            "optimizer": {f"layers.{index}.weight": {"exp_avg": sharded(count), "exp_avg_sq": sharded(count)}
                          for index, count in enumerate(counts)}}


def read_reference(files: list[Path], nbytes: int, first: int, buffer: mmap.mmap) -> None:
    """Read ``nbytes`` of the stored files with ``O_DIRECT``, from the start of file ``first`` on, wrapping."""
    left, index = nbytes, first % len(files)
    while left > 0:
        fd = os.open(files[index], os.O_RDONLY | os.O_DIRECT)
        try:
            offset = 0
            while left > 0 and (count := os.preadv(fd, [memoryview(buffer)], offset)) > 0:
                offset += count
                left -= count
        finally:
            os.close(fd)
        index = (index + 1) % len(files)


def run_worker(args: argparse.Namespace) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh

    from stowaway import Checkpointer

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",))
    training = sharded_state(args.total, mesh)
    storage, dcp_dir = Path(args.storage), Path(args.storage) / "dcp"
    results: dict[str, list[float]] = {}

    def timed(name: str, action: Callable[[], Any]) -> Any:
        dist.barrier()
        started = time.perf_counter()
        value = action()
        seconds = torch.tensor(time.perf_counter() - started, dtype=torch.float64)
        dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
        results.setdefault(name, []).append(float(seconds))
        return value

    def dropped_from_cache() -> None:
        if rank == 0:
            for path in storage.rglob("*"):
                if path.is_file():
                    worker.sync_and_drop(path)
        dist.barrier()

    with Checkpointer(timeout=1800) as ckpt:
        if args.worker == "load_memory":
            measure_from_memory(args, ckpt, training, mesh, timed)
        elif args.worker == "load_bucket":
            measure_from_bucket(args, ckpt, training, mesh, timed, rank)
        elif args.worker == "save":
            ckpt.save(1, training).wait()
            dcp.save(training, checkpoint_id=dcp_dir)
            dist.barrier()
            dist.destroy_process_group()
            return
        else:
            measure_from_storage(args, ckpt, training, mesh, timed, dropped_from_cache, rank)
    if rank == 0:
        Path(args.out).write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


def timed_load(ckpt: Any, mesh: Any, timed: Callable[[str, Callable[[], Any]], Any], source: str) -> Any:
    """``load()`` into new tensors, timed as ``stowaway.load``; its ``last_restore``, of step 1 from ``source``."""
    system.release_free_heap()
    restored = timed("stowaway.load", lambda: ckpt.load(device_mesh=mesh))
    assert restored is not None and restored[0] == 1, restored
    del restored
    restore = ckpt.last_restore
    assert restore is not None and restore.source == source, restore
    return restore


def measure_from_storage(args: argparse.Namespace, ckpt: Any, training: Any, mesh: Any,
                         timed: Callable[[str, Callable[[], Any]], Any], dropped_from_cache: Callable[[], None],
                         rank: int) -> None:
    import torch.distributed.checkpoint as dcp

    storage, dcp_dir = Path(args.storage), Path(args.storage) / "dcp"
    files = sorted((storage / JOB).glob("step-*/rank-*.safetensors"))
    buffer = mmap.mmap(-1, CHUNK_BYTES)
    for _ in range(args.reps):
        dropped_from_cache()
        restore = timed_load(ckpt, mesh, timed, "storage")
        assert restore.saved_by == args.saved and restore.bytes_read > 0, restore
        dropped_from_cache()
        timed("stowaway.load_into", lambda: ckpt.load(into=training))
        dropped_from_cache()
        timed("reference.read_direct",
              lambda nbytes=restore.bytes_read: read_reference(files, nbytes, rank, buffer))
        dropped_from_cache()
        timed("dcp.load", lambda: dcp.load(training, checkpoint_id=dcp_dir))


def measure_from_memory(args: argparse.Namespace, ckpt: Any, training: Any, mesh: Any,
                        timed: Callable[[str, Callable[[], Any]], Any]) -> None:
    """Restores from the old ranks' slots, and the copy-out of this rank's share of their bytes."""
    import torch.distributed as dist

    slots = sorted(Path(args.shm_dir).glob(f"{JOB}.rank*.slot*"))
    share = sum(path.stat().st_size for path in slots) // 2 // dist.get_world_size()
    buffer = mmap.mmap(-1, share)
    for _ in range(args.reps):
        restore = timed_load(ckpt, mesh, timed, "memory")
        assert restore.bytes_read == 0, restore
        timed("stowaway.load_into", lambda: ckpt.load(into=training))
        timed("reference.copy_out", lambda: copy_out(slots, share, buffer))


def measure_from_bucket(args: argparse.Namespace, ckpt: Any, training: Any, mesh: Any,
                        timed: Callable[[str, Callable[[], Any]], Any], rank: int) -> None:
    """Restores from a bucket alone on a new pod, and the plain download of as many bytes."""
    from stowaway.storage import bucket

    location = bucket.Location.parse(args.bucket_url)
    store = bucket.open_store(location, bucket.Settings())
    objects = sorted(bucket.Bucket(location, bucket.Settings()).keys_below(location.key(JOB) + "/"))
    objects = [key for key in objects if key.rsplit("/", 1)[-1].startswith("rank-")]
    buffer = mmap.mmap(-1, CHUNK_BYTES)
    for _ in range(args.reps):
        restore = timed_load(ckpt, mesh, timed, "storage")
        assert restore.bytes_read > 0, restore
        timed("stowaway.load_into", lambda: ckpt.load(into=training))
        timed("reference.download",
              lambda nbytes=restore.bytes_read: download_reference(store, objects, nbytes, rank, buffer))


def download_reference(store: Any, objects: list[str], nbytes: int, first: int, buffer: mmap.mmap) -> None:
    """``nbytes`` of the objects, streamed with obstore's ``get`` into ``buffer``, from object ``first`` on."""
    import obstore

    view, left, index = memoryview(buffer), nbytes, first % len(objects)
    while left > 0:
        for chunk in obstore.get(store, objects[index]).stream():
            for begin in range(0, min(len(chunk), left), len(view)):
                part = memoryview(chunk)[begin : min(len(chunk), left, begin + len(view))]
                view[: len(part)] = part
            left -= min(len(chunk), left)
            if left == 0:
                break
        index = (index + 1) % len(objects)


def copy_out(slots: list[Path], nbytes: int, buffer: mmap.mmap) -> None:
    """``pread`` ``nbytes`` of the slot files into ``buffer``, file after file."""
    view, done = memoryview(buffer), 0
    for path in slots:
        fd = os.open(path, os.O_RDONLY)
        try:
            offset = 0
            while done < nbytes:
                count = os.preadv(fd, [view[done:nbytes]], offset)
                if count == 0:
                    break
                done, offset = done + count, offset + count
        finally:
            os.close(fd)
        if done >= nbytes:
            return


def worker_command(ranks: int, mode: str, total: int, saved: int, reps: int, storage: Path, out: Path,
                   shm_dir: Path | None = None, url: str | None = None) -> list[str]:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks),
               "-m", "bench.reshard", "--worker", mode, "--total", str(total), "--saved", str(saved),
               "--reps", str(reps), "--storage", str(storage), "--out", str(out)]
    return (command + (["--shm-dir", str(shm_dir)] if shm_dir is not None else [])
            + (["--bucket-url", url] if url is not None else []))


def run(command: list[str], ranks: int, **env: str) -> None:
    python_path = os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))
    subprocess.run(command, env=dict(os.environ, PYTHONPATH=python_path,
                                     OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 1) // ranks)), **env),
                   check=True, cwd=ROOT)


def job(storage: Path, ranks: int, mode: str, total: int, saved: int, reps: int, out: Path) -> None:
    """A job under ``stowaway run``: a sidecar of its own, as a new pod has, nothing in shared memory."""
    run([sys.executable, "-m", "stowaway", "run", "--storage", str(storage), "--job", JOB, "--",
         *worker_command(ranks, mode, total, saved, reps, storage, out)], ranks)


@contextlib.contextmanager
def pod(storage: str | Path, workdir: Path) -> Iterator[tuple[Path, dict[str, str]]]:
    """A sidecar of a pod of its own on ``storage`` (a directory, or a bucket's URL alone), for jobs started
    beside it: its shared-memory directory and the environment that points a job at it."""
    shm_dir = Path(tempfile.mkdtemp(prefix="stwr-", dir="/dev/shm"))
    socket_path = Path(tempfile.mkdtemp(prefix="stwr-", dir=workdir)) / "pod.sock"
    where = ["--bucket", storage] if isinstance(storage, str) else ["--storage", str(storage)]
    sidecar = subprocess.Popen(
        [sys.executable, "-m", "stowaway", "sidecar", *where, "--socket", str(socket_path),
         "--shm-dir", str(shm_dir), "--log-level", "WARNING"], start_new_session=True)
    try:
        run_cmd.wait_for_socket(sidecar, socket_path)
        yield shm_dir, {"STOWAWAY_SOCKET": str(socket_path), "STOWAWAY_JOB": JOB}
    finally:
        run_cmd.stop_sidecar(sidecar, 60)
        shutil.rmtree(shm_dir, ignore_errors=True)


def same_pod(storage: Path, total: int, args: argparse.Namespace, workdir: Path) -> None:
    """Save, then restore on each ``--onto`` count, next to one sidecar that outlives the jobs (a restart on the
    same pod): the restores read the old ranks' slots."""
    with pod(storage, workdir) as (shm_dir, beside):
        run(worker_command(args.saved, "save", total, args.saved, args.reps, storage, workdir / "pod-save.json"),
            args.saved, **beside)
        for ranks in (int(count) for count in args.onto.split(",")):
            out = workdir / f"pod-onto-{ranks}.json"
            run(worker_command(ranks, "load_memory", total, args.saved, args.reps, storage, out, shm_dir), ranks,
                **beside)
            report(f"{args.mib} MiB saved on {args.saved} ranks, restored on {ranks} from shared memory:", out, (
                ("into the state / copy-out reference", "stowaway.load_into", "reference.copy_out"),
                ("into new tensors / copy-out reference", "stowaway.load", "reference.copy_out")))


def bucket_alone(url: str, scratch: Path, total: int, args: argparse.Namespace, workdir: Path) -> None:
    """Save next to a sidecar with a bucket alone, then restore on each ``--onto`` count on a new pod; the job's
    objects are deleted afterwards."""
    from stowaway.storage import bucket as bucket_mod

    try:
        with pod(url, workdir) as (_, beside):
            run(worker_command(args.saved, "save", total, args.saved, args.reps, scratch,
                               workdir / "bucket-save.json"), args.saved, **beside)
        for ranks in (int(count) for count in args.onto.split(",")):
            out = workdir / f"bucket-onto-{ranks}.json"
            with pod(url, workdir) as (_, beside):
                run(worker_command(ranks, "load_bucket", total, args.saved, args.reps, scratch, out, url=url),
                    ranks, **beside)
            report(f"{args.mib} MiB saved on {args.saved} ranks in a bucket alone, restored on {ranks} on a new "
                   "pod:", out, (("into the state / download reference", "stowaway.load_into", "reference.download"),
                                 ("into new tensors / download reference", "stowaway.load", "reference.download")))
    finally:
        target = bucket_mod.Bucket(bucket_mod.Location.parse(url), bucket_mod.Settings())
        left = target.keys_below(target.location.key(JOB) + "/")
        if left:
            target.delete(left)


def report(title: str, out: Path, ratios: tuple[tuple[str, str, str], ...]) -> None:
    medians = {name: statistics.median(values) for name, values in json.loads(out.read_text()).items()}
    print(title)
    for name, value in medians.items():
        print(f"  {name:22s} median {value * 1e3:8.1f} ms")
    for label, numerator, denominator in ratios:
        print(f"  {label}: {medians[numerator] / medians[denominator]:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.reshard", description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=256, help="state size in MiB, across the saving ranks")
    parser.add_argument("--saved", type=int, default=4, help="ranks of the job that saves")
    parser.add_argument("--onto", default="2,6", help="rank counts of the jobs that restore, comma-separated")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--storage", type=Path, default=None, help="a directory on the disk to measure (emptied)")
    parser.add_argument("--bucket", default=None, metavar="s3://BUCKET/PREFIX|local",
                        help="also restore from a bucket alone on a new pod: a bucket reached through the AWS_* "
                             "variables, or 'local' for a SeaweedFS started here")
    parser.add_argument("--worker", choices=("save", "load", "load_memory", "load_bucket"), help=argparse.SUPPRESS)
    parser.add_argument("--bucket-url", help=argparse.SUPPRESS)
    parser.add_argument("--total", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--shm-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        run_worker(args)
        return
    storage = args.storage or Path(tempfile.mkdtemp(prefix="stwr-", dir="/var/tmp"))
    workdir = Path(tempfile.mkdtemp(prefix="stwr-", dir="/tmp"))
    total = args.mib * 2**20
    try:
        job(storage, args.saved, "save", total, args.saved, args.reps, workdir / "save.json")
        for ranks in (int(count) for count in args.onto.split(",")):
            out = workdir / f"onto-{ranks}.json"
            job(storage, ranks, "load", total, args.saved, args.reps, out)
            report(f"{args.mib} MiB saved on {args.saved} ranks, restored on {ranks}:", out, (
                ("into the state / O_DIRECT read reference", "stowaway.load_into", "reference.read_direct"),
                ("into the state / DCP load", "stowaway.load_into", "dcp.load"),
                ("into new tensors / DCP load", "stowaway.load", "dcp.load")))
        same_pod(storage / "same-pod", total, args, workdir)
        if args.bucket is not None:
            with bucket.reachable(args.bucket) as url:
                bucket_alone(url, storage / "bucket", total, args, workdir)
    finally:
        shutil.rmtree(storage, ignore_errors=True)
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
