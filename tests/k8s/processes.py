"""Child-process plumbing for the test control plane.

Every component runs in its own session (process group) so teardown can signal
the whole group, including anything it forked. Three layers make sure nothing
outlives the test run, because leaked etcd/apiserver processes hold ports and
CPU and poison the next run:

1. the fixtures stop processes in reverse start order (also after Ctrl-C, since
   pytest still runs session teardown on KeyboardInterrupt);
2. an ``atexit`` hook kills whatever is still registered;
3. on Linux the child asks the kernel for ``PR_SET_PDEATHSIG``/SIGKILL, so even a
   SIGKILL of pytest itself takes the children down.

Readiness is always polled against a real endpoint with a deadline; failures
raise :class:`StartupError` carrying the tail of the component's log.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import os
import signal
import socket
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path

_PR_SET_PDEATHSIG = 1
_RUNNING: set[ManagedProcess] = set()


class StartupError(RuntimeError):
    """A component did not become ready; the message says why and shows its log."""


def free_port() -> int:
    """A currently free TCP port on 127.0.0.1.

    Inherently racy (another process may grab it before our child binds it);
    callers retry the start when the log says the address is in use.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _die_with_parent() -> None:
    """``preexec_fn``: SIGKILL the child when the pytest process dies."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def log_tail(path: Path, lines: int = 40) -> str:
    """The last ``lines`` lines of a log file, for error messages."""
    try:
        text = path.read_text(errors="replace")
    except OSError as exc:
        return f"<no log: {exc}>"
    return "\n".join(text.splitlines()[-lines:])


class ManagedProcess:
    """One long-running component, its log file and its process group."""

    def __init__(self, name: str, argv: Sequence[str | Path], log_path: Path) -> None:
        self.name = name
        self.argv = [str(a) for a in argv]
        self.log_path = log_path
        self._proc: subprocess.Popen[bytes] | None = None

    def start(self, env: dict[str, str] | None = None) -> ManagedProcess:
        """Spawn the process with stdout/stderr appended to its log file."""
        with self.log_path.open("ab") as log:
            log.write(f"$ {' '.join(self.argv)}\n".encode())
            log.flush()
            self._proc = subprocess.Popen(
                self.argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=_die_with_parent,
                env=env,
            )
        _RUNNING.add(self)
        return self

    @property
    def pid(self) -> int | None:
        """Process id (also the process-group id), or None before start."""
        return self._proc.pid if self._proc else None

    def exited(self) -> int | None:
        """The exit status once the process has exited, else None."""
        return self._proc.poll() if self._proc else None

    def describe_failure(self, what: str) -> str:
        """Message for a failed start: what went wrong, exit status, log tail."""
        status = self.exited()
        state = "is still running" if status is None else f"exited with status {status}"
        return (
            f"{self.name} {what}; the process {state}.\n"
            f"--- last lines of {self.log_path} ---\n{log_tail(self.log_path)}"
        )

    def stop(self, grace: float = 10.0) -> None:
        """SIGTERM the process group, then SIGKILL it if it outlives ``grace``.

        A Ctrl-C while waiting escalates straight to SIGKILL before it
        propagates, so an impatient second interrupt never leaks the process.
        """
        proc = self._proc
        if proc is None:
            return
        try:
            self._signal(signal.SIGTERM)
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            pass
        finally:
            self.kill()

    def kill(self) -> None:
        """SIGKILL the whole process group and reap the leader."""
        proc = self._proc
        if proc is None:
            return
        _RUNNING.discard(self)
        # Even after the leader exited, stragglers of its group must go too.
        self._signal(signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=5.0)

    def _signal(self, sig: signal.Signals) -> None:
        if self._proc is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self._proc.pid, sig)

    def address_in_use(self) -> bool:
        """Whether the log says a port we picked was taken meanwhile."""
        return "address already in use" in log_tail(self.log_path, 200).lower()


@atexit.register
def _kill_leftovers() -> None:
    for proc in list(_RUNNING):
        proc.stop(grace=2.0)


def tls_context(ca: Path | None, client_cert: Path | None = None, client_key: Path | None = None) -> ssl.SSLContext:
    """Client TLS context trusting ``ca`` and presenting an optional client cert."""
    ctx = ssl.create_default_context(cafile=str(ca) if ca else None)
    if client_cert and client_key:
        ctx.load_cert_chain(str(client_cert), str(client_key))
    return ctx


def http_get(url: str, ctx: ssl.SSLContext, timeout: float = 2.0) -> tuple[int, str]:
    """GET ``url`` bypassing any proxy; returns (status, body) or raises OSError."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}), urllib.request.HTTPSHandler(context=ctx))
    try:
        with opener.open(url, timeout=timeout) as resp:
            return int(resp.status), resp.read().decode(errors="replace")
    except urllib.error.HTTPError as err:
        return int(err.code), err.read().decode(errors="replace")


def wait_until(
    proc: ManagedProcess,
    what: str,
    check: Callable[[], str | None],
    timeout: float,
    interval: float = 0.2,
) -> None:
    """Poll ``check`` until it returns None (ready) or the deadline passes.

    ``check`` returns a short description of why the component is not ready
    yet; the last one ends up in the error message. Fails fast when the
    process has exited.
    """
    deadline = time.monotonic() + timeout
    last = "not checked yet"
    while True:
        if proc.exited() is not None:
            raise StartupError(proc.describe_failure(f"died before {what} (last check: {last})"))
        try:
            result = check()
        except OSError as exc:  # connection refused, TLS not up yet, timeouts
            result = f"{type(exc).__name__}: {exc}"
        if result is None:
            return
        last = result
        if time.monotonic() >= deadline:
            raise StartupError(proc.describe_failure(f"not {what} within {timeout:.0f}s (last check: {last})"))
        time.sleep(interval)  # poll interval, not synchronisation


def wait_http_ok(proc: ManagedProcess, url: str, ctx: ssl.SSLContext, timeout: float, expect: str = "") -> None:
    """Wait until ``url`` answers 200 (and its body contains ``expect``)."""

    def check() -> str | None:
        status, body = http_get(url, ctx)
        if status == 200 and expect in body:
            return None
        return f"GET {url} -> {status} {body.strip()[-300:]}"

    wait_until(proc, f"ready ({url})", check, timeout)
