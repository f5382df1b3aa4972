"""``python -m bench``: every configuration, each with its own sidecar, then the JSON and markdown report.

Sizes are totals across the local ranks, so the same bytes are compared from
1 to 8 ranks. All shared memory and scratch files are removed afterwards.
Where this Python has DLRover (the harness's own environment, ``python -m
bench.env``, does), each configuration also gets DLRover's saver, started
as its agent would start it (``bench.dlrover_saver``), and the ranks measure
DLRover after the other peers; with ``--out``, the charts are drawn too
where matplotlib is installed (``bench.charts``). With ``--bucket``, the
bucket tier's upload and restore are measured last against the plain
client (``bench.bucket``), on a bucket or a SeaweedFS started for the run.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bench import bucket, charts, dlrover_saver, report, system
from stowaway.cli import run_cmd

ROOT = Path(__file__).resolve().parents[1]


def run_config(total: int, ranks: int, reps: int, storage: Path, device: str, dlrover: bool) -> dict[str, object]:
    """One configuration: its phases one after another, each in its own ranks (``bench.worker --phase``).

    The Stowaway phases each have a sidecar of their own, stopped, with its
    shared memory and storage removed, before the next phase starts: a
    sidecar keeps a job's slots mapped until it exits (for a restart of the
    ranks), so in one run of all phases the pooled phase's slots, then the
    main phase's two slots a rank, were still resident under DLRover's phase.
    At 4 GiB on one rank that was 12 GiB of shared memory beside DLRover's
    copies of the state, and the kernel killed the rank for memory on a
    24 GiB machine.
    """
    workdir = Path(tempfile.mkdtemp(prefix="stwb-", dir="/tmp"))
    scratch = storage / "scratch"
    scratch.mkdir(parents=True, exist_ok=True)
    # torchrun's rendezvous id, and so the TORCHELASTIC_RUN_ID of the ranks, by which DLRover finds its saver.
    run_id = workdir.name
    python_path = os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))
    env = dict(os.environ, STOWAWAY_JOB=f"bench-{total}-{ranks}", PYTHONPATH=python_path,
               OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 1) // ranks)), DLROVER_LOG_LEVEL="WARNING")
    launch = ["--rdzv-backend", "c10d", "--rdzv-endpoint", "localhost:0", "--rdzv-id", run_id, "--nnodes", "1",
              "--nproc-per-node", str(ranks)]
    measure = ["--total-bytes", str(total), "--reps", str(reps), "--scratch", str(scratch), "--device", device]
    phase = _Phase(workdir, launch, measure)
    seconds: dict[str, list[float]] = {}
    result: dict[str, object] = {"ranks": ranks, "total": total, "cores": os.cpu_count(), "seconds": seconds}
    phases = [lambda: _with_sidecar(phase, "pooled", env, storage, reps),
              lambda: _with_sidecar(phase, "stowaway", env, storage, reps)]
    if dlrover:
        phases.append(lambda: _with_dlrover(phase, env, run_id))
    try:
        for run_phase in phases:
            measured = run_phase()
            seconds |= measured.pop("seconds")
            result |= measured
        return result
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
        shutil.rmtree(storage, ignore_errors=True)


class _Phase:
    """Runs one phase of the worker under torchrun, with the arguments every phase of a configuration shares."""

    def __init__(self, workdir: Path, launch: list[str], measure: list[str]) -> None:
        self._workdir = workdir
        self._launch = launch
        self._measure = measure

    def run(self, name: str, env: dict[str, str], readers: dict[str, Callable[[], int]],
            launch: tuple[str, ...] = (), measure: tuple[str, ...] = ()) -> tuple[dict[str, Any], dict[str, int]]:
        """What the phase's ranks measured (its ``seconds`` and the rest) and the peaks ``readers`` sampled."""
        out = self._workdir / f"{name}.json"
        peaks = system.Peaks(readers)
        try:
            subprocess.run(
                [sys.executable, "-m", "torch.distributed.run", *self._launch, *launch, "-m", "bench.worker",
                 *self._measure, "--phase", name, "--out", str(out), *measure],
                env=env, check=True, cwd=ROOT,
            )
        finally:
            peak = peaks.stop()
        return json.loads(out.read_text()), peak


def _with_sidecar(phase: _Phase, name: str, env: dict[str, str], storage: Path, reps: int) -> dict[str, Any]:
    """A Stowaway phase under a sidecar of its own, which is stopped and whose memory and storage are removed."""
    shm_dir = Path(tempfile.mkdtemp(prefix="stowaway-bench-", dir="/dev/shm"))
    socket_path = Path(tempfile.mkdtemp(prefix="stws-", dir="/tmp")) / "s.sock"
    checkpoints = storage / "checkpoints"
    sidecar = subprocess.Popen(
        [sys.executable, "-m", "stowaway", "sidecar", "--storage", str(checkpoints),
         "--socket", str(socket_path), "--shm-dir", str(shm_dir), "--keep-last", str(reps + 2),
         "--log-level", "WARNING"],
        start_new_session=True,
    )
    try:
        run_cmd.wait_for_socket(sidecar, socket_path)
        readers = {"sidecar_private": lambda: system.status_bytes(sidecar.pid, "RssAnon"),
                   "stowaway_shm": lambda: system.shm_bytes(shm_dir)}
        result, peak = phase.run(name, dict(env, STOWAWAY_SOCKET=str(socket_path)), readers,
                                 measure=("--shm-dir", str(shm_dir)))
        if name == "stowaway":
            result["sidecar_peak_rss_bytes"] = system.status_bytes(sidecar.pid, "VmHWM")
            result["sidecar_peak_private_bytes"] = peak["sidecar_private"]
            result["stowaway_peak_shm_bytes"] = peak["stowaway_shm"]
        return result
    finally:
        run_cmd.stop_sidecar(sidecar, 60)
        shutil.rmtree(shm_dir, ignore_errors=True)
        shutil.rmtree(socket_path.parent, ignore_errors=True)
        shutil.rmtree(checkpoints, ignore_errors=True)


