"""Real sidecar and rank processes for the data-path tests.

Readiness is observed (a socket that accepts, a reply line), never assumed
after a sleep; every wait has a deadline and fails with the process's log.
"""

from __future__ import annotations

import json
import os
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

DRIVER = Path(__file__).with_name("rank_driver.py")
DEADLINE = 60.0


def wait_for(condition: Callable[[], Any], what: str, timeout: float = DEADLINE, interval: float = 0.005,
             log: Callable[[], str] | None = None) -> Any:
    """Poll an observable condition until it holds; fail naming what never happened (and showing ``log``)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result = condition()
        if result:
            return result
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}" + (f":\n{log()}" if log else ""))


def as_user(uid: int, groups: list[int]) -> list[str]:
    """Run a command as ``uid`` (its own group, plus ``groups`` as kubelet adds a pod's fsGroup).

    The virtual environment lies under root's home, which no other uid may
    enter, so the command keeps CAP_DAC_READ_SEARCH: it may read any file,
    but writing the socket, the slots and the storage still takes the
    permissions under test.
    """
    supplementary = f"--groups={','.join(map(str, groups))}" if groups else "--clear-groups"
    return ["setpriv", f"--reuid={uid}", f"--regid={uid}", supplementary,
            "--inh-caps=+dac_read_search", "--ambient-caps=+dac_read_search"]


def other_uids_unavailable() -> str | None:
    """Why processes cannot be run as other uids here, or None."""
    if os.getuid() != 0:
        return "running processes as other uids needs root"
    if shutil.which("setpriv") is None:
        return "running processes as other uids needs setpriv (util-linux)"
    return None


class SidecarProcess:
    def __init__(self, root: Path, storage: Path | None, name: str = "a", extra: list[str] | None = None) -> None:
        """``storage`` None: no directory, the sidecar's ``--bucket`` (in ``extra``) is its storage."""
        self.root = root
        self.storage = storage
        self.name = name
        self.socket = root / f"{name}.sock"
        self.shm_dir = Path("/dev/shm") / root.name / name
        self.log_path = root / f"sidecar-{name}.log"
        self.extra = extra or []
        self.process: subprocess.Popen[bytes] | None = None

    def start(self, extra: list[str] | None = None) -> SidecarProcess:
        args = [
            sys.executable, "-m", "stowaway", "sidecar", *(["--storage", str(self.storage)] if self.storage else []),
            "--socket", str(self.socket), "--shm-dir", str(self.shm_dir), "--node-name", self.name,
            "--keep-last", "1000",
            "--commit-poll-interval", "0.01", *self.extra, *(extra or []),
        ]
        log = self.log_path.open("ab")
        self.process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
        wait_for(self._ready, f"sidecar {self.name} to accept connections")
        return self

    def _ready(self) -> bool:
        assert self.process is not None
        if self.process.poll() is not None:
            raise AssertionError(f"sidecar {self.name} exited with {self.process.returncode}:\n{self.log()}")
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            try:
                probe.connect(str(self.socket))
            except OSError:
                return False
        return True

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def kill(self) -> None:
        assert self.process is not None
        self.process.kill()
        self.process.wait(timeout=DEADLINE)

    def stop(self) -> int:
        """SIGTERM, as Kubernetes sends it; returns the exit status."""
        assert self.process is not None
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        return self.process.wait(timeout=DEADLINE)

    def env(self, job: str, rank: int, world_size: int, local_world_size: int | None = None,
            run_id: str = "test-run") -> dict[str, str]:
        return dict(
            os.environ, STOWAWAY_SOCKET=str(self.socket), STOWAWAY_JOB=job, RANK=str(rank),
            LOCAL_RANK=str(rank % (local_world_size or world_size)), WORLD_SIZE=str(world_size),
            LOCAL_WORLD_SIZE=str(local_world_size or world_size), STOWAWAY_RUN_ID=run_id,
        )


class RankProcess:
    """One rank_driver subprocess."""

    def __init__(self, env: dict[str, str], log_path: Path) -> None:
        self._log = log_path.open("ab")
        self.process = subprocess.Popen(
            [sys.executable, str(DRIVER)], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=self._log, text=True, bufsize=1,
        )
        self._selector = selectors.DefaultSelector()
        assert self.process.stdout is not None
        self._selector.register(self.process.stdout, selectors.EVENT_READ)
        self.log_path = log_path
        ready = self.read()
        assert ready.get("ready"), ready

    @property
    def pid(self) -> int:
        return self.process.pid

    def send(self, **command: Any) -> None:
        assert self.process.stdin is not None
        try:
            self.process.stdin.write(json.dumps(command) + "\n")
            self.process.stdin.flush()
        except BrokenPipeError:
            raise AssertionError(f"rank process ended (status {self.process.wait(DEADLINE)}) before {command}:\n"
                                 f"{self.log_path.read_text()}") from None

    def read(self, timeout: float = DEADLINE) -> dict[str, Any]:
        assert self.process.stdout is not None
        if not self._selector.select(timeout):
            raise AssertionError(f"rank process gave no answer within {timeout} s:\n{self.log_path.read_text()}")
        line = self.process.stdout.readline()
        if not line:
            raise AssertionError(f"rank process ended (status {self.process.poll()}):\n{self.log_path.read_text()}")
        return json.loads(line)

    def call(self, **command: Any) -> dict[str, Any]:
        self.send(**command)
        answer = self.read(DEADLINE + float(command.get("timeout", 0)))
        assert "error" not in answer or "committed" in answer, answer
        return answer

    def save(self, step: int, numel: int = 1024, overlap: bool = False) -> dict[str, Any]:
        return self.call(op="save", step=step, numel=numel, overlap=overlap)

    def wait(self, step: int, timeout: float = 30) -> dict[str, Any]:
        return self.call(op="wait", step=step, timeout=timeout)

    def last_restore(self) -> dict[str, Any] | None:
        """The checkpointer's ``last_restore``, as a dict (step, source, seconds), or None."""
        restore: dict[str, Any] | None = self.call(op="last_restore")["restore"]
        return restore

    def done(self, step: int) -> bool:
        return bool(self.call(op="done", step=step)["done"])

    def exit(self) -> None:
        if self.process.poll() is None:
            self.call(op="exit")
            self.process.wait(timeout=DEADLINE)

    def kill(self) -> None:
        self.process.kill()
        self.process.wait(timeout=DEADLINE)

    def replies_left(self) -> list[dict[str, Any]]:
        """The replies an ended process wrote and nobody read: what it had done before it died."""
        assert self.process.poll() is not None and self.process.stdout is not None
        return [json.loads(line) for line in self.process.stdout.read().splitlines() if line.strip()]


def collective(ranks: list[RankProcess], **command: Any) -> list[dict[str, Any]]:
    """Send ``command`` to every rank before reading any answer: each blocks until all have called it."""
    for rank in ranks:
        rank.send(**command)
    return [rank.read() for rank in ranks]


def join_group(ranks: list[RankProcess], store: Path) -> None:
    """Make the ranks one gloo process group, as a job initialises torch.distributed before ``load()``."""
    assert collective(ranks, op="join_group", store=str(store)) == [{"joined": True}] * len(ranks)


def stowaway_cli(*args: str, **kwargs: Any) -> subprocess.CompletedProcess[str]:
    """The ``stowaway`` command as a user runs it, in the test's environment (its endpoint and credentials)."""
    return subprocess.run([sys.executable, "-m", "stowaway", *args], capture_output=True, text=True, timeout=120,
                          **kwargs)


def local_job(storage: Path, job: str, processes: int, script: Path, *args: str) -> list[str]:
    """The command that runs ``script`` under torchrun next to a local sidecar, as the README shows."""
    return [sys.executable, "-m", "stowaway", "run", "--storage", str(storage), "--job", job, "--",
            sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(processes),
            str(script), *args]
