"""Small real tmpfs mounts, for a storage that fills up or a /dev/shm that is too small."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest


@contextmanager
def tmpfs(path: Path, size: str) -> Iterator[Path]:
    path.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0770", "tmpfs", str(path)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"needs permission to mount a {size} tmpfs (run as root): {mounted.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=True)
