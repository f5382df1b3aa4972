"""What the commit's unit tests run on: a clock moved by hand, and sidecars ("nodes") reduced to their commit.

Each node is a real ``Committer`` with a real rank registry, real stats and
real files in a shared temporary storage directory; only the ranks' socket
connections are replaced by a recorder of what the committer tells them, and
time moves only when a test moves it.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import heapq
import itertools
import os
import struct
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple, TypeVar, cast

import pytest

from stowaway.protocol import messages
from stowaway.sidecar.commit import coordinator
from stowaway.sidecar.config import SidecarConfig
from stowaway.sidecar.ranks import Registry
from stowaway.sidecar.stats import Stats
from stowaway.storage import checksum, durable, layout, manifest
from stowaway.storage.directory_store import DirectoryStore

if TYPE_CHECKING:
    from stowaway.sidecar.session import Session

T = TypeVar("T")
# Far above what any test waits for in real time; only reached when a test is broken.
REAL_TIMEOUT = 10.0


@dataclass(order=True)
class _Due:
    deadline: float
    order: int
    fire: Callable[[], None] = field(compare=False)
    wakes_a_sleep: bool = field(default=False, compare=False)
    cancelled: bool = field(default=False, compare=False)

    def cancel(self) -> None:
        self.cancelled = True


class FakeClock:
    """Time that moves only when a test moves it: ``advance`` by hand, or ``run_until`` an outcome.

    ``advance`` sets the time and then fires, in order of their deadlines,
    every timer and wakes every sleep that is due by then.
    """

    def __init__(self, start: float = 1000.0, unix_offset: float = 1_750_000_000.0) -> None:
        self._now = start
        self._unix_offset = unix_offset
        self._due: list[_Due] = []
        self._order = itertools.count()
        self._fell_asleep = asyncio.Event()

    def monotonic(self) -> float:
        return self._now

    def wall(self) -> float:
        return self._now + self._unix_offset

    def call_later(self, delay: float, callback: Callable[[], None]) -> _Due:
        return self._schedule(delay, callback, wakes_a_sleep=False)

    async def sleep(self, seconds: float) -> None:
        woken: asyncio.Future[None] = asyncio.get_running_loop().create_future()

        def wake() -> None:
            if not woken.done():
                woken.set_result(None)

        due = self._schedule(seconds, wake, wakes_a_sleep=True)
        self._fell_asleep.set()
        try:
            await woken
        finally:
            due.cancel()

    def advance(self, seconds: float) -> None:
        self._now += seconds
        while self._due and self._due[0].deadline <= self._now:
            due = heapq.heappop(self._due)
            if not due.cancelled:
                due.cancelled = True
                due.fire()

    async def run_until(self, outcome: Awaitable[T]) -> T:
        """Await ``outcome``; whenever some task sleeps on this clock, move time on to the next deadline.

        Timers (``call_later``) fire once time passes them, in order with the
        sleeps: a commit timeout is reached only after the polls before it.
        """
        result = asyncio.ensure_future(outcome)
        async with asyncio.timeout(REAL_TIMEOUT):
            while not result.done():
                fell_asleep = asyncio.ensure_future(self._fell_asleep.wait())
                await asyncio.wait({result, fell_asleep}, return_when=asyncio.FIRST_COMPLETED)
                fell_asleep.cancel()
                await asyncio.wait({fell_asleep})
                self._fell_asleep.clear()
                if not result.done() and self._asleep():
                    self.advance(min(due.deadline for due in self._due if not due.cancelled) - self._now)
                    if self._asleep():
                        # Still asleep after this deadline, and maybe nobody else will fall asleep to tell.
                        self._fell_asleep.set()
        return result.result()

    async def until_asleep(self, count: int) -> None:
        """Return once ``count`` tasks sleep on this clock, none of which wakes before the clock moves."""
        async with asyncio.timeout(REAL_TIMEOUT):
            while self._sleeping() < count:
                self._fell_asleep.clear()
                await self._fell_asleep.wait()

    def _asleep(self) -> bool:
        return self._sleeping() > 0

    def _sleeping(self) -> int:
        return sum(1 for due in self._due if due.wakes_a_sleep and not due.cancelled)

    def _schedule(self, delay: float, callback: Callable[[], None], *, wakes_a_sleep: bool) -> _Due:
        due = _Due(self._now + delay, next(self._order), callback, wakes_a_sleep)
        heapq.heappush(self._due, due)
        return due


class Answer(NamedTuple):
    """What a rank heard about a step: ``committed`` or ``failed``, and why."""

    kind: str
    step: int
    reason: str | None


class RankConnection:
    """The rank's end of its socket, as far as the commit is concerned: the answers sent to it, in order."""

    def __init__(self) -> None:
        self._answers: asyncio.Queue[Answer] = asyncio.Queue()

    def send(self, message: messages.ToClient) -> None:
        assert isinstance(message, messages.Committed | messages.Failed), f"the commit sent {message!r}"
        reason = message.reason if isinstance(message, messages.Failed) else None
        self._answers.put_nowait(Answer(message.TYPE, message.step, reason))

    async def answer(self) -> Answer:
        return await asyncio.wait_for(self._answers.get(), REAL_TIMEOUT)

    def unanswered(self) -> bool:
        return self._answers.empty()


