"""A job's steps must grow: a run that starts over under the job's name without ``load()`` is told so.

``load()`` resumes from the newest step and retention keeps the newest steps.
An older step used to commit, and the retention of its own commit deleted it
at once: the new run's checkpoints vanished while every ``wait()`` said
committed, and after a crash ``load()`` restored the old run's state.
"""

from __future__ import annotations

from data_path.processes import stowaway_cli, wait_for
from stowaway.storage import catalog, layout, rollbacks


def test_a_step_older_than_the_newest_committed_one_is_refused_with_why_and_nothing_is_lost(
    start_sidecar, start_rank, storage
):
    sidecar = start_sidecar(extra=["--keep-last", "2"])
    first = start_rank(sidecar, job="order", run_id="first-run")
    for step in (1, 2, 3):
        first.save(step)
        assert first.wait(step)["committed"]
    first.exit()

    again = start_rank(sidecar, job="order", run_id="second-run")
    again.save(0)
    refused = again.wait(0)
    assert not refused["committed"]
    assert "step 0 is older than step 3, the newest committed checkpoint of job order" in refused["error"]
    assert "give it another job name (STOWAWAY_JOB)" in refused["error"]
    assert "rank 0: step 0 was not committed: step 0 is older than step 3" in again.log_path.read_text(), \
        "a loop that never waits for its handles sees it in the rank's log"
    assert "step 0 of job order refused" in sidecar.log()
    again.save(3)
    assert "step 3 of job order is already committed" in again.wait(3)["error"]
    wait_for(lambda: catalog.committed_steps(storage / "order") == [2, 3], "retention to keep steps 2 and 3")
    assert again.call(op="load") == {"step": 3, "intact": True, "numel": 1024}

    again.save(4)
    assert again.wait(4)["committed"], "a step past the newest commits"
    # Retention runs after the rank hears of the commit.
    wait_for(lambda: catalog.committed_steps(storage / "order") == [3, 4], "retention to keep steps 3 and 4")


def test_rollback_sets_the_newer_steps_aside_so_the_job_resumes_from_the_older_one_and_saves_on(
    start_sidecar, start_rank, storage
):
    sidecar = start_sidecar()
    first = start_rank(sidecar, job="spike", run_id="first-run")
    for step in (1, 2, 3):
        first.save(step)
        assert first.wait(step)["committed"]
    first.exit()
    job = storage / "spike"
    files_of_3 = {path.name: path.read_bytes() for path in layout.step_dir(job, 3).iterdir()}

    unknown = stowaway_cli("rollback", str(job), "--to", "7")
    assert unknown.returncode == 2
    assert "step 7 is not committed in" in unknown.stderr and "nothing was set aside" in unknown.stderr
    assert catalog.committed_steps(job) == [1, 2, 3]

    done = stowaway_cli("rollback", str(job), "--to", "1")
    assert done.returncode == 0, done.stderr
    assert "step 1 is now the newest committed step" in done.stdout
    assert catalog.committed_steps(job) == [1]
    assert (job / layout.LATEST).read_text() == "1\n"
    aside = {int(path.name.split("-")[3]): path for path in layout.set_aside_dirs(job)}
    assert sorted(aside) == [2, 3] and all(path.name.startswith("rolled-back-step-") for path in aside.values())
    assert {path.name: path.read_bytes() for path in aside[3].iterdir()} == files_of_3, "nothing is deleted"
    assert [record.to for record in rollbacks.recorded(job)] == [1], "a bucket tier needs the record"

    again = start_rank(sidecar, job="spike", run_id="second-run")
    assert again.call(op="load") == {"step": 1, "intact": True, "numel": 1024}
    again.save(2)
    assert again.wait(2)["committed"], "the job saves the steps after the one it went back to"
    assert str(aside[3]) in stowaway_cli("ls", str(job)).stdout

