"""``SaveHandle``: the future of one save, resolved by the sidecar's answers; and the saves awaiting one."""

from __future__ import annotations

import logging
import threading

from stowaway.errors import SaveFailed

log = logging.getLogger("stowaway")


class SaveHandle:
    """Returned by ``Checkpointer.save`` once the state is in shared memory.

    ``wait()`` returns when the checkpoint of this step is committed in
    storage, or raises ``SaveFailed`` with the sidecar's reason. Without an
    argument it waits at most the checkpointer's timeout: no wait is unbounded.
    ``durable`` tells, before the commit, that this rank's own file of the
    step is on storage (the sidecar's ``persisted``): the rank's share is
    safe, whatever the other ranks' shares and the manifest still wait for.

    ``staged()`` tells that the state is in shared memory, so that it may
    change: at once for a blocking save, once the copy thread is done for
    ``save(overlap=True)``, whose persist starts only then. ``wait_staged()``
    waits for it, bounded like ``wait()``, and raises ``SaveFailed`` when the
    copy failed (the step is then not saved, and ``wait()`` says so too).
    """

    def __init__(self, step: int, rank: int, blocking_seconds: float, slot_wait_seconds: float,
                 default_timeout: float, staged: bool = True) -> None:
        self.step = step
        self.rank = rank
        self.blocking_seconds = blocking_seconds
        self.slot_wait_seconds = slot_wait_seconds
        self._default_timeout = default_timeout
        self._done = threading.Event()
        self._error: str | None = None
        self._durable = False
        self._staged = threading.Event()
        self._staging_error: str | None = None
        # Whether a failed copy was raised to the caller already; if not, the next save raises it.
        self._staging_reported = False
        if staged:
            self._staged.set()

    def done(self) -> bool:
        return self._done.is_set()

    def staged(self) -> bool:
        """The copy into shared memory has ended (successfully or not): the state may change now."""
        return self._staged.is_set()

    def wait_staged(self, timeout: float | None = None) -> None:
        """Return once the state is in shared memory; raise ``SaveFailed`` if the copy failed or took too long."""
        timeout = self._default_timeout if timeout is None else timeout
        if not self._staged.wait(timeout):
            raise SaveFailed(
                f"rank {self.rank}: step {self.step} was not copied into shared memory within {timeout} s; "
                "the copy thread is still copying it (a very large state, or a slow or stuck device)"
            )
        if self._staging_error is not None:
            self._staging_reported = True
            raise SaveFailed(f"rank {self.rank}: step {self.step} could not be copied into shared memory: "
                             f"{self._staging_error}")

    def _finish_staging(self, error: str | None) -> None:
        """The copy has ended; a failed one fails the save as well, since the sidecar never got the step."""
        self._staging_error = error
        self._staged.set()
        if error is not None:
            self._resolve(f"its copy into shared memory failed: {error}")

    @property
    def committed(self) -> bool:
        return self._done.is_set() and self._error is None

    @property
    def durable(self) -> bool:
        """This rank's file of the step is durable in storage (it is once the step is committed)."""
        return self._durable or self.committed

    def wait(self, timeout: float | None = None) -> None:
        timeout = self._default_timeout if timeout is None else timeout
        if not self._done.wait(timeout):
            raise SaveFailed(
                f"rank {self.rank}: step {self.step} was not committed within {timeout} s; "
                "the sidecar is still working on it or another rank has not saved this step"
            )
        if self._error is not None:
            self._staging_reported = self._staging_error is not None
            raise SaveFailed(f"rank {self.rank}: step {self.step} was not committed: {self._error}")

    def _mark_durable(self) -> None:
        self._durable = True

    def _resolve(self, error: str | None) -> bool:
        """First answer wins; return False when the handle was already resolved."""
        if self._done.is_set():
            return False
        self._error = error
        self._done.set()
        return True

    def __repr__(self) -> str:
        if not self.staged():
            state = "staging"
        else:
            state = "pending" if not self.done() else ("committed" if self.committed else "failed")
        return f"SaveHandle(step={self.step}, rank={self.rank}, {state})"


class SavesInFlight:
    """The handles of the steps handed to the sidecar and not yet committed or failed, by step.

    Used with the shared lock held: the training thread adds, the reader
    thread resolves, and a lost connection resolves them all.
    """

    def __init__(self, rank: int) -> None:
        self._rank = rank
        self._handles: dict[int, SaveHandle] = {}

    def __bool__(self) -> bool:
        return bool(self._handles)

    def refuse_duplicate(self, step: int) -> None:
        if step in self._handles:
            raise ValueError(f"rank {self._rank}: step {step} is already being saved; steps must differ")

    def add(self, handle: SaveHandle) -> None:
        self._handles[handle.step] = handle

    def persisted(self, step: int) -> None:
        handle = self._handles.get(step)
        if handle is not None:
            handle._mark_durable()

    def committed(self, step: int) -> None:
        handle = self._handles.pop(step, None)
        if handle is not None:
            handle._resolve(None)

    def failed(self, step: int, reason: str) -> None:
        handle = self._handles.pop(step, None)
        if handle is not None:
            # Logged as well: a loop that never waits for its handles would not hear of it otherwise.
            log.warning("rank %d: step %d was not committed: %s", self._rank, step, reason)
            handle._resolve(reason)

    def lost(self, reason: str) -> None:
        for handle in self._handles.values():
            handle._resolve(f"the connection to the sidecar was lost before the commit ({reason}); "
                            "load() tells which step is committed")
        self._handles.clear()
