"""A job restarted on another number of ranks whose state differs per rank is told so by ``load()``.

DTensors are resharded (``test_reshard``); plain state is restored on
another number of ranks only when every saved rank holds the same. These
ranks save their own rank number and a tensor of their own, which no rule
can hand to a new rank: ``load()`` refuses by name (``WorldSizeChanged``),
instead of skipping the step and training again from scratch, and the step
stays loadable on the number of ranks that saved it.
"""

from __future__ import annotations

from data_path.processes import collective, join_group
from data_path.stored import rank_files
from stowaway.storage import catalog, layout


def saved_and_committed(ranks, *steps: int) -> None:
    for step in steps:
        for rank in ranks:
            rank.save(step)
        for rank in ranks:
            assert rank.wait(step)["committed"]


def test_a_job_restarted_on_fewer_ranks_is_refused_with_the_step_and_both_counts_and_loses_nothing(
    start_sidecar, start_rank, storage
):
    sidecar = start_sidecar()
    two = [start_rank(sidecar, job="resized", rank=rank, world_size=2) for rank in range(2)]
    saved_and_committed(two, 1, 2)
    for rank in two:
        rank.exit()
    stored = rank_files(layout.step_dir(storage / "resized", 2), 2)

    one = start_rank(sidecar, job="resized", rank=0, world_size=1)
    one.send(op="load")
    refused = one.read()
    assert refused["type"] == "WorldSizeChanged", refused
    assert ("step 2 of job resized was saved by 2 ranks and this job has 1, and it cannot be resharded: "
            "state['rank'] is 0 in saved rank 0's file and 1 in rank 1's") in refused["error"]
    assert "run the job on 2 ranks" in refused["error"]
    one.send(op="load", step=1)
    assert "step 1 of job resized was saved by 2 ranks" in one.read()["error"], "an explicit step is refused too"
    one.exit()

    again = [start_rank(sidecar, job="resized", rank=rank, world_size=2) for rank in range(2)]
    assert [rank.call(op="load") for rank in again] == [{"step": 2, "intact": True, "numel": 1024}] * 2
    assert catalog.committed_steps(storage / "resized") == [1, 2]
    for before, after in zip(stored, rank_files(layout.step_dir(storage / "resized", 2), 2), strict=True):
        assert before["metadata"] == after["metadata"]
        assert all(after["tensors"][name].equal(tensor) for name, tensor in before["tensors"].items())


def test_ranks_in_a_process_group_all_refuse_a_newer_step_of_another_size_and_name_the_older_one_they_can_load(
    start_sidecar, start_rank, short_tmp
):
    sidecar = start_sidecar()
    alone = start_rank(sidecar, job="grown", rank=0, world_size=1)
    saved_and_committed([alone], 1)
    alone.exit()
    four = [start_rank(sidecar, job="grown", rank=rank, world_size=4) for rank in range(4)]
    saved_and_committed(four, 2)
    for rank in four:
        rank.exit()

    pair = [start_rank(sidecar, job="grown", rank=rank, world_size=2) for rank in range(2)]
    join_group(pair, short_tmp / "grown-group")
    assert [answer["type"] for answer in collective(pair, op="load")] == ["WorldSizeChanged"] * 2, \
        "every rank of the group refuses, none is left waiting in a collective"
    for rank in pair:
        rank.exit()
    fresh = start_rank(sidecar, job="grown", rank=0, world_size=1)
    fresh.send(op="load")
    refused = fresh.read()
    assert "step 2 of job grown was saved by 4 ranks and this job has 1" in refused["error"], refused
    assert refused["error"].endswith("or pass step=1 to load() to resume from the newest step saved by 1 ranks")
    assert fresh.call(op="load", step=1) == {"step": 1, "intact": True, "numel": 1024}
