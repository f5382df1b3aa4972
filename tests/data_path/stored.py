"""Reading a committed step back with the safetensors library, not with the code under test."""

from __future__ import annotations

from pathlib import Path

from safetensors import safe_open


def rank_files(step_path: Path, world_size: int) -> list[dict]:
    """Each rank's file of a step: its ``__metadata__`` and its tensors by name."""
    files = []
    for rank in range(world_size):
        with safe_open(step_path / f"rank-{rank:05d}-of-{world_size:05d}.safetensors", "pt") as handle:
            names = handle.keys()  # a safe_open handle is not iterable
            files.append({"metadata": handle.metadata(), "tensors": {name: handle.get_tensor(name) for name in names}})
    return files
