"""Time as the commit sees it: every deadline, poll and timestamp of a commit goes through a ``Clock``.

The sidecar runs on ``SystemClock``. Passing another clock is what lets the
unit tests move time forward by hand, so that a commit timeout is tested in
milliseconds instead of waited for.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Protocol


class Timer(Protocol):
    """A callback scheduled by ``Clock.call_later``; cancelling it after it ran does nothing."""

    def cancel(self) -> None: ...


class Clock(Protocol):
    def monotonic(self) -> float:
        """Seconds on a clock that never jumps: for durations and deadlines."""
        ...

    def wall(self) -> float:
        """Unix time: for what is written to storage and exported as a timestamp."""
        ...

    async def sleep(self, seconds: float) -> None: ...

    def call_later(self, delay: float, callback: Callable[[], None]) -> Timer:
        """Run ``callback`` in the event loop once ``delay`` seconds have passed."""
        ...


class SystemClock:
    """The system's clocks and the running event loop's timers."""

    def monotonic(self) -> float:
        return time.monotonic()

    def wall(self) -> float:
        return time.time()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)

    def call_later(self, delay: float, callback: Callable[[], None]) -> Timer:
        return asyncio.get_running_loop().call_later(delay, callback)
