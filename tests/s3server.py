"""The suite's S3 server (``bench.s3server``), with the ``weed`` that ``tests/conftest.py`` built before the first
test marked ``s3``: it says where in ``$STOWAWAY_WEED``, or why it could not in ``$STOWAWAY_WEED_MISSING`` (only
when there is no Go toolchain: the tests are then skipped with that message)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from bench.s3server import ADMIN, READER, TRAINER, S3Server
from stowaway.storage import bucket, bucket_jobs

__all__ = ["ADMIN", "READER", "TRAINER", "S3Server", "weed_binary"]


def weed_binary() -> Path:
    missing = os.environ.get("STOWAWAY_WEED_MISSING")
    if missing:
        pytest.skip(f"no S3 server for the s3 tests: {missing}")
    found = os.environ.get("STOWAWAY_WEED")
    if not found:
        pytest.fail("$STOWAWAY_WEED is not set: tests/conftest.py builds weed before the first s3 test "
                    "(run hack/e2e/gobuild seaweedfs to see why it did not)")
    return Path(found)


def bucket_steps(server: S3Server, url: str, retry_seconds: float = 60.0) -> list[int]:
    """The committed steps of the job at ``url`` as the tools see them: the outcome a test waits for."""
    jobs = bucket_jobs.jobs_at(url, bucket.Settings(endpoint=server.endpoint, retry_seconds=retry_seconds))
    return jobs[0].committed_steps() if jobs else []
