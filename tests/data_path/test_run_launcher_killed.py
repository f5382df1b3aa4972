"""``stowaway run`` killed outright leaves nothing running and nothing in ``/dev/shm``.

SIGKILL (or the OOM killer) runs none of the launcher's own clean-up: its
children must notice its death themselves, or the sidecar keeps running and
its slots keep holding the job's state in shared memory until the machine
reboots.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

DEADLINE = 60.0

HOLD = "import os, sys; print(os.getpid(), os.environ['STOWAWAY_SOCKET'], flush=True); sys.stdin.read()"


def _children(pid: int) -> list[int]:
    return [int(child) for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def _gone(pid: int) -> bool:
    """Exited: no such process, or a zombie waiting for whoever inherited it to reap it."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def _until(what: str, done) -> None:
    deadline = time.monotonic() + DEADLINE
    while not done():
        assert time.monotonic() < deadline, f"after {DEADLINE:.0f} s, still not: {what}"
        time.sleep(0.05)


def test_a_killed_launcher_takes_its_sidecar_command_and_directories_with_it(short_tmp):
    launcher = subprocess.Popen(
        [sys.executable, "-m", "stowaway", "run", "--storage", str(short_tmp / "st"), "--", sys.executable, "-c",
         HOLD],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )
    try:
        command_pid, socket_path = launcher.stdout.readline().split()
        sidecar_pid = next(pid for pid in _children(launcher.pid) if pid != int(command_pid))
        argv = Path(f"/proc/{sidecar_pid}/cmdline").read_bytes().decode().split("\0")
        shm_dir = Path(argv[argv.index("--shm-dir") + 1])
        assert shm_dir.is_dir() and Path(socket_path).exists()

        launcher.send_signal(signal.SIGKILL)
        launcher.wait(DEADLINE)

        _until("the training command exited", lambda: _gone(int(command_pid)))
        _until("the sidecar exited", lambda: _gone(sidecar_pid))
        assert not shm_dir.exists(), f"{shm_dir} was left in shared memory"
        assert not Path(socket_path).parent.exists(), f"{Path(socket_path).parent} was left behind"
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
