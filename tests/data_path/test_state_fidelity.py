"""What goes into save() comes out of load(): values, dtypes, shapes, Python types, aliasing.

Checked through both restore paths: from the sidecar's shared memory (a
training process restarting in the same pod) and from storage (a pod
rescheduled onto a fresh node: new sidecar, empty shared memory).
"""

from __future__ import annotations

import copy
import random
import shutil
from collections import OrderedDict

import numpy as np
import pytest
import torch
from torch import nn

from stowaway import Checkpointer, UnsupportedState
from stowaway.protocol.messages import POOLED_SLOT_BASE
from stowaway.slots import header, naming


@pytest.fixture(autouse=True)
def _client_log(caplog):
    caplog.set_level("INFO", logger="stowaway")


def real_training_state() -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(16, 8), nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 16, bias=False))
    model[3].weight = model[0].weight
    adamw = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(adamw, max_lr=0.01, total_steps=10)
    model(torch.randint(0, 16, (4, 3))).sum().backward()
    adamw.step()
    sgd.step()
    scheduler.step()
    scaler = torch.amp.GradScaler("cpu")
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    return {
        "model": model.state_dict(),
        "adamw": adamw.state_dict(),
        "sgd": sgd.state_dict(),
        "scheduler": scheduler.state_dict(),
        "scaler": scaler.state_dict(),
        "rng": {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()},
        "dtypes": {
            "bf16": torch.randn(3, 2).to(torch.bfloat16),
            "fp16": torch.randn(5).to(torch.float16),
            "fp8_e4m3": torch.randn(4).to(torch.float8_e4m3fn),
            "fp8_e5m2": torch.randn(4).to(torch.float8_e5m2),
            "int8": torch.tensor([-3, 7], dtype=torch.int8),
            "int64": torch.tensor([2**62, -1]),
            "uint8": torch.tensor([255, 0], dtype=torch.uint8),
            "bool": torch.tensor([True, False, True]),
            "f64": torch.tensor([1e-300, float("inf")], dtype=torch.float64),
        },
        "zero_d": torch.tensor(3.25),
        "empty": torch.empty(0, 5),
        "transposed": base.t(),
        "strided": base[::2, 1::3],
        "tied_views": (base, base),
        "python": {"int": 7, "float": 0.1, "nan": float("nan"), "inf": float("-inf"), "none": None, "s": "é",
                   "bool": True, "list": [1, [2, (3, "x")]], "tuple": (1.5, None), 5: "int key",
                   "big": 2**70, "size": torch.Size([3, 4]), "dtype": torch.bfloat16},
        "ordered": OrderedDict([("b", 1), ("a", torch.ones(2))]),
        "array": np.arange(6, dtype=np.int16).reshape(2, 3),
    }


def assert_same(restored, original, path="state"):
    assert type(restored) is type(original), f"{path}: {type(restored)} is not {type(original)}"
    if isinstance(original, torch.Tensor):
        assert restored.dtype == original.dtype and restored.shape == original.shape, path
        assert torch.equal(restored.view(torch.uint8) if original.element_size() == 1 else restored,
                           original.view(torch.uint8) if original.element_size() == 1 else original) or (
            original.is_floating_point() and torch.equal(restored.isnan(), original.isnan())
        ), path
        assert restored.is_contiguous(), path
    elif isinstance(original, np.ndarray):
        assert restored.dtype == original.dtype and np.array_equal(restored, original), path
    elif isinstance(original, dict):
        assert list(restored) == list(original), path
        for key in original:
            assert_same(restored[key], original[key], f"{path}[{key!r}]")
        assert getattr(restored, "_metadata", None) == getattr(original, "_metadata", None), path
    elif isinstance(original, list | tuple):
        assert len(restored) == len(original), path
        for index, (a, b) in enumerate(zip(restored, original, strict=True)):
            assert_same(a, b, f"{path}[{index}]")
    elif isinstance(original, float) and original != original:
        assert restored != restored, path
    else:
        assert restored == original, path


def assert_aliasing(restored):
    model = restored["model"]
    assert model["3.weight"] is model["0.weight"], "tied embedding/head weights must come back as one tensor"
    assert restored["tied_views"][0] is restored["tied_views"][1]


@pytest.fixture
def original():
    return real_training_state()


def test_restore_from_shared_memory_returns_the_same_state(start_sidecar, original, caplog):
    sidecar = start_sidecar()
    with Checkpointer(job="fidelity", socket=sidecar.socket, rank=0, world_size=1, timeout=30) as writer:
        writer.save(3, original).wait(30)
    with Checkpointer(job="fidelity", socket=sidecar.socket, rank=0, world_size=1, timeout=30) as reader:
        step, restored = reader.load()
    assert step == 3
    assert_same(restored, original)
    assert_aliasing(restored)
    assert "restored step 3 from memory" in caplog.text


def test_restore_from_storage_after_a_reschedule_returns_the_same_state(start_sidecar, original, caplog):
    first = start_sidecar("first")
    with Checkpointer(job="fidelity", socket=first.socket, rank=0, world_size=1, timeout=30) as writer:
        writer.save(5, original).wait(30)
    assert first.stop() == 0
    shutil.rmtree(first.shm_dir)
    second = start_sidecar("second")
    with Checkpointer(job="fidelity", socket=second.socket, rank=0, world_size=1, timeout=30) as reader:
        step, restored = reader.load()
    assert step == 5
    assert_same(restored, original)
    assert_aliasing(restored)
    assert "restored step 5 from storage" in caplog.text


