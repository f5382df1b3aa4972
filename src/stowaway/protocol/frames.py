"""Length-prefixed JSON frames.

A frame is a 4-byte big-endian payload length followed by that many bytes of
UTF-8 JSON holding one object. JSON (never pickle) keeps a hostile or buggy
peer from executing anything in the sidecar; the hard size limit keeps it from
making the sidecar allocate without bound.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from typing import Any, NoReturn

MAX_FRAME_BYTES = 64 * 1024
_LENGTH = struct.Struct(">I")


class FrameError(ValueError):
    """The byte stream cannot be decoded; the connection must be closed."""


def encode(message: dict[str, Any]) -> bytes:
    """Serialise one message into a frame."""
    payload = json.dumps(message, separators=(",", ":"), allow_nan=False).encode()
    if len(payload) > MAX_FRAME_BYTES:
        raise FrameError(f"message of {len(payload)} bytes exceeds the {MAX_FRAME_BYTES}-byte frame limit")
    return _LENGTH.pack(len(payload)) + payload


class FrameDecoder:
    """Incremental decoder: feed it any chunking of the stream, get whole messages.

    After the first ``FrameError`` the stream has lost framing, so the decoder
    refuses further input instead of guessing where the next frame starts.
    """

    def __init__(self, max_frame_bytes: int = MAX_FRAME_BYTES) -> None:
        self._buffer = bytearray()
        self._max = max_frame_bytes
        self._broken: FrameError | None = None

    @property
    def pending_bytes(self) -> int:
        """Bytes received that do not yet form a whole frame (non-zero at EOF means truncation)."""
        return len(self._buffer)

    def feed(self, data: bytes) -> Iterator[dict[str, Any]]:
        if self._broken is not None:
            raise self._broken
        self._buffer += data
        while len(self._buffer) >= _LENGTH.size:
            (length,) = _LENGTH.unpack_from(self._buffer)
            if length > self._max:
                self._fail(f"frame of {length} bytes exceeds the {self._max}-byte limit")
            if len(self._buffer) < _LENGTH.size + length:
                return
            payload = bytes(self._buffer[_LENGTH.size : _LENGTH.size + length])
            del self._buffer[: _LENGTH.size + length]
            yield self._parse(payload)

    def _parse(self, payload: bytes) -> dict[str, Any]:
        try:
            message: object = json.loads(payload.decode("utf-8"), parse_constant=_refuse_constant)
        except (ValueError, RecursionError) as exc:
            # ValueError covers bad UTF-8, bad JSON, NaN/Infinity, and integers longer than Python's
            # 4300-digit conversion limit, which json raises as a plain ValueError.
            self._fail(f"frame is not UTF-8 JSON: {exc}")
        if not isinstance(message, dict):
            self._fail(f"frame holds a JSON {type(message).__name__}, expected an object")
        return message

    def _fail(self, reason: str) -> NoReturn:
        self._broken = FrameError(reason)
        raise self._broken


def _refuse_constant(name: str) -> None:
    """NaN and Infinity are not JSON (RFC 8259); ``encode`` never sends them, so nobody honest does."""
    raise ValueError(f"{name} is not a JSON value")
