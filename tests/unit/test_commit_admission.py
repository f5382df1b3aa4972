"""Admission: which steps a rank may start persisting, and the same answer for every rank of the job."""

from __future__ import annotations

import asyncio
from pathlib import Path

from stowaway.sidecar.commit import admission, gathering, notices, publishing
from stowaway.sidecar.stats import Stats
from stowaway.storage import layout, manifest
from unit.commit_harness import Answer, FakeClock, Node


async def _commit(node: Node, clock: FakeClock, step: int, run: str = "run-1") -> None:
    """Commit ``step`` of a one-rank job ``job`` through ``node``."""
    rank = node.connect("job", 0, 1, 1)
    assert node.hand_over("job", run, step, 0, 1, 1) is None
    await node.persist("job", step, 0, 1)
    assert await clock.run_until(rank.answer()) == Answer("committed", step, None)


def test_a_step_already_committed_is_refused_once_for_every_rank_and_counted_once(tmp_path: Path) -> None:
    async def scenario() -> None:
        clock = FakeClock()
        node = Node(tmp_path, "a", clock)
        await _commit(node, clock, 5)

        refusal = node.hand_over("job", "run-2", 5, 0, 2, 2)
        assert refusal is not None and refusal.startswith("step 5 of job job is already committed at ")
        assert f"stowaway rollback {tmp_path / 'job'} --to STEP" in refusal
        assert node.hand_over("job", "run-2", 5, 1, 2, 2) == refusal
        assert node.committer.abandoned("job", "run-2", 5) == refusal
        assert node.failures() == {"step_refused": 1}

    asyncio.run(scenario())


def test_a_step_older_than_the_newest_committed_one_is_refused_and_a_newer_one_admitted(tmp_path: Path) -> None:
    async def scenario() -> None:
        clock = FakeClock()
        node = Node(tmp_path, "a", clock)
        await _commit(node, clock, 5)

        refusal = node.hand_over("job", "run-2", 3, 0, 1, 1)
        assert refusal is not None
        assert refusal.startswith("step 3 is older than step 5, the newest committed checkpoint of job job")
        assert node.hand_over("job", "run-2", 6, 0, 1, 1) is None
        assert node.failures() == {"step_refused": 1}

    asyncio.run(scenario())


def test_a_step_set_aside_may_be_saved_again_though_it_was_the_newest_seen(tmp_path: Path) -> None:
    async def scenario() -> None:
        clock = FakeClock()
        node = Node(tmp_path, "a", clock)
        await _commit(node, clock, 5)
        assert node.committer.set_aside("job", 5) is not None

        assert node.hand_over("job", "run-1", 5, 0, 1, 1) is None
        assert node.failures() == {}

    asyncio.run(scenario())


def test_a_step_another_run_is_saving_is_refused(tmp_path: Path) -> None:
    async def scenario() -> None:
        node = Node(tmp_path, "a", FakeClock())
        assert node.hand_over("job", "run-1", 2, 0, 2, 2) is None
        assert node.hand_over("job", "run-2", 2, 1, 2, 2) == "step 2 is being saved by another run (run-1) of job job"
        assert node.hand_over("job", "run-1", 2, 1, 2, 2) is None

    asyncio.run(scenario())


def test_a_multi_node_step_another_node_failed_is_refused_before_any_file_is_written(tmp_path: Path) -> None:
    async def scenario() -> None:
        node = Node(tmp_path, "b", FakeClock())
        step_path = node.step_path("job", 1)
        manifest.write_failure(step_path, manifest.Failure("a", "run-1", 1, "rank 0: disk full"))

        assert node.hand_over("job", "run-2", 1, 2, 4, 2) is None, "another run's notice does not count"
        expected = "step 1 failed on node a: rank 0: disk full"
        assert node.hand_over("job", "run-1", 2, 2, 4, 2) is None
        manifest.write_failure(node.step_path("job", 2), manifest.Failure("a", "run-1", 2, "rank 0: disk full"))
        assert node.hand_over("job", "run-1", 2, 3, 4, 2) is None, "a step already started is not refused here"

        fresh = Node(tmp_path, "b", FakeClock())
        assert fresh.hand_over("job", "run-1", 1, 2, 4, 2) == expected
        assert fresh.hand_over("job", "run-1", 1, 3, 4, 2) == expected
        assert fresh.failures() == {"other_node_failed": 1}
        assert sorted(path.name for path in step_path.iterdir()) == [layout.failure_name("a")]

    asyncio.run(scenario())


def test_a_single_node_job_and_a_nodes_own_notice_never_refuse(tmp_path: Path) -> None:
    async def scenario() -> None:
        node = Node(tmp_path, "a", FakeClock())
        manifest.write_failure(node.step_path("job", 1), manifest.Failure("a", "run-1", 1, "before a restart"))
        manifest.write_failure(node.step_path("job", 2), manifest.Failure("b", "run-1", 2, "elsewhere"))

        assert node.hand_over("job", "run-1", 1, 0, 4, 2) is None, "this node's own notice"
        assert node.hand_over("job", "run-1", 2, 0, 1, 1) is None, "a single-node job has no other node"

    asyncio.run(scenario())


def test_an_unreadable_notice_admits_the_step(tmp_path: Path) -> None:
    async def scenario() -> None:
        node = Node(tmp_path, "b", FakeClock())
        step_path = node.step_path("job", 1)
        step_path.mkdir(parents=True)
        (step_path / layout.failure_name("a")).write_text("{torn")

        assert node.hand_over("job", "run-1", 1, 2, 4, 2) is None

    asyncio.run(scenario())


def test_failures_are_remembered_for_a_bounded_number_of_steps(tmp_path: Path) -> None:
    node = Node(tmp_path, "a", FakeClock())
    clock = FakeClock()
    gate = admission.Admission(publishing.Publisher(node.config, clock, node.committer.store),
                               notices.NoticeBoard("a", clock, 0.2, node.committer.store), Stats())
    for step in range(300):
        gate.remember("job", step, "run-1", f"step {step} failed")

    assert gate.abandoned("job", "run-1", 299) == "step 299 failed"
    assert gate.abandoned("job", "run-1", 43) is None, "the oldest are forgotten"
    assert gate.abandoned("job", "run-1", 44) == "step 44 failed"
    assert gate.abandoned("job", "run-2", 299) is None, "per run"


def test_a_step_being_gathered_is_only_refused_for_another_run_or_a_failure(tmp_path: Path) -> None:
    node = Node(tmp_path, "a", FakeClock())
    clock = FakeClock()
    stats = Stats()
    gate = admission.Admission(publishing.Publisher(node.config, clock, node.committer.store),
                               notices.NoticeBoard("a", clock, 0.2, node.committer.store), stats)
    (node.step_path("job", 1)).mkdir(parents=True)
    (node.step_path("job", 1) / layout.MANIFEST).write_text("{}")
    pending = gathering.PendingStep("job", "run-1", 1, 2, 2, started_unix=0.0, started=0.0)

    assert gate.refusal("job", "run-1", 1, pending) is None, "storage is not looked at again"
    gate.remember("job", 1, "run-1", "rank 0: disk full")
    assert gate.refusal("job", "run-1", 1, pending) == "rank 0: disk full"
    assert stats.summary()["failures"] == {}
