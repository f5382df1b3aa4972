"""Talking raw frames to a live sidecar, as a broken or hostile peer would."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any

from stowaway.protocol import frames

ANSWER_TIMEOUT = 10.0


def exchange(path: Path, data: bytes) -> list[dict[str, Any]]:
    """Send ``data``, hang up our side, and return every frame the sidecar sent until it closed.

    The socket timeout turns a sidecar that never answers or never closes into a test failure.
    """
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(ANSWER_TIMEOUT)
        sock.connect(str(path))
        try:
            sock.sendall(data)
            sock.shutdown(socket.SHUT_WR)
        except (BrokenPipeError, ConnectionResetError):
            pass  # it closed on an early error: the answer is still there to read
        decoder = frames.FrameDecoder()
        received: list[dict[str, Any]] = []
        try:
            while chunk := sock.recv(65536):
                received.extend(decoder.feed(chunk))
        except ConnectionResetError:
            pass
        assert decoder.pending_bytes == 0, "the sidecar sent a truncated frame"
        return received
