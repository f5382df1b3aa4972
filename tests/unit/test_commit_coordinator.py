"""The commit of a step end to end, in one process: ranks' hand-overs in, one answer per rank out.

Sidecars ("nodes") share a temporary storage directory, as they share a
volume in a job; time moves only when the test moves it.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from pathlib import Path

import pytest

from stowaway.storage import catalog, layout, manifest
from unit import commit_harness
from unit.commit_harness import Answer, FakeClock, Node


async def _answers(*connections: commit_harness.RankConnection) -> list[Answer]:
    return list(await asyncio.gather(*(connection.answer() for connection in connections)))


def test_a_single_node_step_commits_once_every_local_rank_is_durable(tmp_path: Path) -> None:
    async def scenario() -> None:
        clock = FakeClock()
        node = Node(tmp_path, "a", clock)
        ranks = [node.connect("job", rank, 2, 2) for rank in range(2)]
        for rank in range(2):
            assert node.hand_over("job", "run-1", 7, rank, 2, 2) is None
        await node.persist("job", 7, 0, 2)
        assert ranks[0].unanswered(), "one of two ranks durable must not commit"
        await node.persist("job", 7, 1, 2)

        assert await clock.run_until(_answers(*ranks)) == [Answer("committed", 7, None)] * 2
        found = manifest.read_manifest(node.step_path("job", 7))
        assert (found.run, found.world_size, found.nodes) == ("run-1", 2, ["a"])
        assert found.created_unix == clock.wall()
        assert (tmp_path / "job" / layout.LATEST).read_text() == "7\n"
        assert catalog.verify_step(tmp_path / "job", 7) == []
        assert node.stats.summary()["commits"] == 1

    asyncio.run(scenario())


def test_a_local_rank_that_never_saves_fails_the_step_at_the_commit_timeout_and_not_before(tmp_path: Path) -> None:
    async def scenario() -> None:
        clock = FakeClock()
        node = Node(tmp_path, "a", clock, commit_timeout=30)
        saver = node.connect("job", 0, 2, 2)
        node.connect("job", 1, 2, 2)  # connected, but never saves step 1
        assert node.hand_over("job", "run-1", 1, 0, 2, 2) is None
        await node.persist("job", 1, 0, 2)

        clock.advance(29.9)
        assert saver.unanswered()
        clock.advance(0.1)
        answer = await saver.answer()
        assert answer.kind == "failed" and answer.reason is not None
        assert ("commit of step 1 timed out after 30 s: 1 of this node's 2 ranks made their file durable (ranks 0)"
                in answer.reason)
        assert node.committer.abandoned("job", "run-1", 1) == answer.reason, "its persists stop"
        assert node.failures() == {"commit_timeout": 1}
        assert not (node.step_path("job", 1) / layout.MANIFEST).exists()

    asyncio.run(scenario())


def test_a_node_whose_peers_never_report_fails_at_the_commit_timeout_and_tells_them(tmp_path: Path) -> None:
    async def scenario() -> None:
        clock = FakeClock()
        node = Node(tmp_path, "a", clock, commit_timeout=2)
        ranks = [node.connect("job", rank, 4, 2) for rank in range(2)]
        for rank in range(2):
            assert node.hand_over("job", "run-1", 1, rank, 4, 2) is None
            await node.persist("job", 1, rank, 4)

        answers = await clock.run_until(_answers(*ranks))
        assert clock.monotonic() >= 1000.0 + 2
        for answer in answers:
            assert answer.kind == "failed" and answer.reason is not None
            assert "commit of step 1 timed out after 2 s waiting for receipts of ranks 2, 3" in answer.reason
        await asyncio.gather(*node.committer.pending_tasks())
        [notice] = manifest.read_failures(node.step_path("job", 1))
        assert (notice.node, notice.run) == ("a", "run-1") and notice.reason == answers[0].reason
        assert not (node.step_path("job", 1) / layout.MANIFEST).exists()

    asyncio.run(scenario())


def test_two_nodes_sharing_a_storage_commit_one_manifest_that_names_both(tmp_path: Path) -> None:
    async def scenario() -> None:
        clock = FakeClock()
        nodes = {"a": Node(tmp_path, "a", clock), "b": Node(tmp_path, "b", clock)}
        ranks = [nodes["a" if rank < 2 else "b"].connect("job", rank, 4, 2) for rank in range(4)]
        for rank in range(4):
            assert nodes["a" if rank < 2 else "b"].hand_over("job", "run-1", 3, rank, 4, 2) is None
        for rank in (0, 1, 2):
            await nodes["a" if rank < 2 else "b"].persist("job", 3, rank, 4)
        assert not (nodes["a"].step_path("job", 3) / layout.MANIFEST).exists()
        await nodes["b"].persist("job", 3, 3, 4)

        assert await clock.run_until(_answers(*ranks)) == [Answer("committed", 3, None)] * 4
        found = manifest.read_manifest(nodes["a"].step_path("job", 3))
        assert found.nodes == ["a", "b"] and [entry.rank for entry in found.files] == [0, 1, 2, 3]
        assert catalog.verify_step(tmp_path / "job", 3) == []
        assert nodes["a"].stats.summary()["commits"] == nodes["b"].stats.summary()["commits"] == 1

    asyncio.run(scenario())


@pytest.mark.parametrize("failing", ["a", "b"], ids=["coordinator fails", "other node fails"])
def test_a_failure_notice_that_lands_before_the_commit_fails_the_step_on_both_nodes(tmp_path: Path,
                                                                                     failing: str) -> None:
    async def scenario() -> None:
        clock = FakeClock()
        nodes = {"a": Node(tmp_path, "a", clock), "b": Node(tmp_path, "b", clock)}
        ranks = {name: [nodes[name].connect("job", rank, 4, 2) for rank in ranks]
                 for name, ranks in (("a", (0, 1)), ("b", (2, 3)))}
        for rank in range(4):
            assert nodes["a" if rank < 2 else "b"].hand_over("job", "run-1", 1, rank, 4, 2) is None
        survivor = "b" if failing == "a" else "a"
        first = 0 if survivor == "a" else 2
        for rank in (first, first + 1):
            await nodes[survivor].persist("job", 1, rank, 4)
        nodes[failing].committer.fail("job", 1, "storage_io", "rank 9: no space left on device")

        expected = "rank 9: no space left on device"
        assert [answer.reason for answer in await _answers(*ranks[failing])] == [expected] * 2
        for answer in await clock.run_until(_answers(*ranks[survivor])):
            assert answer == Answer("failed", 1, f"step 1 failed on node {failing}: {expected}")
        assert not (nodes["a"].step_path("job", 1) / layout.MANIFEST).exists()
        assert nodes[failing].failures() == {"storage_io": 1}
        assert nodes[survivor].failures() == {"other_node_failed": 1}
        assert len(manifest.read_failures(nodes["a"].step_path("job", 1))) == 1, "a failure learnt is not re-told"

    asyncio.run(scenario())


def test_the_coordinator_reads_the_notices_before_it_commits_even_when_every_receipt_is_in(tmp_path: Path) -> None:
    async def scenario() -> None:
        clock = FakeClock()
        nodes = {"a": Node(tmp_path, "a", clock), "b": Node(tmp_path, "b", clock)}
        ranks = [nodes["a" if rank < 2 else "b"].connect("job", rank, 4, 2) for rank in range(4)]
        for rank in range(4):
            assert nodes["a" if rank < 2 else "b"].hand_over("job", "run-1", 1, rank, 4, 2) is None
        for rank in (2, 3):
            await nodes["b"].persist("job", 1, rank, 4)
        # Node b gives up after its receipt is written, while it waits for the manifest.
        nodes["b"].committer.fail("job", 1, "commit_timeout", "node b timed out")
        await asyncio.gather(*nodes["b"].committer.pending_tasks())
        for rank in (0, 1):
            await nodes["a"].persist("job", 1, rank, 4)

        answers = await clock.run_until(_answers(*ranks))
        assert answers[:2] == [Answer("failed", 1, "step 1 failed on node b: node b timed out")] * 2
        assert answers[2:] == [Answer("failed", 1, "node b timed out")] * 2
        step_path = nodes["a"].step_path("job", 1)
        assert {receipt.node for receipt in manifest.read_receipts(step_path)} == {"a", "b"}
        assert not (step_path / layout.MANIFEST).exists()

    asyncio.run(scenario())


def test_a_failure_notice_that_lands_after_the_manifest_leaves_the_commit_standing_on_every_node(
    tmp_path: Path,
) -> None:
    async def scenario() -> None:
        # Each node on its own clock, so that node b's commit wait stays asleep while node a commits.
        clocks = {"a": FakeClock(), "b": FakeClock()}
        nodes = {name: Node(tmp_path, name, clocks[name]) for name in ("a", "b")}
        ranks = {name: [nodes[name].connect("job", rank, 4, 2) for rank in ranks]
                 for name, ranks in (("a", (0, 1)), ("b", (2, 3)))}
        for rank in range(4):
            assert nodes["a" if rank < 2 else "b"].hand_over("job", "run-1", 1, rank, 4, 2) is None
        for rank in (2, 3):
            await nodes["b"].persist("job", 1, rank, 4)
        # Node b's watch for notices and its wait for the manifest, which it found missing.
        await clocks["b"].until_asleep(2)
        for rank in (0, 1):
            await nodes["a"].persist("job", 1, rank, 4)
        assert await clocks["a"].run_until(_answers(*ranks["a"])) == [Answer("committed", 1, None)] * 2

        step_path = nodes["a"].step_path("job", 1)
        manifest.write_failure(step_path, manifest.Failure("c", "run-1", 1, "too late"))
        assert await clocks["b"].run_until(_answers(*ranks["b"])) == [Answer("committed", 1, None)] * 2
        assert catalog.committed_steps(tmp_path / "job") == [1]

    asyncio.run(scenario())


def test_an_unreadable_receipt_of_another_node_fails_the_commit_as_a_storage_error(tmp_path: Path) -> None:
    async def scenario() -> None:
        clock = FakeClock()
        node = Node(tmp_path, "a", clock)
        ranks = [node.connect("job", rank, 4, 2) for rank in range(2)]
        for rank in range(2):
            assert node.hand_over("job", "run-1", 1, rank, 4, 2) is None
        (node.step_path("job", 1)).mkdir(parents=True)
        (node.step_path("job", 1) / layout.receipt_name("b")).write_text("{torn")
        for rank in range(2):
            await node.persist("job", 1, rank, 4)

        for answer in await clock.run_until(_answers(*ranks)):
            assert answer.kind == "failed" and answer.reason is not None
            assert answer.reason.startswith("commit of step 1 failed: cannot read")
            assert layout.receipt_name("b") in answer.reason
        assert node.failures() == {"storage_io": 1}

    asyncio.run(scenario())


def test_a_receipt_that_cannot_be_written_fails_the_step_for_the_nodes_ranks(tmp_path: Path) -> None:
    async def scenario() -> None:
        clock = FakeClock()
        node = Node(tmp_path, "a", clock)
        (tmp_path / "job").write_text("a file where the job's directory belongs")
        rank = node.connect("job", 0, 1, 1)
        assert node.hand_over("job", "run-1", 1, 0, 1, 1) is None
        await node.committer.durable("job", 1, manifest.FileEntry(0, layout.rank_file_name(0, 1), 1, "0" * 16))

        answer = await rank.answer()
        assert answer.kind == "failed" and answer.reason is not None
        assert answer.reason.startswith("cannot write the receipt of node a")
        assert node.failures() == {"storage_io": 1}

    asyncio.run(scenario())


def test_retention_that_fails_after_a_commit_leaves_the_commit_standing_and_says_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async def scenario() -> None:
        clock = FakeClock()
        node = Node(tmp_path, "a", clock, keep_last=1)
        rank = node.connect("job", 0, 1, 1)

        async def commit(step: int) -> Answer:
            assert node.hand_over("job", "run-1", step, 0, 1, 1) is None
            await node.persist("job", step, 0, 1)
            answer = await clock.run_until(rank.answer())
            await commit_harness.background_work_done()
            return answer

        assert await commit(1) == Answer("committed", 1, None)
        with commit_harness.refusing_deletes(node.step_path("job", 1)):
            assert await commit(2) == Answer("committed", 2, None)
        assert catalog.committed_steps(tmp_path / "job") == [1, 2], "step 1 could not be deleted"
        assert (tmp_path / "job" / layout.LATEST).read_text() == "2\n"
        assert any(record.levelno == logging.WARNING and "retention after step 2 of job job failed, will retry "
                   "after the next commit" in record.getMessage() for record in caplog.records)

        assert await commit(3) == Answer("committed", 3, None)
        assert catalog.committed_steps(tmp_path / "job") == [3], "the next commit's retention catches up"

    caplog.set_level(logging.WARNING, logger="stowaway.sidecar.commit")
    asyncio.run(scenario())


def test_settled_waits_for_a_single_node_step_every_rank_handed_over(tmp_path: Path) -> None:
    async def scenario() -> None:
        clock = FakeClock()
        node = Node(tmp_path, "a", clock)
        ranks = [node.connect("job", rank, 2, 2) for rank in range(2)]
        for rank in range(2):
            assert node.hand_over("job", "run-1", 4, rank, 2, 2) is None
        settled = asyncio.ensure_future(node.committer.settled("job"))
        for rank in range(2):
            await node.persist("job", 4, rank, 2)

        await clock.run_until(settled)
        assert (node.step_path("job", 4) / layout.MANIFEST).exists(), "settled before the commit"
        assert await _answers(*ranks) == [Answer("committed", 4, None)] * 2
        await node.committer.settled("job")  # nothing pending: at once

    asyncio.run(scenario())


def test_a_step_that_times_out_while_its_receipt_is_written_is_never_committed_after_failing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every rank gets exactly one answer: a receipt written after the timeout must not start a commit."""
    receipt_may_finish = threading.Event()
    receipt_started = threading.Event()
    write_receipt = manifest.write_receipt

    def slow_write_receipt(step_path: Path, receipt: manifest.Receipt) -> None:
        receipt_started.set()
        receipt_may_finish.wait(commit_harness.REAL_TIMEOUT)
        write_receipt(step_path, receipt)

    monkeypatch.setattr(manifest, "write_receipt", slow_write_receipt)

    async def scenario() -> None:
        clock = FakeClock()
        node = Node(tmp_path, "a", clock, commit_timeout=30)
        rank = node.connect("job", 0, 1, 1)
        assert node.hand_over("job", "run-1", 1, 0, 1, 1) is None
        durable = asyncio.ensure_future(node.persist("job", 1, 0, 1))
        await asyncio.to_thread(receipt_started.wait, commit_harness.REAL_TIMEOUT)

        clock.advance(30)
        answer = await rank.answer()
        assert answer.kind == "failed" and answer.reason is not None and "timed out" in answer.reason
        receipt_may_finish.set()
        await durable
        await commit_harness.background_work_done()

        assert rank.unanswered(), "a rank told its step failed must not then hear that it committed"
        assert not (node.step_path("job", 1) / layout.MANIFEST).exists()
        assert node.committer.pending_tasks() == []

    asyncio.run(scenario())
