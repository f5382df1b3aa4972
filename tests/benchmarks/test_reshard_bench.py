"""The resharding benchmark runs end to end (torchrun jobs, a sidecar each, then one sidecar for a restart on the
same pod) and reports every measurement.

Timings are not asserted: the numbers come from runs on a quiet machine (docs/benchmarks.md).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import obstore
import pytest
from s3server import S3Server

ROOT = Path(__file__).resolve().parents[2]
MEASURED = ("stowaway.load", "stowaway.load_into", "reference.read_direct", "dcp.load")
RATIOS = ("into the state / O_DIRECT read reference", "into the state / DCP load", "into new tensors / DCP load")
# A restart on the same pod: the restores read the old ranks' slots (the worker asserts they did).
FROM_MEMORY = ("stowaway.load", "stowaway.load_into", "reference.copy_out")
MEMORY_RATIOS = ("into the state / copy-out reference", "into new tensors / copy-out reference")
# A bucket alone, on a new pod: the ranges each rank reads are staged into its slots (the worker asserts storage).
FROM_BUCKET = ("stowaway.load", "stowaway.load_into", "reference.download")
BUCKET_RATIOS = ("into the state / download reference", "into new tensors / download reference")


@pytest.mark.timeout(600)
def test_the_reshard_bench_measures_stowaway_dcp_and_the_read_reference_on_fewer_and_more_ranks(tmp_path):
    storage = tmp_path / "storage"
    run = subprocess.run(
        [sys.executable, "-m", "bench.reshard", "--mib", "8", "--saved", "2", "--onto", "1,3", "--reps", "1",
         "--storage", str(storage)],
        cwd=ROOT, capture_output=True, text=True, timeout=540, check=False)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-5000:]
    for ranks in (1, 3):
        report = run.stdout.split(f"restored on {ranks}:\n")[1]
        lines = report.splitlines()[: len(MEASURED) + len(RATIOS)]
        assert [line.split()[0] for line in lines[: len(MEASURED)]] == list(MEASURED), report
        assert [line.split(":")[0].strip() for line in lines[len(MEASURED):]] == list(RATIOS), report
        assert all(float(line.rsplit(":", 1)[1]) > 0 for line in lines[len(MEASURED):]), report
    for ranks in (1, 3):
        report = run.stdout.split(f"restored on {ranks} from shared memory:\n")[1]
        lines = report.splitlines()[: len(FROM_MEMORY) + len(MEMORY_RATIOS)]
        assert [line.split()[0] for line in lines[: len(FROM_MEMORY)]] == list(FROM_MEMORY), report
        assert [line.split(":")[0].strip() for line in lines[len(FROM_MEMORY):]] == list(MEMORY_RATIOS), report
    assert not storage.exists(), "the bench left its storage behind"


@pytest.mark.s3
@pytest.mark.timeout(900)
def test_the_reshard_bench_measures_a_bucket_alone_on_a_new_pod_against_the_download_reference(
        s3_server: S3Server, s3_bucket: str, tmp_path: Path) -> None:
    run = subprocess.run(
        [sys.executable, "-m", "bench.reshard", "--mib", "8", "--saved", "2", "--onto", "3", "--reps", "1",
         "--storage", str(tmp_path / "storage"), "--bucket", f"s3://{s3_bucket}/r"],
        cwd=ROOT, env={**os.environ, **s3_server.env()}, capture_output=True, text=True, timeout=840, check=False)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-5000:]
    report = run.stdout.split("in a bucket alone, restored on 3 on a new pod:\n")[1]
    lines = report.splitlines()[: len(FROM_BUCKET) + len(BUCKET_RATIOS)]
    assert [line.split()[0] for line in lines[: len(FROM_BUCKET)]] == list(FROM_BUCKET), report
    assert [line.split(":")[0].strip() for line in lines[len(FROM_BUCKET):]] == list(BUCKET_RATIOS), report
    assert all(float(line.rsplit(":", 1)[1]) > 0 for line in lines[len(FROM_BUCKET):]), report
    left = [meta["path"] for chunk in obstore.list(s3_server.store(s3_bucket)) for meta in chunk]
    assert left == [], "the bench left its objects in the bucket"
