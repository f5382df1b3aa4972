"""A save that reuses the previous save's tree writes exactly what a first save of the same state writes.

``Encoder`` keeps the last save's tree JSON as a template and fills in only
the scalars when the structure is unchanged. Whatever changes between saves,
the header bytes and the tensors copied must equal those of an encoder that
has never seen the state; and the template must be what is used for an
unchanged structure, or the optimisation silently stops working.
"""

from __future__ import annotations

import json
import math
import struct
from collections import OrderedDict

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from stowaway import UnsupportedState
from stowaway.format import codec, template


def base_state() -> dict:
    weight = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    model = OrderedDict([("0.weight", weight), ("0.bias", torch.zeros(3)), ("1.weight", weight)])
    model._metadata = OrderedDict([("", {"version": 1}), ("0", {"version": 2})])  # type: ignore[attr-defined]
    return {
        "model": model,
        "optimizer": {
            "state": {0: {"step": torch.tensor(5.0), "exp_avg": torch.ones(3, 4)}},
            "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "params": [0], "name": 'q"uote\\é'}],
        },
        "empties": [torch.empty(0), torch.empty(0, 2)],
        "views": (weight[1:], weight.t()),
        "parameter": torch.nn.Parameter(torch.ones(2), requires_grad=False),
        "numpy": ("MT19937", np.arange(5, dtype=np.uint32), 3, 0, 0.0),
        "meta": {"size": torch.Size([2, 3]), "dtype": torch.bfloat16},
        "scalars": {"step": 7, "loss": 0.25, "nan": math.nan, "inf": -math.inf, "neg_zero": -0.0, "none": None,
                    "flag": True, "big": 2**70, 3: "int key", 2.5: "float key", True: "bool key"},
    }


def header_metadata(encoded: codec.Encoded) -> dict:
    header = encoded.layout.header
    (length,) = struct.unpack_from("<Q", header)
    return json.loads(header[8 : 8 + length])["__metadata__"]


def assert_like_a_first_save(reused: codec.Encoder, state) -> codec.Encoded:
    got = reused.encode(state)
    fresh = codec.Encoder().encode(state)
    assert got.layout.header == fresh.layout.header
    assert got.layout.tensors == fresh.layout.tensors
    assert len(got.sources) == len(fresh.sources)
    assert all(a is b or torch.equal(a, b) for a, b in zip(got.sources, fresh.sources, strict=True))
    return got


def test_an_unchanged_structure_is_encoded_from_the_template():
    encoder = codec.Encoder()
    state = base_state()
    encoder.encode(state)
    walked = template.walk(state)
    assert walked is not None and encoder._template is not None and encoder._template.fits(walked)


@pytest.mark.parametrize("change", [
    "scalars", "shape", "dtype", "tie", "untie", "key_type", "swap_leaf_kinds", "list_length", "metadata",
    "parameter_flag", "numpy_dtype", "size", "new_tensor_object",
])
def test_any_change_between_saves_writes_what_a_first_save_writes(change):
    encoder = codec.Encoder()
    state = base_state()
    assert_like_a_first_save(encoder, state)
    if change == "scalars":
        state["scalars"].update(step=8, loss=math.inf, nan=0.5, neg_zero=0.0, none="now a string", flag=False)
        state["optimizer"]["param_groups"][0]["name"] = "\u2028\x00"
    elif change == "shape":
        state["optimizer"]["state"][0]["exp_avg"] = torch.ones(4, 3)
    elif change == "dtype":
        state["optimizer"]["state"][0]["exp_avg"] = torch.ones(3, 4, dtype=torch.float64)
    elif change == "tie":
        state["optimizer"]["state"][0]["exp_avg"] = state["model"]["0.weight"]
    elif change == "untie":
        state["model"]["1.weight"] = state["model"]["0.weight"].clone()
    elif change == "key_type":
        state["scalars"] = {(3.0 if key == 3 else key): value for key, value in state["scalars"].items()}
    elif change == "swap_leaf_kinds":
        state["optimizer"]["state"][0] = {"step": 5, "exp_avg": torch.tensor(5.0)}
    elif change == "list_length":
        state["empties"].append(torch.empty(0))
    elif change == "metadata":
        del state["model"]._metadata
    elif change == "parameter_flag":
        state["parameter"].requires_grad_(True)
    elif change == "numpy_dtype":
        state["numpy"] = ("MT19937", np.arange(5, dtype=np.int32), 3, 0, 0.0)
    elif change == "size":
        state["meta"]["size"] = torch.Size([3, 2])
    elif change == "new_tensor_object":
        state["optimizer"]["state"][0]["exp_avg"] = torch.full((3, 4), 2.0)
    got = assert_like_a_first_save(encoder, state)
    if change == "scalars":
        tree = json.loads(header_metadata(got)["stowaway.tree"])
        assert {"v": 8} in tree["root"]["d"][-1][1]["d"][0]


