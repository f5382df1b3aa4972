"""Publishing a commit: the manifest once receipts cover every rank, ``latest``, and what other nodes wait for."""

from __future__ import annotations

from pathlib import Path

from stowaway.sidecar.commit import gathering, publishing
from stowaway.sidecar.config import SidecarConfig
from stowaway.storage import catalog, durable, layout, manifest
from stowaway.storage.directory_store import DirectoryStore
from unit.commit_harness import FakeClock


def _publisher(storage: Path, clock: FakeClock) -> publishing.Publisher:
    return publishing.Publisher(
        SidecarConfig(storage=storage, socket_path=Path("unused.sock"), shm_dir=storage / "unused-shm",
                      node="a", keep_last=2),
        clock, DirectoryStore(storage),
    )


def _pending(step: int, run: str = "run-1") -> gathering.PendingStep:
    return gathering.PendingStep("job", run, step, world_size=4, local_world_size=2, started_unix=1_000.0,
                                 started=0.0)


def _receipt(publisher: publishing.Publisher, node: str, step: int, ranks: tuple[int, ...],
             run: str = "run-1") -> None:
    step_path = publisher.store.step_path("job", step)
    durable.make_dirs(step_path)
    files = [manifest.FileEntry(rank, layout.rank_file_name(rank, 4), 8, f"{rank:016x}") for rank in ranks]
    manifest.write_receipt(step_path, manifest.Receipt(node, run, step, 4, files))


def commit_if_complete(publisher: publishing.Publisher, step: int) -> str | None:
    return publisher.commit_if_complete(_pending(step), publisher.store.read_notices("job", step).receipts)


def test_the_manifest_is_written_only_once_this_runs_receipts_cover_every_rank(tmp_path: Path) -> None:
    clock = FakeClock()
    publisher = _publisher(tmp_path, clock)
    _receipt(publisher, "a", 1, (0, 1))
    _receipt(publisher, "b", 1, (2, 3), run="run-0")
    assert commit_if_complete(publisher, 1) == "receipts of ranks 2, 3"
    assert publisher.missing_manifest(_pending(1)) == "the manifest written by the sidecar that hosts rank 0"

    _receipt(publisher, "b", 1, (2, 3))
    assert commit_if_complete(publisher, 1) is None
    found = manifest.read_manifest(publisher.store.step_path("job", 1))
    assert found.nodes == ["a", "b"] and [entry.rank for entry in found.files] == [0, 1, 2, 3]
    assert found.timings == {"first_persist_unix": 1_000.0, "commit_seconds": clock.wall() - 1_000.0}
    assert (tmp_path / "job" / layout.LATEST).read_text() == "1\n"
    assert publisher.newest_known("job") == 1
    assert publisher.missing_manifest(_pending(1)) is None
    assert publisher.missing_manifest(_pending(1, run="run-2")) == "a manifest of run run-2 (found one of run run-1)"


def test_latest_never_moves_back_to_an_older_step_committed_late(tmp_path: Path) -> None:
    publisher = _publisher(tmp_path, FakeClock())
    for step in (5, 3):
        _receipt(publisher, "a", step, (0, 1, 2, 3))
    assert commit_if_complete(publisher, 5) is None
    assert commit_if_complete(publisher, 3) is None

    assert catalog.committed_steps(tmp_path / "job") == [3, 5]
    assert (tmp_path / "job" / layout.LATEST).read_text() == "5\n"


def test_the_newest_committed_step_is_remembered_only_when_listed(tmp_path: Path) -> None:
    publisher = _publisher(tmp_path, FakeClock())
    assert publisher.newest_known("job") is None
    assert publisher.newest_committed("job") == -1
    assert publisher.newest_known("job") == -1


def test_retention_keeps_the_newest_and_leaves_busy_steps_alone(tmp_path: Path) -> None:
    publisher = _publisher(tmp_path, FakeClock())
    for step in (1, 2, 3):
        _receipt(publisher, "a", step, (0, 1, 2, 3))
        assert commit_if_complete(publisher, step) is None
    _receipt(publisher, "a", 4, (0, 1))

    publisher.retain("job", busy={4})
    assert catalog.committed_steps(tmp_path / "job") == [2, 3]
    assert publisher.store.step_path("job", 4).is_dir()
