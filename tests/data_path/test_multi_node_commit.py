"""Two sidecars ("nodes") sharing one storage: a checkpoint commits only when all ranks are durable."""

from __future__ import annotations

import pytest

from data_path.processes import collective, join_group, wait_for
from stowaway.storage import catalog, layout, manifest


def test_the_checkpoint_commits_only_when_every_rank_on_every_node_is_durable(start_sidecar, start_rank, storage,
                                                                              short_tmp):
    node_a = start_sidecar("a")
    node_b = start_sidecar("b")
    ranks = [start_rank(node_a if rank < 2 else node_b, job="multi", rank=rank, world_size=4, local_world_size=2)
             for rank in range(4)]
    step_path = layout.step_dir(storage / "multi", 1)

    for rank in ranks[:3]:
        rank.save(1)
    wait_for(lambda: (step_path / layout.receipt_name("a")).exists(), "node a's receipt for its two ranks")
    wait_for(lambda: (step_path / layout.rank_file_name(2, 4)).exists(), "rank 2's durable file on node b")
    assert not (step_path / layout.receipt_name("b")).exists(), "node b still misses rank 3"
    assert not (step_path / layout.MANIFEST).exists()
    assert not any(rank.done(1) for rank in ranks[:3]), "three of four ranks must not commit"

    ranks[3].save(1)
    for rank in ranks:
        assert rank.wait(1)["committed"]
    found = manifest.read_manifest(step_path)
    assert found.world_size == 4 and found.nodes == ["a", "b"]
    assert [entry.rank for entry in found.files] == [0, 1, 2, 3]
    assert catalog.verify_step(storage / "multi", 1) == []

    for step in (2, 3):
        for rank in ranks:
            rank.save(step)
        for rank in ranks:
            assert rank.wait(step)["committed"]
    ranks[2].send(op="load")  # without a process group, nodes cannot agree on the step
    refused = ranks[2].read()
    assert refused["type"] == "ConfigurationError" and "init_process_group() before load()" in refused["error"]
    join_group(ranks, short_tmp / "group")
    assert collective(ranks, op="load") == [{"step": 3, "intact": True, "numel": 1024}] * 4


def test_a_node_that_never_reports_fails_the_step_with_a_commit_timeout(start_sidecar, start_rank, storage):
    node_a = start_sidecar("a", extra=["--commit-timeout", "2"])
    ranks = [start_rank(node_a, job="lonely", rank=rank, world_size=4, local_world_size=2) for rank in range(2)]
    for rank in ranks:
        rank.save(1)
    for rank in ranks:
        answer = rank.wait(1, timeout=30)
        assert not answer["committed"]
        assert "commit of step 1 timed out after 2 s waiting for receipts of ranks 2, 3" in answer["error"]
    assert not (layout.step_dir(storage / "lonely", 1) / layout.MANIFEST).exists()


def test_a_local_rank_that_never_saves_fails_the_step_at_the_commit_timeout(start_sidecar, start_rank, storage):
    node = start_sidecar("a", extra=["--commit-timeout", "1"])
    saver = start_rank(node, job="half", rank=0, world_size=2)
    start_rank(node, job="half", rank=1, world_size=2)  # connected, but never saves step 1
    saver.save(1)
    answer = saver.wait(1, timeout=30)
    assert not answer["committed"]
    assert ("commit of step 1 timed out after 1 s: 1 of this node's 2 ranks made their file durable (ranks 0)"
            in answer["error"])
    assert not (layout.step_dir(storage / "half", 1) / layout.MANIFEST).exists()
    saver.save(2)
    assert not saver.wait(2, timeout=30)["committed"], "a later step must not commit without rank 1 either"


