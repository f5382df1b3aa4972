"""Copy one slot's payload into its storage file, checksumming as it goes.

Two phases, so that the rank gets its slot back as early as possible:
``copy_out`` reads the slot (the rank must not write meanwhile) and returns;
the sidecar then releases the slot and calls ``make_durable`` (on a
directory: fdatasync, rename, directory fsync), which no longer reads shared
memory. A bucket stores the file whole inside ``copy_out`` (a multipart
upload completes only once every part is in), so there the slot stays the
sidecar's until the upload ends.

After copying, and before any of it can be made visible, the slot header is
read again: if the generation moved, some writer broke the ownership rule,
and the copy is thrown away rather than committed torn.
"""

from __future__ import annotations

import errno
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from stowaway.slots import header
from stowaway.slots.shm import SlotFile
from stowaway.storage import checksum, step_store


class PersistError(Exception):
    """A persist failed; ``kind`` is the metric label, the message is for the rank."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


class StepAbandoned(Exception):
    """The step failed while its persist ran, and has been counted and reported already; the persist stops."""


def classify(exc: OSError, path: Path | str) -> PersistError:
    kinds = {errno.ENOSPC: "storage_full", errno.EDQUOT: "storage_full", errno.EROFS: "storage_read_only"}
    kind = kinds.get(exc.errno or 0, "storage_io")
    hint = {
        "storage_full": "free space or raise the volume's size; earlier checkpoints are untouched",
        "storage_read_only": "the storage volume is mounted read-only; mount it read-write",
        "storage_io": "check the storage volume and the sidecar's log",
    }[kind]
    name = errno.errorcode.get(exc.errno or 0, "error")
    return PersistError(kind, f"storage error {name} ({exc.strerror}) writing {path}: {hint}")


class RateLimiter:
    """Caps the sidecar's write bandwidth so checkpoints do not starve shared storage."""

    def __init__(self, bytes_per_second: float) -> None:
        self._rate = bytes_per_second
        self._lock = threading.Lock()
        self._next_free = time.monotonic()

    def acquire(self, nbytes: int) -> None:
        if self._rate <= 0:
            return
        with self._lock:
            now = time.monotonic()
            start = max(now, self._next_free)
            self._next_free = start + nbytes / self._rate
            delay = self._next_free - now
        time.sleep(delay)


@dataclass
class Written:
    target: step_store.RankFileWrite
    nbytes: int
    digest: str
    pieces: checksum.Pieces


def check_slot(slot: SlotFile, step: int, generation: int, nbytes: int) -> None:
    slot.refresh()
    try:
        found = slot.read_header()
    except header.SlotHeaderError as exc:
        raise PersistError("slot_invalid", f"slot {slot.path} is unreadable: {exc}") from exc
    if not found.complete or found.step != step or found.generation != generation:
        raise PersistError(
            "slot_invalid",
            f"slot {slot.path} holds {found.state.name} step {found.step} generation {found.generation}, "
            f"but the persist names step {step} generation {generation}; the slot was not published "
            "completely: this is a client bug, please report it",
        )
    if found.payload_nbytes != nbytes or nbytes > slot.capacity:
        raise PersistError(
            "slot_invalid",
            f"slot {slot.path} holds {found.payload_nbytes} bytes (capacity {slot.capacity}), "
            f"the persist names {nbytes}",
        )


def copy_out(slot: SlotFile, step: int, generation: int, nbytes: int, target: step_store.RankFileWrite,
             limiter: RateLimiter, abandoned: Callable[[], str | None]) -> Written:
    """Write the slot's payload to ``target``; once this returns, the slot is no longer read.

    Before each chunk, ``abandoned`` says whether the step has failed
    meanwhile (on this node or another); the copy then stops, and what it
    wrote is removed.
    """
    check_slot(slot, step, generation, nbytes)

    def before_chunk(size: int) -> None:
        limiter.acquire(size)
        reason = abandoned()
        if reason is not None:
            raise StepAbandoned(f"stopped persisting step {step}: {reason}")

    def unchanged() -> None:
        after = slot.read_header()
        if not after.complete or after.generation != generation:
            raise PersistError(
                "slot_overwritten",
                f"slot {slot.path} changed while it was being persisted (generation {generation} -> "
                f"{after.generation}); the copy was discarded",
            )
    try:
        digest, pieces = target.write(slot.payload(), nbytes, before_chunk, unchanged)
    except OSError as exc:
        if exc.errno == errno.EFAULT:
            # The kernel could not read our own mapping: the slot file was truncated under it.
            raise PersistError(
                "slot_invalid",
                f"slot {slot.path} shrank while it was being persisted; the copy was discarded (some process "
                "truncated a slot the sidecar owned: this is a client bug, please report it)",
            ) from exc
        raise classify(exc, target.where) from exc
    except step_store.StoreError as exc:
        raise PersistError(exc.kind, str(exc)) from exc
    return Written(target, nbytes, digest, pieces)


def make_durable(written: Written) -> None:
    try:
        written.target.finish()
    except OSError as exc:
        raise classify(exc, written.target.where) from exc
    except step_store.StoreError as exc:
        raise PersistError(exc.kind, str(exc)) from exc
