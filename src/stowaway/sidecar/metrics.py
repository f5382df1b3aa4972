"""The sidecar's Prometheus series; with the operator's metrics module, the only door to ``prometheus_client``.

Every series lives in a registry of its own (never the library's global one), so
two sidecars in one process, or a test, cannot see each other's numbers.

Labels are bounded on purpose: a failure's ``reason`` and a restore's
``source`` come from fixed lists, and there is no step, rank, path or job
label. A sidecar serves the ranks of one pod; which job and pod it belongs to
is what Prometheus's target labels (namespace, pod, job) already say.

Throughput has no series of its own: ``stowaway_persisted_bytes_total`` divided
by ``stowaway_persist_duration_seconds_sum`` (both as ``rate``) is the
bytes-weighted write speed, exact and summable over sidecars; a histogram of
per-persist bytes/second would weigh a 1 KiB persist like a 10 GiB one and its
quantiles could not be added up across pods.
"""

from __future__ import annotations

import logging
import threading
import typing
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.registry import Collector

from stowaway.protocol import messages
from stowaway.storage import bucket

log = logging.getLogger(__name__)

# 1 ms (a save that only copies into warm shared memory) to 30 min (a commit of a huge
# multi-node checkpoint on slow shared storage), roughly 1-2.5-5 per decade.
BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
    30.0, 60.0, 120.0, 300.0, 600.0, 1200.0, 1800.0,
)

# Every ``kind`` a PersistError, a commit failure or a session may report.
FAILURE_REASONS = (
    "storage_full", "storage_read_only", "storage_io", "slot_invalid", "slot_overwritten", "commit_timeout",
    "other_node_failed", "protocol", "peer_refused", "internal", "restore_missing", "restore_slot_small",
    "restore_io", "restore_corrupt", "step_refused",
    # A bucket as the storage itself (``storage.bucket_store``): what a bucket refused, and a second manifest.
    *bucket.KINDS, "manifest_exists",
)

# Where a rank's load() may have found the step it restored; the protocol validates the label's value.
RESTORE_SOURCES: tuple[str, ...] = typing.get_args(messages.RestoreSource)


class SidecarMetrics:
    """The series one sidecar exports, created in ``registry``."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.save_blocking = Histogram(
            "stowaway_save_blocking_seconds",
            "Time save() blocked the training loop, as measured by each rank (slot wait and copy).",
            buckets=BUCKETS, registry=r,
        )
        self.slot_wait = Histogram(
            "stowaway_save_slot_wait_seconds",
            "Part of the blocking time a rank waited for a free slot because persisting lagged behind.",
            buckets=BUCKETS, registry=r,
        )
        self.staging = Histogram(
            "stowaway_save_staging_seconds",
            "Per save(overlap=True): time from save() until its copy into shared memory ended, measured by the rank.",
            buckets=BUCKETS, registry=r,
        )
        self.stall = Histogram(
            "stowaway_save_stall_seconds",
            "Per save(overlap=True): time the training loop waited on the host for its copy (a guard, the next save).",
            buckets=BUCKETS, registry=r,
        )
        self.overlap_hidden = Counter(
            "stowaway_save_overlap_hidden_seconds",
            "Copy time of save(overlap=True) the training loop did not wait for (staging less blocking and stall).",
            registry=r,
        )
        self.pooled_spare_saves = Counter(
            "stowaway_pooled_spare_saves",
            "Saves written into one of the pod's pooled spare slots: their rank saved again before its own slot "
            "was persisted.",
            registry=r,
        )
        self.persist_duration = Histogram(
            "stowaway_persist_duration_seconds",
            "Time from starting to copy a slot to storage until its file was durable.",
            buckets=BUCKETS, registry=r,
        )
        self.commit_duration = Histogram(
            "stowaway_commit_duration_seconds",
            "Time from a step's first persist on this node until its manifest was committed.",
            buckets=BUCKETS, registry=r,
        )
        self.persisted_bytes = Counter(
            "stowaway_persisted_bytes", "Bytes written durably to storage.", registry=r,
        )
        self.failures = Counter(
            "stowaway_failures", "Failed saves, restores and refused connections, by reason.",
            ["reason"], registry=r,
        )
        for reason in FAILURE_REASONS:
            self.failures.labels(reason)
        self.restores = Counter(
            "stowaway_restores", "Steps restored by load() on a rank of this sidecar, by where they came from.",
            ["source"], registry=r,
        )
        self.restore_duration = Histogram(
            "stowaway_restore_duration_seconds",
            "Time load() took on a rank, as measured by the rank, by where the restored step came from.",
            ["source"], buckets=BUCKETS, registry=r,
        )
        # Both sources from the start, so that "no restore from memory" is a 0 and not a missing series.
        for source in RESTORE_SOURCES:
            self.restores.labels(source)
            self.restore_duration.labels(source)
        self.last_committed_step = Gauge(
            "stowaway_last_committed_step", "Highest step this sidecar saw committed; -1 before the first.",
            registry=r,
        )
        self.last_committed_step.set(-1)
        self.last_commit_timestamp = Gauge(
            "stowaway_last_commit_timestamp_seconds",
            "Unix time of the last commit this sidecar saw; 0 before the first.", registry=r,
        )
        self.stale_after = Gauge(
            "stowaway_stale_after_seconds",
            "How long the job may go without a new committed checkpoint before the alerts fire (--stale-after).",
            registry=r,
        )

    def failed(self, reason: str) -> None:
        if reason not in FAILURE_REASONS:
            log.warning("failure reason %r is not a known metric label; counted as internal", reason)
            reason = "internal"
        self.failures.labels(reason).inc()

    def watch(self, ranks_connected: Callable[[], int], slots_in_flight: Callable[[], int],
              connected_since: Callable[[], float | None]) -> None:
        """Export gauges read at scrape time from whoever knows them (the rank registry)."""
        self.registry.register(_LiveGauges(ranks_connected, slots_in_flight, connected_since))

    def exposition(self) -> tuple[bytes, str]:
        """The text a scrape gets, and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class _LiveGauges(Collector):
    """Reads the values when scraped, so they cannot drift from the registry they describe."""

    def __init__(self, ranks_connected: Callable[[], int], slots_in_flight: Callable[[], int],
                 connected_since: Callable[[], float | None]) -> None:
        self._ranks_connected = ranks_connected
        self._slots_in_flight = slots_in_flight
        self._connected_since = connected_since

    def collect(self) -> Iterator[GaugeMetricFamily]:
        yield GaugeMetricFamily(
            "stowaway_ranks_connected", "Ranks with an open connection to this sidecar.",
            value=self._ranks_connected(),
        )
        yield GaugeMetricFamily(
            "stowaway_slots_in_flight", "Slots the sidecar owns right now (being persisted or staged).",
            value=self._slots_in_flight(),
        )
        yield GaugeMetricFamily(
            "stowaway_ranks_connected_since_timestamp_seconds",
            "Unix time since which ranks have been connected without a break; 0 while none is.",
            value=self._connected_since() or 0,
        )


