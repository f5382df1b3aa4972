"""The bucket benchmark runs end to end against a real S3 server and reports every way it measures.

Timings are not asserted: the numbers come from runs on a quiet machine.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import obstore
import pytest
from s3server import S3Server, weed_binary

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.s3


def test_the_bucket_bench_measures_upload_and_restore_against_the_plain_client(
        s3_server: S3Server, s3_bucket: str, tmp_path: Path) -> None:
    out = tmp_path / "bucket.json"
    run = subprocess.run(
        [sys.executable, "-m", "bench.bucket", "--bucket", f"s3://{s3_bucket}/b", "--sizes", "20M", "--reps", "1",
         "--out", str(out)],
        cwd=ROOT, env={**os.environ, **s3_server.env()}, capture_output=True, text=True, timeout=300,
        check=False)
    assert run.returncode == 0, run.stdout + run.stderr
    (result,) = json.loads(out.read_text())["results"]
    assert result["bytes"] == 20 * 2**20
    assert set(result["seconds"]) == {"upload", "reference_upload", "slot_upload", "restore", "reference_download"}
    assert all(value > 0 for value in result["ratios"].values())
    assert "| 20 MiB |" in run.stdout
    objects = [meta["path"] for chunk in obstore.list(s3_server.store(s3_bucket)) for meta in chunk]
    assert objects == [], "the bench left objects behind"


def test_the_bucket_bench_starts_a_local_server_of_its_own_as_make_bench_asks_it_to(tmp_path: Path) -> None:
    weed_binary()  # skips, saying why, where weed cannot be built
    out = tmp_path / "bucket.json"
    run = subprocess.run([sys.executable, "-m", "bench.bucket", "--bucket", "local", "--sizes", "4M", "--reps", "1",
                          "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert run.returncode == 0, run.stdout + run.stderr
    assert json.loads(out.read_text())["bucket"] == "local"
    assert "| 4 MiB |" in run.stdout
