"""This rank's link to its sidecar: whether it is up, the answers awaited, and every bounded wait.

The connection's reader thread (``connection``) calls in here, takes the
shared lock, and hands each event to the listener (``answers``); the
training thread sends requests and waits on the same lock, never longer than
the timeout, and every wait ends in an error that names what it waited for.
A sidecar that broke the protocol, or refused this rank, ends every wait at
once with that reason.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from stowaway.client.connection import Connection
from stowaway.errors import ProtocolError, SidecarUnavailable, StowawayError
from stowaway.protocol import messages

log = logging.getLogger("stowaway")

# Which request an answer is for: the request's type and the slot it names (0 for a query).
AnswerKey = tuple[str, int]


class Listener(Protocol):
    """What the sidecar's messages do on this side; called with the shared lock held."""

    def welcomed(self, welcome: messages.Welcome) -> None: ...

    def lost(self, reason: str) -> None: ...

    def handle(self, message: messages.ToClient) -> None: ...


class Link:
    def __init__(self, socket_path: Path, hello: messages.Hello, timeout: float, lock: threading.Condition) -> None:
        self.socket_path = socket_path
        self.timeout = timeout
        self._rank, self._job = hello.rank, hello.job
        self._lock = lock
        self._listener: Listener | None = None
        self.connected = False
        # Connections lost so far: a request waits for its answer on the connection it was sent on, and the
        # reader may have reconnected by the time the waiting thread sees that one end.
        self._losses = 0
        # Why the sidecar refused this rank's last hello; cleared by a welcome.
        self._refusal: str | None = None
        self._violation: str | None = None
        self._answers: dict[AnswerKey, messages.ToClient] = {}
        # The descriptors of the last ``opened`` not yet taken by ``open_files``.
        self._opened_fds: list[int] = []
        self._connection = Connection(socket_path, hello, self._welcomed, self._message, self._lost, self._refused,
                                      self._opened)

    @property
    def last_error(self) -> str:
        return self._connection.last_error

    def open(self, listener: Listener) -> None:
        """Connect, and return once the sidecar has welcomed this rank; raise if it does not within the timeout."""
        self._listener = listener
        self._connection.start()
        try:
            self.wait_until(lambda: self.connected, "a connection to the sidecar", SidecarUnavailable)
        except StowawayError:
            self._connection.close()
            raise

    def send(self, message: messages.ToSidecar) -> bool:
        """Send on the current connection; False when there is none."""
        return self._connection.send(message)

    def request(self, answer: AnswerKey, message: messages.ToSidecar) -> messages.ToClient:
        """Send ``message`` and wait for the answer the listener files under ``answer``."""
        with self._lock:
            self._answers.pop(answer, None)
            if not self._connection.send(message):
                raise SidecarUnavailable(f"rank {self._rank}: cannot send {message.TYPE} to the sidecar: "
                                         f"{self._connection.last_error}")
            sent_after = self._losses
        self.wait_until(lambda: answer in self._answers or self._losses != sent_after,
                        f"the sidecar's answer to {message.TYPE}", SidecarUnavailable)
        with self._lock:
            if answer not in self._answers:
                raise SidecarUnavailable(f"rank {self._rank}: the sidecar went away before answering "
                                         f"{message.TYPE}: {self._connection.last_error}")
            return self._answers.pop(answer)

    def open_files(self, step: int, ranks: tuple[int, ...],
                   from_memory: bool = False) -> tuple[messages.Opened, list[int]]:
        """Ask the sidecar to open committed ``step``'s manifest and the files of ``ranks`` (or, ``from_memory``,
        the slots still holding them); the answer and its descriptors (the caller closes them), none when
        ``reason`` says why they could not be opened."""
        answer = self.request(("open", 0), messages.Open(step=step, ranks=ranks, from_memory=from_memory or None))
        assert isinstance(answer, messages.Opened)
        with self._lock:
            fds, self._opened_fds = self._opened_fds, []
        if answer.step != step or answer.ranks != ranks or len(fds) != answer.descriptors:
            for fd in fds:
                os.close(fd)
            raise ProtocolError(f"rank {self._rank}: the sidecar answered open of step {step} ranks {list(ranks)} "
                                f"with opened of step {answer.step} ranks {list(answer.ranks)}")
        return answer, fds

    def deliver(self, answer: AnswerKey, message: messages.ToClient) -> None:
        """File the answer to a request (reader thread, lock held); a stale one goes when the request is next made."""
        self._answers[answer] = message

    def wait_until(self, ready: Callable[[], bool], what: str | Callable[[], str],
                   error: type[StowawayError]) -> None:
        """Wait for ``ready`` (checked with the lock held), at most the timeout; ``error`` names ``what`` if not."""
        with self._lock:
            ok = self._lock.wait_for(
                lambda: ready() or self._violation is not None or self._refusal is not None, self.timeout
            )
            if self._violation is not None:
                raise ProtocolError(self._violation)
            if self._refusal is not None and not ready():
                raise SidecarUnavailable(f"rank {self._rank} of job {self._job}: the sidecar at {self.socket_path} "
                                         f"refused this rank ({self._refusal})")
            if not ok:
                described = what() if callable(what) else what
                raise error(f"rank {self._rank} of job {self._job}: waited {self.timeout:.0f} s for {described} "
                            f"(socket {self.socket_path}; last connection problem: {self._connection.last_error})")

    def wait_quietly(self, done: Callable[[], bool]) -> None:
        """Wait, at most the timeout, for ``done`` or the end of the connection; raise nothing (for closing)."""
        with self._lock:
            self._lock.wait_for(lambda: done() or not self.connected, self.timeout)

    def close(self) -> None:
        self._connection.close()

    def _welcomed(self, welcome: messages.Welcome) -> None:
        with self._lock:
            try:
                self._require_listener().welcomed(welcome)
            except ProtocolError as exc:
                self._violated(exc)
            self.connected = True
            self._refusal = None
            self._lock.notify_all()

    def _refused(self, reason: str) -> None:
        with self._lock:
            self._refusal = reason
            self._lock.notify_all()

    def _lost(self, reason: str) -> None:
        with self._lock:
            self.connected = False
            self._losses += 1
            self._require_listener().lost(reason)
            self._lock.notify_all()

    def _message(self, message: messages.ToClient) -> None:
        with self._lock:
            try:
                self._require_listener().handle(message)
            except (ProtocolError, messages.MessageError) as exc:
                self._violated(exc)
            self._lock.notify_all()

    def _opened(self, message: messages.Opened, fds: list[int]) -> None:
        with self._lock:
            # One open is asked at a time; the descriptors of an answer nobody took any more are closed.
            for stale in self._opened_fds:
                os.close(stale)
            self._opened_fds = fds
            self.deliver(("open", 0), message)
            self._lock.notify_all()

    def _violated(self, exc: Exception) -> None:
        self._violation = f"rank {self._rank}: the sidecar broke the protocol: {exc}"
        log.error(self._violation)

    def _require_listener(self) -> Listener:
        assert self._listener is not None, "the connection starts only in open(), after the listener is set"
        return self._listener
