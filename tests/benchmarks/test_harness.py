"""The benchmark harness runs end to end and reports every measurement, so it cannot rot between recorded runs.

Timings are not asserted here: performance claims come from full runs on a
quiet machine, recorded in docs/benchmarks.md.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench import report

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_small_run_measures_everything_for_each_rank_count(tmp_path):
    storage, out = tmp_path / "storage", tmp_path / "out"
    finished = subprocess.run(
        [sys.executable, "-m", "bench", "--sizes", "8M", "--ranks", "1,2", "--reps", "2",
         "--storage", str(storage), "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=540,
    )
    assert finished.returncode == 0, finished.stderr[-4000:]
    results = json.loads((out / "results.json").read_text())
    assert [r["ranks"] for r in results] == [1, 2]
    for result in results:
        assert result["bytes"] >= 8 * 2**20 * 0.99
        for key, label in report.ROWS:
            values = result["seconds"][key]
            expected = 1 if key.endswith(".first") else 2
            assert len(values) == expected and all(v > 0 for v in values), f"{label}: {values}"
        assert result["sidecar_peak_private_bytes"] > 0 and result["rank_peak_rss_bytes"] > 0
    markdown = (out / "results.md").read_text()
    assert "save blocking / copy reference" in markdown and "| 8 MiB | 2 |" in markdown
    assert not storage.exists() or not any(storage.iterdir()), "the benchmark left files in its storage"
