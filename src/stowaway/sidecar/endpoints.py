"""``/metrics``, ``/healthz`` and ``/readyz`` over a minimal HTTP/1.1 server.

Served from the sidecar's own event loop rather than a thread: an answer to
``/healthz`` then proves the loop is responsive, and a scrape reads the rank
registry on the thread that changes it. Each connection gets one answer and is
closed; requests are small, and a client that sends nothing is dropped after a
timeout, so a stuck scraper cannot pile up connections.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable

REQUEST_TIMEOUT = 10.0
MAX_HEAD_BYTES = 16 * 1024
_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed", 503: "Service Unavailable"}
_TEXT = "text/plain; charset=utf-8"

Metrics = Callable[[], tuple[bytes, str]]
Readiness = Callable[[], Awaitable[str | None]]


class Endpoints:
    """The HTTP side of one sidecar; ``readiness`` returns why it is not ready, or None."""

    def __init__(self, metrics: Metrics, readiness: Readiness) -> None:
        self._metrics = metrics
        self._readiness = readiness

    async def start(self, address: str, port: int) -> asyncio.base_events.Server:
        return await asyncio.start_server(self._serve, address, port, limit=MAX_HEAD_BYTES)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), REQUEST_TIMEOUT)
            method, path = _request_line(head)
            status, body, content_type = await self._answer(method, path)
            writer.write(_response(status, b"" if method == "HEAD" else body, content_type, len(body)))
            await asyncio.wait_for(writer.drain(), REQUEST_TIMEOUT)
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError, ConnectionError):
            pass
        except ValueError as exc:
            writer.write(_response(400, f"{exc}\n".encode(), _TEXT))
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()

    async def _answer(self, method: str, path: str) -> tuple[int, bytes, str]:
        if path not in ("/metrics", "/healthz", "/readyz"):
            return 404, b"not found: try /metrics, /healthz or /readyz\n", _TEXT
        if method not in ("GET", "HEAD"):
            return 405, f"{method} not allowed: use GET\n".encode(), _TEXT
        if path == "/metrics":
            body, content_type = self._metrics()
            return 200, body, content_type
        if path == "/healthz":
            return 200, b"ok\n", _TEXT
        problem = await self._readiness()
        if problem is not None:
            return 503, f"not ready: {problem}\n".encode(), _TEXT
        return 200, b"ready\n", _TEXT


def _request_line(head: bytes) -> tuple[str, str]:
    parts = head.split(b"\r\n", 1)[0].decode("latin-1").split(" ")
    if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
        raise ValueError("malformed request line")
    method, target, _ = parts
    return method, target.split("?", 1)[0]


def _response(status: int, body: bytes, content_type: str, length: int | None = None) -> bytes:
    head = (
        f"HTTP/1.1 {status} {_REASONS[status]}\r\nContent-Type: {content_type}\r\n"
        f"Content-Length: {len(body) if length is None else length}\r\nConnection: close\r\n\r\n"
    )
    return head.encode("latin-1") + body
