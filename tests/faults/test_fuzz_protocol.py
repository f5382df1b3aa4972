"""Fuzzing the socket protocol: the pure decoder and validator, then a live sidecar.

tests/unit/test_frames.py already feeds random chunkings and raw garbage to the
decoder; here the inputs are nearly valid (real length prefixes around JSON
that is almost a message), which is what reaches the validator and the
sidecar's handlers, and where a crash would hide.
"""

from __future__ import annotations

import dataclasses
import json
import struct
import typing
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from faults.wire import exchange
from stowaway.protocol import frames, messages

pytestmark = pytest.mark.faults

TO_SIDECAR = messages.Direction.TO_SIDECAR
LIVE_EXAMPLES = 120
# The fields docs/protocol.md bounds, written out here so that the test holds the module to the specification.
INT64_FIELDS = {"step", "generation", "nbytes", "capacity", "pid"}
# Longer than any name the strategies make, so no fuzzed hello can supersede the real rank's connection.
REAL_JOB = "the-real-rank-job"

# Unbounded integers and non-finite floats on purpose: json.loads turns 5000 digits into a ValueError and
# accepts NaN, neither of which a message may carry.
json_leaves = (st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12)
               | st.sampled_from(sorted(TO_SIDECAR.kinds)))
json_values = st.recursive(json_leaves, lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=12)


def field_types(kind: str) -> dict[str, Any]:
    """Each field of a client message and its type or ``Literal`` (``float`` fields take ints too), in wire order."""
    cls = TO_SIDECAR.kinds[kind]
    hints = typing.get_type_hints(cls)
    return {field.name: hints[field.name] for field in dataclasses.fields(cls)}


def optional_fields(kind: str) -> set[str]:
    """The fields a frame may lack (they have a default, None), as docs/protocol.md lists them."""
    return {field.name for field in dataclasses.fields(TO_SIDECAR.kinds[kind])
            if field.default is not dataclasses.MISSING}


def good_values(expected: Any) -> st.SearchStrategy[Any]:
    """Values of the field's JSON type, some out of range: what a buggy client would send."""
    if typing.get_origin(expected) is typing.Literal:
        return st.sampled_from(typing.get_args(expected)) | st.text(max_size=8)
    return st.text(max_size=8) if expected is str else st.integers(-3, 70)


@st.composite
def near_messages(draw: st.DrawFn) -> dict[str, Any]:
    """A client message whose fields are each kept, dropped or replaced by any JSON value."""
    kind = draw(st.sampled_from(sorted(TO_SIDECAR.kinds)))
    message: dict[str, Any] = {"type": kind}
    for field, expected in field_types(kind).items():
        choice = draw(st.sampled_from(["good", "good", "missing", "any"]))
        if choice == "good":
            message[field] = draw(good_values(expected))
        elif choice == "any":
            message[field] = draw(json_values)
    return message


def frame_of(payload: bytes) -> bytes:
    return struct.pack(">I", len(payload)) + payload


json_payloads = st.one_of(
    near_messages().map(lambda m: json.dumps(m).encode()),
    json_values.map(lambda v: json.dumps(v).encode()),
    st.integers(4000, 5000).map(lambda digits: b'{"type": "hello", "pid": ' + b"7" * digits + b"}"),
    st.binary(max_size=64),
)


@given(st.lists(json_payloads, min_size=1, max_size=6))
@example([b'{"type": "query", "pid": ' + b"7" * 5000 + b"}"])
@example([b'{"type": "persist", "blocking_seconds": NaN}'])
def test_near_valid_frames_decode_to_json_objects_or_one_frame_error(payloads: list[bytes]) -> None:
    decoder = frames.FrameDecoder()
    try:
        for message in decoder.feed(b"".join(frame_of(p) for p in payloads)):
            assert isinstance(message, dict)
            frames.encode(message)  # whatever decodes is standard JSON again: no NaN, no Infinity
    except frames.FrameError as exc:
        assert str(exc).startswith(("frame is not UTF-8 JSON", "frame holds a JSON"))


