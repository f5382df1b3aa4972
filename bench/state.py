"""A synthetic training state with the shape of a real one.

Real checkpoints are dominated by a few large tensors (embeddings, big
matmuls) and their optimizer moments, with hundreds of KiB-sized tensors
(norms, biases) around them, in several dtypes. Per-tensor overheads only show
with the small ones and copy bandwidth only with the large ones, so the
benchmark needs both.
"""

from __future__ import annotations

from typing import Any

import torch

# Share of the parameter elements held by each large tensor; the rest is split into small tensors.
_LARGE_SHARES = (0.30, 0.12, 0.12, 0.06, 0.06, 0.06, 0.06, 0.06, 0.06)
_SMALL_TENSORS = 240
# Per parameter element: a bf16 weight, its fp32 master copy and two fp32 Adam moments.
_BYTES_PER_ELEMENT = 2 + 4 + 4 + 4


def parameter_sizes(nbytes: int) -> list[int]:
    """Element counts of the parameters of a state of about ``nbytes`` bytes."""
    elements = max(nbytes // _BYTES_PER_ELEMENT, 4 * _SMALL_TENSORS)
    large = [int(elements * share) for share in _LARGE_SHARES]
    small_total = elements - sum(large)
    small = [small_total // _SMALL_TENSORS] * _SMALL_TENSORS
    small[-1] += small_total - sum(small)
    return large + small


def build(nbytes: int, seed: int, device: torch.device | str = "cpu") -> dict[str, Any]:
    """An optimizer-like state dict of about ``nbytes`` bytes, filled with random values.

    On a GPU the parameters and moments live on ``device`` while each ``step``
    and the RNG state stay on the host, as with PyTorch's Adam: a real state
    mixes both, so the copy path sees both.
    """
    generator = torch.Generator(device).manual_seed(seed)
    model: dict[str, torch.Tensor] = {}
    master: dict[int, dict[str, torch.Tensor]] = {}
    for index, count in enumerate(parameter_sizes(nbytes)):
        weight = torch.empty(count, dtype=torch.float32, device=device).uniform_(-1, 1, generator=generator)
        model[f"layers.{index}.weight"] = weight.to(torch.bfloat16)
        master[index] = {
            "step": torch.tensor(1000.0),
            "master": weight,
            "exp_avg": torch.empty_like(weight).normal_(generator=generator),
            "exp_avg_sq": torch.empty_like(weight).uniform_(0, 1e-3, generator=generator),
        }
    return {
        "model": model,
        "optimizer": {
            "state": master,
            "param_groups": [{"lr": 3e-4, "betas": (0.9, 0.95), "weight_decay": 0.1, "params": list(master)}],
        },
        "scheduler": {"last_epoch": 1000, "base_lrs": [3e-4]},
        "rng": torch.get_rng_state(),
        "step": 1000,
    }


def tensors(state: Any) -> list[torch.Tensor]:
    """Every tensor of a state, depth first, for the references that copy the same bytes."""
    if isinstance(state, torch.Tensor):
        return [state]
    if isinstance(state, dict):
        return [found for value in state.values() for found in tensors(value)]
    if isinstance(state, list | tuple):
        return [found for value in state for found in tensors(value)]
    return []


def nbytes_of(state: Any) -> int:
    return sum(tensor.numel() * tensor.element_size() for tensor in tensors(state))
