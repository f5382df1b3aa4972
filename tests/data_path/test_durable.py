"""A save's handle says when this rank's file is durable (the sidecar's ``persisted``), before the step commits."""

from __future__ import annotations

import torch

from data_path.processes import wait_for
from stowaway import Checkpointer


def test_a_rank_s_file_is_durable_before_the_other_rank_has_saved_and_the_step_commits(start_sidecar):
    sidecar = start_sidecar()
    state = {"w": torch.arange(1000)}
    with Checkpointer(job="durable", socket=sidecar.socket, rank=0, world_size=2, timeout=30) as first, \
            Checkpointer(job="durable", socket=sidecar.socket, rank=1, world_size=2, timeout=30) as second:
        handle = first.save(1, state)
        wait_for(lambda: handle.durable, "rank 0's file of step 1 to be durable")
        assert not handle.done(), "step 1 committed with one rank of two saved"
        second.save(1, state).wait(30)
        handle.wait(30)
    assert handle.durable and handle.committed
