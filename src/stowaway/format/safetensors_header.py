"""Build and parse safetensors headers. Pure: no torch, no I/O.

safetensors rules we rely on: an 8-byte little-endian header length, a JSON
header mapping tensor names to dtype/shape/data_offsets plus a string-only
``__metadata__``, then the data buffer, fully indexed with no holes.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass

METADATA_KEY = "__metadata__"
# The data starts on a page boundary: a header that grows by a few bytes (a step counter gaining a
# digit) then rarely moves the data, so cached views of a slot stay valid from one save to the next.
DATA_ALIGNMENT = 4096
MAX_HEADER_BYTES = 100 * 2**20

ELEMENT_BYTES = {
    "F64": 8, "I64": 8, "U64": 8,
    "F32": 4, "I32": 4, "U32": 4,
    "F16": 2, "BF16": 2, "I16": 2, "U16": 2,
    "I8": 1, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1,
}


class HeaderError(ValueError):
    """Bytes that do not form a safetensors header this release can read."""


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        count = 1
        for dim in self.shape:
            count *= dim
        return count * ELEMENT_BYTES[self.dtype]


@dataclass(frozen=True)
class Placed:
    spec: TensorSpec
    begin: int
    end: int


@dataclass(frozen=True)
class Layout:
    header: bytes
    tensors: list[Placed]
    metadata: dict[str, str]

    @property
    def data_start(self) -> int:
        return len(self.header)

    @property
    def total_bytes(self) -> int:
        return self.data_start + (self.tensors[-1].end if self.tensors else 0)


@dataclass(frozen=True)
class Plan:
    """Where every tensor goes, with its header entries serialized once; ``layout`` adds the metadata."""

    tensors: list[Placed]
    entries_json: str

    def layout(self, metadata: dict[str, str]) -> Layout:
        fields = [json.dumps(METADATA_KEY) + ":" + json.dumps(metadata, separators=(",", ":"))]
        if self.entries_json:
            fields.append(self.entries_json)
        body = ("{" + ",".join(fields) + "}").encode()
        padded = -(-(8 + len(body)) // DATA_ALIGNMENT) * DATA_ALIGNMENT - 8
        body += b" " * (padded - len(body))
        return Layout(struct.pack("<Q", len(body)) + body, self.tensors, metadata)


def plan(specs: list[TensorSpec]) -> Plan:
    """Place tensors largest element first, so every offset is aligned to its element size."""
    ordered = sorted(specs, key=lambda spec: (-ELEMENT_BYTES[spec.dtype], spec.name))
    placed, offset = [], 0
    for spec in ordered:
        placed.append(Placed(spec, offset, offset + spec.nbytes))
        offset += spec.nbytes
    entries = {
        item.spec.name: {
            "dtype": item.spec.dtype, "shape": list(item.spec.shape), "data_offsets": [item.begin, item.end],
        }
        for item in placed
    }
    return Plan(placed, json.dumps(entries, separators=(",", ":"))[1:-1])


def parse(buffer: memoryview | bytes, available: int) -> Layout:
    """Parse the header at the start of ``buffer``; ``available`` bounds every offset."""
    if available < 8:
        raise HeaderError(f"payload of {available} bytes is too short for a safetensors header")
    (length,) = struct.unpack_from("<Q", buffer)
    if length > MAX_HEADER_BYTES or 8 + length > available:
        raise HeaderError(f"header length {length} does not fit in a payload of {available} bytes")
    try:
        entries = json.loads(bytes(buffer[8 : 8 + length]))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise HeaderError(f"header is not JSON: {exc}") from exc
    if not isinstance(entries, dict):
        raise HeaderError("header is not a JSON object")
    metadata = entries.pop(METADATA_KEY, {}) or {}
    placed = [_placed(name, entry) for name, entry in entries.items()]
    placed.sort(key=lambda item: item.begin)
    data_bytes = available - 8 - length
    cursor = 0
    for item in placed:
        if item.begin != cursor or item.end > data_bytes:
            raise HeaderError(f"tensor {item.spec.name!r} has offsets outside the data or leaves a hole")
        cursor = item.end
    return Layout(bytes(buffer[: 8 + length]), placed, metadata)


def _placed(name: str, entry: object) -> Placed:
    try:
        dtype, shape, (begin, end) = entry["dtype"], tuple(entry["shape"]), entry["data_offsets"]  # type: ignore[index]
    except (TypeError, KeyError, ValueError) as exc:
        raise HeaderError(f"tensor {name!r} has a malformed entry: {exc}") from exc
    if dtype not in ELEMENT_BYTES:
        raise HeaderError(f"tensor {name!r} has dtype {dtype!r}, which this release does not read")
    spec = TensorSpec(name, dtype, shape)
    if end - begin != spec.nbytes:
        raise HeaderError(f"tensor {name!r} spans {end - begin} bytes, its shape needs {spec.nbytes}")
    return Placed(spec, begin, end)
