"""The sidecar's settings, each declared once.

A declaration holds everything about one setting: the attribute of
``SidecarConfig`` it fills, its command-line flag, type, default, help and
limits, and, where a CheckpointPolicy sets it, the field of the policy's spec.
The sidecar's command-line parser, its config's defaults and checks, and the
command line the operator injects are all derived from these, and
``tests/unit/test_sidecar_settings.py`` holds the CRD in the chart to them.

Rule of this module: standard library only and no I/O, so that both the slim
sidecar and the operator (which never import each other) can import it.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar

N = TypeVar("N", int, float)
V = TypeVar("V")


def _metavar(flag: str) -> str:
    """What argparse would show for ``flag``'s value, so that a dest other than the flag's name does not change it."""
    return flag.removeprefix("--").replace("-", "_").upper()


def _absolute_path(text: str) -> Path:
    return Path(text).absolute()


def _at(spec: Mapping[str, Any], path: tuple[str, ...]) -> Any:
    """The value at ``path`` in a policy's spec: JSON as the API server stored it, CRD defaults applied."""
    value: Any = spec
    for key in path:
        value = value[key]
    return value


@dataclass(frozen=True)
class Location:
    """A path (``--flag PATH``), one the sidecar must be given unless ``required`` is False; the command line
    makes it absolute."""

    name: str
    flag: str
    help: str
    required: bool = True

    def add_to(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument(self.flag, dest=self.name, type=_absolute_path, required=self.required,
                            metavar=_metavar(self.flag), help=self.help)

    def command_line(self, path: str) -> list[str]:
        return [self.flag, path]


@dataclass(frozen=True)
class Number(Generic[N]):
    """A number given as ``--flag VALUE``, with a default and the range the sidecar accepts.

    ``requirement`` completes "``--flag`` must be ..." in the error for a value
    out of range. ``policy`` is the path of the field in a CheckpointPolicy's
    spec that sets it in injected sidecars; ``policy_default`` is the CRD's
    default where it differs from the command line's (``None``: the same).
    """

    name: str
    flag: str
    parse: Callable[[str], N]
    default: N
    help: str
    metavar: str | None = None
    least: float | None = None
    above: float | None = None
    most: float | None = None
    requirement: str = ""
    policy: tuple[str, ...] | None = None
    policy_default: N | None = None

    def add_to(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument(self.flag, dest=self.name, type=self.parse, default=self.default,
                            metavar=self.metavar or _metavar(self.flag), help=self.help)

    @property
    def limited(self) -> bool:
        return self.least is not None or self.above is not None or self.most is not None

    def admits(self, value: float) -> bool:
        return ((self.least is None or value >= self.least) and (self.above is None or value > self.above)
                and (self.most is None or value <= self.most))

    def check(self, value: N) -> None:
        """Refuse a value out of range with an error that names the flag, what it takes and what it got."""
        if not self.admits(value):
            raise ValueError(f"{self.flag} must be {self.requirement}, got {value}")

    def policy_value(self, spec: Mapping[str, Any]) -> Any:
        """The value the policy sets (its spec as stored, so an integer stays one on the command line)."""
        if self.policy is None:
            raise LookupError(f"no CheckpointPolicy field sets {self.flag}")
        return _at(spec, self.policy)

    def command_line(self, value: N) -> list[str]:
        return [self.flag, str(value)]


@dataclass(frozen=True)
class Text(Generic[V]):
    """A string given as ``--flag VALUE``; a default of ``None`` leaves it to ``SidecarConfig`` (the help says how)."""

    name: str
    flag: str
    default: V
    help: str
    metavar: str | None = None

    def add_to(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument(self.flag, dest=self.name, default=self.default,
                            metavar=self.metavar or _metavar(self.flag), help=self.help)


@dataclass(frozen=True)
class Switch:
    """A behaviour that is on unless ``--flag`` is given (a policy sets it with a boolean)."""

    name: str
    flag: str
    help: str
    policy: tuple[str, ...] | None = None
    default: bool = True

    def add_to(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument(self.flag, dest=self.name, action="store_false", help=self.help)

    def policy_value(self, spec: Mapping[str, Any]) -> Any:
        if self.policy is None:
            raise LookupError(f"no CheckpointPolicy field sets {self.flag}")
        return _at(spec, self.policy)

    def command_line(self, value: bool) -> list[str]:
        return [] if value else [self.flag]


@dataclass(frozen=True)
class Flag:
    """A behaviour that is off unless ``--flag`` is given."""

    name: str
    flag: str
    help: str
    default: bool = False

    def add_to(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument(self.flag, dest=self.name, action="store_true", help=self.help)

    def command_line(self, value: bool) -> list[str]:
        return [self.flag] if value else []


@dataclass(frozen=True)
class Repeated(Generic[V]):
    """``--flag VALUE`` given any number of times, each adding one value."""

    name: str
    flag: str
    parse: Callable[[str], V]
    help: str
    metavar: str | None = None

    def add_to(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument(self.flag, dest=self.name, type=self.parse, action="append", default=[],
                            metavar=self.metavar or _metavar(self.flag), help=self.help)

    def command_line(self, value: V) -> list[str]:
        return [self.flag, str(value)]


STORAGE = Location("storage", "--storage",
                   "durable storage directory (a PVC mount); without it, --bucket is the storage", required=False)
SOCKET = Location("socket_path", "--socket", "Unix socket path (shorter than 108 bytes)")
SHM_DIR = Location("shm_dir", "--shm-dir", "shared-memory directory holding slot files")
NODE = Text("node", "--node-name", None, "name of this node in receipts (default: $NODE_NAME or the host name)")
KEEP_LAST = Number(
    "keep_last", "--keep-last", int, 3, "committed checkpoints to keep", metavar="K",
    least=1, requirement="at least 1", policy=("retention", "keepLast"),
)
KEEP_EVERY = Number(
    "keep_every", "--keep-every", int, 0, "also keep every checkpoint whose step is a multiple of M (0: off)",
    metavar="M", least=0, requirement="0 (off) or positive", policy=("retention", "keepEvery"),
)
COMMIT_TIMEOUT = Number(
    "commit_timeout", "--commit-timeout", float, 600.0,
    "how long a step may wait for every rank's file before it fails", metavar="SECONDS",
    above=0, requirement="a positive number of seconds", policy=("commitTimeoutSeconds",),
)
COMMIT_POLL_INTERVAL = Number(
    "commit_poll_interval", "--commit-poll-interval", float, 0.2,
    "how often a pending commit looks for receipts of other nodes on shared storage", metavar="SECONDS",
)
STALE_AFTER = Number(
    "stale_after", "--stale-after", float, 7200.0,
    "how long the job may go without a new committed checkpoint before the shipped alerts fire; exported as "
    "stowaway_stale_after_seconds (default: 2 hours)", metavar="SECONDS",
    above=0, requirement="a positive number of seconds, above the job's save interval",
    policy=("alerting", "staleAfterSeconds"),
)
PERSIST_WORKERS = Number(
    "persist_workers", "--persist-workers", int, 4, "slots persisted concurrently",
    least=1, requirement="at least 1", policy=("persistence", "concurrency"),
)
WRITE_RATE_LIMIT = Number(
    "write_rate_limit", "--write-rate-limit", float, 0.0, "cap on write bandwidth to storage (0: unlimited)",
    metavar="BYTES_PER_SECOND",
)
METRICS_PORT = Number(
    "metrics_port", "--metrics-port", int, 0,
    "serve /metrics (Prometheus), /healthz and /readyz over HTTP on this port (0: off)", metavar="PORT",
    least=0, most=65535, requirement="0 (off) or a TCP port up to 65535",
    # Off on a laptop; an injected sidecar always serves it, for the PodMonitor.
    policy=("sidecar", "metricsPort"), policy_default=9464,
)
METRICS_ADDRESS = Text(
    "metrics_address", "--metrics-address", "0.0.0.0",
    "address the metrics port listens on (default: all interfaces, for a pod's scraper)", metavar="ADDRESS",
)
GRACE_PERIOD = Number(
    "grace_period", "--grace-period", float, 120.0, "on SIGTERM, how long in-flight persists may take to finish",
    metavar="SECONDS", least=0, requirement="0 or more seconds", policy=("sidecar", "gracePeriodSeconds"),
)
DIRECT_IO = Switch(
    "direct_io", "--no-direct-io",
    "write and read checkpoint files through the page cache, even where the filesystem supports O_DIRECT "
    "(the default uses it there)",
    policy=("persistence", "directIO"),
)
ALLOWED_UIDS = Repeated(
    "allowed_uids", "--allow-uid", int,
    "also accept ranks running as this uid (the sidecar's uid, root and members of the socket's group always are)",
    metavar="UID",
)

# The bucket tier (docs/object-storage.md). Credentials are not settings: they come from the environment
# (a Secret's keys as AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or the pod's workload identity).
BUCKET = Text(
    "bucket", "--bucket", "",
    "keep checkpoints in this bucket, s3://BUCKET/PREFIX. With --storage, a second tier: each step committed in "
    "--storage is uploaded in the background (manifest last), and load() restores from the bucket when "
    "--storage holds none. Without --storage, the storage itself: ranks' files are uploaded from their slots and "
    "committed in the bucket (default: no bucket)",
    metavar="URL",
)
BUCKET_ENDPOINT = Text(
    "bucket_endpoint", "--bucket-endpoint", "",
    "the S3 endpoint, e.g. https://s3.example.internal:9000 (default: $AWS_ENDPOINT_URL, else AWS)",
    metavar="URL",
)
BUCKET_REGION = Text("bucket_region", "--bucket-region", "",
                     "the bucket's region (default: $AWS_REGION, else us-east-1)", metavar="REGION")
BUCKET_CA_BUNDLE = Text("bucket_ca_bundle", "--bucket-ca-bundle", "",
                        "PEM file of the CA that signed the endpoint's certificate (default: the system's)",
                        metavar="PATH")
BUCKET_VIRTUAL_HOSTED = Flag(
    "bucket_virtual_hosted", "--bucket-virtual-hosted",
    "address the bucket as BUCKET.ENDPOINT (virtual-hosted style) instead of ENDPOINT/BUCKET (path style, "
    "which on-premises servers expect)",
)
BUCKET_KEEP_LAST = Number(
    "bucket_keep_last", "--bucket-keep-last", int, 3, "committed checkpoints to keep in the bucket",
    metavar="K", least=1, requirement="at least 1",
)
BUCKET_KEEP_EVERY = Number(
    "bucket_keep_every", "--bucket-keep-every", int, 0,
    "also upload and keep in the bucket every checkpoint whose step is a multiple of M (0: off)",
    metavar="M", least=0, requirement="0 (off) or positive",
)
UPLOAD_CONCURRENCY = Number(
    "upload_concurrency", "--upload-concurrency", int, 8, "parts of one file uploaded at once",
    metavar="N", least=1, requirement="at least 1",
)
UPLOAD_PART_SIZE = Number(
    "upload_part_bytes", "--upload-part-size", int, 16 * 2**20, "bytes per part of a multipart upload",
    metavar="BYTES", least=5 * 2**20, most=5 * 2**30, requirement="between 5 MiB and 5 GiB (S3's part limits)",
)
UPLOAD_RETRY_TIMEOUT = Number(
    "upload_retry_timeout", "--upload-retry-timeout", float, 60.0,
    "how long one request to the bucket (one part) is retried before the upload of the step fails",
    metavar="SECONDS", above=0, requirement="a positive number of seconds",
)
UPLOAD_RETRY_INTERVAL = Number(
    "upload_retry_interval", "--upload-retry-interval", float, 10.0,
    "after a failed upload, how long to wait before trying again (the newest committed step)",
    metavar="SECONDS", above=0, requirement="a positive number of seconds",
)

Setting = Location | Number[int] | Number[float] | Text[str] | Text[None] | Switch | Flag | Repeated[int]
PolicySetting = Number[int] | Number[float] | Switch

# In the order of `stowaway sidecar --help`; the settings a policy sets keep this order on the injected command.
ALL: tuple[Setting, ...] = (
    STORAGE, SOCKET, SHM_DIR, NODE,
    KEEP_LAST, KEEP_EVERY, COMMIT_TIMEOUT, COMMIT_POLL_INTERVAL, STALE_AFTER,
    PERSIST_WORKERS, WRITE_RATE_LIMIT, METRICS_PORT, METRICS_ADDRESS, GRACE_PERIOD, DIRECT_IO, ALLOWED_UIDS,
    BUCKET, BUCKET_ENDPOINT, BUCKET_REGION, BUCKET_CA_BUNDLE, BUCKET_VIRTUAL_HOSTED, BUCKET_KEEP_LAST,
    BUCKET_KEEP_EVERY, UPLOAD_CONCURRENCY, UPLOAD_PART_SIZE, UPLOAD_RETRY_TIMEOUT, UPLOAD_RETRY_INTERVAL,
)
FROM_POLICY: tuple[PolicySetting, ...] = tuple(
    s for s in ALL if isinstance(s, Number | Switch) and s.policy is not None
)
CHECKED: tuple[Number[int] | Number[float], ...] = tuple(
    s for s in ALL if isinstance(s, Number) and s.limited
)
