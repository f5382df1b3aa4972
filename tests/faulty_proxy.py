"""An HTTP proxy in front of the S3 server that fails chosen requests once, to show that single parts are retried.

It forwards each request as it came (the Host header too, so the client's
signature still holds) and answers ``500`` instead, once, for the first
request whose method and query match a rule.
"""

from __future__ import annotations

import http.client
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit


class FaultyProxy:
    def __init__(self, upstream: str, method: str, query_has: str) -> None:
        target = urlsplit(upstream)
        self.upstream = (target.hostname or "127.0.0.1", target.port or 80)
        self.rule = (method, query_has)
        self.failed: list[str] = []
        self.forwarded: list[str] = []
        self._lock = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *_args: object) -> None:
                pass

            def _handle(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                line = f"{self.command} {self.path}"
                with proxy._lock:
                    fail = (not proxy.failed and self.command == proxy.rule[0] and proxy.rule[1] in self.path)
                    (proxy.failed if fail else proxy.forwarded).append(line)
                if fail:
                    message = b"<Error><Code>InternalError</Code><Message>injected</Message></Error>"
                    self.send_response(500)
                    self.send_header("Content-Length", str(len(message)))
                    self.end_headers()
                    self.wfile.write(message)
                    return
                connection = http.client.HTTPConnection(*proxy.upstream, timeout=60)
                connection.request(self.command, self.path, body=body, headers=dict(self.headers.items()))
                answer = connection.getresponse()
                data = answer.read()
                self.send_response(answer.status, answer.reason)
                for name, value in answer.getheaders():
                    if name.lower() not in ("content-length", "transfer-encoding", "connection"):
                        self.send_header(name, value)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
                connection.close()

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}"

    @contextmanager
    def running(self) -> Iterator[FaultyProxy]:
        thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        thread.start()
        try:
            yield self
        finally:
            self._server.shutdown()
            self._server.server_close()
