"""Ranks without a process group that ask what to restore while a commit is in flight get the same answer.

Such ranks cannot agree among themselves; each asks the sidecar in turn. A
step that every rank has handed over commits without their help, so the
sidecar answers only once it has, and a rank that asked before the commit
landed restores the same step as one that asked after.
"""

from __future__ import annotations

from stowaway.storage import layout

RATE = 2 * 2**20  # bytes per second: 8 MiB per rank keeps step 2's commit seconds away


def test_a_rank_that_asks_while_step_2_is_persisting_restores_step_2_like_the_rank_that_asks_after(
    start_sidecar, start_rank, storage
):
    sidecar = start_sidecar(extra=["--write-rate-limit", str(RATE)])
    ranks = [start_rank(sidecar, job="inflight", rank=rank, world_size=2) for rank in (0, 1)]
    for rank in ranks:
        rank.save(1)
    for rank in ranks:
        assert rank.wait(1)["committed"]
    for rank in ranks:
        rank.save(2, numel=2**20)
    manifest_2 = layout.step_dir(storage / "inflight", 2) / layout.MANIFEST
    assert not manifest_2.exists(), "step 2 committed before the first rank asked; the test proves nothing"

    early = ranks[0].call(op="load", timeout=60)
    assert ranks[1].wait(2, timeout=60)["committed"]
    late = ranks[1].call(op="load", timeout=60)

    assert early["step"] == late["step"] == 2, f"rank 0 restored {early}, rank 1 restored {late}"
    assert early["intact"] and late["intact"]
