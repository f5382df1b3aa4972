"""``load(into=...)`` and ``read_checkpoint(into=...)`` write a checkpoint into the caller's own tensors.

The point is memory: a restore into new tensors holds the state twice until
the caller copies it into the model. So each test checks that the tensors
returned are the caller's own, that the model and optimizer hold the saved
values without a ``load_state_dict``, and that a state that does not fit is
refused before any of its tensors is written.
"""

from __future__ import annotations

import shutil

import pytest
import torch
from torch import nn

from stowaway import Checkpointer, UnsupportedState, read_checkpoint


def training() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(16, 8), nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 16, bias=False))
    model[3].weight = model[0].weight
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randint(0, 16, (4, 3))).sum().backward()
    optimizer.step()
    return model, optimizer


def live_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    return {"model": model.state_dict(), "optim": optimizer.state_dict()}


def snapshot(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    return {"model": {key: value.clone() for key, value in model.state_dict().items()},
            "exp_avg": [state["exp_avg"].clone() for state in optimizer.state.values()]}


def train_on(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Move every parameter and optimizer state away from the saved values."""
    for _ in range(2):
        optimizer.zero_grad()
        model(torch.randint(0, 16, (4, 3))).sum().backward()
        optimizer.step()


def assert_holds(model: nn.Module, optimizer: torch.optim.Optimizer, saved: dict) -> None:
    assert_model_holds(model, saved)
    for state, expected in zip(optimizer.state.values(), saved["exp_avg"], strict=True):
        assert torch.equal(state["exp_avg"], expected)


def assert_model_holds(model: nn.Module, saved: dict) -> None:
    for key, value in model.state_dict().items():
        assert torch.equal(value, saved["model"][key]), key


def test_a_load_into_the_training_state_fills_the_models_own_tensors_from_memory_and_from_storage(
        start_sidecar, caplog):
    caplog.set_level("INFO", logger="stowaway")
    model, optimizer = training()
    saved = snapshot(model, optimizer)
    first = start_sidecar("first")
    with Checkpointer(job="into", socket=first.socket, rank=0, world_size=1, timeout=30) as ckpt:
        ckpt.save(4, {**live_state(model, optimizer), "epoch": 4}).wait(30)
        train_on(model, optimizer)
        into = live_state(model, optimizer)
        step, restored = ckpt.load(into=into)
    assert step == 4 and "restored step 4 from memory" in caplog.text
    assert_holds(model, optimizer, saved)
    for key, value in into["model"].items():
        assert restored["model"][key] is value, f"{key} came back as a new tensor"
    assert restored["optim"]["state"][0]["exp_avg"] is optimizer.state[model[0].weight]["exp_avg"]
    assert restored["epoch"] == 4, "what into lacks comes back as saved"

    train_on(model, optimizer)
    assert first.stop() == 0
    shutil.rmtree(first.shm_dir)
    second = start_sidecar("second")
    with Checkpointer(job="into", socket=second.socket, rank=0, world_size=1, timeout=30) as ckpt:
        step, restored = ckpt.load(into=live_state(model, optimizer))
    assert step == 4 and "restored step 4 from storage" in caplog.text
    assert_holds(model, optimizer, saved)
    # Loading the returned state is a no-op: its tensors are the model's already.
    model.load_state_dict(restored["model"])
    optimizer.load_state_dict(restored["optim"])
    assert_holds(model, optimizer, saved)


def test_what_into_lacks_comes_back_new(start_sidecar):
    model, optimizer = training()
    saved = snapshot(model, optimizer)
    base = torch.arange(6.0)
    sidecar = start_sidecar()
    with Checkpointer(job="into", socket=sidecar.socket, rank=0, world_size=1, timeout=30) as ckpt:
        ckpt.save(1, {**live_state(model, optimizer), "tied": (base, base)}).wait(30)
        train_on(model, optimizer)
        mine = torch.zeros(6)
        # An optimizer that has not stepped yet holds no state tensors: they come back new.
        fresh = torch.optim.AdamW(model.parameters(), lr=1e-3)
        step, restored = ckpt.load(into={"model": model.state_dict(), "optim": fresh.state_dict(),
                                         "tied": (mine, None)})
        with pytest.raises(UnsupportedState, match=r"into is a Sequential: pass its state_dict\(\)"):
            ckpt.load(into=model)
    assert step == 1
    assert_model_holds(model, saved)
    assert torch.equal(restored["optim"]["state"][0]["exp_avg"], saved["exp_avg"][0])
    # One stored tensor at two paths, into's at the first: the second comes back as a copy of its own.
    assert restored["tied"][0] is mine and torch.equal(mine, base)
    assert restored["tied"][1] is not mine and torch.equal(restored["tied"][1], base)


@pytest.mark.parametrize(("mismatch", "message"), [
    (lambda into: into["model"].update(extra=torch.zeros(2)),
     r"into\['model'\]\['extra'\] is a tensor, where the checkpoint holds nothing"),
    (lambda into: into["model"].update({"1.weight": torch.zeros(8, 9)}),
     r"into\['model'\]\['1.weight'\] is torch.float32 of shape \[8, 9\], where the checkpoint holds "
     r"torch.float32 of shape \[8, 8\]"),
    (lambda into: into["model"].update({"2.bias": into["model"]["2.bias"].double()}),
     r"into\['model'\]\['2.bias'\] is torch.float64 of shape \[8\]"),
    (lambda into: into.update(epoch=torch.tensor(4)), r"into\['epoch'\] is a tensor, where the checkpoint holds "
                                                      r"a value"),
    (lambda into: into.update(model=nn.Linear(8, 8)), r"into\['model'\] is a Linear: pass its state_dict\(\)"),
    (lambda into: into.update(optim=[torch.zeros(1)]), r"into\['optim'\]\[0\] is a tensor, where the checkpoint "
                                                       r"holds a dict at into\['optim'\]"),
], ids=["extra key", "other shape", "other dtype", "tensor for a number", "module", "list for a dict"])
def test_a_state_that_does_not_fit_is_refused_before_any_tensor_is_written(start_sidecar, mismatch, message):
    model, optimizer = training()
    saved = snapshot(model, optimizer)
    sidecar = start_sidecar()
    with Checkpointer(job="into", socket=sidecar.socket, rank=0, world_size=1, timeout=30) as ckpt:
        ckpt.save(2, {**live_state(model, optimizer), "epoch": 4}).wait(30)
        train_on(model, optimizer)
        moved = snapshot(model, optimizer)
        into = live_state(model, optimizer)
        mismatch(into)
        with pytest.raises(UnsupportedState, match=rf"rank 0: load\(into=\.\.\.\) was given a state that does not "
                                                   rf"fit the checkpoint, so none of its tensors was written: "
                                                   rf"{message}"):
            ckpt.load(into=into)
        assert_holds(model, optimizer, moved)
        assert ckpt.load(into=live_state(model, optimizer))[0] == 2
    assert_holds(model, optimizer, saved)


def test_read_checkpoint_into_a_model_fills_its_own_tensors_and_refuses_a_state_that_does_not_fit(
        start_sidecar, storage):
    model, optimizer = training()
    saved = snapshot(model, optimizer)
    with Checkpointer(job="into", socket=start_sidecar().socket, rank=0, world_size=1, timeout=30) as ckpt:
        ckpt.save(3, {**live_state(model, optimizer), "epoch": 3}).wait(30)
    train_on(model, optimizer)
    moved = snapshot(model, optimizer)
    wrong = live_state(model, optimizer)
    wrong["model"]["1.weight"] = torch.zeros(8, 9)
    with pytest.raises(UnsupportedState, match=r"read_checkpoint\(into=\.\.\.\) was given a state that does not fit "
                                               r"the checkpoint, so none of its tensors was written: "
                                               r"into\['model'\]\['1.weight'\] is torch.float32 of shape \[8, 9\]"):
        read_checkpoint(storage / "into", into=wrong)
    assert_holds(model, optimizer, moved)

    # An evaluation: a model built anew, no optimizer, whose weights are written where they live.
    fresh = nn.Sequential(nn.Embedding(16, 8), nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 16, bias=False))
    fresh[3].weight = fresh[0].weight
    into = {"model": fresh.state_dict()}
    step, restored = read_checkpoint(storage / "into", into=into)
    assert step == 3 and restored["epoch"] == 3
    assert_model_holds(fresh, saved)
    for key, value in into["model"].items():
        assert restored["model"][key] is value, f"{key} came back as a new tensor"
    assert torch.equal(restored["optim"]["state"][0]["exp_avg"], saved["exp_avg"][0]), "what into lacks comes back new"
