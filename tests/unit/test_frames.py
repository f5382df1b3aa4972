"""The frame decoder: any chunking decodes the same; garbage becomes one clear error."""

from __future__ import annotations

import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st

from stowaway.protocol import frames

json_scalars = st.none() | st.booleans() | st.integers(-(2**63), 2**63) | st.text(max_size=20)
messages = st.dictionaries(st.text(max_size=10), json_scalars, max_size=6)


@given(st.lists(messages, min_size=1, max_size=8), st.data())
def test_any_chunking_of_a_stream_decodes_to_the_same_messages(batch, data):
    stream = b"".join(frames.encode(message) for message in batch)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(stream)), max_size=10)))
    decoder = frames.FrameDecoder()
    decoded = []
    for begin, end in zip([0, *cuts], [*cuts, len(stream)], strict=True):
        decoded.extend(decoder.feed(stream[begin:end]))
    assert decoded == batch
    assert decoder.pending_bytes == 0


@given(st.binary(min_size=1, max_size=512))
def test_garbage_never_escapes_as_anything_but_a_frame_error(garbage):
    decoder = frames.FrameDecoder()
    try:
        for message in decoder.feed(garbage):
            assert isinstance(message, dict)
    except frames.FrameError as exc:
        assert str(exc)


def test_an_oversized_length_is_refused_before_any_payload_arrives():
    decoder = frames.FrameDecoder()
    with pytest.raises(frames.FrameError, match="exceeds the 65536-byte limit"):
        list(decoder.feed(struct.pack(">I", 2**31)))


def test_a_decoder_that_lost_framing_refuses_further_input():
    decoder = frames.FrameDecoder()
    with pytest.raises(frames.FrameError):
        list(decoder.feed(struct.pack(">I", 3) + b"abc"))
    with pytest.raises(frames.FrameError, match="not UTF-8 JSON"):
        list(decoder.feed(frames.encode({"type": "query"})))


def test_a_json_array_is_not_a_message():
    with pytest.raises(frames.FrameError, match="JSON list, expected an object"):
        list(frames.FrameDecoder().feed(struct.pack(">I", 2) + b"[]"))


def test_deeply_nested_json_is_an_error_not_a_crash():
    payload = b"[" * 30000 + b"]" * 30000
    with pytest.raises(frames.FrameError):
        list(frames.FrameDecoder().feed(struct.pack(">I", len(payload)) + payload))


def test_a_truncated_frame_stays_pending():
    frame = frames.encode({"type": "query"})
    decoder = frames.FrameDecoder()
    assert list(decoder.feed(frame[:-1])) == []
    assert decoder.pending_bytes == len(frame) - 1


def test_encoding_refuses_a_message_larger_than_a_frame():
    with pytest.raises(frames.FrameError, match="frame limit"):
        frames.encode({"type": "x", "blob": "a" * 70000})
