"""The exporter with a private registry: what each Stats call puts into which series."""

from __future__ import annotations

import ast
import errno
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from metrics.promtools import sample_names, samples
from stowaway.protocol import messages
from stowaway.sidecar import metrics as sidecar_metrics
from stowaway.sidecar.metrics import BUCKETS, FAILURE_REASONS, RESTORE_SOURCES, SidecarMetrics
from stowaway.sidecar.persister import classify
from stowaway.sidecar.stats import Stats

SIDECAR_SOURCE = Path(sidecar_metrics.__file__).parent
# Where a failure kind is passed: the callee's name and the argument's position.
KIND_ARGUMENT = {"PersistError": 0, "failed": 0, "fail": 2, "_answer_failure": 3}


def scrape(stats: Stats) -> dict[str, float]:
    body, _ = stats.metrics.exposition()
    return samples(body.decode())


def fresh() -> Stats:
    return Stats(SidecarMetrics(CollectorRegistry()))


def test_a_fresh_exporter_reports_no_commit_yet_and_zero_failures_and_restores_of_every_label() -> None:
    found = scrape(fresh())
    assert found["stowaway_last_committed_step"] == -1
    assert found["stowaway_last_commit_timestamp_seconds"] == 0
    for reason in FAILURE_REASONS:
        assert found[f'stowaway_failures_total{{reason="{reason}"}}'] == 0
    for source in ("memory", "storage"):
        assert found[f'stowaway_restores_total{{source="{source}"}}'] == 0
        assert found[f'stowaway_restore_duration_seconds_count{{source="{source}"}}'] == 0


def test_the_restore_sources_are_those_the_protocol_allows() -> None:
    assert RESTORE_SOURCES == ("memory", "storage")
    for source in RESTORE_SOURCES:
        messages.Restored(step=1, source=source, seconds=0.0)


def test_each_stats_call_feeds_its_series() -> None:
    stats = fresh()
    stats.save_reported(blocking=0.003, slot_wait=0.0)
    stats.save_reported(blocking=0.2, slot_wait=0.15)
    stats.persist_finished(nbytes=4096, seconds=0.04)
    stats.committed(step=7, seconds=0.5, when=1_700_000_000.0)
    stats.committed(step=5, seconds=0.6, when=1_700_000_001.0)
    stats.failed("storage_full")
    stats.restored("memory", 0.03)
    stats.restored("memory", 0.002)
    stats.restored("storage", 4.0)
    stats.pooled_spare_saved()
    found = scrape(stats)
    assert found["stowaway_save_blocking_seconds_count"] == 2
    assert found["stowaway_save_blocking_seconds_sum"] == 0.203
    assert found['stowaway_save_blocking_seconds_bucket{le="0.005"}'] == 1
    assert found['stowaway_save_slot_wait_seconds_bucket{le="0.25"}'] == 2
    assert found["stowaway_persist_duration_seconds_count"] == 1
    assert found["stowaway_persisted_bytes_total"] == 4096
    assert found["stowaway_commit_duration_seconds_count"] == 2
    assert found["stowaway_last_committed_step"] == 7, "a late commit of an older step must not move it back"
    assert found["stowaway_last_commit_timestamp_seconds"] == 1_700_000_001.0
    assert found['stowaway_failures_total{reason="storage_full"}'] == 1
    assert found['stowaway_restores_total{source="memory"}'] == 2
    assert found['stowaway_restores_total{source="storage"}'] == 1
    assert found['stowaway_restore_duration_seconds_count{source="memory"}'] == 2
    assert found['stowaway_restore_duration_seconds_sum{source="memory"}'] == 0.032
    assert found['stowaway_restore_duration_seconds_bucket{le="0.0025",source="memory"}'] == 1
    assert found['stowaway_restore_duration_seconds_bucket{le="2.5",source="storage"}'] == 0
    assert found['stowaway_restore_duration_seconds_bucket{le="5.0",source="storage"}'] == 1
    assert found["stowaway_pooled_spare_saves_total"] == 1
    assert stats.summary() == {"persists": 1, "persisted_bytes": 4096, "commits": 2, "last_committed_step": 7,
                               "failures": {"storage_full": 1}, "restores": {"memory": 2, "storage": 1},
                               "pooled_spare_saves": 1}


def test_an_unknown_failure_reason_is_counted_as_internal_so_the_label_set_stays_bounded() -> None:
    stats = fresh()
    stats.failed("something new")
    found = scrape(stats)
    assert found['stowaway_failures_total{reason="internal"}'] == 1
    assert not any("something new" in series for series in found)


def test_nonsense_durations_sent_by_a_rank_are_dropped() -> None:
    stats = fresh()
    for blocking, slot_wait in ((-1.0, 0.0), (float("nan"), 0.0), (0.1, float("inf"))):
        stats.save_reported(blocking, slot_wait)
    stats.restored("memory", -0.5)
    found = scrape(stats)
    assert found["stowaway_save_blocking_seconds_count"] == 0
    assert found["stowaway_save_slot_wait_seconds_count"] == 0
    assert found['stowaway_restore_duration_seconds_count{source="memory"}'] == 0
    assert found['stowaway_restores_total{source="memory"}'] == 1, "the restore happened all the same"


