"""``stowaway run``: a sidecar next to a local command, the whole data path on one machine.

The sidecar runs in its own session so that Ctrl-C reaches the training
command only; once the command has exited, the sidecar is asked to stop and
finishes the persists still in flight before the launcher exits with the
command's status.

A launcher killed outright (SIGKILL, the OOM killer) runs none of that, so
both children are also told to stop when it dies (``PR_SET_PDEATHSIG``):
the command is terminated rather than left training against a sidecar about
to go, and the sidecar drains its persists and removes the directories the
launcher made for this run (its shared memory and its socket).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from stowaway import sidecar_settings
from stowaway.cli import bucket_cmds, catalog_cmds
from stowaway.cli.errors import CommandError
from stowaway.storage import bucket, bucket_jobs

STARTUP_TIMEOUT = 30.0
_PR_SET_PDEATHSIG = 1


def add_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = commands.add_parser(
        "run", help="run a command (e.g. torchrun ...) with a local sidecar",
        description="Start a sidecar on --storage, --bucket or both, run COMMAND with STOWAWAY_SOCKET and "
        "STOWAWAY_JOB set, wait for in-flight persists, stop the sidecar, and exit with COMMAND's status.",
    )
    parser.add_argument("--storage", type=Path, help="durable storage directory")
    parser.add_argument("--bucket", metavar="s3://BUCKET/PREFIX",
                        help="a bucket: behind --storage, a second tier; without it, the storage itself (reached "
                             "through the AWS_* variables: AWS_ENDPOINT_URL, the credentials, ...)")
    parser.add_argument("--job", default="local", help="job name, the directory under --storage (default: local)")
    sidecar_settings.KEEP_LAST.add_to(parser)  # passed on to the sidecar as it is
    parser.add_argument("--grace-period", type=float, default=300.0, metavar="SECONDS",
                        help="how long in-flight persists may take once COMMAND has exited")
    parser.add_argument("argv", nargs=argparse.REMAINDER, metavar="-- COMMAND...",
                        help="the command to run, after --")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    command = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
    if not command:
        raise CommandError("no command given: use `stowaway run --storage DIR -- torchrun ... train.py`")
    if args.storage is None and args.bucket is None:
        raise CommandError("no storage given: pass --storage DIR, --bucket s3://BUCKET/PREFIX, or both")
    try:
        location = bucket.Location.parse(args.bucket) if args.bucket is not None else None
    except ValueError as exc:
        raise CommandError(str(exc)) from None
    where = [*(["--storage", str(args.storage)] if args.storage is not None else []),
             *(["--bucket", args.bucket] if args.bucket is not None else [])]
    job_at = (str((args.storage / args.job).absolute()) if args.storage is not None
              else f"{args.bucket.rstrip('/')}/{args.job}")
    workdir = Path(tempfile.mkdtemp(prefix="stw-", dir="/tmp"))
    shm_root = Path("/dev/shm") if Path("/dev/shm").is_dir() else workdir
    shm_dir = Path(tempfile.mkdtemp(prefix="stowaway-", dir=shm_root))
    socket_path = workdir / "sidecar.sock"
    sidecar = subprocess.Popen(
        [sys.executable, "-m", "stowaway", "sidecar", *where, "--socket", str(socket_path),
         "--shm-dir", str(shm_dir), *sidecar_settings.KEEP_LAST.command_line(args.keep_last),
         "--grace-period", str(args.grace_period), "--remove-dirs-on-exit", "--log-level", "WARNING"],
        start_new_session=True, preexec_fn=_terminate_with(os.getpid()),
    )
    try:
        wait_for_socket(sidecar, socket_path)
        env = dict(os.environ, STOWAWAY_SOCKET=str(socket_path), STOWAWAY_JOB=args.job,
                   STOWAWAY_STORAGE=job_at,
                   STOWAWAY_RUN_ID=uuid.uuid4().hex)
        print(f"stowaway: sidecar ready; running {' '.join(command)}", file=sys.stderr, flush=True)
        status = _run_command(command, env)
    finally:
        stop_sidecar(sidecar, args.grace_period)
        shutil.rmtree(shm_dir, ignore_errors=True)
        shutil.rmtree(workdir, ignore_errors=True)
    print(f"stowaway: checkpoints of job {args.job!r} in {job_at}:", file=sys.stderr)
    if args.storage is not None:
        catalog_cmds.print_listing(args.storage / args.job, sys.stderr)
    elif location is not None:
        try:
            job = bucket_jobs.BucketJob(bucket.Bucket(location, bucket.Settings()), args.job)
            bucket_cmds.print_listing(job, sys.stderr)
        except bucket.BucketError as exc:
            print(f"  (cannot list the bucket: {exc})", file=sys.stderr)
    return status


def wait_for_socket(sidecar: subprocess.Popen[bytes], path: Path) -> None:
    """Return once the sidecar accepts connections; fail early if it exits first."""
    deadline = time.monotonic() + STARTUP_TIMEOUT
    while time.monotonic() < deadline:
        if sidecar.poll() is not None:
            raise CommandError(f"the sidecar exited with status {sidecar.returncode} before it was ready; "
                               "see its message above")
        with contextlib.suppress(OSError), socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            probe.connect(str(path))
            return
        time.sleep(0.02)
    raise CommandError(f"the sidecar did not open {path} within {STARTUP_TIMEOUT:.0f} s")


def _run_command(command: list[str], env: dict[str, str]) -> int:
    try:
        child = subprocess.Popen(command, env=env, preexec_fn=_terminate_with(os.getpid()))
    except OSError as exc:
        raise CommandError(f"cannot start {command[0]!r}: {exc.strerror}") from None
    try:
        return child.wait()
    except KeyboardInterrupt:
        return child.wait()


def _terminate_with(launcher: int) -> Callable[[], None]:
    """What a child runs before its program: be sent SIGTERM when the launcher dies, even if it already has."""

    def arrange() -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
        if os.getppid() != launcher:
            os.kill(os.getpid(), signal.SIGTERM)

    return arrange


def stop_sidecar(sidecar: subprocess.Popen[bytes], grace: float) -> None:
    """SIGTERM lets the sidecar finish its persists; it is killed only past the grace period."""
    if sidecar.poll() is None:
        sidecar.send_signal(signal.SIGTERM)
    try:
        sidecar.wait(timeout=grace + 10)
    except subprocess.TimeoutExpired:
        sidecar.kill()
        sidecar.wait()
