"""A too-small /dev/shm is reported before anything is written, with the setting to raise."""

from __future__ import annotations

import pytest

from data_path.mounts import tmpfs
from stowaway import Checkpointer, ShmCapacityError
from stowaway.slots import naming


def test_a_too_small_shared_memory_gives_the_documented_error_before_writing(start_sidecar, short_tmp):
    import torch

    with tmpfs(short_tmp / "shm", "8m") as shm:
        sidecar = start_sidecar(extra=["--shm-dir", str(shm)])
        with Checkpointer(job="tiny", socket=sidecar.socket, rank=0, world_size=2, local_world_size=2,
                          timeout=5) as ckpt:
            # 4 MiB per slot, 2 slots, 2 local ranks: 16 MiB; reserving it says so at once, as the save does.
            for attempt in (ckpt.reserve, lambda state: ckpt.save(1, state)):
                with pytest.raises(ShmCapacityError) as raised:
                    attempt({"w": torch.zeros(2**20)})
                message = str(raised.value)
                assert f"shared memory at {shm} is too small" in message
                assert "2 local rank(s) need 16.0 MiB" in message
                assert "spec.sharedMemory.sizeLimit" in message
            assert list(shm.glob(naming.job_slot_glob("tiny"))) == [], "nothing may be written"
            # 1 MiB per slot fits, and the step commits once the other local rank saves it too.
            with Checkpointer(job="tiny", socket=sidecar.socket, rank=1, world_size=2, local_world_size=2,
                              timeout=30) as other:
                handles = [rank.save(2, {"w": torch.zeros(2**18)}) for rank in (ckpt, other)]
                for handle in handles:
                    handle.wait(30)
            assert list(shm.glob(naming.job_slot_glob("tiny")))


def test_the_shared_memory_check_counts_what_this_job_already_holds(start_sidecar, short_tmp):
    import torch

    with tmpfs(short_tmp / "shm", "16m") as shm:
        sidecar = start_sidecar(extra=["--shm-dir", str(shm)])
        with Checkpointer(job="regrow", socket=sidecar.socket, rank=0, world_size=1, timeout=30) as ckpt:
            for step in range(4):
                ckpt.save(step, {"w": torch.zeros(2**20)}).wait(30)  # 2 x 4 MiB slots, reused, not re-counted


def test_one_slot_per_rank_and_a_pooled_spare_fit_where_two_slots_per_rank_do_not(start_sidecar, short_tmp):
    import torch

    state = {"w": torch.zeros(2**20)}  # 4 MiB
    with tmpfs(short_tmp / "shm", "14m") as shm:
        sidecar = start_sidecar(extra=["--shm-dir", str(shm)])
        with (Checkpointer(job="two", socket=sidecar.socket, rank=0, world_size=2, local_world_size=2,
                           timeout=5) as ckpt,
              pytest.raises(ShmCapacityError, match=r"2 local rank\(s\) need 16\.0 MiB")):
            ckpt.reserve(state)
        pooled = [Checkpointer(job="pool", socket=sidecar.socket, rank=rank, world_size=2, local_world_size=2,
                               slots=1, pooled_spares=1, timeout=30) for rank in (0, 1)]
        try:
            # Two saves in a row on each rank, the second while the first may still persist: into the spare, then.
            handles = [ckpt.save(step, state) for step in (1, 2) for ckpt in pooled]
            for handle in handles:
                handle.wait(30)
        finally:
            for ckpt in pooled:
                ckpt.close()
        assert sorted(path.name for path in shm.glob("pool.*")) == [
            "pool.pool.slot00", "pool.rank00000.slot00", "pool.rank00001.slot00"]

    with tmpfs(short_tmp / "shm", "8m") as shm:
        sidecar = start_sidecar("small", extra=["--shm-dir", str(shm)])
        with (Checkpointer(job="pool", socket=sidecar.socket, rank=0, world_size=2, local_world_size=2, slots=1,
                           pooled_spares=1, timeout=5) as ckpt,
              pytest.raises(ShmCapacityError) as raised):
            ckpt.reserve(state)
        assert "2 local rank(s) need 12.0 MiB for their slots (4.0 MiB each and 4.0 MiB of pooled spares)" in str(
            raised.value)
