"""Retention: what a sidecar keeps of a job's committed checkpoints."""

from __future__ import annotations

from data_path.processes import wait_for
from stowaway.storage import catalog, layout


def test_keeps_the_last_k_and_every_mth_committed_step_and_nothing_partial(start_sidecar, start_rank, storage):
    sidecar = start_sidecar(extra=["--keep-last", "2", "--keep-every", "5"])
    rank = start_rank(sidecar)
    for step in range(12):
        rank.save(step)
        assert rank.wait(step).get("committed"), f"step {step} was not committed"
    rank.exit()
    job = storage / "job"
    # Retention runs after the ranks hear of a commit, so it may still be deleting when the last one returns.
    wait_for(lambda: catalog.committed_steps(job) == [0, 5, 10, 11], "retention to keep steps 0, 5, 10 and 11")
    assert sorted(layout.step_dirs(job)) == [0, 5, 10, 11], "a removed step left a partial directory behind"
    assert (job / layout.LATEST).read_text().strip() == "11"
