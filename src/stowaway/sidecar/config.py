"""Settings of one sidecar process, as given on its command line.

Defaults, limits and their error messages come from the declarations in
``stowaway.sidecar_settings``; this class gives them attribute types.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field
from pathlib import Path

from stowaway import sidecar_settings
from stowaway.storage.bucket import Location as BucketLocation
from stowaway.storage.bucket import Settings as BucketSettings


@dataclass(frozen=True)
class SidecarConfig:
    socket_path: Path
    shm_dir: Path
    # A directory (a claim's mount); without one, ``bucket`` is the storage itself (``storage.bucket_store``).
    storage: Path | None = None
    node: str = field(default_factory=lambda: os.environ.get("NODE_NAME") or socket.gethostname())
    keep_last: int = sidecar_settings.KEEP_LAST.default
    keep_every: int = sidecar_settings.KEEP_EVERY.default
    commit_timeout: float = sidecar_settings.COMMIT_TIMEOUT.default
    persist_workers: int = sidecar_settings.PERSIST_WORKERS.default
    write_rate_limit: float = sidecar_settings.WRITE_RATE_LIMIT.default
    grace_period: float = sidecar_settings.GRACE_PERIOD.default
    commit_poll_interval: float = sidecar_settings.COMMIT_POLL_INTERVAL.default
    allowed_uids: frozenset[int] = field(default_factory=lambda: frozenset({os.getuid(), 0}))
    metrics_port: int = sidecar_settings.METRICS_PORT.default
    metrics_address: str = sidecar_settings.METRICS_ADDRESS.default
    direct_io: bool = sidecar_settings.DIRECT_IO.default
    # Exported for the alerts, which cannot know each job's save interval: how old a commit may grow.
    stale_after: float = sidecar_settings.STALE_AFTER.default
    # The bucket: a tier behind ``storage`` (``sidecar.bucket_tier``), or the storage where there is no directory;
    # "" means not set.
    bucket: str = sidecar_settings.BUCKET.default
    bucket_endpoint: str = sidecar_settings.BUCKET_ENDPOINT.default
    bucket_region: str = sidecar_settings.BUCKET_REGION.default
    bucket_ca_bundle: str = sidecar_settings.BUCKET_CA_BUNDLE.default
    bucket_virtual_hosted: bool = False
    bucket_keep_last: int = sidecar_settings.BUCKET_KEEP_LAST.default
    bucket_keep_every: int = sidecar_settings.BUCKET_KEEP_EVERY.default
    upload_concurrency: int = sidecar_settings.UPLOAD_CONCURRENCY.default
    upload_part_bytes: int = sidecar_settings.UPLOAD_PART_SIZE.default
    upload_retry_timeout: float = sidecar_settings.UPLOAD_RETRY_TIMEOUT.default
    upload_retry_interval: float = sidecar_settings.UPLOAD_RETRY_INTERVAL.default

    def __post_init__(self) -> None:
        if len(os.fsencode(self.socket_path)) >= 108:
            raise ValueError(
                f"socket path {self.socket_path} is {len(os.fsencode(self.socket_path))} bytes; "
                "Unix sockets need a path shorter than 108 bytes: choose a shorter --socket"
            )
        if self.storage is None and not self.bucket:
            raise ValueError("no storage: give --storage DIR (a claim's mount), --bucket s3://BUCKET/PREFIX, "
                             "or both (the bucket then keeps a second copy of each step committed in DIR)")
        if self.bucket:
            # Refuse a malformed URL at startup, not at the first upload (imports nothing heavy).
            BucketLocation.parse(self.bucket)
        for setting in sidecar_settings.CHECKED:
            setting.check(getattr(self, setting.name))

    @property
    def bucket_tier(self) -> bool:
        """The bucket is a second tier behind the directory, uploaded to in the background."""
        return bool(self.bucket) and self.storage is not None

    def bucket_settings(self) -> BucketSettings:
        return BucketSettings(
            endpoint=self.bucket_endpoint or None, region=self.bucket_region or None,
            virtual_hosted=self.bucket_virtual_hosted,
            ca_bundle=Path(self.bucket_ca_bundle) if self.bucket_ca_bundle else None,
            part_bytes=self.upload_part_bytes, concurrency=self.upload_concurrency,
            retry_seconds=self.upload_retry_timeout,
        )
