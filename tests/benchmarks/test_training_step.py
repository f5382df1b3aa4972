"""``python -m bench.training_step`` runs end to end and reports every row, on the CPU here and on a GPU there.

The CPU run is tiny and its timings mean nothing (the cores are shared);
it keeps the code path of the GPU measurement (hack/gpu-check) working
between GPU runs: the same model, saves, guard, reference and report.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench import report

ROOT = Path(__file__).resolve().parents[2]
ROWS = {"step.no_save", "step.blocking_save", "save.blocking", "step.overlapped_save", "save.overlapped.staging"}
REPS = 2


def run_step_bench(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "bench.training_step", "--reps", str(REPS), "--storage", str(tmp_path / "storage"),
         "--out", str(tmp_path / "out"), *args],
        cwd=ROOT, capture_output=True, text=True, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"),
    )


def assert_every_row_measured(tmp_path: Path, reference: str) -> dict[str, object]:
    result = json.loads((tmp_path / "out" / "results.json").read_text())
    assert set(result["seconds"]) == ROWS | {reference}
    for key, values in result["seconds"].items():
        assert len(values) == REPS and all(value > 0 for value in values), f"{key}: {values}"
    markdown = (tmp_path / "out" / "results.md").read_text()
    assert all(f"| {target.label} | " in markdown for target in report.STEP_TARGETS), markdown
    storage = tmp_path / "storage"
    assert not storage.exists() or not any(storage.iterdir()), "the benchmark left files in its storage"
    return result


def test_the_training_step_benchmark_measures_every_row_on_the_cpu_at_a_tiny_size(tmp_path):
    finished = run_step_bench(tmp_path, "--device", "cpu", "--size", "2M", "--width", "64", "--batch", "32")
    assert finished.returncode == 0, finished.stderr[-4000:]
    result = assert_every_row_measured(tmp_path, "reference.copy")
    assert result["bytes"] >= 2 * 2**20 * 0.5 and result["layers"] >= 2
    # The overlapped save's copy ends within the step it overlaps, so neither can be shorter than the other allows.
    seconds = result["seconds"]
    assert all(staging < step for staging, step in zip(seconds["save.overlapped.staging"],
                                                      seconds["step.overlapped_save"], strict=True))


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: the GPU run itself is tested instead")
def test_the_training_step_benchmark_refuses_a_gpu_run_without_cuda_before_anything_starts(tmp_path):
    finished = run_step_bench(tmp_path)  # --device cuda is the default: the measurement is meant for a GPU
    assert finished.returncode == 2
    assert "--device cuda needs a CUDA device" in finished.stderr
    assert not (tmp_path / "out").exists() and not (tmp_path / "storage").exists()


@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="no CUDA device here: the training step's GPU run is checked on a machine with one")
def test_the_training_step_benchmark_measures_every_row_on_a_gpu(tmp_path):
    finished = run_step_bench(tmp_path, "--device", "cuda", "--size", "256M", "--width", "2048", "--batch", "4096")
    assert finished.returncode == 0, finished.stderr[-4000:]
    result = assert_every_row_measured(tmp_path, "reference.copy_pinned")
    assert result["device_peak_bytes"] >= result["bytes"]
