"""Settings of one sidecar process, as given on its command line."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class SidecarConfig:
    storage: Path
    socket_path: Path
    shm_dir: Path
    node: str = field(default_factory=lambda: os.environ.get("NODE_NAME") or socket.gethostname())
    keep_last: int = 3
    keep_every: int = 0
    commit_timeout: float = 600.0
    persist_workers: int = 4
    write_rate_limit: float = 0.0
    grace_period: float = 120.0
    commit_poll_interval: float = 0.2
    allowed_uids: frozenset[int] = field(default_factory=lambda: frozenset({os.getuid(), 0}))
    metrics_port: int = 0
    metrics_address: str = "0.0.0.0"
    direct_io: bool = True
    # Exported for the alerts, which cannot know each job's save interval: how old a commit may grow.
    stale_after: float = 7200.0

    def __post_init__(self) -> None:
        if len(os.fsencode(self.socket_path)) >= 108:
            raise ValueError(
                f"socket path {self.socket_path} is {len(os.fsencode(self.socket_path))} bytes; "
                "Unix sockets need a path shorter than 108 bytes: choose a shorter --socket"
            )
        if self.keep_last < 1:
            raise ValueError(f"--keep-last must be at least 1, got {self.keep_last}")
        if self.keep_every < 0:
            raise ValueError(f"--keep-every must be 0 (off) or positive, got {self.keep_every}")
        if self.persist_workers < 1:
            raise ValueError(f"--persist-workers must be at least 1, got {self.persist_workers}")
        if not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"--metrics-port must be 0 (off) or a TCP port up to 65535, got {self.metrics_port}")
        if self.stale_after <= 0:
            raise ValueError(f"--stale-after must be a positive number of seconds, above the job's save interval, "
                             f"got {self.stale_after}")
        if self.commit_timeout <= 0 or self.grace_period < 0:
            raise ValueError("--commit-timeout must be positive and --grace-period not negative")
