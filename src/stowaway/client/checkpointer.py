"""``Checkpointer``: save to shared memory at memcpy speed, restore from memory or storage.

The roles behind it: ``link`` talks to the sidecar (one connection per
rank, requests and their answers, every wait bounded); ``answers`` is what
each message from the sidecar does; ``ledger`` records who holds each slot,
and ``rank_slots`` takes, sizes and hands over slots through it; ``pool``
holds the slot files and ``spare_slots`` allocates them ahead of use;
``restorer`` is ``load``; ``handle`` is what ``save`` returns; ``staging``
copies a ``save(overlap=True)`` behind the training loop and guards the state.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar, cast

import torch
from torch.utils.hooks import RemovableHandle

from stowaway.client import answers, env, ledger, link, rank_slots, restorer, staging
from stowaway.client.handle import SaveHandle, SavesInFlight
from stowaway.client.pool import ClientSlot
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

    ``pooled_spares`` (``STOWAWAY_POOLED_SPARES``, else 0) is the number of
    spare slots the pod's ranks share: a save that finds every slot of its
    rank's still persisting borrows a free one instead of waiting. Every
    rank of the pod must be given the same number. With ``slots=1`` and one
    pooled spare, a pod of N ranks holds (N + 1) / N of its state in shared
    memory instead of twice it, and one of its ranks at a time may save
    again before its last save is persisted (docs/operator.md, "Pooled
    spare slots").
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
        pooled_spares: int | None = None,
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
        pooled_spares = env.integer(pooled_spares, "STOWAWAY_POOLED_SPARES", 0)
        if not 0 <= pooled_spares <= messages.MAX_POOLED_SPARES:
            raise ConfigurationError(
                f"pooled_spares must be between 0 and {messages.MAX_POOLED_SPARES}, got {pooled_spares}")
        if timeout <= 0:
            raise ConfigurationError(f"timeout must be positive, got {timeout}")
        self.timeout = timeout
        self.allow_pickle = allow_pickle
        self.blocking_seconds: list[float] = []
        self.slot_wait_seconds: list[float] = []
        self._hidden_seconds = 0.0  # see overlap_seconds; added to by the copy thread only
        self._encoder = codec.Encoder()
        self._run = env.RunId(run_id, self.world_size)
        self._closed = False
        # One lock for everything the reader thread changes; waits on it end at the timeout.
        self._lock = threading.Condition()
        self._link = link.Link(self.socket_path, self._hello(), timeout, self._lock)
        self._ledger = ledger.SlotLedger(slots, self._lock, pooled_spares,
                                         returned=lambda index: self._slots.spare_returned(index))
        self._slots = rank_slots.RankSlots(self.job, self.rank, slots, self.local_world_size, self._link,
                                           self._ledger, self._lock, pooled_spares)
        self._saves = SavesInFlight(self.rank)
        self._stager = staging.Stager(self.rank, timeout)
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
        ``wait``, return once the slot the first save writes is ready; the
        other slots (spares for a save made while the previous one persists)
        go on at the lowest priority. Raises ``ShmCapacityError`` at once if
        shared memory cannot hold the slots of every local rank.
        """
        encoded = self._encoder.encode(state, self.allow_pickle)
        self._slots.reserve(encoded.nbytes, wait)

    @_collector_paused
    def save(self, step: int, state: Any, overlap: bool = False) -> SaveHandle:
        """Copy ``state`` into a slot and hand it to the sidecar; return once it is in shared memory.

        With ``overlap``, return once the copy has started instead: a copy
        thread (on a GPU, a side stream per device) copies the state while the
        next step computes, and hands the slot to the sidecar when done
        (``handle.staged()``, ``handle.wait_staged()``). Until then the state
        must not change: call ``guard(optimizer)`` once, so that the
        optimizer's step waits for the copy, and wrap any other change in
        ``guarded()``. Unguarded, a change made during the copy may reach the
        checkpoint: that is the caller's risk. A save first waits (bounded)
        for the copy of the save before it, and raises its failure if nobody
        was told of it yet.
        """
        started = time.perf_counter()
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be a non-negative int, got {step!r}")
        self._stager.wait(f"the save of step {step}")
        self._stager.raise_failure()
        encoded = self._encoder.encode(state, self.allow_pickle)
        run = self._run.current()
        with self._lock:
            self._saves.refuse_duplicate(step)
        waiting = time.perf_counter()
        if overlap:
            return self._save_overlapped(step, encoded, run, started, waiting)
        with self._slots.taken(step, borrow=True) as slot:
            slot_wait = time.perf_counter() - waiting
            generation = self._slots.write(slot, step, encoded)
            blocking = time.perf_counter() - started
            handle = SaveHandle(step, self.rank, blocking, slot_wait, self.timeout)
            request = messages.Persist(run=run, step=step, slot=slot.index, generation=generation,
                                       nbytes=encoded.nbytes, blocking_seconds=blocking, slot_wait_seconds=slot_wait)
            self._hand_over(slot, request, handle)
        return handle

    def _save_overlapped(self, step: int, encoded: codec.Encoded, run: str, started: float,
                         waiting: float) -> SaveHandle:
        """Take a slot, queue the device copies, and leave the rest of the copy and the persist to the copy thread."""
        slot = self._slots.take(step, borrow=True)
        host_now = staging.copies_host_tensors_itself(encoded.sources, bool(encoded.cuda_devices))
        try:
            slot_wait = time.perf_counter() - waiting
            generation = self._slots.begin(slot, encoded)
            views = slot.views_for(encoded.layout)
            codec.write_header(encoded, slot.payload())
            events = (codec.enqueue_device_copies(encoded, views, self._stager.side_streams(encoded.cuda_devices))
                      if encoded.cuda_devices else {})
            if host_now:  # while the device copies run
                codec.copy_host_sources(encoded, views)
        except BaseException:
            self._slots.give_back_unsent(slot)
            raise
        blocking = time.perf_counter() - started
        handle = SaveHandle(step, self.rank, blocking, slot_wait, self.timeout, staged=False)
        request = messages.Persist(run=run, step=step, slot=slot.index, generation=generation,
                                   nbytes=encoded.nbytes, blocking_seconds=blocking, slot_wait_seconds=slot_wait)

        def copy() -> None:
            if not host_now:
                codec.copy_host_sources(encoded, views)
            for event in events.values():
                event.synchronize()
            self._slots.finish(slot, step, generation, encoded.nbytes)

        host_copies = not host_now and any(source.device.type != "cuda" for source in encoded.sources)
        job = staging.Staging(handle, events, host_copies, started)

        def hand_over() -> None:
            """Persist, telling the sidecar what the copy cost (known now, at its end); unsent, the slot is idle again.

            As ``taken`` does for a blocking save: a persist the connection
            could not carry fails the save, and must not keep its slot.
            """
            measured = dataclasses.replace(request, staging_seconds=job.seconds, stall_seconds=job.stall)
            self._hidden_seconds += measured.hidden_seconds or 0.0
            try:
                self._hand_over(slot, measured, handle)
            finally:
                self._slots.give_back_unsent(slot)

        self._stager.start(job, copy, hand_over, lambda: self._slots.give_back_unsent(slot))
        return handle

    def _hand_over(self, slot: ClientSlot, request: messages.Persist, handle: SaveHandle) -> None:
        """Persist the written ``slot``: the handle joins the saves in flight, or fails if the sidecar is gone."""
        with self._lock:
            self.blocking_seconds.append(request.blocking_seconds)
            self.slot_wait_seconds.append(request.slot_wait_seconds)
            if self._slots.persist(slot, request):
                self._saves.add(handle)
            else:
                handle._resolve(f"the connection to the sidecar was lost before the persist was sent "
                                f"({self._link.last_error})")

    def guard(self, optimizer: torch.optim.Optimizer) -> RemovableHandle:
        """Make ``optimizer.step()`` wait for the copy of a ``save(overlap=True)``; return the hook's handle.

        The step's pre-hook waits for the copy on the host (the copy thread),
        or, when the state is on a GPU (its few host tensors, such as Adam's
        step counts, copied by ``save`` itself), makes each device's current
        stream wait for its copy's event, without blocking the host. Call
        ``.remove()`` on what it returns to drop the guard.
        """
        return optimizer.register_step_pre_hook(lambda *_: self._stager.guard())

    @contextmanager
    def guarded(self) -> Iterator[None]:
        """``with ckpt.guarded():`` around a change of the state made outside a guarded optimizer's step."""
        self._stager.guard()
        yield

    @property
    def staging_seconds(self) -> list[float]:
        """Per ``save(overlap=True)`` whose copy ended: seconds from ``save()`` to the end of its copy."""
        return self._stager.staging_seconds

    @property
    def stall_seconds(self) -> list[float]:
        """Per wait on the host for a copy still running (a guard, or the next save): what the overlap cost."""
        return self._stager.stall_seconds

    @property
    def overlap_seconds(self) -> float:
        """Copy time the training loop did not wait for, over the run's overlapped saves handed to the sidecar.

        Per save, its staging seconds less what ``save()`` blocked for and
        less its stall (``messages.Persist.hidden_seconds``), as the
        sidecar's ``stowaway_save_overlap_hidden_seconds_total`` counts it.
        """
        return self._hidden_seconds

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

        A step saved by another number of ranks is resharded: each rank
        reads only the byte ranges of the stored files its new shards need.
        Pass the new mesh as ``device_mesh``, or the state to fill as
        ``into``. Raises ``WorldSizeChanged`` when such a step cannot be
        resharded, naming what: state that differs per saved rank, or a
        ``Partial`` placement.

        Where the step came from, memory or storage, is ``last_restore``.
        """
        self._stager.wait("load()")
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
        copied = self._stager.close()
        self._link.wait_quietly(lambda: not self._saves)
        self._link.close()
        if copied:  # unmapping a slot the copy thread still writes would crash the process
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
