"""The one table of the tensor dtypes a payload stores. Pure: no torch, no I/O.

A dtype has three names that must agree: the safetensors header's, torch's,
and its element size, which places and bounds every tensor. The header
module and the torch-free CLI read the sizes; the torch side
(``tree.SAFETENSORS_NAMES``) looks the torch dtypes up by name, so this
table is the only place a dtype is added.
"""

from __future__ import annotations

from typing import NamedTuple


class Dtype(NamedTuple):
    # As the safetensors header's "dtype" names it.
    safetensors: str
    # The attribute of the ``torch`` module.
    torch: str
    element_bytes: int


TABLE: tuple[Dtype, ...] = (
    Dtype("F64", "float64", 8),
    Dtype("F32", "float32", 4),
    Dtype("F16", "float16", 2),
    Dtype("BF16", "bfloat16", 2),
    Dtype("I64", "int64", 8),
    Dtype("I32", "int32", 4),
    Dtype("I16", "int16", 2),
    Dtype("I8", "int8", 1),
    Dtype("U8", "uint8", 1),
    Dtype("BOOL", "bool", 1),
    Dtype("F8_E4M3", "float8_e4m3fn", 1),
    Dtype("F8_E5M2", "float8_e5m2", 1),
    Dtype("U16", "uint16", 2),
    Dtype("U32", "uint32", 4),
    Dtype("U64", "uint64", 8),
)

# By safetensors name: a tensor's size, and (a name missing here) whether a header read back is readable at all.
ELEMENT_BYTES: dict[str, int] = {dtype.safetensors: dtype.element_bytes for dtype in TABLE}
