"""Who may write a pooled spare: an open-file-description lock on its file, which the kernel ends with its holder.

A pooled spare is shared by the pod's ranks, so, unlike a rank's own slot,
no single process can say it is free. The lock says it: a rank writes a
spare only while it holds the write lock, so two ranks never write one at
once; when it hands the spare over (``persist``) it turns that into a read
lock, and the sidecar takes a read lock of its own for as long as it reads
the spare, so no rank can take it for writing meanwhile; each lets go once
its part is done (the sidecar's ``released``). A process that dies, however
it dies, holds nothing any more, so a spare is never lost to a crashed
rank, and a restarted sidecar needs no memory of who borrowed what.

Open-file-description locks (Linux 3.15), not ``flock`` or POSIX record
locks: POSIX locks drop when the process closes any descriptor of the file
(the sidecar opens a spare once per rank that writes it), and all three
work across the containers of a pod, which share the tmpfs inode. A child
forked while a lock is held (a data loader's worker) shares the open file
description, so the spare stays taken until that child exits too: slower
to come back, never lent twice.
"""

from __future__ import annotations

import errno
import fcntl
import os
import struct

# struct flock: l_type, l_whence, l_start, l_len (0: to the end of the file), l_pid (0 for these locks).
_FLOCK = struct.Struct("hhqqi4x")


def try_lock(fd: int, exclusive: bool) -> bool:
    """Take (or turn the held lock into) a write or read lock on the whole file; False if another holder has one."""
    return _set(fd, fcntl.F_WRLCK if exclusive else fcntl.F_RDLCK)


def unlock(fd: int) -> None:
    _set(fd, fcntl.F_UNLCK)


def _set(fd: int, kind: int) -> bool:
    try:
        fcntl.fcntl(fd, fcntl.F_OFD_SETLK, _FLOCK.pack(kind, os.SEEK_SET, 0, 0, 0))
    except OSError as exc:
        if exc.errno in (errno.EAGAIN, errno.EACCES):
            return False
        raise
    return True
