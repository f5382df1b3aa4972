"""Python's cyclic collector never runs inside ``save`` or ``load``.

A full collection walks the whole training process: in the benchmark it took
0.25-0.7 s on 8 ranks, and when it started inside a save (the first into a
spare slot allocates a view per tensor) that save blocked eight times longer.
The collection is the process's due, not the call's: it must run at the
caller's next allocation instead, so the collector must be on again after
every call, and stay off where the caller had turned it off.
"""

from __future__ import annotations

import gc
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from stowaway import Checkpointer


class Collections:
    """Which collections the test's thread starts while a save or load is at work.

    A collection counts as inside when the call's own frame is on the stack
    that started it. Starting the call packs its arguments first, and that
    allocation may start one before the call has begun: that collection is
    the caller's, at the same moment as one at its previous allocation.
    The connection's thread is left out: it runs collections of its own
    whenever a message arrives.
    """

    def __init__(self) -> None:
        self.inside: list[str] = []
        self._thread = threading.get_ident()
        self._calls = {Checkpointer.save.__code__, Checkpointer.load.__code__}

    def record(self, phase: str, info: dict) -> None:
        if phase != "start" or threading.get_ident() != self._thread:
            return
        started_at = frame = sys._getframe(1)
        while frame is not None:
            if frame.f_code in self._calls:
                self.inside.append(f"{started_at.f_code.co_qualname}:{started_at.f_lineno}")
                return
            frame = frame.f_back

    def check(self, what: str, call: Callable[[], Any]) -> Any:
        """Make ``call``, and assert that it started no collection and left the collector on."""
        self.inside.clear()
        result = call()
        assert gc.isenabled(), f"{what} left the collector disabled"
        assert not self.inside, f"{len(self.inside)} collections started inside {what}, the first at {self.inside[:3]}"
        return result


@pytest.fixture
def collections() -> Iterator[Collections]:
    log = Collections()
    thresholds = gc.get_threshold()
    gc.set_threshold(1, 1, 1)
    gc.callbacks.append(log.record)
    try:
        yield log
    finally:
        gc.callbacks.remove(log.record)
        gc.set_threshold(*thresholds)


def test_no_collection_starts_inside_save_or_load(start_sidecar, collections):
    state = {f"layer{i}": {"weight": torch.randn(16, 16), "step": i} for i in range(300)}
    sidecar = start_sidecar()
    with Checkpointer(job="gc", socket=sidecar.socket, rank=0, world_size=1, timeout=30) as ckpt:
        first = collections.check("the first save into a slot", lambda: ckpt.save(1, state))
        second = collections.check("a save into another slot while the first persists", lambda: ckpt.save(2, state))
        first.wait(30)
        second.wait(30)
        restored = collections.check("a load into new tensors", lambda: ckpt.load(step=1))
        collections.check("a load into the state's own tensors", lambda: ckpt.load(step=2, into=state))
    assert restored is not None and torch.equal(restored[1]["layer7"]["weight"], state["layer7"]["weight"])


def test_a_collector_the_caller_disabled_stays_disabled(start_sidecar):
    sidecar = start_sidecar()
    gc.disable()
    try:
        with Checkpointer(job="gc", socket=sidecar.socket, rank=0, world_size=1, timeout=30) as ckpt:
            ckpt.save(1, {"w": torch.ones(4)}).wait(30)
            assert not gc.isenabled(), "save enabled a collector its caller had disabled"
            ckpt.load()
            assert not gc.isenabled(), "load enabled a collector its caller had disabled"
    finally:
        gc.enable()
