"""What the bucket tier uploads and deletes: pure functions of the steps each tier holds.

Rule of this module: no I/O, so that every choice is tested in milliseconds
(``tests/unit/test_tier_plan.py``); ``bucket_tier`` lists, uploads and
deletes accordingly.
"""

from __future__ import annotations

from stowaway.storage.retention import kept
from stowaway.storage.rollbacks import Rollback


def to_upload(claim: list[int], bucket: list[int], keep_every: int) -> list[int]:
    """Steps committed on the claim to upload now, oldest first.

    Only steps newer than the bucket's newest: the newest of them, and
    those the bucket's ``keep_every`` keeps. A bucket slower than the saves
    thus skips intermediate steps instead of falling ever further behind,
    and never re-uploads a step older than what it already holds.
    """
    newest = max(bucket, default=-1)
    newer = sorted(step for step in claim if step > newest)
    if not newer:
        return []
    chosen = {newer[-1]}
    if keep_every:
        chosen.update(step for step in newer if step % keep_every == 0)
    return sorted(chosen)


def to_delete(committed: list[int], keep_last: int, keep_every: int) -> list[int]:
    """Committed steps retention drops, oldest first."""
    keep = kept(committed, keep_last, keep_every)
    return sorted(step for step in committed if step not in keep)


def to_sweep(present: list[int], committed: list[int]) -> list[int]:
    """Uncommitted steps (objects but no manifest) below the newest committed step: torn uploads.

    One above it may still be uploading (on this or a restarted sidecar),
    so it stays until a newer step commits.
    """
    newest = max(committed, default=-1)
    done = set(committed)
    return sorted(step for step in present if step < newest and step not in done)


def may_be_rolled_back(bucket: list[int], rollbacks: list[Rollback]) -> list[int]:
    """Bucket steps newer than some rollback's target: when each was committed decides whether it is abandoned."""
    if not rollbacks:
        return []
    lowest = min(rollback.to for rollback in rollbacks)
    return [step for step in bucket if step > lowest]


def in_force(rollbacks: list[Rollback], claim_unix: dict[int, float]) -> list[Rollback]:
    """The rollbacks still in force: not those whose abandoned steps the claim holds committed again (renamed
    back by hand, undoing it), which would otherwise have their bucket copies uploaded and set aside in turn."""
    return [rollback for rollback in rollbacks
            if not any(rollback.abandons(step, unix) for step, unix in claim_unix.items())]


def rolled_back(committed_unix: dict[int, float], rollbacks: list[Rollback]) -> dict[int, Rollback]:
    """Bucket steps (with the time each was committed) that a rollback abandoned, each with the earliest such
    rollback: a step saved again after the rollback is newer than it, and stays."""
    found: dict[int, Rollback] = {}
    for step, unix in committed_unix.items():
        abandoning = [rollback for rollback in rollbacks if rollback.abandons(step, unix)]
        if abandoning:
            found[step] = abandoning[0]
    return found
