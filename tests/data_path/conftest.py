"""Fixtures of the data-path tests: short temp dirs, real sidecars, real rank processes."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from s3server import S3Server

from data_path.processes import RankProcess, SidecarProcess


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """A temp dir under /tmp with a short name: Unix socket paths must stay under 108 bytes."""
    path = Path(tempfile.mkdtemp(prefix="sw", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)
    shutil.rmtree(Path("/dev/shm") / path.name, ignore_errors=True)


@pytest.fixture
def storage(short_tmp: Path) -> Path:
    return short_tmp / "storage"


@pytest.fixture
def start_sidecar(short_tmp: Path, storage: Path) -> Iterator[Callable[..., SidecarProcess]]:
    started: list[SidecarProcess] = []

    def start(name: str = "a", extra: list[str] | None = None, storage_dir: Path | None = None,
              claim: bool = True) -> SidecarProcess:
        """``claim`` False: a sidecar without a storage directory, whose ``--bucket`` in ``extra`` is its storage."""
        sidecar = SidecarProcess(short_tmp, (storage_dir or storage) if claim else None, name, extra).start()
        started.append(sidecar)
        return sidecar

    yield start
    # Stop every sidecar before reporting any of them, so a failure never leaks a process.
    bad = [f"sidecar {sidecar.name} exited with {status} on SIGTERM:\n{sidecar.log()}"
           for sidecar in started if sidecar.alive() and (status := sidecar.stop()) != 0]
    assert not bad, "\n".join(bad)


@pytest.fixture
def start_rank(short_tmp: Path) -> Iterator[Callable[..., RankProcess]]:
    started: list[RankProcess] = []

    def start(sidecar: SidecarProcess, job: str = "job", rank: int = 0, world_size: int = 1,
              local_world_size: int | None = None, run_id: str = "test-run",
              extra_env: dict[str, str] | None = None) -> RankProcess:
        env = {**sidecar.env(job, rank, world_size, local_world_size, run_id), **(extra_env or {})}
        process = RankProcess(env, short_tmp / f"rank-{job}-{rank}-{len(started)}.log")
        started.append(process)
        return process

    yield start
    for process in started:
        if process.process.poll() is None:
            process.kill()


@pytest.fixture
def bucket_env(s3_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> S3Server:
    """The trainer's credentials and the endpoint in the environment the sidecars and the CLI inherit."""
    for name, value in s3_server.env().items():
        monkeypatch.setenv(name, value)
    return s3_server
