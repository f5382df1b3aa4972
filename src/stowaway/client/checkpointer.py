"""``Checkpointer``: save to shared memory at memcpy speed, restore from memory or storage."""

from __future__ import annotations

import functools
import gc
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar, cast

from stowaway.client import agreement, env
from stowaway.client.connection import Connection
from stowaway.client.handle import SaveHandle
from stowaway.client.pool import ClientSlot, Owner, SlotPool
from stowaway.client.spare_slots import SpareSlots
from stowaway.errors import (
    ConfigurationError,
    ProtocolError,
    SaveFailed,
    SidecarUnavailable,
    SlotWaitTimeout,
    StowawayError,
    UnsupportedState,
    WorldSizeChanged,
)
from stowaway.format import codec, dtensors
from stowaway.format.safetensors_header import HeaderError
from stowaway.protocol import dispatch, messages
from stowaway.slots import header

log = logging.getLogger("stowaway")
DEFAULT_TIMEOUT = 600.0
# Owners of a slot the sidecar may still read or write: it has not handed it back on this connection yet.
_HELD_BY_SIDECAR = (Owner.SIDECAR, Owner.UNKNOWN)
_Call = TypeVar("_Call", bound=Callable[..., Any])
# Every message the sidecar may send once it has welcomed this rank, and what it does here.
_ANSWERS: dispatch.Table[Checkpointer, None] = dispatch.Table("the rank")


def _collector_paused(call: _Call) -> _Call:
    """Keep Python's cyclic collector out of ``save`` and ``load``, which the training loop blocks on.

    Both allocate a few objects per tensor (the encode's garbage, a new
    slot's views, the restored tensors), enough to start collections. A
    full one walks the whole training process: 0.25-0.7 s for 285,000
    objects on 8 ranks sharing 2 cores, which landed inside the first save
    into a spare slot and took it from 0.1 s to 0.8 s. The collection is
    not the call's work but the process's, due whenever its heap has grown
    enough; paused, it runs at the caller's next allocation instead. Whole
    calls are covered, since the first allocation after re-enabling would
    start it inside them; so is the wrapper, whose first act is the pause.
    """

    @functools.wraps(call)
    def paused(*args: Any, **kwargs: Any) -> Any:
        enabled = gc.isenabled()
        gc.disable()
        try:
            return call(*args, **kwargs)
        finally:
            if enabled:
                gc.enable()

    return cast(_Call, paused)


