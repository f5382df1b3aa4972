"""The bug this product exists to prevent, provoked thousands of times.

Eight ranks save faster than a throttled storage can persist, with random
pauses, so every rank keeps waiting for its slots. Every save must commit,
every persist must be answered exactly once on its own rank's connection, no
rank may hang, and every committed file must hold exactly what its rank wrote
at that step.

It runs with two slots per rank, blocking and overlapped, and with one slot
per rank and one spare pooled by all eight, which they fight over at every
save: no spare may be written by two ranks at once, or by a rank while the
sidecar still persists it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from metrics.promtools import free_port, http_get, samples
from safetensors.torch import load_file

from stowaway.storage import catalog

RANKS = 8
SAVES_PER_RANK = 256
NUMEL = 4096  # 16 KiB per rank and step
WORKER = Path(__file__).with_name("seed_race_worker.py")


POOLED = {"STOWAWAY_SLOTS_PER_RANK": "1", "STOWAWAY_POOLED_SPARES": "1"}


@pytest.mark.timeout(600)
@pytest.mark.parametrize(("overlap", "slots"), [(False, {}), (True, {}), (False, POOLED)],
                         ids=["blocking", "overlapped", "pooled-spare"])
def test_eight_ranks_saving_faster_than_storage_never_tear_or_hang(start_sidecar, storage, overlap, slots):
    port = free_port()
    sidecar = start_sidecar(extra=["--write-rate-limit", str(4 * 2**20), "--persist-workers", "4",
                                   "--metrics-port", str(port), "--metrics-address", "127.0.0.1"])
    workers = [
        subprocess.Popen(
            [sys.executable, str(WORKER), str(SAVES_PER_RANK), str(NUMEL), *(["overlap"] if overlap else [])],
            env={**sidecar.env("race", rank, RANKS), **slots}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(RANKS)
    ]
    reports = []
    for worker in workers:
        out, err = worker.communicate(timeout=480)
        assert worker.returncode == 0, f"a rank failed or hung:\n{err[-4000:]}"
        reports.append(json.loads(out.strip().splitlines()[-1]))

    total = sum(report["saves"] for report in reports)
    assert total == RANKS * SAVES_PER_RANK >= 2000
    for report in reports:
        assert report["failed"] == [], report["failed"][:3]
        assert report["committed"] == list(range(SAVES_PER_RANK))
        assert report["slots_in_flight"] == 0, "every persist must have been answered, releasing its slot"
    assert sum(report["slot_waits"] for report in reports) > 0, "storage was not slower than saving: no slot waits"
    borrowed = samples(http_get(f"http://127.0.0.1:{port}/metrics").body)["stowaway_pooled_spare_saves_total"]
    if slots:
        assert borrowed >= RANKS, f"the ranks borrowed the pooled spare for {borrowed} saves only"
    else:
        assert borrowed == 0

    job = storage / "race"
    assert catalog.committed_steps(job) == list(range(SAVES_PER_RANK))
    for step in range(SAVES_PER_RANK):
        assert catalog.verify_step(job, step) == []
        for rank in range(RANKS):
            tensors = load_file(job / f"step-{step:012d}" / f"rank-{rank:05d}-of-{RANKS:05d}.safetensors")
            assert (tensors["x"] == float(rank * 100_000 + step)).all(), f"torn: rank {rank} step {step}"
            tail = tensors["tail"]
            assert (tail == step + tail.new_tensor(range(len(tail)))).all(), f"torn tail: rank {rank} step {step}"
    assert "Traceback" not in sidecar.log()
