"""Copy a flattened state dict into a payload buffer, and read one back.

``encode`` plans the layout once; ``write_into`` is the hot path of ``save``:
one ``copy_`` per tensor into a view of the slot, nothing else.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import torch

from stowaway.format import safetensors_header as st
from stowaway.format import tree as tree_mod

TREE_METADATA_KEY = "stowaway.tree"

_TO_SAFETENSORS = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
    torch.uint16: "U16", torch.uint32: "U32", torch.uint64: "U64",
}
_FROM_SAFETENSORS = {name: dtype for dtype, name in _TO_SAFETENSORS.items()}


@dataclass(frozen=True)
class Encoded:
    layout: st.Layout
    # The non-empty tensors, in layout order: what ``targets`` returns views for.
    sources: list[torch.Tensor]
    # CUDA devices holding some of the sources: their copies are asynchronous and must be fenced.
    cuda_devices: frozenset[torch.device] = frozenset()

    @property
    def nbytes(self) -> int:
        return self.layout.total_bytes


class Encoder:
    """Plans layouts, reusing the previous plan while the state keeps its tensors' names, dtypes and shapes.

    A training state keeps its structure from one save to the next; only
    scalars such as step counters change. Planning a thousand tensors and
    serializing their header entries costs milliseconds of Python, which
    ``save`` would otherwise block on every time.
    """

    def __init__(self) -> None:
        self._signature: list[tuple[str, torch.dtype, torch.Size, torch.device]] = []
        self._plan: st.Plan | None = None
        self._cuda_devices: frozenset[torch.device] = frozenset()

    def encode(self, state: Any, allow_pickle: bool = False) -> Encoded:
        flat = tree_mod.flatten(state, allow_pickle)
        # Compared element by element in C: names, dtypes, torch.Size and devices are all built-in comparisons.
        signature = [(name, tensor.dtype, tensor.shape, tensor.device) for name, tensor in flat.tensors.items()]
        if self._plan is None or signature != self._signature:
            specs = [st.TensorSpec(name, _TO_SAFETENSORS[dtype], tuple(shape)) for name, dtype, shape, _ in signature]
            self._signature, self._plan = signature, st.plan(specs)
            self._cuda_devices = frozenset(device for *_, device in signature if device.type == "cuda")
        # The tree is built by flatten() and has no cycles, so the encoder need not look for any.
        tree_json = json.dumps(flat.tree, separators=(",", ":"), check_circular=False)
        metadata = {"format": "pt", TREE_METADATA_KEY: tree_json}
        layout = self._plan.layout(metadata)
        sources = [flat.tensors[item.spec.name] for item in layout.tensors if item.begin != item.end]
        return Encoded(layout, sources, self._cuda_devices)


def targets(layout: st.Layout, payload: torch.Tensor) -> list[torch.Tensor]:
    """Views of ``payload`` where each non-empty tensor of ``layout`` goes, in layout order."""
    base = layout.data_start
    return [_view(payload, base + item.begin, item) for item in layout.tensors if item.begin != item.end]


def write_into(encoded: Encoded, payload: torch.Tensor, views: list[torch.Tensor]) -> None:
    """Fill ``payload`` (a uint8 tensor over the slot) with the file image; ``views`` come from ``targets``."""
    header = encoded.layout.header
    payload[: len(header)].copy_(torch.frombuffer(bytearray(header), dtype=torch.uint8))
    with torch.no_grad():
        if not encoded.cuda_devices:
            torch._foreach_copy_(views, encoded.sources)
            return
        for view, source in zip(views, encoded.sources, strict=True):
            view.copy_(source, non_blocking=source.device.type == "cuda")
        # The fence: save() returns once the bytes are in the slot, so the caller may then change its tensors.
        for device in encoded.cuda_devices:
            torch.cuda.current_stream(device).synchronize()


def read_from(payload: torch.Tensor, nbytes: int, map_location: Any, allow_pickle: bool = False) -> Any:
    """Rebuild the state dict from a payload, copying every tensor out of the buffer."""
    raw = memoryview(payload.numpy())
    layout = st.parse(raw, nbytes)
    try:
        tree = json.loads(layout.metadata[TREE_METADATA_KEY])
    except (KeyError, json.JSONDecodeError) as exc:
        raise st.HeaderError(f"payload carries no Stowaway state tree: {exc}") from exc
    tensors = {}
    for item in layout.tensors:
        view = _view(payload, layout.data_start + item.begin, item)
        tensors[item.spec.name] = view.to(map_location, copy=True)
    return tree_mod.unflatten(tree, tensors, allow_pickle)


def _view(payload: torch.Tensor, offset: int, item: st.Placed) -> torch.Tensor:
    dtype = _FROM_SAFETENSORS[item.spec.dtype]
    return payload[offset : offset + item.spec.nbytes].view(dtype).view(item.spec.shape)
