"""Failure notices: how the nodes of a multi-node job tell each other that a step failed.

The sidecars share nothing but the storage, so a node that fails a step
writes a notice beside the step's files (a file, or an object in a bucket). The others read it: before they
admit the step (and refuse it at once), while they persist it (and stop at
the next chunk), and while they wait for its commit (and fail it long before
their own commit timeout).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from stowaway.sidecar.commit import gathering, timing
from stowaway.storage import manifest, step_store

log = logging.getLogger(__name__)

# The failure kind of a step another node gave up on: counted apart, so that summing the
# other kinds across sidecars counts each failure once.
OTHER_NODE_FAILED = "other_node_failed"


class NoticeBoard:
    """This node's view of the notices in a job's step directories."""

    def __init__(self, node: str, clock: timing.Clock, poll_interval: float, store: step_store.StepStore) -> None:
        self._node = node
        self._store = store
        self._clock = clock
        self._poll_interval = poll_interval

    def failure_elsewhere(self, job: str, run: str, step: int) -> str | None:
        """Why another node failed this run's step, or None; an unreadable notice raises."""
        return self.failure_among(self._store.read_failures(job, step), run, step)

    def failure_among(self, failures: list[manifest.Failure], run: str, step: int) -> str | None:
        """Why another node failed this run's step, going by ``failures`` (the step's notices), or None."""
        for failure in failures:
            if failure.run == run and failure.node != self._node:
                return f"step {step} failed on node {failure.node}: {failure.reason}"
        return None

    def readable_failure_elsewhere(self, job: str, run: str, step: int) -> str | None:
        """``failure_elsewhere``, where an unreadable notice counts as none: the commit's poll reports it."""
        try:
            return self.failure_elsewhere(job, run, step)
        except (OSError, step_store.StoreError, manifest.ManifestError):
            return None

    async def announce(self, pending: gathering.PendingStep, reason: str) -> None:
        """Write this node's notice; if storage refuses it, the other nodes learn at their commit timeout."""
        failure = manifest.Failure(self._node, pending.run, pending.step, reason)
        try:
            await asyncio.to_thread(self._store.write_failure, pending.job, pending.step, failure)
        except (OSError, step_store.StoreError) as exc:
            log.warning("cannot tell the other nodes that step %d of job %s failed (they will time out "
                        "instead): %s", pending.step, pending.job, exc)

    async def watch(self, pending: gathering.PendingStep, fail: Callable[[str], None]) -> None:
        """While this node persists a multi-node step, call ``fail`` as soon as another node's notice appears.

        Persisting gigabytes takes a while, and the commit's own poll starts
        only once every local file is durable; until then this watch lets the
        persists stop at their next chunk and hand their slots back.
        """
        while pending.task is None and not pending.resolved.is_set():
            elsewhere = await asyncio.to_thread(self.readable_failure_elsewhere, pending.job, pending.run,
                                                pending.step)
            if elsewhere is not None and pending.task is None and not pending.resolved.is_set():
                fail(elsewhere)
                return
            await self._clock.sleep(self._poll_interval)