def test_every_save_of_a_training_loop_restores_its_own_values(start_sidecar, original):
    # Saves after the first reuse its tree (only scalars are rendered anew): each step must still come
    # back with its own tensors, scalars and aliasing, from memory and from storage.
    sidecar = start_sidecar()
    saved = {}
    with Checkpointer(job="loop", socket=sidecar.socket, rank=0, world_size=1, slots=1, timeout=30) as ckpt:
        for step in range(1, 5):
            original["python"].update(int=step, float=step / 3, s="é" * step, none=None if step % 2 else "x")
            original["scheduler"]["last_epoch"] = step
            original["model"]["0.weight"].add_(1)
            ckpt.save(step, original).wait(30)
            saved[step] = copy.deepcopy(original)
            assert_same(ckpt.load(step)[1], saved[step])
        for step in range(1, 5):
            restored = ckpt.load(step)[1]
            assert_same(restored, saved[step])
            assert_aliasing(restored)


def test_a_state_saved_into_a_pooled_spare_restores_the_same(start_sidecar, original, caplog):
    # One slot per rank and a pooled spare: the second save, made while the first persists (slowly), goes into
    # the spare. Its step comes back from storage (a spare's header does not say whose step it holds), the
    # first's from memory, each the state it saved.
    sidecar = start_sidecar(extra=["--write-rate-limit", str(2**20)])
    saved, handles = {}, []
    with Checkpointer(job="pooled", socket=sidecar.socket, rank=0, world_size=1, slots=1, pooled_spares=1,
                      timeout=60) as ckpt:
        for step in (1, 2):
            original["python"].update(int=step, s="é" * step)
            original["model"]["0.weight"].add_(1)
            handles.append(ckpt.save(step, original))
            saved[step] = copy.deepcopy(original)
        for handle in handles:
            handle.wait(60)
        spare = naming.slot_path(sidecar.shm_dir, "pooled", 0, POOLED_SLOT_BASE)
        assert header.read(spare.read_bytes()[:64]).step == 2, "the second save did not go into the spare"
        for step, source in ((1, "memory"), (2, "storage")):
            restored = ckpt.load(step)[1]
            assert_same(restored, saved[step])
            assert_aliasing(restored)
            assert f"restored step {step} from {source}" in caplog.text


def test_the_stored_file_is_a_valid_safetensors_file(start_sidecar, storage, original):
    from safetensors.torch import load_file

    sidecar = start_sidecar()
    with Checkpointer(job="fidelity", socket=sidecar.socket, rank=0, world_size=1, timeout=30) as writer:
        writer.save(1, original).wait(30)
    loaded = load_file(storage / "fidelity" / "step-000000000001" / "rank-00000-of-00001.safetensors")
    assert torch.equal(loaded["model.0.weight"], original["model"]["0.weight"])
    assert torch.equal(loaded["transposed"], original["transposed"])


def test_objects_without_a_safe_encoding_are_refused_with_their_path(start_sidecar):
    sidecar = start_sidecar()
    with Checkpointer(job="fidelity", socket=sidecar.socket, rank=0, world_size=1, timeout=30) as ckpt:
        with pytest.raises(UnsupportedState, match=r"state\['extra'\]\['fn'\] is a builtins.function"):
            ckpt.save(1, {"extra": {"fn": lambda: 1}})
        with pytest.raises(UnsupportedState, match=r"layout torch\.sparse_coo"):
            ckpt.save(1, {"sparse": torch.eye(3).to_sparse()})
        with pytest.raises(UnsupportedState, match=r"state\['w'\] is a torch.Tensor on meta with no data"):
            ckpt.save(1, {"w": torch.empty(4, device="meta")})
        # Nothing was written by the refused saves: the slot still takes a good one.
        ckpt.save(1, {"w": torch.ones(4)}).wait(30)
        assert torch.equal(ckpt.load()[1]["w"], torch.ones(4))


def test_pickled_objects_need_an_opt_in_on_both_sides(start_sidecar):
    sidecar = start_sidecar()
    with Checkpointer(job="pickle", socket=sidecar.socket, rank=0, world_size=1, timeout=30,
                      allow_pickle=True) as ckpt:
        ckpt.save(1, {"obj": {1, 2, 3}}).wait(30)
        assert ckpt.load()[1] == {"obj": {1, 2, 3}}
    with (
        Checkpointer(job="pickle", socket=sidecar.socket, rank=0, world_size=1, timeout=30) as ckpt,
        pytest.raises(UnsupportedState, match="allow_pickle=True"),
    ):
        ckpt.load()


@pytest.mark.parametrize("state", [{"epoch": 3}, {}, {"empty": torch.empty(0, 4), "step": 2}],
                         ids=["scalars-only", "empty-dict", "empty-tensor-only"])
def test_a_state_with_no_tensor_bytes_saves_and_restores(start_sidecar, state):
    # A data loader's position or an epoch counter saved on its own has no tensor data to copy.
    sidecar = start_sidecar()
    with Checkpointer(job="no-bytes", socket=sidecar.socket, rank=0, world_size=1, timeout=30) as ckpt:
        ckpt.save(1, state).wait(30)
        ckpt.save(2, state).wait(30)
        step, restored = ckpt.load()
    assert step == 2
    assert_same(restored, state)