class Node:
    """One sidecar's commit side, on ``storage`` shared with the other nodes of the test."""

    def __init__(self, storage: Path, name: str, clock: FakeClock, *, commit_timeout: float = 600.0,
                 poll_interval: float = 0.2, keep_last: int = 3) -> None:
        self.storage = storage
        self.config = SidecarConfig(
            storage=storage, socket_path=Path("unused.sock"), shm_dir=storage / "unused-shm", node=name,
            commit_timeout=commit_timeout, commit_poll_interval=poll_interval, keep_last=keep_last,
        )
        self.registry = Registry()
        self.stats = Stats()
        self.committer = coordinator.Committer(self.config, self.registry, self.stats, DirectoryStore(storage), clock)

    def connect(self, job: str, rank: int, world_size: int, local_world_size: int) -> RankConnection:
        connection = RankConnection()
        hello = messages.Hello(protocol=messages.PROTOCOL_VERSION, job=job, rank=rank,
                               local_rank=rank % local_world_size, world_size=world_size,
                               local_world_size=local_world_size, node="test", pid=os.getpid())
        # The committer only ever calls ``send`` on a rank's connection.
        self.registry.attach(cast("Session", connection), hello)
        return connection

    def hand_over(self, job: str, run: str, step: int, rank: int, world_size: int,
                  local_world_size: int) -> str | None:
        """A rank's ``persist`` of ``step`` reaching the committer, as the pipeline hands it over (the storage's
        verdict first): None when admitted, else why not."""
        refusal = self.committer.stored_refusal(job, run, step, world_size, local_world_size)
        return refusal if refusal is not None else self.committer.admit(job, run, step, rank, world_size,
                                                                        local_world_size)

    async def persist(self, job: str, step: int, rank: int, world_size: int) -> None:
        """Write the rank's file durably, as the persister would, and report it."""
        step_path = self.step_path(job, step)
        await asyncio.to_thread(durable.make_dirs, step_path)
        data = f"rank {rank} of step {step}".encode()
        name = layout.rank_file_name(rank, world_size)
        await asyncio.to_thread(durable.write_atomic, step_path / name, data)
        await self.committer.durable(job, step, manifest.FileEntry(rank, name, len(data), checksum.of_bytes(data)))

    def step_path(self, job: str, step: int) -> Path:
        return layout.step_dir(layout.job_dir(self.storage, job), step)

    def failures(self) -> dict[str, int]:
        counted = self.stats.summary()["failures"]
        assert isinstance(counted, dict)
        return counted


async def background_work_done() -> None:
    """Wait for every other task of the loop: what a commit goes on doing after the ranks heard of it."""
    others = asyncio.all_tasks() - {asyncio.current_task()}
    async with asyncio.timeout(REAL_TIMEOUT):
        await asyncio.gather(*others)


# The Linux ioctls that read and set a file's attribute flags, and the flag that forbids changing a directory's
# entries even to root (``chattr +i``).
_FS_IOC_GETFLAGS = 0x80086601
_FS_IOC_SETFLAGS = 0x40086602
_FS_IMMUTABLE_FL = 0x10


@contextlib.contextmanager
def refusing_deletes(directory: Path) -> Iterator[None]:
    """Make deleting anything in ``directory`` fail, as a storage that refuses deletes would.

    Permissions do not stop root, so as root the directory is made immutable,
    where its filesystem allows; elsewhere the test is skipped and says why.
    """
    if os.geteuid() != 0:
        mode = directory.stat().st_mode
        directory.chmod(0o555)
        try:
            yield
        finally:
            directory.chmod(mode)
        return
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        try:
            flags = struct.unpack("i", fcntl.ioctl(fd, _FS_IOC_GETFLAGS, struct.pack("i", 0)))[0]
            fcntl.ioctl(fd, _FS_IOC_SETFLAGS, struct.pack("i", flags | _FS_IMMUTABLE_FL))
        except OSError as exc:
            pytest.skip(f"running as root, and the filesystem of {directory} cannot make it immutable "
                        f"({exc.strerror}), so nothing makes a delete fail")
        try:
            yield
        finally:
            fcntl.ioctl(fd, _FS_IOC_SETFLAGS, struct.pack("i", flags))
    finally:
        os.close(fd)