class Checkpointer:
    """A rank's handle on its sidecar.

    Every argument defaults from the environment: ``STOWAWAY_JOB``,
    ``STOWAWAY_SOCKET`` and torchrun's ``RANK``, ``LOCAL_RANK``,
    ``WORLD_SIZE`` and ``LOCAL_WORLD_SIZE``; ``slots`` from ``STOWAWAY_SLOTS_PER_RANK``
    (set by the operator from the policy), else 2. ``timeout`` bounds every wait:
    for the sidecar, for a free slot, for an answer.
    """

    def __init__(
        self,
        job: str | None = None,
        socket: str | os.PathLike[str] | None = None,
        rank: int | None = None,
        local_rank: int | None = None,
        world_size: int | None = None,
        slots: int | None = None,
        timeout: float = DEFAULT_TIMEOUT,
        *,
        local_world_size: int | None = None,
        allow_pickle: bool = False,
        run_id: str | None = None,
    ) -> None:
        self.job = env.text(job, "STOWAWAY_JOB", "the job name")
        self.socket_path = Path(env.text(None if socket is None else os.fspath(socket), "STOWAWAY_SOCKET",
                                         "the sidecar's socket path"))
        self.rank = env.integer(rank, "RANK", 0)
        self.local_rank = env.integer(local_rank, "LOCAL_RANK", self.rank)
        self.world_size = env.integer(world_size, "WORLD_SIZE", 1)
        self.local_world_size = env.integer(local_world_size, "LOCAL_WORLD_SIZE", self.world_size)
        slots = env.integer(slots, "STOWAWAY_SLOTS_PER_RANK", 2)
        if not 1 <= slots <= messages.MAX_SLOTS_PER_RANK:
            raise ConfigurationError(f"slots must be between 1 and {messages.MAX_SLOTS_PER_RANK}, got {slots}")
        if timeout <= 0:
            raise ConfigurationError(f"timeout must be positive, got {timeout}")
        self.timeout = timeout
        self.allow_pickle = allow_pickle
        self._run_id = run_id or os.environ.get("STOWAWAY_RUN_ID") or None
        self._slot_count = slots
        self._encoder = codec.Encoder()
        self._cond = threading.Condition()
        self._pool: SlotPool | None = None
        self._spares: SpareSlots | None = None
        self._connected = False
        self._handles: dict[int, SaveHandle] = {}
        self._responses: dict[tuple[str, int], messages.ToClient] = {}
        self._violation: str | None = None
        # Why the sidecar refused this rank's last hello; cleared by a welcome.
        self._refusal: str | None = None
        self._closed = False
        self.blocking_seconds: list[float] = []
        self.slot_wait_seconds: list[float] = []
        try:
            hello = messages.Hello(
                protocol=messages.PROTOCOL_VERSION, job=self.job, rank=self.rank, local_rank=self.local_rank,
                world_size=self.world_size, local_world_size=self.local_world_size, node=_node_name(),
                pid=os.getpid(),
            )
        except messages.MessageError as exc:
            raise ConfigurationError(str(exc)) from None
        self._connection = Connection(self.socket_path, hello, self._connected_cb, self._message_cb, self._lost_cb,
                                      self._refused_cb)
        self._connection.start()
        try:
            self._wait_until(lambda: self._connected, "a connection to the sidecar", SidecarUnavailable)
        except StowawayError:
            self._connection.close()
            raise

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def reserve(self, state: Any, wait: bool = False) -> None:
        """Allocate this rank's slots for states like ``state`` in the background, so the first save is steady.

        A first save otherwise allocates its slot and pays the kernel a page
        fault per page, 7-29 times a steady save in the latest benchmark run;
        into a reserved slot it copies at memcpy speed, and its state is
        encoded already. Call it once the state holds every tensor it will
        (an optimizer creates its state at its first step), early enough for
        the allocation to end (on a thread of its own): a save arriving
        sooner waits for its slot. With ``wait``, return once it has ended. Raises
        ``ShmCapacityError`` at once if shared memory cannot hold the slots
        of every local rank.
        """
        encoded = self._encoder.encode(state, self.allow_pickle)
        assert self._spares is not None
        # A preparation a save started may still run, and a second cannot start alongside it.
        self._spares.join(self.timeout)
        with self._cond:
            self._require_pool().check_room(encoded.nbytes)
            self._spares.prepare(encoded.nbytes, every=True)
        if wait:
            self._spares.join(self.timeout)

    @_collector_paused
    def save(self, step: int, state: Any) -> SaveHandle:
        """Copy ``state`` into a slot and hand it to the sidecar; return once it is in shared memory."""
        started = time.perf_counter()
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be a non-negative int, got {step!r}")
        encoded = self._encoder.encode(state, self.allow_pickle)
        run = self._current_run_id()
        with self._cond:
            if step in self._handles:
                raise ValueError(f"rank {self.rank}: step {step} is already being saved; steps must differ")
        waiting = time.perf_counter()
        slot = self._take_slot(step)
        slot_wait = time.perf_counter() - waiting
        pool = self._require_pool()
        pool.ensure_capacity(slot, encoded.nbytes)
        self._register(slot)
        assert slot.file is not None
        if encoded.cuda_devices:
            slot.pin()
        generation = slot.next_generation()
        header.begin_write(slot.file.header_view, generation)
        codec.write_into(encoded, slot.payload(), slot.views_for(encoded.layout))
        header.finish_write(slot.file.header_view, step, generation, encoded.nbytes)
        blocking = time.perf_counter() - started
        handle = SaveHandle(step, self.rank, blocking, slot_wait, self.timeout)
        request = messages.Persist(run=run, step=step, slot=slot.index, generation=generation, nbytes=encoded.nbytes,
                                   blocking_seconds=blocking, slot_wait_seconds=slot_wait)
        with self._cond:
            self.blocking_seconds.append(blocking)
            self.slot_wait_seconds.append(slot_wait)
            if self._connected and slot.registered and self._connection.send(request):
                slot.owner, slot.in_flight_step, slot.in_flight_generation = Owner.SIDECAR, step, generation
                self._handles[step] = handle
                assert self._spares is not None
                self._spares.prepare(slot.capacity)
            else:
                handle._resolve(f"the connection to the sidecar was lost before the persist was sent "
                                f"({self._connection.last_error})")
        return handle

    @_collector_paused
    def load(self, step: int | None = None, map_location: Any = "cpu",
             device_mesh: Any = None, *, into: Any = None) -> tuple[int, Any] | None:
        """Restore the newest step every rank can restore (or ``step``); None when there is none.

        From shared memory when this rank's slot still holds the step intact,
        else from storage through the sidecar. A corrupt checkpoint makes all
        ranks fall back to the next older committed one, with a warning.
        A job on several nodes must initialise its process group first.
        DTensors (FSDP2, tensor parallelism) are rebuilt on ``device_mesh``
        (a ``DeviceMesh``, or a sequence of them): the mesh, or meshes, they
        were saved on.

        ``into`` (a state shaped as the saved one, e.g. ``{"model":
        model.state_dict(), ...}``) receives the bytes in its own tensors,
        which come back in the state in place of new ones: the state is not
        held twice, on the host or the GPU. Every tensor of ``into`` must have
        a stored counterpart of the same dtype, shape and DTensor layout,
        checked before anything is written; whatever ``into`` lacks comes back
        new, as without it. If a step cannot be restored on every rank after
        some rank wrote it into ``into``, the next older one is written over
        it; if none can be, ``load`` raises instead of returning None.

        Raises ``WorldSizeChanged`` when the newest committed step (or
        ``step``) was saved by another number of ranks.
        """
        meshes = dtensors.given_meshes(device_mesh)
        if self.world_size > self.local_world_size and not agreement.active(self.world_size):
            # Each node's sidecar answers alone, and a commit landing between two nodes' questions (as
            # happens on a restart, while the last incarnation's steps still commit) would split the job.
            raise ConfigurationError(
                f"rank {self.rank}: load() in a job spanning several nodes ({self.world_size} ranks, "
                f"{self.local_world_size} on this node) needs a torch.distributed process group of all "
                f"{self.world_size} ranks, through which the ranks agree on the step to restore: call "
                "torch.distributed.init_process_group() before load()"
            )
        self._wait_until(lambda: self._connected, "a connection to the sidecar", SidecarUnavailable)
        assert self._spares is not None
        # The allocator may be growing a slot that holds the step this load reads.
        self._spares.join(self.timeout)
        pool = self._require_pool()
        for slot in pool.slots:
            if slot.file is not None and slot.owner is Owner.RANK:
                self._register(slot)
        inventory = self._request(("inventory", 0), messages.Query())
        assert isinstance(inventory, messages.Inventory)
        sizes = {item.step: item.nbytes for item in inventory.committed}
        in_memory = {item.step: item.slot for item in inventory.memory}
        wanted = [found for found in sizes if step is None or found == step]
        other_world = {item.step: item.world_size for item in inventory.other_world}
        self._run_id, candidates, other_world = agreement.candidates(self._current_run_id(), wanted, other_world,
                                                                     self.world_size)
        self._refuse_other_world(step, candidates, other_world)
        problems = []
        for candidate in candidates:
            error, refused, state, source = None, None, None, "memory"
            try:
                slot = pool.slots[in_memory[candidate]] if candidate in in_memory else None
                if slot is not None and _header_holding(slot, candidate) is not None:
                    state = self._read_slot(slot, candidate, map_location, meshes, into)
                else:
                    # Also when the slot held it at the inventory but a newer candidate was staged into it since.
                    source = "storage"
                    state = self._restore_from_storage(candidate, sizes[candidate], map_location, meshes, into)
            except UnsupportedState as exc:
                refused = str(exc)
            except (StowawayError, HeaderError) as exc:
                error = str(exc)
            refusals, failures = agreement.restore_outcomes(refused, error, self.rank, self.world_size)
            # An older step would be refused for the same reason: every rank raises it instead.
            for rank, reason in refusals:
                raise UnsupportedState(f"rank {rank}: {reason}")
            if not failures:
                log.info("rank %d restored step %d from %s", self.rank, candidate, source)
                return candidate, state
            for rank, reason in failures:
                problems.append(f"step {candidate} rank {rank}: {reason}")
                log.warning("step %d cannot be restored on rank %d (%s); trying the next older committed "
                            "checkpoint", candidate, rank, reason)
        if step is not None:
            detail = "; ".join(problems) or "it is not committed in storage"
            raise SaveFailed(f"rank {self.rank}: step {step} of job {self.job} cannot be restored: {detail}")
        if into is not None and problems:
            # None would mean "start from scratch", with tensors that some step may already have been copied into.
            raise SaveFailed(
                f"rank {self.rank}: no committed step of job {self.job} can be restored ({'; '.join(problems)}), "
                "and load(into=...) may have written one of them into the given tensors on some ranks before "
                "that was known; re-initialise them before training from scratch"
            )
        return None

    def _refuse_other_world(self, step: int | None, candidates: list[int], other_world: dict[int, int]) -> None:
        """Refuse ``step``, or a newest committed step, saved by another number of ranks.

        Each rank's file holds that rank's own state, so such a step cannot be
        restored here; skipping it would return an older step, or None, and
        the job would silently train again from there.
        """
        newest_here = candidates[0] if candidates else -1
        refused = [found for found in other_world if found == step or (step is None and found > newest_here)]
        if not refused:
            return
        found = max(refused)
        saved_by = other_world[found]
        older = (f"pass step={newest_here} to load() to resume from the newest step saved by {self.world_size} "
                 "ranks; " if step is None and candidates else "")
        raise WorldSizeChanged(
            f"rank {self.rank}: step {found} of job {self.job} was saved by {saved_by} ranks and this job has "
            f"{self.world_size}; a step is restored only on as many ranks as saved it, as each rank's file holds "
            f"its own share of the state. Run the job on {saved_by} ranks; or read the step with "
            "stowaway.read_checkpoint() where the storage is mounted (it gathers DTensors whole) and load it into "
            f"the model yourself; {older}or give the job another name (STOWAWAY_JOB) to start afresh"
        )

    @property
    def slots_in_flight(self) -> int:
        """Slots this rank has handed to the sidecar and not yet got back."""
        with self._cond:
            return 0 if self._pool is None else sum(slot.owner in _HELD_BY_SIDECAR for slot in self._pool.slots)

    def close(self) -> None:
        """Wait (bounded by the timeout) for saves in flight to be answered, then disconnect."""
        if self._closed:
            return
        self._closed = True
        with self._cond:
            self._cond.wait_for(lambda: not self._handles or not self._connected, self.timeout)
        self._connection.close()
        if self._spares is not None:
            self._spares.join(self.timeout)
        with self._cond:
            if self._pool is not None:
                self._pool.close()

    def _current_run_id(self) -> str:
        if self._run_id is None:
            elastic = os.environ.get("TORCHELASTIC_RUN_ID")
            if elastic and elastic != "none":
                self._run_id = f"{elastic}-{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
            elif self.world_size == 1:
                self._run_id = uuid.uuid4().hex
            else:
                self._run_id = "default"
        return self._run_id

    def _require_pool(self) -> SlotPool:
        with self._cond:
            assert self._pool is not None
            return self._pool

    def _take_slot(self, step: int) -> ClientSlot:
        def free() -> ClientSlot | None:
            if not self._connected or self._pool is None:
                return None
            owned = [slot for slot in self._pool.slots if slot.owner is Owner.RANK]
            return max(owned, key=lambda slot: slot.capacity) if owned else None

        def describe() -> str:
            assert self._pool is not None
            flights = [s.in_flight_step for s in self._pool.slots if s.owner in _HELD_BY_SIDECAR]
            held = (f"all {len(flights)} slots in flight" if len(flights) == len(self._pool.slots) else
                    f"{len(flights)} of {len(self._pool.slots)} slots in flight, the others still being allocated")
            return (f"a free slot for step {step} ({held}, steps {flights}): the sidecar persists slower than "
                    "this rank saves; save less often, add slots, or check storage throughput")

        self._wait_until(lambda: free() is not None, describe, SlotWaitTimeout)
        with self._cond:
            slot = free()
            assert slot is not None
            return slot

    def _register(self, slot: ClientSlot) -> None:
        if slot.registered:
            return
        self._request(("registered", slot.index), messages.Register(slot=slot.index, capacity=slot.capacity))
        with self._cond:
            slot.registered = True

    def _request(self, answer: tuple[str, int], message: messages.ToSidecar) -> messages.ToClient:
        with self._cond:
            self._responses.pop(answer, None)
            if not self._connection.send(message):
                raise SidecarUnavailable(f"rank {self.rank}: cannot send {message.TYPE} to the sidecar: "
                                         f"{self._connection.last_error}")
        self._wait_until(lambda: answer in self._responses or not self._connected,
                         f"the sidecar's answer to {message.TYPE}", SidecarUnavailable)
        with self._cond:
            if answer not in self._responses:
                raise SidecarUnavailable(f"rank {self.rank}: the sidecar went away before answering "
                                         f"{message.TYPE}: {self._connection.last_error}")
            return self._responses.pop(answer)

    def _restore_from_storage(self, step: int, nbytes: int, map_location: Any, meshes: tuple[Any, ...],
                              into: Any) -> Any:
        slot = self._take_slot(step)
        self._require_pool().ensure_capacity(slot, nbytes)
        self._register(slot)
        with self._cond:
            slot.owner, slot.in_flight_step, slot.in_flight_generation = Owner.SIDECAR, step, None
        answer = self._request(("stage", slot.index), messages.Stage(step=step, slot=slot.index))
        if isinstance(answer, messages.Failed):
            raise SaveFailed(answer.reason)
        assert isinstance(answer, messages.Staged)
        slot.generation = max(slot.generation, answer.generation)
        return self._read_slot(slot, step, map_location, meshes, into)

    def _read_slot(self, slot: ClientSlot, step: int, map_location: Any, meshes: tuple[Any, ...], into: Any) -> Any:
        before = _header_holding(slot, step)
        if before is None:
            raise SaveFailed(f"slot {slot.index} no longer holds step {step}")
        assert slot.file is not None
        slot.drop_view()
        state = codec.read_from(slot.payload(), before.payload_nbytes, map_location, self.allow_pickle, meshes, into)
        if slot.file.read_header().generation != before.generation:
            raise SaveFailed(f"slot {slot.index} changed while step {step} was read from it")
        return state

    def _wait_until(self, ready: Callable[[], bool], what: str | Callable[[], str],
                    error: type[StowawayError]) -> None:
        with self._cond:
            ok = self._cond.wait_for(
                lambda: ready() or self._violation is not None or self._refusal is not None, self.timeout
            )
            if self._violation is not None:
                raise ProtocolError(self._violation)
            if self._refusal is not None and not ready():
                raise SidecarUnavailable(f"rank {self.rank} of job {self.job}: the sidecar at {self.socket_path} "
                                         f"refused this rank ({self._refusal})")
            if not ok:
                described = what() if callable(what) else what
                raise error(f"rank {self.rank} of job {self.job}: waited {self.timeout:.0f} s for {described} "
                            f"(socket {self.socket_path}; last connection problem: {self._connection.last_error})")

    def _connected_cb(self, welcome: messages.Welcome) -> None:
        with self._cond:
            if self._pool is None:
                self._pool = SlotPool(Path(welcome.shm_dir), self.job, self.rank, self._slot_count,
                                      self.local_world_size)
                self._pool.adopt_existing()
                self._spares = SpareSlots(self._pool, self._cond)
            busy = set(welcome.busy)
            for slot in self._pool.slots:
                slot.registered = False
                if slot.index in busy:
                    slot.owner, slot.in_flight_generation = Owner.SIDECAR, None
                elif slot.owner in _HELD_BY_SIDECAR:
                    slot.owner, slot.in_flight_step, slot.in_flight_generation = Owner.RANK, None, None
            self._connected = True
            self._refusal = None
            self._cond.notify_all()

    def _refused_cb(self, reason: str) -> None:
        with self._cond:
            self._refusal = reason
            self._cond.notify_all()

    def _lost_cb(self, reason: str) -> None:
        with self._cond:
            self._connected = False
            if self._pool is not None:
                for slot in self._pool.slots:
                    if slot.owner is Owner.SIDECAR:
                        slot.owner = Owner.UNKNOWN
            for handle in self._handles.values():
                handle._resolve(f"the connection to the sidecar was lost before the commit ({reason}); "
                                "load() tells which step is committed")
            self._handles.clear()
            self._cond.notify_all()

    def _message_cb(self, message: messages.ToClient) -> None:
        with self._cond:
            try:
                _ANSWERS.handle(self, message)
            except (IndexError, ProtocolError, messages.MessageError) as exc:
                self._violation = f"rank {self.rank}: the sidecar broke the protocol: {exc}"
                log.error(self._violation)
            self._cond.notify_all()

    @_ANSWERS.on(messages.Registered)
    def _registered(self, message: messages.Registered) -> None:
        self._responses[("registered", message.slot)] = message

    @_ANSWERS.on(messages.Inventory)
    def _inventory(self, message: messages.Inventory) -> None:
        self._responses[("inventory", 0)] = message

    @_ANSWERS.on(messages.Released)
    def _released(self, message: messages.Released) -> None:
        self._return_slot(message.slot, message.step, message.generation)

    @_ANSWERS.on(messages.Staged)
    def _staged(self, message: messages.Staged) -> None:
        self._return_slot(message.slot, message.step, None)
        self._responses[("stage", message.slot)] = message

    @_ANSWERS.on(messages.Persisted)
    def _persisted(self, message: messages.Persisted) -> None:
        handle = self._handles.get(message.step)
        if handle is not None:
            handle._mark_durable()

    @_ANSWERS.on(messages.Committed)
    def _committed(self, message: messages.Committed) -> None:
        handle = self._handles.pop(message.step, None)
        if handle is not None:
            handle._resolve(None)

    @_ANSWERS.on(messages.Failed)
    def _failed(self, message: messages.Failed) -> None:
        step, index = message.step, message.slot
        if index is not None:
            staging = self._require_pool().slots[index].in_flight_generation is None
            self._return_slot(index, step, None)
            if staging:
                self._responses[("stage", index)] = message
                return
        handle = self._handles.pop(step, None)
        if handle is not None:
            # Logged as well: a loop that never waits for its handles would not hear of it otherwise.
            log.warning("rank %d: step %d was not committed: %s", self.rank, step, message.reason)
            handle._resolve(message.reason)

    def _return_slot(self, index: int, step: int, generation: int | None) -> None:
        assert self._pool is not None
        slot = self._pool.slots[index]
        if slot.owner not in _HELD_BY_SIDECAR or (generation is not None and slot.in_flight_generation
                                                  not in (None, generation)):
            raise ProtocolError(f"answer for slot {index} step {step}, which the sidecar does not hold "
                                f"(owner {slot.owner.value}, in flight {slot.in_flight_step}): a duplicate answer")
        slot.owner, slot.in_flight_step, slot.in_flight_generation = Owner.RANK, None, None


def _header_holding(slot: ClientSlot, step: int) -> header.SlotHeader | None:
    """The slot's header if the slot holds ``step`` whole, else None."""
    if slot.file is None:
        return None
    slot.file.refresh()
    found = slot.file.read_header()
    return found if found.complete and found.step == step else None


def _node_name() -> str:
    name = os.environ.get("NODE_NAME") or socket.gethostname()
    return name if messages.NODE_NAME.match(name) else "node"
