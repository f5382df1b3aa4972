"""A step saved on one number of ranks loads on another: each rank assembles its new shards from stored ranges.

Real torchrun jobs (gloo, CPU) next to a real sidecar: one saves, a later
one with another number of ranks loads, through descriptors the sidecar
passes, reading only the byte ranges its new shards need.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

from data_path.processes import local_job
from stowaway.storage import layout

WORKER = Path(__file__).with_name("reshard_worker.py")


def job(storage: Path, ranks: int, mode: str, out: Path, shape: str = "fsdp") -> list[dict]:
    out.mkdir(exist_ok=True)
    done = subprocess.run(local_job(storage, "elastic", ranks, WORKER, mode, str(out), shape), capture_output=True,
                          text=True, env=dict(os.environ, OMP_NUM_THREADS="1"), timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    return [json.loads((out / f"{mode}-{rank}.json").read_text()) for rank in range(ranks)]


def assert_identical(saved: dict, restored: dict) -> None:
    assert saved["model"].keys() == restored["model"].keys()
    for name, tensor in saved["model"].items():
        assert torch.equal(restored["model"][name], tensor), name
    assert saved["optimizer"].keys() == restored["optimizer"].keys()
    for index, entries in saved["optimizer"].items():
        for key, value in entries.items():
            assert torch.equal(restored["optimizer"][index][key], value), f"optimizer {index} {key}"


def stored_bytes(storage: Path) -> list[int]:
    step = layout.step_dir(storage / "elastic", 2)
    return [path.stat().st_size for path in sorted(step.glob("rank-*.safetensors"))]


@pytest.mark.timeout(900)
def test_fsdp2_saved_on_4_ranks_loads_on_2_3_and_4_bit_identical_reading_only_overlapping_ranges(short_tmp):
    storage = short_tmp / "s"
    job(storage, 4, "save", short_tmp / "saved")
    saved = torch.load(short_tmp / "saved" / "save.pt")
    files = stored_bytes(storage)
    for ranks, mode in ((2, "load"), (3, "load_into"), (3, "load"), (4, "load")):
        out = short_tmp / f"on{ranks}{mode}"
        restores = job(storage, ranks, mode, out)
        assert_identical(saved, torch.load(out / f"{mode}.pt"))
        if ranks == 4:
            assert restores == [{"saved_by": 4, "bytes_read": 0}] * 4, "the same world size is staged as before"
            continue
        assert [restore["saved_by"] for restore in restores] == [4] * ranks
        read = [restore["bytes_read"] for restore in restores]
        # Each rank reads its share of the tensor bytes, plus the headers and at most a piece each side of a range.
        share = sum(files) / ranks
        assert all(count < share + 4 * 256 * 2**10 + sum(files) * 0.1 for count in read), (read, files)
        assert all(count < sum(files) * 0.75 for count in read), (read, files)
