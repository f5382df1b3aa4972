"""``Checkpointer``: save to shared memory at memcpy speed, restore from memory or storage.

The roles behind it: ``link`` talks to the sidecar (one connection per
rank, requests and their answers, every wait bounded); ``answers`` is what
each message from the sidecar does; ``ledger`` records who holds each slot,
and ``rank_slots`` takes, sizes and hands over slots through it; ``pool``
holds the slot files and ``spare_slots`` allocates them ahead of use;
``restorer`` is ``load``; ``handle`` is what ``save`` returns.
"""

from __future__ import annotations

import functools
import gc
import os
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar, cast

from stowaway.client import answers, env, ledger, link, rank_slots, restorer
from stowaway.client.handle import SaveHandle, SavesInFlight
from stowaway.errors import ConfigurationError
from stowaway.format import codec
from stowaway.protocol import messages

DEFAULT_TIMEOUT = 600.0
_Call = TypeVar("_Call", bound=Callable[..., Any])


def _collector_paused(call: _Call) -> _Call:
    """Keep Python's cyclic collector out of ``save`` and ``load``, which the training loop blocks on.

    Both allocate a few objects per tensor (the encode's garbage, a new
    slot's views, the restored tensors), enough to start collections. A
    full one walks the whole training process, so one landing inside a save
    would stretch it by far more than the save's own work. The collection
    is not the call's work but the process's, due whenever its heap has
    grown enough; paused, it runs at the caller's next allocation instead.
    Whole calls are covered, since the first allocation after re-enabling
    would start it inside them; so is the wrapper, whose first act is the
    pause.
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
        self.blocking_seconds: list[float] = []
        self.slot_wait_seconds: list[float] = []
        self._encoder = codec.Encoder()
        self._run = env.RunId(run_id, self.world_size)
        self._closed = False
        # One lock for everything the reader thread changes; waits on it end at the timeout.
        self._lock = threading.Condition()
        self._link = link.Link(self.socket_path, self._hello(), timeout, self._lock)
        self._ledger = ledger.SlotLedger(slots, self._lock)
        self._slots = rank_slots.RankSlots(self.job, self.rank, slots, self.local_world_size, self._link,
                                           self._ledger, self._lock)
        self._saves = SavesInFlight(self.rank)
        self._restorer = restorer.Restorer(self.job, self.rank, self.world_size, self.local_world_size, allow_pickle,
                                           self._run, self._link, self._slots)
        self._link.open(answers.Answers(self._link, self._ledger, self._slots, self._saves))

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def reserve(self, state: Any, wait: bool = False) -> None:
        """Allocate this rank's slots for states like ``state`` in the background, so the first save is steady.

        A first save otherwise allocates its slot and pays the kernel a page
        fault per page, which a steady save does not; into a reserved slot it
        copies at memcpy speed, and its state is encoded already. Call it once
        the state holds every tensor it will (an optimizer creates its state
        at its first step), early enough for the allocation to end (on a
        thread of its own): a save arriving sooner waits for its slot. With
        ``wait``, return once it has ended. Raises ``ShmCapacityError`` at
        once if shared memory cannot hold the slots of every local rank.
        """
        encoded = self._encoder.encode(state, self.allow_pickle)
        self._slots.reserve(encoded.nbytes, wait)

    @_collector_paused
    def save(self, step: int, state: Any) -> SaveHandle:
        """Copy ``state`` into a slot and hand it to the sidecar; return once it is in shared memory."""
        started = time.perf_counter()
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be a non-negative int, got {step!r}")
        encoded = self._encoder.encode(state, self.allow_pickle)
        run = self._run.current()
        with self._lock:
            self._saves.refuse_duplicate(step)
        waiting = time.perf_counter()
        with self._slots.taken(step) as slot:
            slot_wait = time.perf_counter() - waiting
            generation = self._slots.write(slot, step, encoded)
            blocking = time.perf_counter() - started
            handle = SaveHandle(step, self.rank, blocking, slot_wait, self.timeout)
            request = messages.Persist(run=run, step=step, slot=slot.index, generation=generation,
                                       nbytes=encoded.nbytes, blocking_seconds=blocking, slot_wait_seconds=slot_wait)
            with self._lock:
                self.blocking_seconds.append(blocking)
                self.slot_wait_seconds.append(slot_wait)
                if self._slots.persist(slot, request):
                    self._saves.add(handle)
                else:
                    handle._resolve(f"the connection to the sidecar was lost before the persist was sent "
                                    f"({self._link.last_error})")
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

        Where the step came from, memory or storage, is ``last_restore``.
        """
        return self._restorer.load(step, map_location, device_mesh, into)

    @property
    def last_restore(self) -> restorer.Restore | None:
        """What the last ``load()`` restored (step, ``"memory"`` or ``"storage"``, seconds); None if nothing.

        None before any ``load()``, and after one that found nothing to
        restore or raised. A trainer that expected to come back from memory
        and did not (its slots were gone) can tell it here, and log it.
        """
        return self._restorer.last

    @property
    def slots_in_flight(self) -> int:
        """Slots this rank has handed to the sidecar and not yet got back."""
        with self._lock:
            return self._slots.in_flight()

    def close(self) -> None:
        """Wait (bounded by the timeout) for saves in flight to be answered, then disconnect."""
        if self._closed:
            return
        self._closed = True
        self._link.wait_quietly(lambda: not self._saves)
        self._link.close()
        self._slots.close()

    def _hello(self) -> messages.Hello:
        try:
            return messages.Hello(
                protocol=messages.PROTOCOL_VERSION, job=self.job, rank=self.rank, local_rank=self.local_rank,
                world_size=self.world_size, local_world_size=self.local_world_size, node=_node_name(),
                pid=os.getpid(),
            )
        except messages.MessageError as exc:
            raise ConfigurationError(str(exc)) from None


def _node_name() -> str:
    name = os.environ.get("NODE_NAME") or socket.gethostname()
    return name if messages.NODE_NAME.match(name) else "node"
