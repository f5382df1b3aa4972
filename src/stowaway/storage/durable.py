"""Crash-safe file writes: temp name, fdatasync, rename, directory fsync.

The directory fsync is what makes a rename survive power loss; the
best-known peers skip it, and so lose "committed" checkpoints on a crash.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

from stowaway.storage.layout import TMP_SUFFIX

FILE_MODE = 0o640


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def make_dirs(path: Path) -> None:
    """Create a directory and fsync each new parent, so the directory itself is durable."""
    missing = []
    current = path
    while not current.exists():
        missing.append(current)
        current = current.parent
    for directory in reversed(missing):
        try:
            directory.mkdir(mode=0o750)
        except FileExistsError:
            continue
        fsync_dir(directory.parent)


def publish(fd: int, tmp: Path, final: Path) -> None:
    """Make a fully written temp file durable under its final name; always closes ``fd``.

    On failure the temp file is removed, so a half-published file never lingers.
    """
    try:
        os.fdatasync(fd)
        # Dirty pages count against the pod's memory limit; drop them once they are on disk.
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    except BaseException:
        os.close(fd)
        tmp.unlink(missing_ok=True)
        raise
    os.close(fd)
    try:
        os.replace(tmp, final)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(final.parent)


def write_atomic(path: Path, data: bytes) -> None:
    # Unique per writer: two threads or two nodes may write the same name at once.
    tmp = path.with_name(f"{path.name}.{os.getpid()}-{threading.get_ident()}{TMP_SUFFIX}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, FILE_MODE)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
    except BaseException:
        os.close(fd)
        tmp.unlink(missing_ok=True)
        raise
    publish(fd, tmp, path)