def test_a_state_the_walk_does_not_know_is_flattened_every_time():
    state = {"weights": torch.ones(2), "scalars": np.float64(0.5)}
    encoder = codec.Encoder()
    for value in (0.5, 0.75):
        state["scalars"] = np.float64(value)
        assert_like_a_first_save(encoder, state)
    assert template.walk(state) is None


def test_a_sparse_tensor_in_place_of_a_dense_one_is_refused_with_its_path():
    encoder = codec.Encoder()
    state = {"w": torch.ones(2, 2)}
    encoder.encode(state)
    state["w"] = torch.ones(2, 2).to_sparse()
    with pytest.raises(UnsupportedState, match=r"state\['w'\].*layout"):
        encoder.encode(state)


def test_a_string_that_looks_like_a_hole_does_not_break_the_tree():
    encoder = codec.Encoder()
    state = {"a": torch.ones(1), "hole": "\x00stowaway-scalar\x00", "n": 1}
    assert_like_a_first_save(encoder, state)
    state["n"] = 2
    assert_like_a_first_save(encoder, state)


leaves = st.one_of(
    st.integers(), st.floats(allow_nan=True), st.text(max_size=4), st.none(), st.booleans(),
    st.sampled_from([(2,), (1, 3), (0,), ()]).map(lambda shape: torch.ones(shape)),
)
states = st.recursive(
    leaves,
    lambda children: st.one_of(
        st.lists(children, max_size=3),
        st.lists(children, max_size=3).map(tuple),
        st.dictionaries(st.one_of(st.text(max_size=3), st.integers(-3, 3)), children, max_size=3),
    ),
    max_leaves=12,
)


@settings(max_examples=300, deadline=None)
@given(first=states, second=states)
def test_encoding_any_two_states_in_turn_writes_what_first_saves_write(first, second):
    encoder = codec.Encoder()
    for state in (first, second, first):
        assert_like_a_first_save(encoder, {"root": state})


scalars = st.one_of(st.integers(), st.floats(allow_nan=True), st.text(max_size=4), st.none(), st.booleans())


def with_new_scalars(state, draw):
    if isinstance(state, dict):
        return {key: with_new_scalars(value, draw) for key, value in state.items()}
    if isinstance(state, list | tuple):
        return type(state)(with_new_scalars(value, draw) for value in state)
    return state if isinstance(state, torch.Tensor) else draw(scalars)


@settings(max_examples=300, deadline=None)
@given(state=states, data=st.data())
def test_new_scalars_in_the_same_structure_are_written_from_the_template(state, data):
    encoder = codec.Encoder()
    encoder.encode({"root": state})
    changed = {"root": with_new_scalars(state, data.draw)}
    assert_like_a_first_save(encoder, changed)
    walked = template.walk(changed)
    assert walked is not None and encoder._template is not None and encoder._template.fits(walked)