def test_gauges_of_ranks_and_slots_are_read_from_their_source_at_scrape_time() -> None:
    stats = fresh()
    current: dict[str, Any] = {"ranks": 3, "slots": 1, "since": 1_700_000_000.5}
    stats.watch(lambda: current["ranks"], lambda: current["slots"], lambda: current["since"])
    found = scrape(stats)
    assert found["stowaway_ranks_connected"] == 3
    assert found["stowaway_ranks_connected_since_timestamp_seconds"] == 1_700_000_000.5
    current.update(ranks=0, slots=0, since=None)
    found = scrape(stats)
    assert (found["stowaway_ranks_connected"], found["stowaway_slots_in_flight"]) == (0, 0)
    assert found["stowaway_ranks_connected_since_timestamp_seconds"] == 0


def test_buckets_span_one_millisecond_to_thirty_minutes() -> None:
    assert BUCKETS[0] == 0.001 and BUCKETS[-1] == 1800
    assert list(BUCKETS) == sorted(set(BUCKETS))


def test_every_series_is_named_stowaway_and_only_reason_source_and_le_are_labels() -> None:
    stats = fresh()
    stats.watch(lambda: 0, lambda: 0, lambda: None)
    found = scrape(stats)
    assert all(name.startswith("stowaway_") for name in sample_names(stats.metrics.exposition()[0].decode()))
    labels = {pair.split("=", 1)[0] for series in found if "{" in series
              for pair in series.split("{", 1)[1].rstrip("}").split(",")}
    assert labels == {"reason", "source", "le"}


def test_every_failure_kind_the_sidecar_can_report_is_a_known_reason() -> None:
    kinds = {classify(OSError(code, "x"), Path("/x")).kind for code in (errno.ENOSPC, errno.EROFS, errno.EIO)}
    for module in SIDECAR_SOURCE.rglob("*.py"):
        for node in ast.walk(ast.parse(module.read_text())):
            if not isinstance(node, ast.Call):
                continue
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            position = KIND_ARGUMENT.get(name)
            if position is not None and len(node.args) > position:
                argument = node.args[position]
                if isinstance(argument, ast.Constant) and isinstance(argument.value, str):
                    kinds.add(argument.value)
    assert {"commit_timeout", "peer_refused", "protocol", "internal", "restore_corrupt"} <= kinds, kinds
    assert kinds <= set(FAILURE_REASONS), sorted(kinds - set(FAILURE_REASONS))


def persist(**overlap: float | None) -> messages.Persist:
    return messages.Persist(run="r", step=1, slot=0, generation=1, nbytes=1, blocking_seconds=0.002,
                            slot_wait_seconds=0.0, **overlap)


def test_an_overlapped_save_feeds_staging_stall_and_hidden_seconds_and_a_blocking_one_none_of_them() -> None:
    stats = fresh()
    stats.staging_reported(persist())
    stats.staging_reported(persist(staging_seconds=0.302, stall_seconds=0.1))
    stats.staging_reported(persist(staging_seconds=0.052, stall_seconds=None))
    found = scrape(stats)
    assert found["stowaway_save_staging_seconds_count"] == 2
    assert found["stowaway_save_staging_seconds_sum"] == 0.354
    assert found['stowaway_save_staging_seconds_bucket{le="0.25"}'] == 1
    assert found["stowaway_save_stall_seconds_count"] == 2 and found["stowaway_save_stall_seconds_sum"] == 0.1
    # 0.302 - 0.002 - 0.1, plus 0.052 - 0.002
    assert found["stowaway_save_overlap_hidden_seconds_total"] == pytest.approx(0.25)


def test_nonsense_staging_times_sent_by_a_rank_are_dropped() -> None:
    stats = fresh()
    for staging, stall in ((-1.0, 0.0), (float("nan"), 0.0), (0.1, float("inf")), (0.1, -0.5)):
        stats.staging_reported(persist(staging_seconds=staging, stall_seconds=stall))
    found = scrape(stats)
    assert found["stowaway_save_staging_seconds_count"] == 0 and found["stowaway_save_stall_seconds_count"] == 0
    assert found["stowaway_save_overlap_hidden_seconds_total"] == 0


def test_every_kind_the_bucket_tier_can_report_is_a_known_bucket_reason() -> None:
    from stowaway.sidecar.metrics import BUCKET_FAILURE_REASONS
    from stowaway.storage import bucket

    kinds = set(bucket.KINDS)
    source = (SIDECAR_SOURCE / "bucket_tier.py").read_text()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "upload_failed" and node.args:
            # Every string the argument may evaluate to, also inside a conditional expression.
            kinds.update(part.value for part in ast.walk(node.args[0])
                         if isinstance(part, ast.Constant) and isinstance(part.value, str))
    assert {"claim_io", "restore_corrupt", "bucket_denied"} <= kinds
    assert kinds <= set(BUCKET_FAILURE_REASONS), sorted(kinds - set(BUCKET_FAILURE_REASONS))
