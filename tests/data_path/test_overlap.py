"""``save(overlap=True)`` copies the state behind the next step; a guarded optimizer's step waits for the copy.

The copy is held back by the stager's test seam (``_before_copy``, called on
the copy thread before it copies), so that the optimizer's step always
starts while the copy has not: without that, a small state's copy would win
the race and prove nothing. The checkpoints are read back from storage with
``read_checkpoint`` and compared bit for bit with a copy taken before the step.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch
import torch.distributed as dist

from data_path.processes import wait_for
from stowaway import Checkpointer, SaveFailed, StagingTimeout, read_checkpoint
from stowaway.client.ledger import SlotState

HOLD = 30.0  # the longest a held copy waits for the test: far longer than it ever needs


def snapshot(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {key: snapshot(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(snapshot(item) for item in value)
    return value


def bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8)


def differences(stored: Any, expected: Any, path: str = "") -> list[str]:
    """Where ``stored`` differs from ``expected``, bit for bit for tensors."""
    if isinstance(expected, torch.Tensor):
        same = (isinstance(stored, torch.Tensor) and stored.dtype == expected.dtype
                and stored.shape == expected.shape and torch.equal(bits(stored), bits(expected)))
        return [] if same else [path]
    if isinstance(expected, dict):
        if not isinstance(stored, dict) or stored.keys() != expected.keys():
            return [path]
        return [where for key in expected for where in differences(stored[key], expected[key], f"{path}/{key}")]
    if isinstance(expected, list | tuple):
        if not isinstance(stored, list | tuple) or len(stored) != len(expected):
            return [path]
        return [where for index, (a, b) in enumerate(zip(stored, expected, strict=True))
                for where in differences(a, b, f"{path}/{index}")]
    return [] if stored == expected else [path]


class Trainer:
    """A small model and its Adam optimizer, past the first step so that the optimizer has its state."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        self.model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8))
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=1e-2)
        self.backward()
        self.optimizer.step()

    def backward(self) -> None:
        self.optimizer.zero_grad()
        self.model(torch.randn(32, 64)).pow(2).mean().backward()

    def state(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "optim": self.optimizer.state_dict()}


def test_a_guarded_step_right_after_save_checkpoints_exactly_the_pre_step_values(start_sidecar, storage):
    sidecar = start_sidecar()
    trainer = Trainer()
    stepping = threading.Event()
    held: list[bool] = []

    def hold_until_the_step_starts(step: int) -> None:
        held.append(stepping.wait(HOLD))
        stepping.clear()

    # Registered before the guard, so it runs first: the step has begun when the copy is let go.
    trainer.optimizer.register_step_pre_hook(lambda *_: stepping.set())
    with Checkpointer(job="guarded", socket=sidecar.socket, rank=0, world_size=1, slots=3, timeout=60) as ckpt:
        ckpt.reserve(trainer.state(), wait=True)
        ckpt.guard(trainer.optimizer)
        ckpt._stager._before_copy = hold_until_the_step_starts
        expected = {}
        for step in range(1, 21):
            trainer.backward()
            expected[step] = snapshot(trainer.state())
            handle = ckpt.save(step, trainer.state(), overlap=True)
            trainer.optimizer.step()  # at once: the guard makes it wait for the copy
            assert handle.staged(), f"step {step}: the optimizer stepped before the copy ended"
            handle.wait(60)
        assert held == [True] * 20, "a copy was let go before the optimizer's step had begun"
        # A guard that finds the copy already ended (it was let go just before) does not wait, nor count a stall.
        assert len(ckpt.staging_seconds) == 20 and len(ckpt.stall_seconds) <= 20
        assert 0 <= ckpt.overlap_seconds <= sum(ckpt.staging_seconds)
    for step, values in expected.items():
        stored = read_checkpoint(storage / "guarded", step)[1]
        assert not differences(stored, values), f"step {step}: {differences(stored, values)} differ"


def test_without_a_guard_a_step_during_the_copy_reaches_the_checkpoint(start_sidecar, storage):
    """The documented risk: unguarded, a change made before the copy ends is what gets saved."""
    sidecar = start_sidecar()
    trainer = Trainer()
    stepped = threading.Event()
    with Checkpointer(job="unguarded", socket=sidecar.socket, rank=0, world_size=1, timeout=60) as ckpt:
        ckpt._stager._before_copy = lambda step: stepped.wait(HOLD) or None
        trainer.backward()
        before = snapshot(trainer.state())
        handle = ckpt.save(1, trainer.state(), overlap=True)
        assert not handle.staged()
        trainer.optimizer.step()
        after = snapshot(trainer.state())
        stepped.set()
        handle.wait(60)
    stored = read_checkpoint(storage / "unguarded", 1)[1]
    assert differences(stored, before), "the step's change did not reach the checkpoint: no race was shown"
    assert not differences(stored, after)


def test_a_change_inside_guarded_waits_for_the_copy(start_sidecar, storage):
    sidecar = start_sidecar()
    state = {"w": torch.arange(1 << 20, dtype=torch.float32)}
    expected = snapshot(state)
    entering = threading.Event()
    with Checkpointer(job="manual", socket=sidecar.socket, rank=0, world_size=1, timeout=60) as ckpt:
        ckpt._stager._before_copy = lambda step: entering.wait(HOLD) or None
        handle = ckpt.save(1, state, overlap=True)
        entering.set()
        with ckpt.guarded():
            assert handle.staged(), "guarded() let the change start before the copy ended"
            state["w"].add_(1)
        handle.wait(60)
    assert not differences(read_checkpoint(storage / "manual", 1)[1], expected)


