"""Polling with a deadline, the only synchronisation the k8s tests use.

Kubernetes is eventually consistent: controllers, the scheduler and kwok act
asynchronously, so tests poll for the state they expect instead of sleeping,
and fail with the last observation when the deadline passes.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

from kubernetes.client.exceptions import ApiException

T = TypeVar("T")


def eventually(
    probe: Callable[[], T],
    *,
    what: str,
    timeout: float = 60.0,
    interval: float = 0.25,
) -> T:
    """Call ``probe`` until it returns a truthy value without raising.

    ``ApiException`` (e.g. 404 before an object exists) and ``AssertionError``
    count as "not yet". Returns the probe's first truthy result.
    """
    deadline = time.monotonic() + timeout
    last: object = "never probed"
    while True:
        try:
            result = probe()
            if result:
                return result
            last = result
        except (ApiException, AssertionError) as exc:
            last = exc
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}; last: {last}")
        time.sleep(interval)  # poll interval, not synchronisation
