"""This rank's own socket to its sidecar.

One reader thread per rank reads every answer addressed to this rank and
hands it to the checkpointer; nothing else reads this socket, and no other
rank's answers travel on it. When the sidecar goes away the thread reports
the loss and reconnects with backoff, so a restarted sidecar is picked up
without the training loop noticing more than the failed saves in between.
A sidecar that refuses the hello (another uid, another protocol version)
would refuse it again: that is reported at once, not retried silently.
Descriptors the sidecar passes (``SCM_RIGHTS``) arrive with the first byte
of the ``opened`` frame they belong to; they are queued as received and
handed over with that frame (``on_opened``).
"""

from __future__ import annotations

import errno
import logging
import os
import socket
import threading
from collections import deque
from collections.abc import Callable
from pathlib import Path

from stowaway.protocol import frames, messages

log = logging.getLogger("stowaway")

# The messages this module acts on itself; every other message goes to ``on_message``.
HANDLED_HERE: frozenset[type[messages.ToClient]] = frozenset({messages.Welcome, messages.Error, messages.Opened})
RECV_BYTES = 64 * 1024
_FIRST_BACKOFF = 0.02
_MAX_BACKOFF = 1.0


class Connection:
    def __init__(
        self,
        path: Path,
        hello: messages.Hello,
        on_connected: Callable[[messages.Welcome], None],
        on_message: Callable[[messages.ToClient], None],
        on_lost: Callable[[str], None],
        on_refused: Callable[[str], None],
        on_opened: Callable[[messages.Opened, list[int]], None],
    ) -> None:
        self._path = path
        self._hello = hello
        self._on_connected = on_connected
        self._on_message = on_message
        self._on_lost = on_lost
        self._on_refused = on_refused
        self._on_opened = on_opened
        self._sock: socket.socket | None = None
        self._send_lock = threading.Lock()
        self._closed = threading.Event()
        self.last_error = "not connected yet"
        self._thread = threading.Thread(target=self._run, name=f"stowaway-rank{hello.rank}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def send(self, message: messages.ToSidecar) -> bool:
        """Send on the current socket; False when there is none (the caller waits for a reconnect)."""
        data = frames.encode(messages.encode(message))
        with self._send_lock:
            if self._sock is None:
                return False
            try:
                self._sock.sendall(data)
            except OSError as exc:
                self.last_error = f"send failed: {exc}"
                return False
        return True

    def close(self) -> None:
        self._closed.set()
        with self._send_lock:
            if self._sock is not None:
                self._sock.shutdown(socket.SHUT_RDWR)
        self._thread.join(timeout=5)

    def _run(self) -> None:
        backoff = _FIRST_BACKOFF
        while not self._closed.is_set():
            sock = self._connect()
            if sock is not None:
                reason, welcomed = self._serve(sock)
                with self._send_lock:
                    self._sock = None
                sock.close()
                self.last_error = reason
                # After a served connection, try again at once (the sidecar restarted); after one that was
                # never welcomed, back off like after a failed connect, or a refusing sidecar is hammered.
                if welcomed:
                    backoff = _FIRST_BACKOFF
                    if not self._closed.is_set():
                        self._on_lost(reason)
                    continue
            self._closed.wait(backoff)
            backoff = min(backoff * 2, _MAX_BACKOFF)

    def _connect(self) -> socket.socket | None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(str(self._path))
        except OSError as exc:
            sock.close()
            problem = f"cannot connect to the sidecar at {self._path}: {exc.strerror or exc}"
            if exc.errno == errno.EACCES:
                # Retried, as any failed connect is, but said at once: it lasts until the rank runs differently.
                problem += (f" (uid {os.getuid()} may not open the socket: run the rank in the socket's group, "
                            "in Kubernetes the pod's fsGroup, or as the sidecar's user)")
                if problem != self.last_error:
                    log.warning("rank %d: %s; retrying", self._hello.rank, problem)
            self.last_error = problem
            return None
        return sock

    def _serve(self, sock: socket.socket) -> tuple[str, bool]:
        """Say hello and dispatch answers until the connection ends; returns why, and whether it was welcomed."""
        decoder = frames.FrameDecoder()
        welcomed = False
        unsent: str | None = None
        passed: deque[int] = deque()
        try:
            sock.sendall(frames.encode(messages.encode(self._hello)))
        except OSError as exc:
            # A sidecar that refuses a peer answers and closes before reading the hello: its reason is still
            # waiting in the socket, and says more than the broken pipe.
            unsent = f"connection to the sidecar failed: {exc}"
        try:
            while data := self._received(sock, passed):
                for frame in decoder.feed(data):
                    message = messages.decode(frame, messages.Direction.TO_CLIENT)
                    if isinstance(message, messages.Error):
                        reason = f"the sidecar closed the connection: {message.reason}"
                        if not welcomed:
                            self._on_refused(reason)
                        return reason, welcomed
                    if not welcomed:
                        if not isinstance(message, messages.Welcome):
                            return f"the sidecar sent {message.TYPE} before welcome", welcomed
                        with self._send_lock:
                            self._sock = sock
                        welcomed = True
                        self._on_connected(message)
                    elif isinstance(message, messages.Opened):
                        if len(passed) < message.descriptors:
                            return (f"the sidecar sent opened for step {message.step} with {len(passed)} "
                                    f"descriptors, where it names {message.descriptors}"), welcomed
                        self._on_opened(message, [passed.popleft() for _ in range(message.descriptors)])
                    else:
                        self._on_message(message)
        except (frames.FrameError, messages.MessageError) as exc:
            return f"the sidecar sent an invalid frame: {exc}", welcomed
        except OSError as exc:
            return f"connection to the sidecar failed: {exc}", welcomed
        finally:
            for fd in passed:
                os.close(fd)
        return unsent or "the sidecar closed the connection", welcomed

    @staticmethod
    def _received(sock: socket.socket, passed: deque[int]) -> bytes:
        """The next bytes of the stream; the descriptors that came with them join ``passed``."""
        data, fds, flags, _ = socket.recv_fds(sock, RECV_BYTES, messages.MAX_FILES_PER_OPEN + 1)
        passed.extend(fds)
        if flags & socket.MSG_CTRUNC:
            raise OSError(errno.EPROTO, "descriptors passed by the sidecar were cut off (more than one opened holds)")
        return data
