"""Gathering a step on one node: when its share is complete, and what its receipt says."""

from __future__ import annotations

from stowaway.sidecar.commit import gathering
from stowaway.storage import manifest


def _entry(rank: int) -> manifest.FileEntry:
    return manifest.FileEntry(rank, f"rank-{rank}", 10 + rank, f"{rank:016x}")


def test_the_share_is_complete_once_every_local_rank_is_durable_and_only_once() -> None:
    pending = gathering.PendingStep("job", "run-1", 3, world_size=4, local_world_size=2, started_unix=0.0, started=0.0)
    assert not pending.add_durable(_entry(3))
    assert pending.add_durable(_entry(2))
    assert not pending.hosts_rank_zero, "rank 0's node writes the manifest"

    receipt = pending.receipt("b")
    assert (receipt.node, receipt.run, receipt.step, receipt.world_size) == ("b", "run-1", 3, 4)
    assert [entry.rank for entry in receipt.files] == [2, 3]


def test_a_late_rank_raises_the_share_a_node_waits_for() -> None:
    pending = gathering.PendingStep("job", "run-1", 3, world_size=3, local_world_size=1, started_unix=0.0, started=0.0)
    pending.admit(0, 1)
    pending.admit(1, 3)
    assert pending.local_world_size == 3 and not pending.multi_node
    assert not pending.add_durable(_entry(0))
    assert not pending.add_durable(_entry(1))
    assert pending.add_durable(_entry(2)) and pending.hosts_rank_zero


def test_a_single_node_step_is_committing_once_every_rank_handed_it_over() -> None:
    single = gathering.PendingStep("job", "run-1", 1, world_size=2, local_world_size=2, started_unix=0.0, started=0.0)
    single.admit(0, 2)
    assert not single.committing
    single.admit(1, 2)
    assert single.committing

    split = gathering.PendingStep("job", "run-1", 1, world_size=4, local_world_size=2, started_unix=0.0, started=0.0)
    split.admit(0, 2)
    split.admit(1, 2)
    assert split.multi_node and not split.committing, "other nodes may be gone for good"


def test_ranks_in_a_message_are_cut_short_for_a_large_job() -> None:
    assert gathering.describe_ranks([2, 3]) == "2, 3"
    assert gathering.describe_ranks(list(range(20))) == ", ".join(str(rank) for rank in range(16)) + " and 4 more"
