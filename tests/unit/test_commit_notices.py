"""Failure notices between nodes that share only storage: reading, writing and watching for them."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest

from stowaway.sidecar.commit import gathering, notices
from stowaway.storage import layout, manifest
from unit.commit_harness import FakeClock


def _pending(step: int = 1) -> gathering.PendingStep:
    return gathering.PendingStep("job", "run-1", step, world_size=4, local_world_size=2, started_unix=0.0,
                                 started=0.0)


def test_a_notice_counts_only_when_another_node_wrote_it_for_this_run(tmp_path: Path) -> None:
    board = notices.NoticeBoard("a", FakeClock(), 0.2)
    manifest.write_failure(tmp_path, manifest.Failure("a", "run-1", 1, "own"))
    manifest.write_failure(tmp_path, manifest.Failure("b", "run-0", 1, "an earlier run"))
    assert board.failure_elsewhere("run-1", 1, tmp_path) is None

    manifest.write_failure(tmp_path, manifest.Failure("c", "run-1", 1, "rank 5: disk full"))
    assert board.failure_elsewhere("run-1", 1, tmp_path) == "step 1 failed on node c: rank 5: disk full"


def test_an_unreadable_notice_raises_for_the_commit_and_counts_as_none_elsewhere(tmp_path: Path) -> None:
    board = notices.NoticeBoard("a", FakeClock(), 0.2)
    (tmp_path / layout.failure_name("b")).write_text("[]")
    with pytest.raises(manifest.ManifestError):
        board.failure_elsewhere("run-1", 1, tmp_path)
    assert board.readable_failure_elsewhere("run-1", 1, tmp_path) is None


def test_an_announced_failure_is_read_by_the_other_nodes(tmp_path: Path) -> None:
    step_path = tmp_path / "job" / "step-000000000001"
    asyncio.run(notices.NoticeBoard("a", FakeClock(), 0.2).announce(_pending(), step_path, "rank 1: disk full"))

    board = notices.NoticeBoard("b", FakeClock(), 0.2)
    assert board.failure_elsewhere("run-1", 1, step_path) == "step 1 failed on node a: rank 1: disk full"


def test_a_notice_that_cannot_be_written_is_logged_and_not_raised(tmp_path: Path,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / "job").write_text("a file where the job's directory belongs")
    board = notices.NoticeBoard("a", FakeClock(), 0.2)
    with caplog.at_level(logging.WARNING, logger=notices.__name__):
        asyncio.run(board.announce(_pending(), tmp_path / "job" / "step-000000000001", "rank 1: disk full"))
    assert "cannot tell the other nodes that step 1 of job job failed (they will time out instead)" in caplog.text


def test_the_watch_fails_the_step_when_a_notice_appears_while_the_node_persists(tmp_path: Path) -> None:
    async def scenario() -> None:
        clock = FakeClock()
        board = notices.NoticeBoard("b", clock, 0.2)
        pending = _pending()
        failed: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        watch = asyncio.ensure_future(board.watch(pending, tmp_path, failed.set_result))
        await clock.until_asleep(1)
        assert not failed.done()

        manifest.write_failure(tmp_path, manifest.Failure("a", "run-1", 1, "rank 0: disk full"))
        assert await clock.run_until(failed) == "step 1 failed on node a: rank 0: disk full"
        await watch

    asyncio.run(scenario())


def test_the_watch_ends_once_every_local_file_is_durable(tmp_path: Path) -> None:
    async def scenario() -> None:
        clock = FakeClock()
        pending = _pending()
        watch = asyncio.ensure_future(notices.NoticeBoard("b", clock, 0.2).watch(pending, tmp_path, pytest.fail))
        await clock.until_asleep(1)
        # Every local file is durable: the commit's wait has begun, and polls for notices itself.
        pending.task = asyncio.ensure_future(clock.sleep(3600))
        manifest.write_failure(tmp_path, manifest.Failure("a", "run-1", 1, "for the commit's poll to report"))

        await clock.run_until(watch)
        pending.task.cancel()

    asyncio.run(scenario())