# Why an upload to (or a restore from) the bucket tier failed: ``storage.bucket.KINDS`` and the claim's side.
BUCKET_FAILURE_REASONS = (*bucket.KINDS, "claim_io", "restore_corrupt")
# The storage tiers a step can be committed in, below shared memory.
TIERS = ("claim", "bucket")


class BucketMetrics:
    """The bucket tier's series (``sidecar.bucket_tier``), in the sidecar's registry; created only with a bucket.

    Upload throughput is ``rate(stowaway_bucket_uploaded_bytes_total)`` over
    ``rate(stowaway_bucket_upload_duration_seconds_sum)``, as for persists.
    How far the bucket lags is ``stowaway_tier_newest_step{tier="claim"}``
    minus ``{tier="bucket"}``.
    """

    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.uploaded_bytes = Counter(
            "stowaway_bucket_uploaded_bytes", "Bytes of rank files uploaded to the bucket tier (parts sent).",
            registry=r,
        )
        self.upload_duration = Histogram(
            "stowaway_bucket_upload_duration_seconds",
            "Time to upload one committed step to the bucket, from its first part to its manifest.",
            buckets=BUCKETS, registry=r,
        )
        self.uploads = Counter("stowaway_bucket_uploads", "Steps committed in the bucket by this sidecar.",
                               registry=r)
        self.failures = Counter(
            "stowaway_bucket_failures", "Failed uploads to and restores from the bucket tier, by reason.",
            ["reason"], registry=r,
        )
        for reason in BUCKET_FAILURE_REASONS:
            self.failures.labels(reason)
        self.downloaded_bytes = Counter(
            "stowaway_bucket_downloaded_bytes",
            "Bytes copied from the bucket to the claim to restore a job whose claim held no checkpoint.",
            registry=r,
        )
        self.newest_step = Gauge(
            "stowaway_tier_newest_step", "Newest step this sidecar knows committed in each storage tier; -1 if none.",
            ["tier"], registry=r,
        )
        self.last_upload_timestamp = Gauge(
            "stowaway_bucket_last_upload_timestamp_seconds",
            "Unix time this sidecar last committed a step in the bucket; 0 before the first.", registry=r,
        )
        self._newest = dict.fromkeys(TIERS, -1)
        self._lock = threading.Lock()
        for tier in TIERS:
            self.newest_step.labels(tier).set(-1)

    def upload_failed(self, reason: str) -> None:
        if reason not in BUCKET_FAILURE_REASONS:
            log.warning("bucket failure reason %r is not a known metric label; counted as bucket_io", reason)
            reason = "bucket_io"
        self.failures.labels(reason).inc()

    def newest(self, tier: str, step: int) -> None:
        """Raise the tier's newest step to ``step`` (it never goes back: retention only drops older steps)."""
        with self._lock:
            self._newest[tier] = max(self._newest[tier], step)
            self.newest_step.labels(tier).set(self._newest[tier])
