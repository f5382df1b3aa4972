"""Making every rank of a job restore the same step.

When a process group is initialised, ranks exchange what they can restore and
whether their restore worked; without one, a rank decides alone (correct for
one rank, and for ranks that only ever restore committed steps from one
shared storage).
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist


def active(world_size: int) -> bool:
    return world_size > 1 and dist.is_available() and dist.is_initialized() and dist.get_world_size() == world_size


def _gather(value: Any, world_size: int) -> list[Any]:
    if not active(world_size):
        return [value]
    gathered: list[Any] = [None] * world_size
    dist.all_gather_object(gathered, value)
    return gathered


def candidates(run_id: str, steps: list[int], world_size: int) -> tuple[str, list[int]]:
    """Rank 0's run id, so all ranks of this incarnation tag their files alike, and the steps every
    rank can restore, newest first: one exchange, because each costs milliseconds per rank."""
    gathered = _gather((run_id, steps), world_size)
    common = set.intersection(*(set(found) for _, found in gathered))
    return gathered[0][0], sorted(common, reverse=True)


def restore_outcomes(
    refused: str | None, error: str | None, rank: int, world_size: int
) -> tuple[list[tuple[int, str]], list[tuple[int, str]]]:
    """Every rank's refusal and error for one candidate step, in one exchange; both empty on success."""
    gathered = _gather((rank, refused, error), world_size)
    return (
        [(r, reason) for r, reason, _ in gathered if reason is not None],
        [(r, reason) for r, _, reason in gathered if reason is not None],
    )