def _with_dlrover(phase: _Phase, env: dict[str, str], run_id: str) -> dict[str, Any]:
    """DLRover's phase, with its saver started as its agent would start it, and no sidecar of Stowaway's."""
    saver = dlrover_saver.start(env, run_id, ROOT)
    try:
        readers = {"dlrover_saver_private": lambda: system.status_bytes(saver.pid, "RssAnon"),
                   "dlrover_shm": lambda: system.shm_bytes(dlrover_saver.SHM_DIR, dlrover_saver.shm_prefix(run_id))}
        result, peak = phase.run("dlrover", env, readers, launch=("--role", "dlrover-trainer"))
        result["dlrover_version"] = importlib.metadata.version("dlrover")
        result["dlrover_saver_peak_rss_bytes"] = system.status_bytes(saver.pid, "VmHWM")
        result["dlrover_saver_peak_private_bytes"] = peak["dlrover_saver_private"]
        result["dlrover_peak_shm_bytes"] = peak["dlrover_shm"]
        return result
    finally:
        dlrover_saver.stop(saver, run_id)


def machine(device: str, dlrover: bool) -> str:
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    text = (f"{os.cpu_count()} cores, {memory / 2**30:.0f} GiB RAM, Linux {platform.release()}, "
            f"Python {platform.python_version()}")
    if device == "cuda":
        text += f", {torch.cuda.get_device_name()}, torch {torch.__version__}"
    if dlrover:
        text += f", DLRover {importlib.metadata.version('dlrover')}"
    reported = system.reported_to_host_bytes()
    if reported:
        text += (f", hands freed memory back to its host (free page reporting, {reported / 2**40:.1f} TiB since boot): "
                 "fresh pages cost more to touch")
    return text


def require_cuda(parser: argparse.ArgumentParser) -> None:
    if not torch.cuda.is_available():
        parser.error("--device cuda needs a CUDA device, and torch sees none here (torch.cuda.is_available() "
                     "is False); run it on a GPU machine, or leave --device out to measure on the CPU")


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="256M,1G,4G", help="checkpoint sizes in total across the ranks")
    parser.add_argument("--ranks", default="1,2,4,8", help="local rank counts")
    parser.add_argument("--reps", type=int, default=3, help="repetitions of each measurement")
    parser.add_argument("--storage", type=Path, default=Path("/var/tmp/stowaway-bench"),
                        help="durable storage to write to (emptied afterwards)")
    parser.add_argument("--out", type=Path, default=None,
                        help="directory for results.json and results.md (default: print the markdown only)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="where the training state lives; cuda measures the GPU-to-slot path against "
                             "plain and pinned device-to-host copies")
    parser.add_argument("--no-dlrover", action="store_true",
                        help="leave DLRover out even where it is installed (a run about Stowaway alone, or one "
                             "short of memory: DLRover's phase holds its own copy of the state in shared memory)")
    parser.add_argument("--bucket", default=None, metavar="s3://BUCKET/PREFIX|local",
                        help="also measure the bucket tier's upload and restore against the plain client "
                             "(bench.bucket): a bucket reached through the AWS_* variables, or 'local' for a "
                             "SeaweedFS built (hack/e2e/gobuild) and started on this machine for the run")
    parser.add_argument("--bucket-sizes", default="256M,1G", help="file sizes for --bucket, comma-separated")
    args = parser.parse_args()
    if args.device == "cuda":
        require_cuda(parser)
    if args.storage.exists() and any(args.storage.iterdir()):
        parser.error(f"--storage {args.storage} is not empty; the benchmark deletes what it writes there, "
                     "so give it an empty or missing directory")
    installed = importlib.util.find_spec("dlrover") is not None
    dlrover = installed and not args.no_dlrover
    if not installed and not args.no_dlrover:
        print(f"bench: DLRover is not installed in this Python ({sys.executable}), so it is not measured; "
              "hack/bench runs the harness from its own environment (python -m bench.env), which has it",
              file=sys.stderr, flush=True)
    results = []
    for total in (report.parse_size(size) for size in args.sizes.split(",")):
        for ranks in (int(count) for count in args.ranks.split(",")):
            print(f"bench: {report.size_label(total)} across {ranks} rank(s)", file=sys.stderr, flush=True)
            results.append(run_config(total, ranks, args.reps, args.storage, args.device, dlrover))
    uploads = None
    if args.bucket is not None:
        print(f"bench: the bucket tier against {args.bucket}", file=sys.stderr, flush=True)
        with bucket.reachable(args.bucket) as url:
            sizes = [report.parse_size(size) for size in args.bucket_sizes.split(",")]
            uploads = bucket.measure_sizes(url, sizes, args.reps)
    command = shlex.join(["python", "-m", "bench", *sys.argv[1:]])
    text = report.markdown(results, command, machine(args.device, dlrover))
    if uploads is not None:
        text += "\n" + bucket.section(args.bucket, uploads)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.json").write_text(json.dumps(results, indent=1))
        if uploads is not None:
            (args.out / "bucket.json").write_text(json.dumps({"bucket": args.bucket, "results": uploads}, indent=1))
        (args.out / "results.md").write_text(text)
        charts.draw_or_say_why(results, args.out)
    print(text)


if __name__ == "__main__":
    main()