def test_a_failed_copy_fails_its_save_gives_the_slot_back_and_is_raised_by_the_next_save(start_sidecar):
    sidecar = start_sidecar()
    state = {"w": torch.ones(1000)}

    def fail_step_2(step: int) -> None:
        if step == 2:
            raise RuntimeError("the copy broke")

    with Checkpointer(job="broken", socket=sidecar.socket, rank=0, world_size=1, slots=2, timeout=60) as ckpt:
        ckpt._stager._before_copy = fail_step_2
        ckpt.save(1, state, overlap=True).wait(60)
        failed = ckpt.save(2, state, overlap=True)
        with pytest.raises(SaveFailed, match="step 2 could not be copied into shared memory: RuntimeError: the copy"):
            ckpt.save(3, state, overlap=True)
        assert failed.staged() and failed.done() and not failed.committed
        with pytest.raises(SaveFailed, match="step 2 was not committed: its copy into shared memory failed"):
            failed.wait(1)
        assert ckpt._ledger.states() == [SlotState.IDLE, SlotState.IDLE], "the failed copy kept its slot"
        # Told once: the save after it goes through, and so does one after a failure already raised by the handle.
        ckpt.save(3, state, overlap=True).wait(60)
        ckpt._stager._before_copy = lambda step: fail_step_2(step - 2)
        failed = ckpt.save(4, state, overlap=True)
        with pytest.raises(SaveFailed, match="step 4 could not be copied"):
            failed.wait_staged(60)
        ckpt._stager._before_copy = None
        ckpt.save(5, state, overlap=True).wait(60)
        assert ckpt.load()[0] == 5


def test_a_save_while_the_previous_copy_runs_waits_for_it_and_says_so_at_the_timeout(start_sidecar):
    sidecar = start_sidecar()
    state = {"w": torch.ones(1000)}
    release = threading.Event()
    with Checkpointer(job="queued", socket=sidecar.socket, rank=0, world_size=1, slots=2, timeout=2) as ckpt:
        ckpt._stager._before_copy = lambda step: release.wait(HOLD) or None
        first = ckpt.save(1, state, overlap=True)
        with pytest.raises(StagingTimeout, match="rank 0: the save of step 2 waited 2 s for step 1 to be copied"):
            ckpt.save(2, state)
        assert ckpt._ledger.states().count(SlotState.WRITING) == 1, "the copy's slot changed owner meanwhile"
        release.set()
        ckpt.save(2, state).wait(30)
        first.wait(30)
        assert ckpt.stall_seconds and ckpt.stall_seconds[0] >= 2


def test_an_overlapped_dtensor_shard_is_checkpointed_with_its_pre_step_values(start_sidecar, storage):
    """FSDP2: the local shard is copied, and the guarded step waits for it like for any tensor."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        mesh = init_device_mesh("cpu", (1,))
        weight = torch.nn.Parameter(DTensor.from_local(torch.randn(512, 33), mesh, [Shard(0)], run_check=False))
        optimizer = torch.optim.SGD([weight], lr=0.5, momentum=0.9)
        weight.grad = DTensor.from_local(torch.ones(512, 33), mesh, [Shard(0)], run_check=False)
        optimizer.step()
        stepping = threading.Event()
        optimizer.register_step_pre_hook(lambda *_: stepping.set())
        sidecar = start_sidecar()
        with Checkpointer(job="shards", socket=sidecar.socket, rank=0, world_size=1, timeout=60) as ckpt:
            ckpt.guard(optimizer)
            ckpt._stager._before_copy = lambda step: stepping.wait(HOLD) or None
            expected = weight.to_local().clone()
            handle = ckpt.save(1, {"w": weight, "optim": optimizer.state_dict()}, overlap=True)
            optimizer.step()
            handle.wait(60)
        assert not torch.equal(weight.to_local(), expected), "the step changed nothing: the test shows nothing"
        stored = read_checkpoint(storage / "shards", 1)[1]
        assert torch.equal(bits(stored["w"]), bits(expected))
    finally:
        dist.destroy_process_group()


def test_a_copy_that_ends_while_the_sidecar_is_gone_fails_its_save_and_frees_its_slot(start_sidecar):
    """The persist cannot be sent: the save fails, and its slot is the rank's again, not WRITING for good."""
    sidecar = start_sidecar()
    state = {"w": torch.ones(1000)}
    release = threading.Event()
    with Checkpointer(job="gone", socket=sidecar.socket, rank=0, world_size=1, slots=2, timeout=60) as ckpt:
        ckpt._stager._before_copy = lambda step: release.wait(HOLD) or None
        handle = ckpt.save(1, state, overlap=True)
        sidecar.kill()
        wait_for(lambda: not ckpt._link.connected, "the rank to see the sidecar gone")
        release.set()
        with pytest.raises(SaveFailed, match="step 1 was not committed: the connection to the sidecar was lost"):
            handle.wait(60)
        assert ckpt._ledger.states() == [SlotState.IDLE, SlotState.IDLE], "the unsent slot stayed taken"
        ckpt._stager._before_copy = None
        sidecar.start()
        for step in (2, 3):  # one save into each slot
            ckpt.save(step, state, overlap=True).wait(60)
