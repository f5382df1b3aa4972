"""A real ext4 filesystem on a loop device, and the kernel's own way to make it fail with EIO.

``EXT4_IOC_SHUTDOWN`` is what xfstests' ``godown`` uses: from that moment every
read and write on the filesystem returns EIO, and with ``NOLOGFLUSH`` the
journal is not flushed, so what survives a remount is exactly what was made
durable before, as after a power cut.
"""

from __future__ import annotations

import fcntl
import os
import struct
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

EXT4_IOC_SHUTDOWN = 0x8004587D  # _IOR('X', 125, __u32)
EXT4_GOING_FLAGS_NOLOGFLUSH = 2


@contextmanager
def ext4_volume(image: Path, mount_point: Path, size: str = "64M") -> Iterator[Path]:
    subprocess.run(["truncate", "-s", size, str(image)], check=True)
    made = subprocess.run(["mkfs.ext4", "-q", "-F", str(image)], capture_output=True, text=True)
    if made.returncode != 0:
        pytest.skip(f"needs mkfs.ext4 to make a test filesystem: {made.stderr.strip()}")
    mount_point.mkdir(parents=True, exist_ok=True)
    mount(image, mount_point)
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], capture_output=True)


def mount(image: Path, mount_point: Path) -> None:
    mounted = subprocess.run(["mount", "-o", "loop", str(image), str(mount_point)], capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"needs permission to mount a loop device (run as root): {mounted.stderr.strip()}")


def remount(image: Path, mount_point: Path) -> None:
    """Unmount and mount again: the journal is replayed, as on the next boot."""
    subprocess.run(["umount", str(mount_point)], check=True)
    mount(image, mount_point)


def shut_down(mount_point: Path) -> None:
    """From now on every I/O on this filesystem fails with EIO; nothing not yet durable survives."""
    fd = os.open(mount_point, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.ioctl(fd, EXT4_IOC_SHUTDOWN, struct.pack("I", EXT4_GOING_FLAGS_NOLOGFLUSH))
    finally:
        os.close(fd)
