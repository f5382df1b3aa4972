"""A live rank whose sidecar restarts keeps saving, whatever became of the shared memory the sidecar had.

In a pod the memory ``emptyDir`` outlives a restart of the sidecar
container, and the rank's slots are still there. A sidecar started again with
an emptied directory, or with another one (a local ``stowaway run`` makes a
new one each time), cannot open the slot files the rank still maps: the rank
must allocate them again where the sidecar looks, not fail every later save.
Each test keeps one rank process (one ``Checkpointer``) across the restart.
"""

from __future__ import annotations

from pathlib import Path

from data_path.processes import RankProcess, SidecarProcess, wait_for
from stowaway.slots import naming
from stowaway.storage import catalog

JOB = "revive"
SLOTS = 2  # the default
# The restarted sidecar persists a save's 8 KiB in about a second, so that the save after it, made at once,
# finds the first slot still in flight and takes the second: both slots are used after the restart.
SLOW = ["--write-rate-limit", "8192"]


def slot_paths(shm_dir: Path) -> list[Path]:
    return [naming.slot_path(shm_dir, JOB, 0, index) for index in range(SLOTS)]


def save_committed(rank: RankProcess, steps: range, shm_dir: Path) -> None:
    """Save and commit ``steps`` one by one; then see the second slot, which the rank allocates aside, there too."""
    for step in steps:
        rank.save(step)
        answer = rank.wait(step)
        assert answer["committed"], f"step {step}: {answer}"
    wait_for(lambda: all(path.exists() for path in slot_paths(shm_dir)), "the rank to allocate its second slot")


def save_into_both_slots(rank: RankProcess, first: int) -> None:
    """Save ``first`` and the step after it before either commits, then see both commit."""
    for step in (first, first + 1):
        rank.save(step)
    for step in (first, first + 1):
        answer = rank.wait(step)
        assert answer["committed"], f"step {step}: {answer}"


def restores_newest_from_memory(rank: RankProcess, step: int) -> None:
    assert rank.call(op="load") == {"step": step, "intact": True, "numel": 1024}
    restore = rank.last_restore()
    assert restore is not None and (restore["step"], restore["source"]) == (step, "memory"), restore


def rank_log(rank: RankProcess) -> str:
    return rank.log_path.read_text(errors="replace")


def test_a_rank_whose_sidecar_restarts_with_its_shared_memory_intact_keeps_its_slots(
    start_sidecar, start_rank, storage
):
    sidecar = start_sidecar()
    rank = start_rank(sidecar, job=JOB)
    save_committed(rank, range(1, 3), sidecar.shm_dir)
    files = [path.stat().st_ino for path in slot_paths(sidecar.shm_dir)]
    assert sidecar.stop() == 0

    sidecar.start(SLOW)
    restores_newest_from_memory(rank, 2)
    save_into_both_slots(rank, 3)
    assert [path.stat().st_ino for path in slot_paths(sidecar.shm_dir)] == files, "the slots were kept, not remade"
    assert "allocated there anew" not in rank_log(rank)
    assert catalog.committed_steps(storage / JOB) == [1, 2, 3, 4]


def test_a_rank_whose_sidecar_comes_back_with_emptied_shared_memory_allocates_its_slots_again_and_saves(
    start_sidecar, start_rank, storage
):
    sidecar = start_sidecar()
    rank = start_rank(sidecar, job=JOB)
    save_committed(rank, range(1, 3), sidecar.shm_dir)
    sidecar.kill()  # a crash; the pod-level directory is then emptied, as a fresh emptyDir would be
    for path in slot_paths(sidecar.shm_dir):
        path.unlink()

    sidecar.start(SLOW)
    # This load and these saves raised SidecarUnavailable: the rank registered slot files the sidecar could not open.
    assert rank.call(op="load") == {"step": 2, "intact": True, "numel": 1024}
    assert rank.last_restore()["source"] == "storage", "the memory that held step 2 is gone"
    save_into_both_slots(rank, 3)
    assert all(path.exists() for path in slot_paths(sidecar.shm_dir))
    assert catalog.committed_steps(storage / JOB) == [1, 2, 3, 4]
    assert catalog.verify_step(storage / JOB, 4) == []
    restores_newest_from_memory(rank, 4)
    assert "allocated there anew" in rank_log(rank)


def test_a_rank_whose_sidecar_comes_back_with_another_directory_moves_its_slots_there_and_frees_the_old(
    start_sidecar, start_rank, storage
):
    sidecar: SidecarProcess = start_sidecar()
    rank = start_rank(sidecar, job=JOB)
    save_committed(rank, range(1, 3), sidecar.shm_dir)
    old_dir = sidecar.shm_dir
    assert sidecar.stop() == 0

    sidecar.shm_dir = old_dir.with_name("elsewhere")  # the same socket and storage, another shared memory
    sidecar.start(SLOW)
    save_into_both_slots(rank, 3)
    assert all(path.exists() for path in slot_paths(sidecar.shm_dir))
    assert not any(path.exists() for path in slot_paths(old_dir)), "files nobody opens again still hold memory"
    assert catalog.committed_steps(storage / JOB) == [1, 2, 3, 4]
    restores_newest_from_memory(rank, 4)
