"""Defaults from the environment, so the three-line integration needs no arguments.

torchrun sets RANK, LOCAL_RANK, WORLD_SIZE and LOCAL_WORLD_SIZE; the operator
(or ``stowaway run``) sets STOWAWAY_SOCKET and STOWAWAY_JOB.
"""

from __future__ import annotations

import os

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
