"""The benchmark harness runs end to end and reports every measurement, so it cannot rot between recorded runs.

Timings are not asserted here: performance claims come from full runs on a
quiet machine, recorded in docs/benchmarks.md.
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
GPU_ONLY = {"reference.copy_pinned"}
# On a GPU a restore into the state's own tensors is staged through the slot, which then holds the step.
CPU_ONLY = {"stowaway.restore.storage_into"}
# Measured only from the harness's own environment, which has DLRover (tests/benchmarks/test_dlrover_and_charts.py);
# these runs use the project's Python, which does not.
DLROVER = {key for key, _ in report.ROWS if key.startswith("dlrover.")}


def measured_keys(rows: set[str]) -> set[str]:
    """The report's rows, and for each CPU time the sum over all ranks that its CPU floor needs."""
    return rows | {key.removesuffix(".cpu") + ".cpu_all" for key in rows if key.endswith(".cpu")}


def run_bench(tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "bench", "--sizes", "8M", "--reps", "2", "--storage", str(tmp_path / "storage"),
         "--out", str(tmp_path / "out"), *args],
        cwd=ROOT, capture_output=True, text=True, timeout=540, env={**os.environ, **(env or {})},
    )


def assert_everything_measured(tmp_path: Path, ranks: list[int], expected_keys: set[str]) -> None:
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    assert [r["ranks"] for r in results] == ranks
    for result in results:
        assert result["bytes"] >= 8 * 2**20 * 0.99
        assert set(result["seconds"]) == expected_keys
        for key in expected_keys:
            values = result["seconds"][key]
            expected = 1 if key.endswith(".first") else 2
            assert len(values) == expected and all(v > 0 for v in values), f"{key}: {values}"
        assert result["sidecar_peak_private_bytes"] > 0 and result["rank_peak_rss_bytes"] > 0
        # One slot per rank and one spare: (N + 1) / N of the state, less than two slots per rank from 2 ranks on.
        pooled, ranks_of = result["stowaway_pooled_shm_bytes"], result["ranks"]
        assert pooled >= result["bytes"] * (ranks_of + 1) / ranks_of * 0.99
        assert ranks_of == 1 or pooled < result["stowaway_peak_shm_bytes"]
        # Issue 23 counts the ranks' private memory in the footprint, and it holds the state itself.
        assert result["stowaway_pooled_ranks_private_bytes"] >= result["bytes"]
    markdown = (tmp_path / "out" / "results.md").read_text()
    assert "save blocking / copy reference" in markdown and f"| 8 MiB | {ranks[-1]} |" in markdown
    assert all(f"{label} |" in markdown for label, _ in report.CPU_FLOORS)
    storage = tmp_path / "storage"
    assert not storage.exists() or not any(storage.iterdir()), "the benchmark left files in its storage"


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_benchmark_harness_measures_everything_for_each_rank_count_in_a_small_run(tmp_path):
    finished = run_bench(tmp_path, "--ranks", "1,2")
    assert finished.returncode == 0, finished.stderr[-4000:]
    assert "DLRover is not installed in this Python" in finished.stderr
    assert_everything_measured(tmp_path, [1, 2], measured_keys({key for key, _ in report.ROWS} - GPU_ONLY - DLROVER))


@pytest.mark.s3
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_benchmark_harness_measures_the_bucket_tier_in_the_same_run(tmp_path, s3_server, s3_bucket):
    target = f"s3://{s3_bucket}/h"
    finished = run_bench(tmp_path, "--ranks", "1", "--bucket", target, "--bucket-sizes", "8M", env=s3_server.env())
    assert finished.returncode == 0, finished.stderr[-4000:]
    (uploads,) = json.loads((tmp_path / "out" / "bucket.json").read_text())["results"]
    assert uploads["bytes"] == 8 * 2**20
    assert set(uploads["seconds"]) == {"upload", "reference_upload", "slot_upload", "restore", "reference_download"}
    assert all(len(values) == 2 for values in uploads["seconds"].values())
    markdown = (tmp_path / "out" / "results.md").read_text()
    assert f"### Bucket tier against {target}" in markdown and "| size | upload MB/s |" in markdown
    assert "save blocking / copy reference" in markdown, "the bucket rows come with the rest of the run"


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: the GPU run itself is tested instead")
def test_the_benchmark_harness_refuses_a_gpu_run_without_cuda_before_anything_starts(tmp_path):
    finished = run_bench(tmp_path, "--ranks", "1", "--device", "cuda")
    assert finished.returncode == 2
    assert "--device cuda needs a CUDA device" in finished.stderr and "leave --device out" in finished.stderr
    assert not (tmp_path / "out").exists() and not (tmp_path / "storage").exists()


@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="no CUDA device here: the GPU run of the harness is checked on a machine with one")
@pytest.mark.timeout(600)
def test_the_benchmark_harness_measures_the_pinned_copy_too_in_a_small_gpu_run(tmp_path):
    finished = run_bench(tmp_path, "--ranks", "1,2", "--device", "cuda")
    assert finished.returncode == 0, finished.stderr[-4000:]
    assert_everything_measured(tmp_path, [1, 2],
                               measured_keys({key for key, _ in report.ROWS} - CPU_ONLY - DLROVER))
    assert "save blocking / pinned copy reference" in (tmp_path / "out" / "results.md").read_text()


def test_the_benchmark_harness_first_touch_probe_times_each_round_and_says_whether_memory_goes_back() -> None:
    finished = subprocess.run([sys.executable, "-m", "bench.first_touch", "--mib", "8", "--rounds", "2"],
                              cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert finished.returncode == 0, finished.stderr
    lines = finished.stdout.splitlines()
    assert lines[0].startswith(("freed memory handed back to the host since boot: ",
                                "this kernel reports no memory handed back to a host"))
    assert [line.split(":")[0] for line in lines[1:]] == ["round 0", "round 1"]
    assert all(line.endswith(" ms per MiB") and " 8 MiB in " in line for line in lines[1:])


def test_the_allocation_probe_measures_reserve_spares_and_restores_against_their_references() -> None:
    finished = subprocess.run([sys.executable, "-m", "bench.allocation", "--mib", "8", "--reps", "1"],
                              cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert finished.returncode == 0, finished.stderr
    measured = {line.split()[0] for line in finished.stdout.splitlines() if " median " in line}
    assert {"reference.first_touch", "save.first", "reserve.first_slot_left_before", "reserve.no_slot_yet",
            "save.steady", "restore.memory", "reference.copy_out_fresh", "restore.storage", "restore.storage_new_pod",
            "reference.torch_load"} <= measured
    for label in ("reserve(wait=True), first slot left before / first touch", "cold first save / first touch",
                  "restore from memory / copy-out", "restore from storage / torch.load, cold cache"):
        assert f"{label}: " in finished.stdout
