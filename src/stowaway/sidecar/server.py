"""The sidecar daemon's lifecycle: startup → serve → drain → shutdown.

Signal handlers only set an event. Shutdown stops accepting connections,
lets in-flight persists and commits finish within the grace period, then
exits; ranks still connected get a closed connection and reconnect to the
next sidecar.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import stat
from pathlib import Path

from stowaway.sidecar import bucket_tier, peers
from stowaway.sidecar.commit import Committer
from stowaway.sidecar.config import SidecarConfig
from stowaway.sidecar.endpoints import Endpoints
from stowaway.sidecar.metrics import BucketMetrics
from stowaway.sidecar.pipeline import SavePipeline
from stowaway.sidecar.ranks import Registry
from stowaway.sidecar.session import Session
from stowaway.sidecar.stats import Stats
from stowaway.storage import bucket, bucket_store, directory_store, step_store

log = logging.getLogger(__name__)
_PROBE_TIMEOUT = 2.0


class SidecarError(Exception):
    """The sidecar cannot start; the message says what to change."""


class Sidecar:
    def __init__(self, config: SidecarConfig, stats: Stats | None = None) -> None:
        self.config = config
        self.stats = stats or Stats()
        self.registry = Registry()
        self.stats.watch(self.registry.connected, self.registry.in_flight, self.registry.connected_since)
        self.stats.stale_after(config.stale_after)
        self.store = _open_store(config)
        # The bucket tier, when the bucket backs a directory; without a bucket, obstore is never imported.
        self.bucket_tier = (
            bucket_tier.BucketTier(config, config.storage, BucketMetrics(self.stats.metrics.registry))
            if config.bucket_tier and config.storage is not None else None
        )
        self.committer = Committer(config, self.registry, self.stats, self.store,
                                   on_commit=self.bucket_tier.committed if self.bucket_tier else None)
        self.pipeline: SavePipeline
        self._stop = asyncio.Event()
        self._sessions: set[asyncio.Task[None]] = set()
        self._server: asyncio.base_events.Server | None = None
        # The group that owns the socket: its members may connect whatever their uid (see ``peers``).
        self._socket_group = -1
        # Set when the grace period ended with persists or commits still running: their threads may be
        # stuck in a storage write that nothing can interrupt, so the process must not wait for them.
        self.abandoned_work = False

    def request_stop(self) -> None:
        self._stop.set()

    async def serve(self) -> None:
        # Before the socket or the probes show us as up: from then on a SIGTERM must drain, not kill.
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, self.request_stop)
        self.pipeline = SavePipeline(self.config, self.committer, self.stats)
        self._prepare_directories()
        endpoints = await self._start_endpoints()
        try:
            self._server = server = await self._listen()
            if self.bucket_tier is not None:
                self.bucket_tier.start()
            log.info(
                "sidecar ready: socket %s, shared memory %s, storage %s%s, node %s",
                self.config.socket_path, self.config.shm_dir, self.config.storage or self.config.bucket,
                f" then {self.bucket_tier.location}" if self.bucket_tier else "", self.config.node,
            )
            try:
                await self._stop.wait()
            finally:
                await self._shutdown(server)
        finally:
            # Last to go, so that a scrape can watch the drain.
            if endpoints is not None:
                endpoints.close()

    async def _start_endpoints(self) -> asyncio.base_events.Server | None:
        address, port = self.config.metrics_address, self.config.metrics_port
        if port == 0:
            return None
        try:
            server = await Endpoints(self.stats.metrics.exposition, self.readiness).start(address, port)
        except OSError as exc:
            raise SidecarError(
                f"cannot serve metrics on {address}:{port}: {exc.strerror}; choose another --metrics-port "
                "or 0 to turn the endpoints off"
            ) from exc
        log.info("serving /metrics, /healthz and /readyz on %s:%d", address, port)
        return server

    async def readiness(self) -> str | None:
        """Why ranks cannot be served right now, or None: the socket listens and storage is writable."""
        if self._server is None or not self._server.is_serving():
            return f"not listening on {self.config.socket_path}"
        try:
            # A hung network filesystem (or bucket) must not stall the event loop, only this probe.
            return await asyncio.wait_for(asyncio.to_thread(self.store.probe), _PROBE_TIMEOUT)
        except TimeoutError:
            return f"storage {self.config.storage or self.config.bucket} did not answer within {_PROBE_TIMEOUT:.0f} s"

    def _prepare_directories(self) -> None:
        """Use the socket and slot directories, creating them private to one group when missing.

        A created directory gets mode 2770 whatever the umask: the setgid bit makes the socket and
        the slot files inherit the directory's group (a pod's fsGroup), which ranks and sidecar share.
        That is how the sidecar works inside kubelet's emptyDirs, which are world-writable: it is
        pointed at a subdirectory it creates, never at the volume's root.
        """
        for directory in (self.config.socket_path.parent, self.config.shm_dir):
            if not directory.exists():
                directory.mkdir(parents=True)
                os.chmod(directory, 0o2770)
            mode = directory.stat().st_mode
            if mode & stat.S_IWOTH and not mode & stat.S_ISVTX:
                raise SidecarError(
                    f"{directory} is world-writable without the sticky bit; any local user could "
                    "replace the socket or slot files: use a directory with mode 0770"
                )
        if self.config.storage is None:
            return
        try:
            self.config.storage.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise SidecarError(f"cannot create storage directory {self.config.storage}: {exc.strerror}") from exc

    async def _listen(self) -> asyncio.base_events.Server:
        path = self.config.socket_path
        if path.exists() or path.is_symlink():
            if _socket_answers(path):
                raise SidecarError(f"another sidecar is already serving {path}; stop it or choose another --socket")
            path.unlink()
        server = await asyncio.start_unix_server(self._accept, path=str(path))
        os.chmod(path, 0o660)
        self._socket_group = path.stat().st_gid
        return server

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        sock = writer.get_extra_info("socket")
        peer = peers.credentials(sock)
        session = Session(self, reader, writer, peer.uid)
        refusal = peers.refusal(peer, self.config.allowed_uids, self._socket_group)
        if refusal is not None:
            self.stats.failed("peer_refused")
            session.close(refusal)
            return
        task = asyncio.current_task()
        assert task is not None
        self._sessions.add(task)
        try:
            await session.run()
        except asyncio.CancelledError:
            # Shutdown ends connections by cancelling them; that is their normal end, not an error to log.
            pass
        finally:
            self._sessions.discard(task)

    async def _shutdown(self, server: asyncio.base_events.Server) -> None:
        server.close()
        grace = self.config.grace_period
        log.info("stopping: waiting up to %.0f s for in-flight persists and commits", grace)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace
        drained = await self.pipeline.drain(grace)
        commits = self.committer.pending_tasks()
        unfinished: set[asyncio.Task[None]] = set()
        if commits:
            _, unfinished = await asyncio.wait(commits, timeout=max(0.0, deadline - loop.time()))
        if not drained or unfinished:
            self.abandoned_work = True
            log.warning(
                "grace period of %.0f s ended with work in flight (%d slot(s) still being copied, %d commit(s) "
                "pending); it was abandoned: those steps have no manifest, so none of them counts as committed. "
                "Raise --grace-period (and the pod's terminationGracePeriodSeconds) if storage is this slow",
                grace, self.registry.in_flight(), len(unfinished),
            )
        if self.bucket_tier is not None and not await self.bucket_tier.stop(max(1.0, deadline - loop.time())):
            # Harmless: the step has no manifest in the bucket, and the next start uploads it again.
            self.abandoned_work = True
            log.warning("an upload to %s was still sending a part when the grace period ended; abandoned",
                        self.bucket_tier.location)
        for task in list(self._sessions):
            task.cancel()
        with contextlib.suppress(FileNotFoundError):
            self.config.socket_path.unlink()
        self.registry.close()
        log.info("stopped: %s", self.stats.summary())


def _open_store(config: SidecarConfig) -> step_store.StepStore:
    """The directory when there is one (with the bucket as a tier behind it), else the bucket itself."""
    if config.storage is not None:
        return directory_store.DirectoryStore(config.storage, config.direct_io)
    try:
        return bucket_store.open_bucket(config.bucket, config.bucket_settings())
    except bucket.BucketError as exc:
        raise SidecarError(f"cannot use the bucket {config.bucket}: {exc}") from exc


def _socket_answers(path: Path) -> bool:
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(str(path))
    except OSError:
        return False
    finally:
        probe.close()
    return True
