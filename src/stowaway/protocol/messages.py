"""Message types, their fields, and validation.

Each message is a JSON object with a ``type``. ``validate`` checks the type and
every field before any handler sees it, so handlers never deal with a missing
key or a string where a number belongs, and a bad message becomes one clear
error frame instead of an exception deep inside the sidecar.
"""

from __future__ import annotations

import re
from typing import Any

PROTOCOL_VERSION = 1

# \Z, not $: "$" also matches before a trailing newline, which would let "job\n" name a directory.
JOB_NAME = re.compile(r"\A[A-Za-z0-9][A-Za-z0-9._-]{0,127}\Z")
NODE_NAME = re.compile(r"\A[A-Za-z0-9][A-Za-z0-9._-]{0,252}\Z")
MAX_SLOTS_PER_RANK = 64
MAX_WORLD_SIZE = 1 << 20
# Steps, generations and sizes are stored as 64-bit integers (slot header, file names); a value outside
# this range can only come from a broken or hostile peer.
MAX_INT64 = 2**63 - 1
NON_NEGATIVE = frozenset({"step", "generation", "nbytes", "capacity", "pid"})

_INT = int
_NUM = (int, float)

# type -> {field: expected python type(s)}; bool is rejected where int is expected.
CLIENT_MESSAGES: dict[str, dict[str, Any]] = {
    "hello": {
        "protocol": _INT,
        "job": str,
        "rank": _INT,
        "local_rank": _INT,
        "world_size": _INT,
        "local_world_size": _INT,
        "node": str,
        "pid": _INT,
    },
    "register": {"slot": _INT, "capacity": _INT},
    "persist": {
        "run": str,
        "step": _INT,
        "slot": _INT,
        "generation": _INT,
        "nbytes": _INT,
        "blocking_seconds": _NUM,
        "slot_wait_seconds": _NUM,
    },
    "query": {},
    "stage": {"step": _INT, "slot": _INT},
}

SIDECAR_MESSAGES: dict[str, dict[str, Any]] = {
    "welcome": {"protocol": _INT, "node": str, "busy": list, "shm_dir": str},
    "registered": {"slot": _INT},
    "released": {"slot": _INT, "step": _INT, "generation": _INT},
    "persisted": {"step": _INT},
    "committed": {"step": _INT},
    "failed": {"step": _INT, "slot": (int, type(None)), "reason": str},
    "inventory": {"committed": list, "memory": list, "other_world": list},
    "staged": {"step": _INT, "slot": _INT, "generation": _INT, "nbytes": _INT},
    "error": {"reason": str},
}


class MessageError(ValueError):
    """A decoded frame is not a valid message of the protocol."""


def validate(message: dict[str, Any], schema: dict[str, dict[str, Any]]) -> dict[str, Any]:
    kind = message.get("type")
    if kind not in schema:
        raise MessageError(f"unknown message type {kind!r}; expected one of {sorted(schema)}")
    for field, expected in schema[kind].items():
        if field not in message:
            raise MessageError(f"{kind} message lacks field {field!r}")
        value = message[field]
        if isinstance(value, bool) and bool not in _as_tuple(expected):
            raise MessageError(f"{kind}.{field} must be {_describe(expected)}, got a boolean")
        if not isinstance(value, expected):
            raise MessageError(f"{kind}.{field} must be {_describe(expected)}, got {type(value).__name__}")
        if field in NON_NEGATIVE and isinstance(value, int) and not 0 <= value <= MAX_INT64:
            raise MessageError(f"{kind}.{field} must be between 0 and {MAX_INT64}, got {value}")
    return message


def validate_hello(message: dict[str, Any]) -> dict[str, Any]:
    """Check what the schema cannot: version, names, and rank arithmetic."""
    if message["protocol"] != PROTOCOL_VERSION:
        raise MessageError(
            f"protocol version {message['protocol']} is not supported; this sidecar speaks "
            f"version {PROTOCOL_VERSION}: use the same Stowaway release for client and sidecar"
        )
    if not JOB_NAME.match(message["job"]):
        raise MessageError(
            f"job name {message['job']!r} is invalid: use 1-128 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit"
        )
    if not NODE_NAME.match(message["node"]):
        raise MessageError(f"node name {message['node']!r} is invalid")
    world, rank = message["world_size"], message["rank"]
    local_world, local_rank = message["local_world_size"], message["local_rank"]
    if not 1 <= world <= MAX_WORLD_SIZE or not 0 <= rank < world:
        raise MessageError(f"rank {rank} is not within world size {world}")
    if not 1 <= local_world <= world or not 0 <= local_rank < local_world:
        raise MessageError(f"local rank {local_rank} is not within local world size {local_world}")
    return message


def check_slot_index(slot: int) -> None:
    if not 0 <= slot < MAX_SLOTS_PER_RANK:
        raise MessageError(f"slot index {slot} is outside 0..{MAX_SLOTS_PER_RANK - 1}")


def _as_tuple(expected: Any) -> tuple[Any, ...]:
    return expected if isinstance(expected, tuple) else (expected,)


def _describe(expected: Any) -> str:
    return " or ".join(t.__name__ for t in _as_tuple(expected))
