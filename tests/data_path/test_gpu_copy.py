"""Device tensors go straight from the GPU into a pinned slot; save() returns once they are there (or, with
overlap=True, once their copies are queued on a side stream that a guarded optimizer step waits for).

These need a CUDA device; on a machine without one they are skipped, and the
same checks run on the device machine (see docs/benchmarks.md).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

from stowaway import Checkpointer, read_checkpoint

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="no CUDA device here: the GPU-to-slot copy path (pinned slot, fenced non-blocking copies) "
           "is checked on a machine with one",
)


def device_state() -> dict[str, torch.Tensor]:
    generator = torch.Generator("cuda").manual_seed(0)
    return {
        "big": torch.randn(64 * 2**20 // 4, device="cuda", generator=generator),
        "bf16": torch.randn(4096, 257, device="cuda", generator=generator).to(torch.bfloat16),
        "ints": torch.randint(0, 1000, (1000,), device="cuda", generator=generator),
        "host": torch.arange(10.0),
    }


def test_the_stored_checkpoint_holds_the_values_at_save_time_not_later_ones(start_sidecar, storage):
    sidecar = start_sidecar()
    state = device_state()
    expected = {name: tensor.cpu() for name, tensor in state.items()}
    with Checkpointer(job="gpu", socket=sidecar.socket, rank=0, world_size=1, timeout=60) as ckpt:
        handle = ckpt.save(1, state)
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):  # a change the save's stream knows nothing about
            for tensor in state.values():
                tensor.add_(1)
        handle.wait(60)
        assert ckpt._slots.pool.slots[0].payload().is_pinned(), "the slot was not registered as pinned memory"
    stored = load_file(storage / "gpu" / "step-000000000001" / "rank-00000-of-00001.safetensors")
    for name, tensor in expected.items():
        assert torch.equal(stored[name], tensor), f"{name}: the stored bytes are not those of save time"


def test_restore_onto_the_device(start_sidecar):
    sidecar = start_sidecar()
    state = device_state()
    with Checkpointer(job="gpu", socket=sidecar.socket, rank=0, world_size=1, timeout=60) as ckpt:
        ckpt.save(2, state).wait(60)
        step, restored = ckpt.load(map_location="cuda")
    assert step == 2
    for name, tensor in state.items():
        assert restored[name].device.type == "cuda"
        assert torch.equal(restored[name].cpu(), tensor.cpu()), name


def test_a_load_into_device_tensors_fills_them_before_returning(start_sidecar):
    sidecar = start_sidecar()
    state = device_state()
    expected = {name: tensor.clone() for name, tensor in state.items()}
    with Checkpointer(job="gpu", socket=sidecar.socket, rank=0, world_size=1, timeout=60) as ckpt:
        ckpt.save(3, state).wait(60)
        for tensor in state.values():
            tensor.zero_()
        step, restored = ckpt.load(into=state)
        # The slot is written again right away: the copies out of it must already be complete.
        ckpt.save(4, {name: torch.zeros_like(tensor) for name, tensor in state.items()}).wait(60)
    assert step == 3
    for name, tensor in state.items():
        assert restored[name] is tensor and tensor.device == expected[name].device
        assert torch.equal(tensor, expected[name]), name


def test_a_dtensor_shard_on_the_device_comes_back_on_the_device_mesh(start_sidecar):
    """FSDP2 on GPUs: the local shard is a device tensor, copied into the pinned slot like any other."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        mesh = init_device_mesh("cuda", (1,))
        local = torch.randn(1000, 33, device="cuda")
        expected = local.cpu()
        saved = torch.nn.Parameter(DTensor.from_local(local, mesh, [Shard(0)], run_check=False))
        sidecar = start_sidecar()
        with Checkpointer(job="gpu", socket=sidecar.socket, rank=0, world_size=1, timeout=60) as ckpt:
            ckpt.save(3, {"w": saved}).wait(60)
            assert ckpt._slots.pool.slots[0].payload().is_pinned(), "the slot was not registered as pinned memory"
            step, restored = ckpt.load(map_location="cuda", device_mesh=mesh)
        weight = restored["w"]
        assert step == 3 and isinstance(weight, DTensor) and isinstance(weight, torch.nn.Parameter)
        assert weight.device.type == "cuda" and weight.placements == (Shard(0),) and weight.device_mesh is mesh
        assert torch.equal(weight.to_local().cpu(), expected)
    finally:
        dist.destroy_process_group()