@pytest.mark.parametrize("failing", ["a", "b"], ids=["coordinator fails", "other node fails"])
def test_a_step_one_node_fails_fails_on_every_node_with_that_nodes_reason_long_before_their_timeout(
    start_sidecar, start_rank, storage, failing
):
    # Only the failing node has a short commit timeout: the other learns from its notice, or waits 10 minutes.
    nodes = {name: start_sidecar(name, extra=["--commit-timeout", "5" if name == failing else "600"])
             for name in ("a", "b")}
    ranks = [start_rank(nodes["a" if rank < 2 else "b"], job="split", rank=rank, world_size=4, local_world_size=2)
             for rank in range(4)]
    silent = 1 if failing == "a" else 3  # connected, but skips step 1
    healthy = [rank for index, rank in enumerate(ranks) if index != silent]
    for rank in healthy:
        rank.save(1)
    expected = f"step 1 failed on node {failing}: commit of step 1 timed out after 5 s: 1 of this node's 2 ranks"
    for index, rank in enumerate(ranks):
        if index == silent:
            continue
        answer = rank.wait(1, timeout=120)
        assert not answer["committed"]
        if (index < 2) != (failing == "a"):
            assert expected in answer["error"], f"rank {index} on the healthy node"
    step_path = layout.step_dir(storage / "split", 1)
    assert not (step_path / layout.MANIFEST).exists()
    notice = manifest.read_failures(step_path)
    assert [(failure.node, failure.step) for failure in notice] == [(failing, 1)]

    for rank in ranks:
        rank.save(2)
    for rank in ranks:
        assert rank.wait(2, timeout=60)["committed"], "the failure of step 1 must not spill over to step 2"


def test_a_node_whose_ranks_save_a_step_after_another_node_failed_it_refuses_it_without_writing(
    start_sidecar, start_rank, storage
):
    nodes = {"a": start_sidecar("a"), "b": start_sidecar("b", extra=["--commit-timeout", "2"])}
    ranks = [start_rank(nodes["a" if rank < 2 else "b"], job="late", rank=rank, world_size=4, local_world_size=2)
             for rank in range(4)]
    ranks[2].save(1)  # rank 3 skips step 1, so node b fails it at its timeout and leaves a notice
    assert not ranks[2].wait(1, timeout=60)["committed"]
    step_path = layout.step_dir(storage / "late", 1)
    wait_for(lambda: manifest.read_failures(step_path), "node b's failure notice for step 1")

    for rank in ranks[:2]:
        rank.save(1)
    for rank in ranks[:2]:
        answer = rank.wait(1, timeout=60)
        assert not answer["committed"] and "step 1 failed on node b: commit of step 1 timed out" in answer["error"]
    # Node a wrote nothing for step 1: no rank file (finished or temporary) and no receipt.
    node_a = (layout.rank_file_name(0, 4), layout.rank_file_name(1, 4), layout.receipt_name("a"))
    written = sorted(path.name for path in step_path.iterdir())
    assert not [name for name in written if name.startswith(node_a)], written
    assert not (step_path / layout.MANIFEST).exists()


def test_a_node_still_persisting_a_step_another_node_failed_stops_and_keeps_no_file(start_sidecar, start_rank,
                                                                                  storage):
    # Node a writes its ranks' 64 MiB each at 16 MiB/s, in 32 MiB chunks: about 8 s, far past node b's 2 s
    # timeout, so the notice appears while node a is between chunks.
    nodes = {"a": start_sidecar("a", extra=["--write-rate-limit", str(16 * 2**20)]),
             "b": start_sidecar("b", extra=["--commit-timeout", "2"])}
    ranks = [start_rank(nodes["a" if rank < 2 else "b"], job="stop", rank=rank, world_size=4, local_world_size=2)
             for rank in range(4)]
    step_path = layout.step_dir(storage / "stop", 1)
    ranks[2].save(1)  # rank 3 skips step 1, so node b fails it at its timeout and leaves a notice
    for rank in ranks[:2]:
        rank.save(1, numel=8 * 2**20)
    assert not manifest.read_failures(step_path), "node b failed step 1 before node a started it: proves nothing"

    for rank in ranks[:2]:
        answer = rank.wait(1, timeout=60)
        assert not answer["committed"] and "step 1 failed on node b: commit of step 1 timed out" in answer["error"]
    assert nodes["a"].stop() == 0  # a graceful stop waits for the persists in flight to end
    node_a = (layout.rank_file_name(0, 4), layout.rank_file_name(1, 4), layout.receipt_name("a"))
    written = sorted(path.name for path in step_path.iterdir())
    assert not [name for name in written if name.startswith(node_a)], written
