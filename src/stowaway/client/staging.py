"""Overlapped staging: ``save(overlap=True)`` copies the state into its slot behind the training loop's back.

Between ``save(overlap=True)`` and the end of its copy the state is on loan
to the copy: a change made meanwhile may reach the checkpoint. ``guard``
ends the loan early the only safe way, by waiting: on the host for the copy
thread, or, when the copy thread copies nothing from host memory, by
making the current stream (the optimizer's) wait for the copies' events,
which does not block the host. A state on a GPU mostly is: ``save()``
copies its few host tensors itself (Adam's step counts, RNG and scheduler
states; ``copies_host_tensors_itself``), so a real optimizer's state gets
the stream-ordered guard too.

The slot stays the rank's (``WRITING`` in the ledger) until the copy has
ended; only then does the copy thread hand it to the sidecar with
``persist``, so the sidecar still reads only slots it owns. One copy thread
per checkpointer and one copy at a time: every save first waits (bounded)
for the copy before it, so steps reach the sidecar in the order saved.

What each copy cost is known before its persist is sent, which carries it
to the sidecar's metrics: its staging seconds, and its stall, from the
first host wait on it to the end of the copy (a wait that begins after the
copy ended, while the persist is sent, does not count: the state was safe).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any

import torch

from stowaway.client.handle import SaveHandle
from stowaway.errors import StagingTimeout

log = logging.getLogger("stowaway")

# Host bytes of a state with GPU tensors that save() copies itself rather than leave to the copy thread; beyond
# it (a state offloaded to the host), the host copy is worth overlapping even though the guard then blocks.
INLINE_HOST_BYTES = 16 * 2**20


def copies_host_tensors_itself(sources: list[torch.Tensor], on_gpu: bool) -> bool:
    """Whether ``save(overlap=True)`` copies the host sources before returning: with GPU sources, when they are few.

    Then the copy thread only waits for the device copies, and a guard can
    order the optimizer's stream after them instead of waiting on the host
    for a thread.
    """
    host = sum(source.numel() * source.element_size() for source in sources if source.device.type != "cuda")
    return on_gpu and host <= INLINE_HOST_BYTES


@dataclass
class Staging:
    """One overlapped save's copy: its handle, and what a guard waits for."""

    handle: SaveHandle
    # The end of the device copies, per device; empty when no source is on a GPU.
    events: dict[torch.device, Any]
    # Whether the copy thread copies sources itself (host tensors): then only the host can wait for them.
    host_copies: bool
    # When save() started: the staging time runs from there to the end of the copy.
    started: float
    finished: threading.Event = field(default_factory=threading.Event)
    # When the training loop first waited on the host for this copy, if it did before the copy ended.
    stalled_since: float | None = None
    # Set by the copy thread at the end of the copy (before the persist): the copy's seconds, and the stall's.
    seconds: float | None = None
    stall: float = 0.0


@dataclass(frozen=True)
class _Job:
    staging: Staging
    copy: Callable[[], None]
    hand_over: Callable[[], None]
    give_back: Callable[[], None]


