"""A spare slot pooled by the pod's ranks: borrowed by one rank at a time, and never lost to one that dies.

Each rank has one slot of its own and the two share one spare, so a rank
that saves again while its own slot still persists borrows the spare. The
sidecar persists slowly (a write-rate limit), so a persist lasts about a
second, long enough for the other rank to want the spare meanwhile. The
seed race (test_seed_race.py) runs eight ranks fighting over one spare;
these tests kill its borrower at the two moments that matter.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from metrics.promtools import free_port, http_get, samples
from safetensors.torch import load_file

from data_path.processes import wait_for
from data_path.rank_driver import pattern
from stowaway.protocol.messages import POOLED_SLOT_BASE
from stowaway.slots import header, naming
from stowaway.storage import catalog, layout

JOB = "pool"
WORLD = 2
POOLED = {"STOWAWAY_SLOTS_PER_RANK": "1", "STOWAWAY_POOLED_SPARES": "1"}
NUMEL = 2**20  # float64: 8 MiB per rank and step
RATE = 8 * 2**20  # bytes/s: a persist lasts about a second


@pytest.fixture
def pooled_job(start_sidecar, start_rank):
    """A sidecar with its metrics port open, and a function that starts rank ``r`` of the job with pooled spares."""
    port = free_port()
    sidecar = start_sidecar(extra=["--write-rate-limit", str(RATE), "--metrics-port", str(port),
                                   "--metrics-address", "127.0.0.1"])

    def rank(r: int):
        return start_rank(sidecar, job=JOB, rank=r, world_size=WORLD, extra_env=POOLED)

    def borrowed() -> float:
        """Saves the sidecar was handed in the pooled spare."""
        return samples(http_get(f"http://127.0.0.1:{port}/metrics").body)["stowaway_pooled_spare_saves_total"]

    return sidecar, rank, borrowed


def spare_header(sidecar) -> header.SlotHeader:
    with open(naming.slot_path(sidecar.shm_dir, JOB, 0, POOLED_SLOT_BASE), "rb") as spare:
        return header.read(spare.read(64))


def rank_file(storage: Path, step: int, rank: int) -> Path:
    return layout.step_dir(storage / JOB, step) / layout.rank_file_name(rank, WORLD)


def test_a_borrower_killed_mid_write_leaves_the_spare_to_the_others_and_its_bytes_out_of_storage(
        pooled_job, storage):
    sidecar, start, borrowed = pooled_job
    ranks = [start(0), start(1)]
    ranks[0].save(1, numel=NUMEL)
    # Its own slot persists step 1, so step 2 borrows the spare; the copy thread sleeps before copying into it.
    answer = ranks[0].call(op="save", step=2, numel=NUMEL, overlap=True, copy_delay=60)
    assert "saved" in answer, answer
    assert spare_header(sidecar).state is header.SlotState.WRITING, "step 2 went to the spare"
    ranks[0].kill()

    ranks[1].save(1, numel=NUMEL)
    ranks[1].save(2, numel=NUMEL)  # its own slot still persists step 1: the spare, free again with its holder dead
    wait_for(lambda: borrowed() == 1, "rank 1's save into the spare to be handed to the sidecar")
    wait_for(lambda: rank_file(storage, 2, 1).exists(), "rank 1's step 2 to be durable")
    assert (load_file(rank_file(storage, 2, 1))["w"] == pattern(1, 2)).all()
    assert not rank_file(storage, 2, 0).exists(), "the killed rank's half-written spare reached storage"

    ranks[0] = start(0)  # the restarted rank comes back to step 1, the newest every rank saved, and saves on
    assert ranks[0].call(op="load") == {"step": 1, "intact": True, "numel": NUMEL}
    ranks[0].save(2, numel=NUMEL)
    assert ranks[0].wait(2)["committed"] and ranks[1].wait(2)["committed"]
    assert catalog.verify_step(storage / JOB, 2) == []
    assert (load_file(rank_file(storage, 2, 0))["w"] == pattern(0, 2)).all()


def test_a_borrower_killed_mid_persist_keeps_the_spare_from_others_until_its_persist_ends(pooled_job, storage):
    sidecar, start, borrowed = pooled_job
    ranks = [start(0), start(1)]
    ranks[0].save(1, numel=NUMEL)
    ranks[0].save(2, numel=NUMEL)  # into the spare: its own slot still persists step 1
    wait_for(lambda: borrowed() == 1, "rank 0's save into the spare to be handed to the sidecar")
    tmp = rank_file(storage, 2, 0).with_name(rank_file(storage, 2, 0).name + layout.TMP_SUFFIX)
    wait_for(tmp.exists, "the spare's persist to be under way", interval=0.0005)
    ranks[0].kill()

    # Rank 1's own slot persists step 1 when it saves step 2: the spare would be free to borrow, its borrower
    # dead, were it not the sidecar's until the persist ends. So rank 1 waits for its own slot, and writes that.
    ranks[1].save(1, numel=NUMEL)
    ranks[1].save(2, numel=NUMEL)
    assert ranks[1].wait(1)["committed"] and ranks[1].wait(2)["committed"]
    assert borrowed() == 1, "rank 1 borrowed the spare while the sidecar still persisted the dead rank's step"
    for step in (1, 2):
        assert catalog.verify_step(storage / JOB, step) == []
        for rank in range(WORLD):
            assert (load_file(rank_file(storage, step, rank))["w"] == pattern(rank, step)).all(), (step, rank)

    # Once that persist ended, the spare is free again: the next save made while rank 1's slot persists takes it.
    ranks[1].save(3, numel=NUMEL)
    ranks[1].save(4, numel=NUMEL)
    wait_for(lambda: borrowed() == 2, "rank 1's save of step 4 into the spare to be handed to the sidecar")
    assert spare_header(sidecar).step == 4
