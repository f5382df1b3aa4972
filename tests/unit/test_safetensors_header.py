"""Headers read back from a slot or a file are refused, with the reason, unless every entry is well formed."""

from __future__ import annotations

import json
import struct

import pytest

from stowaway.format import safetensors_header as st


def image(entries: dict, data: bytes = bytes(8)) -> bytes:
    body = json.dumps(entries).encode()
    return struct.pack("<Q", len(body)) + body + data


def test_a_well_formed_header_gives_its_tensors_in_offset_order_and_its_metadata():
    raw = image({"__metadata__": {"k": "v"}, "b": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]},
                 "a": {"dtype": "I16", "shape": [2], "data_offsets": [0, 4]}})
    layout, metadata = st.parse(raw, len(raw))
    assert [item.spec.name for item in layout.tensors] == ["a", "b"]
    assert metadata == {"k": "v"}


@pytest.mark.parametrize(("entry", "reason"), [
    ({"dtype": "F32", "shape": [-1, -2], "data_offsets": [0, 8]}, "do not fit"),
    ({"dtype": "F32", "shape": [2.0], "data_offsets": [0, 8]}, "do not fit"),
    ({"dtype": "F32", "shape": [2], "data_offsets": [0, 8.0]}, "do not fit"),
    ({"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}, "do not fit"),
    ({"dtype": "F32", "shape": ["2"], "data_offsets": [0, 8]}, "malformed"),
    ({"dtype": "X9", "shape": [2], "data_offsets": [0, 8]}, "unknown dtype"),
    ({"dtype": "F32", "shape": [2]}, "malformed"),
])
def test_a_malformed_entry_is_refused_with_the_tensor_named(entry, reason):
    raw = image({"t": entry})
    with pytest.raises(st.HeaderError, match=rf"tensor 't' .*{reason}"):
        st.parse(raw, len(raw))


def test_metadata_that_is_not_a_map_of_strings_is_refused():
    for metadata in (["x"], {"k": 1}):
        raw = image({"__metadata__": metadata, "t": {"dtype": "U8", "shape": [8], "data_offsets": [0, 8]}})
        with pytest.raises(st.HeaderError, match="not a map of strings"):
            st.parse(raw, len(raw))


def test_a_tensor_placed_alone_is_checked_as_it_would_be_with_the_whole_layout():
    raw = image({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                 "far": {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]},
                 "bad": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}})
    decoded = st.decode(raw, len(raw))
    assert decoded.placed("a") == st.Placed(st.TensorSpec("a", "F32", (2,)), 0, 8)
    assert decoded.placed("missing") is None
    with pytest.raises(st.HeaderError, match="tensor 'far' has offsets outside the data"):
        decoded.placed("far")
    with pytest.raises(st.HeaderError, match=r"tensor 'bad' .*do not fit"):
        decoded.placed("bad")