class Stager:
    """The copy thread of one checkpointer, the copy in flight, and the seconds it cost and saved.

    ``staging_seconds``: per overlapped save, from ``save()`` to the end of
    its copy. ``stall_seconds``: per host wait for a copy still running (a
    guard, or the next save), what the overlap failed to hide.
    """

    def __init__(self, rank: int, timeout: float) -> None:
        self._rank = rank
        self._timeout = timeout
        self.staging_seconds: list[float] = []
        self.stall_seconds: list[float] = []
        # Orders a waiter's start against the end of the copy, so a stall is counted in full or not at all.
        self._clock = threading.Lock()
        self._current: Staging | None = None
        self._failed: Staging | None = None
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._streams: dict[torch.device, Any] = {}
        # A test seam, never a setting: called on the copy thread with the step before it copies, so that a test
        # can hold a copy back until the training loop has changed (or, guarded, tried to change) the state.
        self._before_copy: Callable[[int], None] | None = None

    def side_streams(self, devices: Collection[torch.device]) -> dict[torch.device, Any]:
        """A copy stream per device, made once: the copies run beside the training's own stream."""
        for device in devices:
            if device not in self._streams:
                self._streams[device] = torch.cuda.Stream(device)
        return self._streams

    def start(self, staging: Staging, copy: Callable[[], None], hand_over: Callable[[], None],
              give_back: Callable[[], None]) -> None:
        """Run ``copy`` on the copy thread, then mark the save staged and run ``hand_over`` (the persist).

        A failed ``copy`` runs ``give_back`` (the slot is idle again) and
        fails the save instead (its handle says why), which the next save
        raises again unless the handle has raised it already.
        """
        self._current = staging
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="stowaway-copy", daemon=True)
            self._thread.start()
        self._jobs.put(_Job(staging, copy, hand_over, give_back))

    def wait(self, waiter: str) -> None:
        """Wait on the host (bounded) for the copy in flight, if any, counting the stall; ``waiter`` says who waits."""
        staging = self._current
        if staging is None or staging.finished.is_set():
            return
        began = time.perf_counter()
        with self._clock:
            if staging.seconds is None and staging.stalled_since is None:
                staging.stalled_since = began
        ended = staging.finished.wait(self._timeout)
        self.stall_seconds.append(time.perf_counter() - began)
        if not ended:
            raise StagingTimeout(
                f"rank {self._rank}: {waiter} waited {self._timeout} s for step {staging.handle.step} to be copied "
                "into shared memory, and the copy thread is still copying it; check for a stuck GPU or a state "
                "far larger than shared memory copies in that time, or raise the checkpointer's timeout"
            )

    def guard(self) -> None:
        """Make the state safe to change: on a GPU by ordering the current streams after the copies, else by waiting.

        Each device's current stream waits for its copy event, so the work
        queued next (the optimizer's step) runs after the copies, and the host
        goes on. Host sources are copied by the copy thread, which only the
        host can wait for.
        """
        staging = self._current
        if staging is None or staging.finished.is_set():
            return
        if staging.host_copies or not staging.events:
            self.wait(f"a guarded change of the state after the save of step {staging.handle.step}")
            return
        for device, event in staging.events.items():
            torch.cuda.current_stream(device).wait_event(event)

    def raise_failure(self) -> None:
        """Raise the failed copy nobody has heard of yet (``wait_staged``/``wait`` would have raised it), once."""
        failed, self._failed = self._failed, None
        if failed is not None and not failed.handle._staging_reported:
            failed.handle._staging_reported = True
            failed.handle.wait_staged(0)

    def close(self) -> bool:
        """Let the copy in flight end (bounded), then stop the copy thread; False if it is still copying."""
        if self._thread is None:
            return True
        self._jobs.put(None)
        self._thread.join(self._timeout)
        if self._thread.is_alive():
            log.error("rank %d: the copy of step %s into shared memory did not end within %s s; its slot stays "
                      "mapped so that it cannot fault", self._rank,
                      None if self._current is None else self._current.handle.step, self._timeout)
            return False
        self._thread = None
        return True

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            staging = job.staging
            try:
                if self._before_copy is not None:
                    self._before_copy(staging.handle.step)
                job.copy()
            except Exception as exc:  # the copy's error belongs to its save, not to this thread
                error = f"{type(exc).__name__}: {exc}"
                log.warning("rank %d: step %d could not be copied into shared memory: %s",
                            self._rank, staging.handle.step, error)
                job.give_back()
                self._failed = staging
                self._staged(staging, error)
                staging.finished.set()
                continue
            self._staged(staging, None)
            # Finished only once handed over: the next save, which waits for it, must find the step in flight,
            # and its own persist must follow this one.
            try:
                job.hand_over()
            except Exception:  # the thread must outlive a bug in one hand-over, to copy the next save
                log.exception("rank %d: handing step %d to the sidecar failed", self._rank, staging.handle.step)
                staging.handle._resolve("handing it to the sidecar failed (see the rank's log)")
            finally:
                staging.finished.set()

    def _staged(self, staging: Staging, error: str | None) -> None:
        with self._clock:
            ended = time.perf_counter()
            staging.seconds = ended - staging.started
            if staging.stalled_since is not None:
                staging.stall = ended - staging.stalled_since
        self.staging_seconds.append(staging.seconds)
        staging.handle._finish_staging(error)
