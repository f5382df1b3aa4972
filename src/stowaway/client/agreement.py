"""Making every rank of a job restore the same step.

When a process group is initialised, ranks exchange what they can restore and
whether their restore worked; without one, a rank decides alone (correct for
one rank, and for ranks that only ever restore committed steps from one
shared storage).

Ranks nearly always agree, and an object exchange (``all_gather_object``:
pickling, two collectives) costs many times a one-tensor ``all_reduce``. So
each question is first asked with an ``all_reduce``; the full exchange runs
only when that shows a difference.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch
import torch.distributed as dist


def active(world_size: int) -> bool:
    return world_size > 1 and dist.is_available() and dist.is_initialized() and dist.get_world_size() == world_size


def _gather(value: Any, world_size: int) -> list[Any]:
    gathered: list[Any] = [None] * world_size
    dist.all_gather_object(gathered, value)
    return gathered


def _tensor_device() -> torch.device | None:
    """Where the default group can reduce a small tensor; None for backends this module does not know,
    which then always take the object exchange."""
    backend = str(dist.get_backend())
    if backend == "gloo" or "cpu:" in backend:
        return torch.device("cpu")
    if backend == "nccl":
        # Where all_gather_object would put its tensors too.
        return torch.device("cuda", torch.cuda.current_device())
    return None


def _reduced(values: list[int], op: Any) -> list[int] | None:
    device = _tensor_device()
    if device is None:
        return None
    tensor = torch.tensor(values, dtype=torch.int64, device=device)
    dist.all_reduce(tensor, op=op)
    return tensor.tolist()


def _digest(value: Any) -> int:
    """A 62-bit digest of ``repr(value)``: small enough to negate in an int64, wide enough that two
    different values never meet in practice."""
    return int.from_bytes(hashlib.blake2b(repr(value).encode(), digest_size=8).digest(), "little") >> 2


def _same_everywhere(value: Any) -> bool:
    """Whether every rank passed an equal ``value``: the minimum and maximum of its digest, in one reduction.

    Every rank gets the same answer, so every rank takes the same next collective.
    """
    digest = _digest(value)
    reduced = _reduced([digest, -digest], dist.ReduceOp.MIN)
    return reduced is not None and reduced[0] == -reduced[1]


def candidates(run_id: str, steps: list[int], other_world: dict[int, int],
               world_size: int) -> tuple[str, list[int], dict[int, int]]:
    """Rank 0's run id, so all ranks of this incarnation tag their files alike; the steps every rank can
    restore, newest first; and the committed steps any rank found saved by another number of ranks, with
    that number, so that every rank refuses them alike."""
    ordered = sorted(set(steps), reverse=True)
    resized = sorted(other_world.items(), reverse=True)
    if not active(world_size) or _same_everywhere((run_id, ordered, resized)):
        return run_id, ordered, dict(resized)
    gathered = _gather((run_id, ordered, resized), world_size)
    common = set.intersection(*(set(found) for _, found, _ in gathered))
    anywhere = {step: size for _, _, found in gathered for step, size in found}
    return gathered[0][0], sorted(common, reverse=True), anywhere


def restore_outcomes(
    refused: tuple[bool, str] | None, error: str | None, rank: int, world_size: int
) -> tuple[list[tuple[int, tuple[bool, str]]], list[tuple[int, str]]]:
    """Every rank's refusal (whether it is a step that cannot be resharded, and why) and error for one candidate
    step; both empty when every rank restored it."""
    failed = int(refused is not None or error is not None)
    if not active(world_size):
        gathered = [(rank, refused, error)]
    elif _reduced([failed], dist.ReduceOp.MAX) == [0]:
        return [], []
    else:
        gathered = _gather((rank, refused, error), world_size)
    return (
        [(r, reason) for r, reason, _ in gathered if reason is not None],
        [(r, reason) for r, _, reason in gathered if reason is not None],
    )
