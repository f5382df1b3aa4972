"""Build and parse safetensors headers. Pure: no torch, no I/O.

safetensors rules we rely on: an 8-byte little-endian header length, a JSON
header mapping tensor names to dtype/shape/data_offsets plus a string-only
``__metadata__``, then the data buffer, fully indexed with no holes.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from operator import itemgetter
from typing import NamedTuple

from stowaway.format import dtypes

METADATA_KEY = "__metadata__"
# The data starts on a page boundary: a header that grows by a few bytes (a step counter gaining a
# digit) then rarely moves the data, so cached views of a slot stay valid from one save to the next.
DATA_ALIGNMENT = 4096
MAX_HEADER_BYTES = 100 * 2**20
_METADATA_OPENING = b'{"' + METADATA_KEY.encode() + b'":'


class HeaderError(ValueError):
    """Bytes that do not form a safetensors header this release can read."""


class TensorSpec(NamedTuple):
    # Tuples rather than dataclasses: a restore builds one per tensor, thousands of them.
    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        count = 1
        for dim in self.shape:
            count *= dim
        return count * dtypes.ELEMENT_BYTES[self.dtype]


class Placed(NamedTuple):
    spec: TensorSpec
    begin: int
    end: int


@dataclass(frozen=True)
class Layout:
    header: bytes
    tensors: list[Placed]

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
    # The tensor entries as JSON members, with the comma that joins them to the metadata (b"" when none).
    entries_json: bytes

    def layout(self, metadata_json: str) -> Layout:
        """The layout with ``metadata_json``, the ``__metadata__`` object already serialized.

        Serialized by the caller, who may keep most of it from the last save:
        escaping a large string into JSON costs more than the rest of the header.
        The header is joined once: each large intermediate copy would cost page faults.
        """
        metadata = metadata_json.encode()
        unpadded = 8 + len(_METADATA_OPENING) + len(metadata) + len(self.entries_json) + 1
        padding = -unpadded % DATA_ALIGNMENT
        length = unpadded - 8 + padding
        header = b"".join((struct.pack("<Q", length), _METADATA_OPENING, metadata, self.entries_json, b"}",
                           b" " * padding))
        return Layout(header, self.tensors)


def plan(specs: list[TensorSpec]) -> Plan:
    """Place tensors largest element first, so every offset is aligned to its element size."""
    ordered = sorted(specs, key=lambda spec: (-dtypes.ELEMENT_BYTES[spec.dtype], spec.name))
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
    members = json.dumps(entries, separators=(",", ":"))[1:-1]
    return Plan(placed, f",{members}".encode() if members else b"")


class Decoded(NamedTuple):
    """A header decoded but its tensors not yet placed: a reader of a few tensors of a large header (a
    resharding rank reads a few of each saved rank's) places only those, with ``placed``."""

    header: bytes
    entries: dict[str, object]
    metadata: dict[str, str]
    data_bytes: int

    def placed(self, name: str) -> Placed | None:
        """Where tensor ``name`` lies in the data, checked against the data's size; None if the header has none."""
        entry = self.entries.get(name)
        if entry is None:
            return None
        item = _placed(name, entry)
        if item.begin < 0 or item.end > self.data_bytes:
            raise HeaderError(f"tensor {name!r} has offsets outside the data")
        return item


def decode(buffer: memoryview | bytes, available: int) -> Decoded:
    """Decode the header at the start of ``buffer``; ``available`` bounds every offset."""
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
    if not isinstance(metadata, dict) or not all(isinstance(value, str) for value in metadata.values()):
        raise HeaderError(f"header's {METADATA_KEY} is not a map of strings")
    return Decoded(bytes(buffer[: 8 + length]), entries, metadata, available - 8 - length)


def parse(buffer: memoryview | bytes, available: int) -> tuple[Layout, dict[str, str]]:
    """Parse the header at the start of ``buffer`` into its layout and metadata; ``available`` bounds every offset."""
    decoded = decode(buffer, available)
    placed = [_placed(name, entry) for name, entry in decoded.entries.items()]
    placed.sort(key=itemgetter(1))
    cursor = 0
    for item in placed:
        if item.begin != cursor or item.end > decoded.data_bytes:
            raise HeaderError(f"tensor {item.spec.name!r} has offsets outside the data or leaves a hole")
        cursor = item.end
    return Layout(decoded.header, placed), decoded.metadata


def _placed(name: str, entry: object) -> Placed:
    try:
        dtype, shape, (begin, end) = entry["dtype"], tuple(entry["shape"]), entry["data_offsets"]  # type: ignore[index]
        # math.prod gives a float for a float dimension and fails on anything but numbers.
        nbytes = math.prod(shape) * dtypes.ELEMENT_BYTES[dtype]
        negative = bool(shape) and min(shape) < 0
    except (TypeError, KeyError, ValueError) as exc:
        raise HeaderError(f"tensor {name!r} has a malformed entry or an unknown dtype: {exc!r}") from exc
    if type(nbytes) is not int or negative or type(begin) is not int or type(end) is not int or end - begin != nbytes:
        raise HeaderError(f"tensor {name!r} has shape {list(shape)} and spans offsets {begin}..{end}, "
                          "which do not fit each other")
    return Placed(TensorSpec(name, dtype, shape), begin, end)