@given(near_messages())
def test_validation_accepts_only_well_typed_in_range_messages_and_names_the_field_it_refuses(
    message: dict[str, Any]
) -> None:
    fields = field_types(message["type"])
    try:
        decoded = messages.decode(message, TO_SIDECAR)
    except messages.MessageError as exc:
        names = {message["type"], *fields, *(field.replace("_", " ") for field in fields)}
        assert any(name in str(exc) for name in names), f"the error names neither the message nor a field: {exc}"
        return
    assert type(decoded) is TO_SIDECAR.kinds[message["type"]]
    optional = optional_fields(message["type"])
    for field, expected in fields.items():
        value = getattr(decoded, field)
        if field in optional:
            if value is None:
                continue
            (expected,) = [arm for arm in typing.get_args(expected) if arm is not type(None)]
        if typing.get_origin(expected) is typing.Literal:
            assert value in typing.get_args(expected), (field, value)
            continue
        # A parameterised type (``tuple[int, ...]``) is checked by its origin: isinstance cannot take it whole.
        checked = (int, float) if expected is float else typing.get_origin(expected) or expected
        assert isinstance(value, checked), (field, value)
        assert not isinstance(value, bool), (field, value)
        if field in INT64_FIELDS:
            assert 0 <= value <= messages.MAX_INT64
        if field == "slot":
            assert 0 <= value < messages.MAX_SLOTS_PER_RANK
    sent = {key: value for key, value in message.items() if value is not None or key not in optional}
    assert messages.encode(decoded) == sent, "the message decoded is not the one sent (less optional nulls)"


HELLO = {"type": "hello", "protocol": messages.PROTOCOL_VERSION, "rank": 0, "local_rank": 0, "world_size": 1,
         "local_world_size": 1, "node": "fuzz", "pid": 1}
hellos = st.builds(lambda job: {**HELLO, "job": job}, st.from_regex(r"\Afuzz[a-z0-9]{0,6}\Z"))
streams = st.tuples(
    st.one_of(hellos.map(frames.encode), json_payloads.map(frame_of)),
    st.lists(st.one_of(near_messages().map(lambda m: frame_of(json.dumps(m).encode())), json_payloads.map(frame_of),
                       st.binary(max_size=16)), max_size=5),
)


def is_valid_hello(frame: bytes) -> bool:
    """The oracle: what the pure decoder and validator say about a connection's first frame."""
    try:
        decoded = list(frames.FrameDecoder().feed(frame))
        if len(decoded) != 1 or decoded[0].get("type") != "hello":
            return False
        messages.decode(decoded[0], TO_SIDECAR)
    except (frames.FrameError, messages.MessageError):
        return False
    return True


def test_a_live_sidecar_answers_fuzzed_connections_with_valid_frames_and_keeps_serving_a_real_rank(
    start_sidecar, start_rank
):
    sidecar = start_sidecar()
    rank = start_rank(sidecar, job=REAL_JOB)
    rank.save(1)

    @settings(max_examples=LIVE_EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(streams)
    def one_connection(stream: tuple[bytes, list[bytes]]) -> None:
        first, rest = stream
        answers = exchange(sidecar.socket, first + b"".join(rest))
        for answer in answers:
            messages.decode(answer, messages.Direction.TO_CLIENT)
        errors = [i for i, answer in enumerate(answers) if answer["type"] == "error"]
        assert errors in ([], [len(answers) - 1]), f"an error frame must be the last frame: {answers}"
        if errors:
            assert answers[-1]["reason"].strip(), "an error must say what was wrong"
        if is_valid_hello(first):
            assert answers and answers[0]["type"] == "welcome", answers
        else:
            assert [answer["type"] for answer in answers] == ["error"], answers
        assert sidecar.alive(), sidecar.log()

    one_connection()
    rank.save(2)
    for step in (1, 2):
        assert rank.wait(step)["committed"], "the real rank keeps saving through the fuzzing"
    assert "Traceback" not in sidecar.log(), sidecar.log()
