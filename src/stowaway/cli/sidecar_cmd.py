"""``stowaway sidecar``: the daemon that runs next to the training container."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
from pathlib import Path

from stowaway.cli.errors import CommandError
from stowaway.sidecar.config import SidecarConfig
from stowaway.sidecar.server import Sidecar, SidecarError


def add_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = commands.add_parser(
        "sidecar", help="run the saver sidecar daemon",
        description="Serve ranks on a Unix socket, persist their slots to storage and commit checkpoints.",
    )
    parser.add_argument("--storage", type=Path, required=True, help="durable storage directory (a PVC mount)")
    parser.add_argument("--socket", type=Path, required=True, help="Unix socket path (shorter than 108 bytes)")
    parser.add_argument("--shm-dir", type=Path, required=True, help="shared-memory directory holding slot files")
    parser.add_argument("--node-name", default=None, help="name of this node in receipts (default: $NODE_NAME "
                        "or the host name)")
    parser.add_argument("--keep-last", type=int, default=3, metavar="K", help="committed checkpoints to keep")
    parser.add_argument("--keep-every", type=int, default=0, metavar="M",
                        help="also keep every checkpoint whose step is a multiple of M (0: off)")
    parser.add_argument("--commit-timeout", type=float, default=600.0, metavar="SECONDS",
                        help="how long a step may wait for every rank's file before it fails")
    parser.add_argument("--commit-poll-interval", type=float, default=0.2, metavar="SECONDS",
                        help="how often a pending commit looks for receipts of other nodes on shared storage")
    parser.add_argument("--persist-workers", type=int, default=4, help="slots persisted concurrently")
    parser.add_argument("--write-rate-limit", type=float, default=0.0, metavar="BYTES_PER_SECOND",
                        help="cap on write bandwidth to storage (0: unlimited)")
    parser.add_argument("--grace-period", type=float, default=120.0, metavar="SECONDS",
                        help="on SIGTERM, how long in-flight persists may take to finish")
    parser.add_argument("--no-direct-io", dest="direct_io", action="store_false",
                        help="write and read checkpoint files through the page cache, even where the filesystem "
                        "supports O_DIRECT (the default uses it there)")
    parser.add_argument("--allow-uid", type=int, action="append", default=[], metavar="UID",
                        help="also accept ranks running as this uid (the sidecar's uid, root and members of the "
                        "socket's group always are)")
    parser.add_argument("--metrics-port", type=int, default=0, metavar="PORT",
                        help="serve /metrics (Prometheus), /healthz and /readyz over HTTP on this port (0: off)")
    parser.add_argument("--metrics-address", default="0.0.0.0", metavar="ADDRESS",
                        help="address the metrics port listens on (default: all interfaces, for a pod's scraper)")
    parser.add_argument("--stale-after", type=float, default=7200.0, metavar="SECONDS",
                        help="how long the job may go without a new committed checkpoint before the shipped alerts "
                        "fire; exported as stowaway_stale_after_seconds (default: 2 hours)")
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    extra = {} if args.node_name is None else {"node": args.node_name}
    try:
        config = SidecarConfig(
            storage=args.storage.absolute(), socket_path=args.socket.absolute(), shm_dir=args.shm_dir.absolute(),
            keep_last=args.keep_last, keep_every=args.keep_every, commit_timeout=args.commit_timeout,
            persist_workers=args.persist_workers, write_rate_limit=args.write_rate_limit,
            grace_period=args.grace_period, direct_io=args.direct_io,
            commit_poll_interval=args.commit_poll_interval,
            metrics_port=args.metrics_port, metrics_address=args.metrics_address, stale_after=args.stale_after,
            allowed_uids=frozenset({os.getuid(), 0, *args.allow_uid}), **extra,
        )
    except ValueError as exc:
        raise CommandError(str(exc)) from None
    sidecar = Sidecar(config)
    runner = asyncio.Runner()
    try:
        runner.run(sidecar.serve())
    except SidecarError as exc:
        runner.close()
        raise CommandError(str(exc)) from None
    if sidecar.abandoned_work:
        # Closing the runner, or leaving the interpreter, joins the persist threads, which may sit in a write
        # to slow storage for far longer than the grace period; Kubernetes would SIGKILL us anyway.
        logging.shutdown()
        os._exit(0)
    runner.close()
    return 0
