"""Defaults from the environment, so the three-line integration needs no arguments.

torchrun sets RANK, LOCAL_RANK, WORLD_SIZE and LOCAL_WORLD_SIZE; the operator
(or ``stowaway run``) sets STOWAWAY_SOCKET and STOWAWAY_JOB.
"""

from __future__ import annotations

import os
import uuid

from stowaway.errors import ConfigurationError


def text(value: str | None, name: str, what: str) -> str:
    if value is not None:
        return value
    found = os.environ.get(name)
    if not found:
        raise ConfigurationError(
            f"{what} is not set: pass it to Checkpointer or set {name} (the Stowaway operator sets it in "
            "injected pods, `stowaway run` sets it locally)"
        )
    return found


def integer(value: int | None, name: str, default: int) -> int:
    if value is not None:
        return value
    found = os.environ.get(name)
    if found is None:
        return default
    try:
        return int(found)
    except ValueError:
        raise ConfigurationError(f"environment variable {name}={found!r} is not an integer") from None


class RunId:
    """Which incarnation of the job this process belongs to: the ``run`` of its persists.

    Given, or from ``STOWAWAY_RUN_ID``; else, when first asked, torchelastic's
    run and restart count, a fresh one for a job of one rank, or "default".
    ``load`` replaces it with rank 0's, so that all ranks tag their files alike.
    """

    def __init__(self, given: str | None, world_size: int) -> None:
        self._value = given or os.environ.get("STOWAWAY_RUN_ID") or None
        self._world_size = world_size

    def current(self) -> str:
        if self._value is None:
            elastic = os.environ.get("TORCHELASTIC_RUN_ID")
            if elastic and elastic != "none":
                self._value = f"{elastic}-{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
            elif self._world_size == 1:
                self._value = uuid.uuid4().hex
            else:
                self._value = "default"
        return self._value

    def agree(self, rank0s: str) -> None:
        self._value = rank0s
