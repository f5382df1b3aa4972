"""Failure notices between nodes that share only storage: reading, writing and watching for them."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest

from stowaway.sidecar.commit import gathering, notices
from stowaway.storage import layout, manifest
from stowaway.storage.directory_store import DirectoryStore
from unit.commit_harness import FakeClock


def _board(node: str, root: Path, clock: FakeClock | None = None) -> notices.NoticeBoard:
    return notices.NoticeBoard(node, clock or FakeClock(), 0.2, DirectoryStore(root))


def _step_path(root: Path, step: int = 1) -> Path:
    return DirectoryStore(root).step_path("job", step)


def _pending(step: int = 1) -> gathering.PendingStep:
    return gathering.PendingStep("job", "run-1", step, world_size=4, local_world_size=2, started_unix=0.0,
                                 started=0.0)


def test_a_notice_counts_only_when_another_node_wrote_it_for_this_run(tmp_path: Path) -> None:
    board = _board("a", tmp_path)
    manifest.write_failure(_step_path(tmp_path), manifest.Failure("a", "run-1", 1, "own"))
    manifest.write_failure(_step_path(tmp_path), manifest.Failure("b", "run-0", 1, "an earlier run"))
    assert board.failure_elsewhere("job", "run-1", 1) is None

    manifest.write_failure(_step_path(tmp_path), manifest.Failure("c", "run-1", 1, "rank 5: disk full"))
    assert board.failure_elsewhere("job", "run-1", 1) == "step 1 failed on node c: rank 5: disk full"


def test_an_unreadable_notice_raises_for_the_commit_and_counts_as_none_elsewhere(tmp_path: Path) -> None:
    board = _board("a", tmp_path)
    _step_path(tmp_path).mkdir(parents=True)
    (_step_path(tmp_path) / layout.failure_name("b")).write_text("[]")
    with pytest.raises(manifest.ManifestError):
        board.failure_elsewhere("job", "run-1", 1)
    assert board.readable_failure_elsewhere("job", "run-1", 1) is None


def test_an_announced_failure_is_read_by_the_other_nodes(tmp_path: Path) -> None:
    asyncio.run(_board("a", tmp_path).announce(_pending(), "rank 1: disk full"))

    assert _board("b", tmp_path).failure_elsewhere("job", "run-1", 1) == "step 1 failed on node a: rank 1: disk full"


def test_a_notice_that_cannot_be_written_is_logged_and_not_raised(tmp_path: Path,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / "job").write_text("a file where the job's directory belongs")
    board = _board("a", tmp_path)
    with caplog.at_level(logging.WARNING, logger=notices.__name__):
        asyncio.run(board.announce(_pending(), "rank 1: disk full"))
    assert "cannot tell the other nodes that step 1 of job job failed (they will time out instead)" in caplog.text


def test_the_watch_fails_the_step_when_a_notice_appears_while_the_node_persists(tmp_path: Path) -> None:
    async def scenario() -> None:
        clock = FakeClock()
        board = _board("b", tmp_path, clock)
        pending = _pending()
        failed: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        watch = asyncio.ensure_future(board.watch(pending, failed.set_result))
        await clock.until_asleep(1)
        assert not failed.done()

        manifest.write_failure(_step_path(tmp_path), manifest.Failure("a", "run-1", 1, "rank 0: disk full"))
        assert await clock.run_until(failed) == "step 1 failed on node a: rank 0: disk full"
        await watch

    asyncio.run(scenario())


def test_the_watch_ends_once_every_local_file_is_durable(tmp_path: Path) -> None:
    async def scenario() -> None:
        clock = FakeClock()
        pending = _pending()
        watch = asyncio.ensure_future(_board("b", tmp_path, clock).watch(pending, pytest.fail))
        await clock.until_asleep(1)
        # Every local file is durable: the commit's wait has begun, and polls for notices itself.
        pending.task = asyncio.ensure_future(clock.sleep(3600))
        manifest.write_failure(tmp_path, manifest.Failure("a", "run-1", 1, "for the commit's poll to report"))

        await clock.run_until(watch)
        pending.task.cancel()

    asyncio.run(scenario())
