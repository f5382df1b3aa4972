"""Setting a corrupt committed step aside: it stops being a checkpoint, keeps its bytes, and ``latest`` follows."""

from __future__ import annotations

from pathlib import Path

from stowaway.storage import catalog, layout
from stowaway.storage.set_aside import set_aside


def committed_job(root: Path, steps: list[int], latest: int) -> Path:
    job = root / "job"
    for step in steps:
        step_path = layout.step_dir(job, step)
        step_path.mkdir(parents=True)
        (step_path / layout.rank_file_name(0, 1)).write_bytes(f"bytes of {step}".encode())
        (step_path / layout.MANIFEST).write_text("{}")
    (job / layout.LATEST).write_text(f"{latest}\n")
    return job


def test_the_newest_step_set_aside_is_no_checkpoint_keeps_its_files_and_latest_moves_back(tmp_path):
    job = committed_job(tmp_path, [1, 2, 3], latest=3)
    target = set_aside(job, 3, layout.CORRUPT)
    assert target is not None and target.name.startswith("corrupt-step-000000000003-")
    assert (target / layout.rank_file_name(0, 1)).read_bytes() == b"bytes of 3"
    assert catalog.committed_steps(job) == [1, 2]
    assert layout.set_aside_dirs(job) == [target]
    assert (job / layout.LATEST).read_text() == "2\n"
    assert set_aside(job, 3, layout.CORRUPT) is None, "a second rank that finds the same step corrupt finds it gone"


def test_an_older_step_set_aside_leaves_latest_alone_and_the_last_one_removes_it(tmp_path):
    job = committed_job(tmp_path, [1, 2], latest=2)
    set_aside(job, 1, layout.CORRUPT)
    assert (job / layout.LATEST).read_text() == "2\n"
    set_aside(job, 2, layout.ROLLED_BACK)
    assert catalog.committed_steps(job) == []
    assert not (job / layout.LATEST).exists(), "latest must not name a step that is no checkpoint"
    assert len(layout.set_aside_dirs(job)) == 2
    assert layout.is_job_dir(job), "stowaway ls still finds the job, to list what was set aside"
