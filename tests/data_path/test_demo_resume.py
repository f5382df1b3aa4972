"""The README demo: a torchrun job interrupted and restarted resumes bit-identically."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest
import torch

from data_path.processes import local_job, wait_for
from data_path.stored import rank_files
from stowaway.storage import catalog

ROOT = Path(__file__).resolve().parents[2]
STEPS = 8


def demo(storage: Path) -> list[str]:
    return local_job(storage, "demo", 2, ROOT / "examples" / "train.py", "--steps", str(STEPS))


def final_checkpoint(storage: Path) -> list[dict]:
    return rank_files(storage / "demo" / f"step-{STEPS - 1:012d}", 2)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_an_interrupted_demo_resumes_with_state_identical_to_an_uninterrupted_run(short_tmp):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    straight = subprocess.run(demo(short_tmp / "straight"), capture_output=True, text=True, env=env, timeout=300)
    assert straight.returncode == 0, straight.stderr[-3000:]
    assert "saves: 16 across 2 ranks; blocking time p50" in straight.stdout

    interrupted_storage = short_tmp / "interrupted"
    first = subprocess.Popen(demo(interrupted_storage), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             env=env, start_new_session=True)
    wait_for(lambda: len(catalog.committed_steps(interrupted_storage / "demo")) >= 3 or first.poll() is not None,
             "three committed steps of the first run", timeout=240)
    os.killpg(first.pid, signal.SIGINT)  # Ctrl-C in the terminal
    first_output, _ = first.communicate(timeout=240)
    committed = catalog.committed_steps(interrupted_storage / "demo")
    assert committed and committed[-1] < STEPS - 1, f"the interrupt came too late:\n{first_output[-2000:]}"

    resumed = subprocess.run(demo(interrupted_storage), capture_output=True, text=True, env=env, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from step {committed[-1]}; continuing at step {committed[-1] + 1}" in resumed.stdout

    for expected, actual in zip(final_checkpoint(short_tmp / "straight"), final_checkpoint(interrupted_storage),
                                strict=True):
        assert actual["metadata"] == expected["metadata"], "scheduler, RNG and other non-tensor state differ"
        assert actual["tensors"].keys() == expected["tensors"].keys()
        for name, tensor in expected["tensors"].items():
            assert torch.equal(actual["tensors"][name], tensor), f"{name} differs after resume"
