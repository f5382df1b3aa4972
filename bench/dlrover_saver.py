"""DLRover's checkpoint saver in a process of its own, as its agent hosts it: ``python -m bench.dlrover_saver``.

Under ``dlrover-run``, DLRover's elastic agent (the parent of the training
processes) starts the saver (``AsyncCheckpointSaver.start_async_saving_ckpt``)
before it starts them with the role ``dlrover-trainer``, and registers its
signal handlers: on SIGTERM the saver persists what shared memory holds that
it has not, then unlinks it. Started any other way, each node's local rank 0
forks a saver from itself when it creates its checkpointer, state and all.
The harness runs this module in the agent's place, next to the torchrun that
starts the ranks with that role, so that the saver is not a fork of a
training process and its memory can be measured on its own, as the Stowaway
sidecar's is. DLRover names its sockets and shared memory after the run id
(``TORCHELASTIC_RUN_ID``), which the harness gives torchrun too.

``start`` and ``stop`` are the harness's side; only ``main`` imports DLRover.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path

# Where DLRover 0.6.1 puts its sockets (dlrover.python.common.multi_process.SOCKET_TMP_DIR), one folder a run.
SOCKET_DIR = Path("/tmp/ckpt_sock")
SHM_DIR = Path("/dev/shm")
START_TIMEOUT = 60.0


def shm_prefix(run_id: str) -> str:
    """The names DLRover gives its shared memory in a run: ``<run id>_ckpt_shm_<local rank>``."""
    return f"{run_id}_ckpt_shm_"


def start(env: Mapping[str, str], run_id: str, cwd: Path) -> subprocess.Popen[bytes]:
    """The saver, once it listens for the ranks' request to create it."""
    saver = subprocess.Popen([sys.executable, "-m", "bench.dlrover_saver"], env=dict(env, TORCHELASTIC_RUN_ID=run_id),
                             cwd=cwd, start_new_session=True)
    factory = SOCKET_DIR / run_id / "sharedqueue_factory.sock"
    deadline = time.monotonic() + START_TIMEOUT
    while not factory.exists():
        if saver.poll() is not None:
            raise RuntimeError(f"DLRover's saver exited with {saver.returncode} before it listened on {factory}; "
                               "its output above says why")
        if time.monotonic() > deadline:
            stop(saver, run_id)
            raise TimeoutError(f"DLRover's saver did not listen on {factory} within {START_TIMEOUT:.0f} s")
        time.sleep(0.05)
    return saver


def stop(saver: subprocess.Popen[bytes], run_id: str) -> None:
    """SIGTERM, as an agent stops it (it then unlinks its shared memory), then whatever it left behind."""
    saver.terminate()
    try:
        saver.wait(60)
    except subprocess.TimeoutExpired:
        saver.kill()
        saver.wait()
    shutil.rmtree(SOCKET_DIR / run_id, ignore_errors=True)
    for leftover in SHM_DIR.glob(f"{shm_prefix(run_id)}*"):
        leftover.unlink(missing_ok=True)


def main() -> None:
    from dlrover.python.elastic_agent.torch.ckpt_saver import AsyncCheckpointSaver

    AsyncCheckpointSaver.start_async_saving_ckpt()
    AsyncCheckpointSaver.register_signal_handler()
    # The saver's own threads do the work; this one only waits for the signal that ends it.
    while True:
        signal.pause()


if __name__ == "__main__":
    main()