def test_an_overlapped_save_of_device_tensors_holds_the_values_before_a_guarded_step(start_sidecar, storage):
    """On a GPU the guard orders the optimizer's stream after the copies' events: the step cannot reach them."""
    sidecar = start_sidecar()
    generator = torch.Generator("cuda").manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(64 * 2**20 // 4, device="cuda", generator=generator))
    optimizer = torch.optim.SGD([weight], lr=0.5, momentum=0.9)
    with Checkpointer(job="gpu-overlap", socket=sidecar.socket, rank=0, world_size=1, timeout=60) as ckpt:
        ckpt.guard(optimizer)
        expected = {}
        for step in range(1, 6):
            weight.grad = torch.ones_like(weight)
            expected[step] = weight.detach().cpu()
            handle = ckpt.save(step, {"w": weight}, overlap=True)
            optimizer.step()  # queued behind the copy's event on the current stream; the host goes on
            handle.wait(60)
        assert ckpt._slots.pool.slots[0].payload().is_pinned(), "the slot was not registered as pinned memory"
    for step, values in expected.items():
        stored = load_file(storage / "gpu-overlap" / f"step-{step:012d}" / "rank-00000-of-00001.safetensors")
        assert torch.equal(stored["w"], values), f"step {step}: the stored bytes are not those before the step"


def leaves(value: Any, path: str = "") -> dict[str, Any]:
    """Every leaf of a state by its path, tensors on the host: what a stored checkpoint is compared by."""
    if isinstance(value, dict):
        return {where: leaf for key, item in value.items() for where, leaf in leaves(item, f"{path}/{key}").items()}
    if isinstance(value, list | tuple):
        return {where: leaf for index, item in enumerate(value)
                for where, leaf in leaves(item, f"{path}/{index}").items()}
    return {path: value.detach().to("cpu", copy=True) if isinstance(value, torch.Tensor) else value}


def test_an_overlapped_save_of_a_model_and_its_adam_state_holds_the_values_before_each_guarded_step(
    start_sidecar, storage
):
    """A real optimizer's state mixes device tensors with Adam's step counts on the host; both are saved exact."""
    sidecar = start_sidecar()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.ReLU(), torch.nn.Linear(4096, 1024)).cuda()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    inputs = torch.randn(512, 1024, device="cuda")

    def backward() -> None:
        optimizer.zero_grad()
        model(inputs).square().mean().backward()

    def state() -> dict[str, Any]:
        return {"model": model.state_dict(), "optim": optimizer.state_dict()}

    backward()
    optimizer.step()
    with Checkpointer(job="gpu-adam", socket=sidecar.socket, rank=0, world_size=1, timeout=60) as ckpt:
        ckpt.guard(optimizer)
        expected = {}
        for step in range(1, 6):
            backward()
            expected[step] = leaves(state())
            handle = ckpt.save(step, state(), overlap=True)
            optimizer.step()  # at once: the guard makes it wait for the copies
            handle.wait(60)
    for step, values in expected.items():
        stored = leaves(read_checkpoint(storage / "gpu-adam", step)[1])
        assert stored.keys() == values.keys(), f"step {step}: {sorted(stored.keys() ^ values.keys())}"
        differ = [where for where, value in values.items() if not (
            torch.equal(stored[where], value) if isinstance(value, torch.Tensor) else stored[where] == value)]
        assert not differ, f"step {step}: {differ} are not the values before the step"
