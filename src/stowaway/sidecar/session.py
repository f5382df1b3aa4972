"""One rank's connection: frames in, validated messages to handlers, answers out.

A malformed frame or message ends this connection with one ``error`` frame
that says what was wrong; it never reaches other ranks or stops the daemon.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from collections.abc import Awaitable
from typing import TYPE_CHECKING

from stowaway.protocol import dispatch, frames, messages
from stowaway.sidecar import restore
from stowaway.sidecar.persister import PersistError
from stowaway.sidecar.ranks import RankState
from stowaway.slots import naming
from stowaway.slots.header import SlotHeaderError
from stowaway.storage import manifest, step_store

if TYPE_CHECKING:
    from stowaway.sidecar.server import Sidecar

log = logging.getLogger(__name__)
READ_BYTES = 64 * 1024
# How long an ``opened`` with descriptors may wait for room in the socket before the connection is given up.
SEND_FILES_TIMEOUT = 60.0


def _settle(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


class SessionClosed(Exception):
    """The connection must end; the message goes to the peer as an error frame."""


# Every message a rank may send, and the handler that answers it.
_HANDLERS: dispatch.Table[Session, Awaitable[None]] = dispatch.Table("the sidecar")


class Session:
    def __init__(self, sidecar: Sidecar, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                 peer_uid: int) -> None:
        self._sidecar = sidecar
        self._reader = reader
        self._writer = writer
        self._peer_uid = peer_uid
        self._state: RankState | None = None
        self.label = "unidentified peer"
        # The manifest of the step this rank has ranges staged of (a resharding rank asks for many in a row).
        self._ranged: tuple[int, manifest.Manifest] | None = None

    def send(self, message: messages.ToClient) -> None:
        if not self._writer.is_closing():
            self._writer.write(frames.encode(messages.encode(message)))

    async def send_with_files(self, message: messages.ToClient, fds: list[int]) -> None:
        """Send ``message`` with ``fds`` attached (``SCM_RIGHTS``), in order with every frame sent before it.

        The stream's own buffer cannot carry descriptors: it is drained
        first, then the frame goes to the socket with the descriptors on its
        first byte, through a duplicate of the socket (the transport owns the
        original); whatever part the socket did not take follows through the
        stream at once, before anything else can be written. A socket that
        takes nothing yet is waited for, and the stream drained again, as
        other frames may have been queued meanwhile.
        """
        data = frames.encode(messages.encode(message))
        loop = asyncio.get_running_loop()
        with socket.socket(fileno=os.dup(self._writer.get_extra_info("socket").fileno())) as raw:
            while True:
                await self._drained()
                if self._writer.is_closing():
                    return
                try:
                    sent = socket.send_fds(raw, [data], fds)
                    break
                except BlockingIOError:
                    writable: asyncio.Future[None] = loop.create_future()
                    loop.add_writer(raw.fileno(), _settle, writable)
                    try:
                        await asyncio.wait_for(writable, SEND_FILES_TIMEOUT)
                    finally:
                        loop.remove_writer(raw.fileno())
        if sent < len(data):
            self._writer.write(data[sent:])

    async def _drained(self) -> None:
        """Return once the stream has handed every byte written to it to the socket."""
        transport = self._writer.transport
        low, high = transport.get_write_buffer_limits()
        transport.set_write_buffer_limits(high=0)
        try:
            await asyncio.wait_for(self._writer.drain(), SEND_FILES_TIMEOUT)
        finally:
            transport.set_write_buffer_limits(high=high, low=low)

    def close(self, reason: str) -> None:
        log.warning("closing connection of %s: %s", self.label, reason)
        self.send(messages.Error(reason=reason))
        self._writer.close()

    async def run(self) -> None:
        decoder = frames.FrameDecoder()
        try:
            while data := await self._reader.read(READ_BYTES):
                for message in decoder.feed(data):
                    await self._handle(message)
            if decoder.pending_bytes:
                log.warning("%s closed in the middle of a frame (%d bytes)", self.label, decoder.pending_bytes)
        except (frames.FrameError, messages.MessageError, SessionClosed) as exc:
            self._sidecar.stats.failed("protocol")
            self.close(str(exc))
        except ConnectionError:
            pass
        finally:
            if self._state is not None:
                self._sidecar.registry.detach(self._state, self)
            self._writer.close()

    async def _handle(self, frame: dict[str, object]) -> None:
        message = messages.decode(frame, messages.Direction.TO_SIDECAR)
        if self._state is None and not isinstance(message, messages.Hello):
            raise SessionClosed(f"expected hello as the first message, got {message.TYPE}")
        await _HANDLERS.handle(self, message)

    def _rank(self) -> RankState:
        """The rank this connection said hello for; every handler but the hello's runs after it."""
        assert self._state is not None
        return self._state

    @_HANDLERS.on(messages.Hello)
    async def _hello(self, hello: messages.Hello) -> None:
        if self._state is not None:
            raise SessionClosed("hello sent twice on one connection")
        state, previous = self._sidecar.registry.attach(self, hello)
        self._state = state
        self.label = f"job {state.job} rank {state.rank} (pid {hello.pid})"
        if previous is not None:
            previous.close(f"superseded by a new connection of {self.label}")
        log.info("connected: %s", self.label)
        self.send(messages.Welcome(
            protocol=messages.PROTOCOL_VERSION, node=self._sidecar.config.node, busy=tuple(sorted(state.busy)),
            shm_dir=str(self._sidecar.config.shm_dir),
        ))

    @_HANDLERS.on(messages.Register)
    async def _register(self, message: messages.Register) -> None:
        state, index = self._rank(), message.slot
        if index in state.busy:
            raise SessionClosed(f"register of slot {index} while the sidecar still owns it")
        try:
            slot = state.open_slot(self._sidecar.config.shm_dir, index)
            slot.read_header()
        except (OSError, SlotHeaderError) as exc:
            raise SessionClosed(f"cannot open slot {index} in {self._sidecar.config.shm_dir}: {exc}") from exc
        if slot.owner_uid != self._peer_uid and self._peer_uid != 0:
            state.slots.pop(index).close()
            raise SessionClosed(f"slot file {slot.path} belongs to uid {slot.owner_uid}, not to the peer")
        self.send(messages.Registered(slot=index))

    @_HANDLERS.on(messages.Persist)
    async def _persist(self, message: messages.Persist) -> None:
        state = self._rank()
        self._owned_slot(state, message.slot, "persist")
        await self._sidecar.pipeline.start(state, message)

    @_HANDLERS.on(messages.Query)
    async def _query(self, message: messages.Query) -> None:
        state, committer = self._rank(), self._sidecar.committer
        await committer.settled(state.job)
        if self._sidecar.bucket_tier is not None:
            await self._sidecar.bucket_tier.fill_claim(state.job)
        try:
            inventory = await asyncio.to_thread(restore.inventory, committer.store, state)
        except (OSError, step_store.StoreError) as exc:
            # No answer rather than an empty one, which load() would take for "nothing saved: start over".
            self._sidecar.stats.failed(exc.kind if isinstance(exc, step_store.StoreError) else "storage_io")
            self.close(f"cannot list the committed steps of job {state.job} in storage: {exc}")
            return
        self.send(inventory)

    @_HANDLERS.on(messages.Open)
    async def _open(self, message: messages.Open) -> None:
        """Pass read-only descriptors of a committed step's files (the storage is not mounted where the rank runs),
        or of the slots that still hold them where the rank asks ``from_memory``."""
        state = self._rank()
        # A restore asks for the manifest first: the ranges it may have staged next are of that manifest's files.
        self._ranged = None
        memory = (restore.MemorySource(self._sidecar.config.shm_dir, state.job, self._peer_uid)
                  if message.from_memory else None)
        try:
            fds, offsets = await asyncio.to_thread(restore.open_step, self._sidecar.committer.store, state.job,
                                                   message.step, message.ranks, memory)
        except PersistError as exc:
            if exc.kind != step_store.FilesNotPassed.KIND:
                self._sidecar.stats.failed(exc.kind)
            self.send(messages.Opened(step=message.step, ranks=message.ranks, reason=str(exc)))
            return
        answer = messages.Opened(step=message.step, ranks=message.ranks, reason=None,
                                 payload_offsets=tuple(offsets) if memory is not None else None)
        try:
            await self.send_with_files(answer, fds)
        finally:
            for fd in fds:
                os.close(fd)

    @_HANDLERS.on(messages.Restored)
    async def _restored(self, message: messages.Restored) -> None:
        """Log and count a rank's restore: the one place that shows a restarted rank came back from memory."""
        state = self._rank()
        log.info("rank %d of job %s restored step %d from %s in %.3f s", state.rank, state.job, message.step,
                 message.source, message.seconds)
        self._sidecar.stats.restored(message.source, message.seconds)

    def _owned_slot(self, state: RankState, index: int, action: str) -> None:
        if index not in state.slots:
            raise SessionClosed(f"{action} names slot {index}, which was never registered")
        if index in state.busy:
            raise SessionClosed(
                f"{action} names slot {index}, which the sidecar still owns: wait for its released message"
            )

    async def _set_aside(self, job: str, step: int) -> str:
        """Set a step found corrupt aside, so that the job can save it again; what to add to the reason."""
        try:
            target = await asyncio.to_thread(self._sidecar.committer.set_aside, job, step)
        except (OSError, step_store.StoreError) as exc:
            log.error("step %d of job %s is corrupt and could not be set aside: %s", step, job, exc)
            why = exc.strerror if isinstance(exc, OSError) else str(exc)
            return f"; it could not be set aside ({why}), so saving step {step} again will be refused"
        if target is None:
            return ""
        log.warning("step %d of job %s is corrupt: set it aside as %s, so that it can be saved again; "
                    "its files are kept there for inspection", step, job, target)
        return f"; the step was set aside as {target}, so that it can be saved again"

    async def _manifest_for_ranges(self, job: str, step: int) -> manifest.Manifest:
        if self._ranged is None or self._ranged[0] != step:
            try:
                found = await asyncio.to_thread(self._sidecar.committer.store.read_manifest, job, step)
            except manifest.ManifestError as exc:
                raise PersistError("restore_missing", f"step {step} cannot be restored: {exc}") from exc
            except step_store.StoreError as exc:
                raise PersistError("restore_io", str(exc)) from exc
            self._ranged = (step, found)
        return self._ranged[1]

    @_HANDLERS.on(messages.Stage)
    async def _stage(self, message: messages.Stage) -> None:
        state, step, index = self._rank(), message.step, message.slot
        self._owned_slot(state, index, "stage")
        if naming.is_pooled(index):
            raise SessionClosed(f"stage names slot {index}, a pooled spare: a rank restores into its own slots only")
        state.busy.add(index)
        store = self._sidecar.committer.store
        try:
            if message.span is None:
                generation, nbytes = await asyncio.to_thread(restore.stage, store, state, index, step)
            else:
                found = await self._manifest_for_ranges(state.job, step)
                generation = await asyncio.to_thread(restore.stage_range, store, state, index, step, found,
                                                     message.span)
                nbytes = message.span[2]
        except PersistError as exc:
            self._sidecar.stats.failed(exc.kind)
            reason = str(exc)
            if exc.kind == "restore_corrupt":
                reason += await self._set_aside(state.job, step)
            state.busy.discard(index)
            state.send(messages.Failed(step=step, slot=index, reason=reason))
            return
        state.busy.discard(index)
        state.send(messages.Staged(step=step, slot=index, generation=generation, nbytes=nbytes))
