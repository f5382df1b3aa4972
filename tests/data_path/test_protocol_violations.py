"""A sidecar that breaks the protocol makes the rank raise ``ProtocolError``: nothing it sends is dropped unread.

The sidecar here is a scripted peer on a real socket, so that it can send what
the real one never does.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from stowaway import Checkpointer, ProtocolError
from stowaway.protocol import frames


@contextmanager
def scripted_sidecar(path: Path, script: list[dict[str, Any]]) -> Iterator[Path]:
    """Accept one rank, read its hello, send ``script``, and hold the connection until the rank hangs up."""
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    server.listen(1)
    server.settimeout(30)
    heard: list[dict[str, Any]] = []

    def serve() -> None:
        connection, _ = server.accept()
        with connection:
            decoder = frames.FrameDecoder()
            while not heard and (data := connection.recv(65536)):
                heard.extend(decoder.feed(data))
            for message in script:
                connection.sendall(frames.encode(message))
            while connection.recv(65536):
                pass

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield path
    finally:
        thread.join(timeout=30)
        server.close()
    assert heard and heard[0]["type"] == "hello", heard
    assert not thread.is_alive(), "the rank never hung up"


def test_a_message_the_rank_has_no_handler_for_is_a_protocol_error(short_tmp):
    welcome = {"type": "welcome", "protocol": 1, "node": "n", "busy": [], "shm_dir": str(short_tmp)}
    broke = "the sidecar broke the protocol: .* no handler for welcome messages"
    # Raised by whichever call first waits after the second welcome arrives: the constructor's, or the load's.
    with scripted_sidecar(short_tmp / "s.sock", [welcome, welcome]) as path, \
            pytest.raises(ProtocolError, match=broke), \
            Checkpointer(job="j", socket=path, rank=0, world_size=1, timeout=10) as ckpt:
        ckpt.load()
