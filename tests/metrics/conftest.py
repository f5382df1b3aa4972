"""Fixtures of the metrics tests: the data-path fixtures plus a sidecar with its metrics port open."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from data_path.conftest import short_tmp, start_rank, start_sidecar, storage
from data_path.processes import SidecarProcess

from metrics.promtools import free_port

__all__ = ["metrics_sidecar", "short_tmp", "start_rank", "start_sidecar", "storage"]


class MetricsSidecar:
    """A running sidecar and the base URL of its HTTP endpoints."""

    def __init__(self, process: SidecarProcess, port: int) -> None:
        self.process = process
        self.url = f"http://127.0.0.1:{port}"


@pytest.fixture
def metrics_sidecar(start_sidecar: Callable[..., SidecarProcess]) -> MetricsSidecar:
    port = free_port()
    # With a bucket tier, whose series exist only then; the endpoint takes no connection (nothing is saved).
    bucket = ["--bucket", "s3://metrics-test", "--bucket-endpoint", "http://127.0.0.1:9"]
    return MetricsSidecar(start_sidecar("a", ["--metrics-port", str(port), "--metrics-address", "127.0.0.1",
                                              *bucket]), port)
