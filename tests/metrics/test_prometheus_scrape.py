"""A real Prometheus scrapes a sidecar while three ranks save 30 steps, every other one with ``overlap=True``, and
its bucket tier uploads them to a real S3 server.

What the ranks measured must be what Prometheus reports, and every dashboard
query must return data. Synchronisation is on what Prometheus has observably
stored (a sample with a given value), never on sleeps.
"""

from __future__ import annotations

import bisect
import math
import shutil
import statistics
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from data_path.processes import RankProcess, SidecarProcess, wait_for
from s3server import S3Server

from metrics import dashboard
from metrics.promtools import PrometheusServer, free_port
from stowaway.sidecar.metrics import BUCKETS

pytestmark = [pytest.mark.prometheus, pytest.mark.s3]

RANKS = 3
STEPS = 30
POLL = 0.2


@dataclass
class ObservedRun:
    prometheus: PrometheusServer
    blocking: list[float]
    staging: list[float]
    started_unix: float


def until_prometheus_has(prometheus: PrometheusServer, expr: str, expected: float) -> None:
    wait_for(lambda: prometheus.value(expr) == expected, f"Prometheus to report {expr} == {expected}", interval=POLL)


@pytest.fixture(scope="module")
def observed_run(s3_server: S3Server) -> Iterator[ObservedRun]:
    root = Path(tempfile.mkdtemp(prefix="sw", dir="/tmp"))
    port = free_port()
    # With a bucket tier on a real S3 server: its series, and the dashboard's row over them, exist only then.
    s3_server.create_bucket("metrics-scrape")
    sidecar = SidecarProcess(root, root / "storage", "a", ["--metrics-port", str(port), "--metrics-address",
                                                           "127.0.0.1", "--bucket", "s3://metrics-scrape"])
    prometheus = PrometheusServer(f"127.0.0.1:{port}")
    ranks: list[RankProcess] = []
    environment = pytest.MonkeyPatch()
    try:
        for name, value in s3_server.env().items():
            environment.setenv(name, value)  # the sidecar's credentials and endpoint, as the policy gives them
        sidecar.start()
        for rank in range(RANKS):
            ranks.append(RankProcess(sidecar.env("job", rank, RANKS), root / f"rank-{rank}.log"))
        # A scraped zero before the first save: rate() then covers every observation.
        until_prometheus_has(prometheus, "stowaway_save_blocking_seconds_count", 0)
        started_unix = time.time()
        blocking = [rank.save(step, overlap=step % 2 == 1)["blocking"] for step in range(STEPS) for rank in ranks]
        for rank in ranks:
            assert rank.wait(STEPS - 1)["committed"]
        staging = [seconds for rank in ranks for seconds in rank.call(op="overlap_seconds")["staging"]]
        until_prometheus_has(prometheus, "stowaway_save_blocking_seconds_count", RANKS * STEPS)
        until_prometheus_has(prometheus, "stowaway_save_staging_seconds_count", RANKS * (STEPS // 2))
        until_prometheus_has(prometheus, "stowaway_last_committed_step", STEPS - 1)
        wait_for(lambda: (prometheus.value("stowaway_bucket_uploads_total") or 0) >= 1,
                 "Prometheus to report an upload to the bucket", interval=POLL)
        yield ObservedRun(prometheus, blocking, staging, started_unix)
    finally:
        environment.undo()
        for rank in ranks:
            rank.kill()
        if sidecar.alive():
            sidecar.stop()
        prometheus.stop()
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(Path("/dev/shm") / root.name, ignore_errors=True)


def bucket_bounds(value: float) -> tuple[float, float]:
    """The histogram bucket (lower, upper] that holds ``value``."""
    index = bisect.bisect_left(BUCKETS, value)
    return (BUCKETS[index - 1] if index else 0.0), (BUCKETS[index] if index < len(BUCKETS) else math.inf)


def test_prometheus_holds_every_blocking_time_the_ranks_measured(observed_run: ObservedRun) -> None:
    total = observed_run.prometheus.value("stowaway_save_blocking_seconds_sum")
    assert total == pytest.approx(sum(observed_run.blocking), rel=1e-9)


def test_prometheus_holds_every_staging_time_of_the_overlapped_saves(observed_run: ObservedRun) -> None:
    assert len(observed_run.staging) == RANKS * (STEPS // 2)
    total = observed_run.prometheus.value("stowaway_save_staging_seconds_sum")
    assert total == pytest.approx(sum(observed_run.staging), rel=1e-9)


def test_the_median_blocking_time_from_promql_lies_in_the_bucket_of_the_ranks_median(
    observed_run: ObservedRun,
) -> None:
    median = observed_run.prometheus.value(
        "histogram_quantile(0.5, sum by (le) (rate(stowaway_save_blocking_seconds_bucket[5m])))"
    )
    assert median is not None
    lower, _ = bucket_bounds(statistics.median_low(observed_run.blocking))
    _, upper = bucket_bounds(statistics.median_high(observed_run.blocking))
    assert lower <= median <= upper, (median, sorted(observed_run.blocking))


def test_prometheus_sees_the_last_committed_step_and_when_it_was_committed(observed_run: ObservedRun) -> None:
    prometheus = observed_run.prometheus
    assert prometheus.value("stowaway_last_committed_step") == STEPS - 1
    committed = prometheus.value("stowaway_last_commit_timestamp_seconds")
    assert committed is not None and observed_run.started_unix <= committed <= time.time()
    assert prometheus.value("stowaway_ranks_connected") == RANKS


def test_every_dashboard_query_returns_data_from_the_scraped_run(observed_run: ObservedRun) -> None:
    for where, expr in dashboard.queries(dashboard.load()):
        result = observed_run.prometheus.query(dashboard.with_all_selected(expr))
        assert result, f"{where}: {expr} returns nothing; the panel would be blank"
        values = [float(series["value"][1]) for series in result]
        assert all(math.isfinite(value) for value in values), f"{where}: {expr} returns {values}"
