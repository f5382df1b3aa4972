"""``SaveHandle``: the future of one save, resolved by the sidecar's answers."""

from __future__ import annotations

import threading

from stowaway.errors import SaveFailed


class SaveHandle:
    """Returned by ``Checkpointer.save`` once the state is in shared memory.

    ``wait()`` returns when the checkpoint of this step is committed in
    storage, or raises ``SaveFailed`` with the sidecar's reason. Without an
    argument it waits at most the checkpointer's timeout: no wait is unbounded.
    ``durable`` tells, before the commit, that this rank's own file of the
    step is on storage (the sidecar's ``persisted``): the rank's share is
    safe, whatever the other ranks' shares and the manifest still wait for.
    """

    def __init__(self, step: int, rank: int, blocking_seconds: float, slot_wait_seconds: float,
                 default_timeout: float) -> None:
        self.step = step
        self.rank = rank
        self.blocking_seconds = blocking_seconds
        self.slot_wait_seconds = slot_wait_seconds
        self._default_timeout = default_timeout
        self._done = threading.Event()
        self._error: str | None = None
        self._durable = False

    def done(self) -> bool:
        return self._done.is_set()

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
        state = "pending" if not self.done() else ("committed" if self.committed else "failed")
        return f"SaveHandle(step={self.step}, rank={self.rank}, {state})"
