"""Message validation: every field checked before a handler runs."""

from __future__ import annotations

import pytest

from stowaway.protocol import messages


def hello(**overrides):
    base = {"type": "hello", "protocol": messages.PROTOCOL_VERSION, "job": "train-1", "rank": 1, "local_rank": 1,
            "world_size": 4, "local_world_size": 2, "node": "node-a", "pid": 42}
    return {**base, **overrides}


def test_a_good_hello_passes():
    assert messages.validate_hello(messages.validate(hello(), messages.CLIENT_MESSAGES))["rank"] == 1


@pytest.mark.parametrize(
    ("overrides", "error"),
    [
        ({"protocol": 99}, "protocol version 99 is not supported"),
        ({"job": "../etc"}, "job name '../etc' is invalid"),
        ({"job": ""}, "job name '' is invalid"),
        ({"rank": 4}, "rank 4 is not within world size 4"),
        ({"local_rank": 2}, "local rank 2 is not within local world size 2"),
        ({"node": "a/b"}, "node name 'a/b' is invalid"),
    ],
)
def test_a_bad_hello_names_what_is_wrong(overrides, error):
    with pytest.raises(messages.MessageError, match=error.replace("(", r"\(")):
        messages.validate_hello(messages.validate(hello(**overrides), messages.CLIENT_MESSAGES))


@pytest.mark.parametrize(
    ("message", "error"),
    [
        ({"type": "launch"}, "unknown message type 'launch'"),
        ({"type": "register", "slot": 0}, "register message lacks field 'capacity'"),
        ({"type": "register", "slot": "0", "capacity": 1}, "register.slot must be int, got str"),
        ({"type": "register", "slot": True, "capacity": 1}, "register.slot must be int, got a boolean"),
    ],
)
def test_malformed_messages_are_rejected_with_the_field_named(message, error):
    with pytest.raises(messages.MessageError, match=error):
        messages.validate(message, messages.CLIENT_MESSAGES)


def test_slot_indices_are_bounded():
    with pytest.raises(messages.MessageError, match="slot index 64"):
        messages.check_slot_index(64)
