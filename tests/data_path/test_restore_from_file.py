"""A rank restoring from storage onto the CPU reads its own stored file, through a descriptor the sidecar passes.

What a user gains: the restore a failed job waits for makes one pass over
the state's bytes and no slot is allocated for it; the slot comes later, from
``reserve`` or the first save. These tests prove the path from what the rank
reports it read and from what the new pod's shared memory holds, with the
storage on a disk (read with ``O_DIRECT``) and on tmpfs (which refuses it).
The state spans more than one of the reader's chunks, so a tensor is copied
from two.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from data_path.processes import RankProcess, SidecarProcess
from stowaway.client import file_restore
from stowaway.storage import layout

JOB = "tiny-lm"
# float64 elements: five and a half of the reader's chunks, more than its buffers, so that buffers are read into
# again while other reads are in flight.
NUMEL = 11 * file_restore.CHUNK_BYTES // 16
assert NUMEL * 8 > file_restore.BUFFERS * file_restore.CHUNK_BYTES


def stored_file(storage: Path, step: int) -> Path:
    return layout.step_dir(storage / JOB, step) / layout.rank_file_name(0, 1)


def shared_memory_bytes(sidecar: SidecarProcess) -> int:
    return sum(path.stat().st_size for path in sidecar.shm_dir.rglob("*") if path.is_file())


def saved_then_moved(start_sidecar, start_rank, storage: Path) -> tuple[SidecarProcess, RankProcess]:
    """Steps 11 and 12 saved in one pod; a rank in a new pod (the same storage, empty shared memory)."""
    old_pod = start_sidecar("a", storage_dir=storage)
    rank = start_rank(old_pod, job=JOB)
    for step in (11, 12):
        rank.save(step, numel=NUMEL)
        assert rank.wait(step)["committed"]
    rank.exit()
    assert old_pod.stop() == 0
    new_pod = start_sidecar("b", storage_dir=storage)
    return new_pod, start_rank(new_pod, job=JOB)


@pytest.fixture(params=["disk", "tmpfs"])
def storage_dir(request, short_tmp: Path, storage: Path) -> Path:
    if request.param == "disk":
        return storage
    return Path("/dev/shm") / short_tmp.name / "storage"


def test_a_rank_in_a_new_pod_reads_its_own_file_and_allocates_no_slot(start_sidecar, start_rank, storage_dir):
    new_pod, fresh = saved_then_moved(start_sidecar, start_rank, storage_dir)
    assert fresh.call(op="load") == {"step": 12, "intact": True, "numel": NUMEL}
    restore = fresh.last_restore()
    assert restore is not None and (restore["step"], restore["source"]) == (12, "storage"), restore
    assert restore["bytes_read"] == stored_file(storage_dir, 12).stat().st_size, restore
    assert shared_memory_bytes(new_pod) < NUMEL * 8, sorted(new_pod.shm_dir.rglob("*"))
    # The slot comes with the first save, which commits as usual.
    fresh.save(13, numel=NUMEL)
    assert fresh.wait(13)["committed"]


def test_a_restore_into_the_ranks_own_tensor_reads_the_file_straight_into_it(start_sidecar, start_rank, storage):
    new_pod, fresh = saved_then_moved(start_sidecar, start_rank, storage)
    assert fresh.call(op="load", into=NUMEL) == {"step": 12, "intact": True, "numel": NUMEL, "in_place": True}
    restore = fresh.last_restore()
    assert restore is not None and restore["bytes_read"] == stored_file(storage, 12).stat().st_size, restore
    assert shared_memory_bytes(new_pod) < NUMEL * 8


def test_a_file_the_rank_finds_corrupt_is_staged_by_the_sidecar_which_sets_the_step_aside(
    start_sidecar, start_rank, storage
):
    _, fresh = saved_then_moved(start_sidecar, start_rank, storage)
    newest = stored_file(storage, 12)
    data = bytearray(newest.read_bytes())
    data[NUMEL * 4] ^= 0x01  # in the middle of the tensor: the header still parses
    newest.write_bytes(bytes(data))
    assert fresh.call(op="load") == {"step": 11, "intact": True, "numel": NUMEL}
    restore = fresh.last_restore()
    assert restore is not None and restore["step"] == 11 and restore["bytes_read"] > 0, restore
    assert not layout.step_dir(storage / JOB, 12).exists(), "the corrupt step was set aside"
    # So the job can save step 12 again.
    fresh.save(12, numel=NUMEL)
    assert fresh.wait(12)["committed"]
    assert fresh.call(op="load") == {"step": 12, "intact": True, "numel": NUMEL}
