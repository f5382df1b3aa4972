"""Message validation: every field checked before a handler runs; the wire format kept key for key."""

from __future__ import annotations

import pytest

from stowaway.protocol import frames, messages

TO_SIDECAR = messages.Direction.TO_SIDECAR
TO_CLIENT = messages.Direction.TO_CLIENT


def hello(**overrides):
    base = {"type": "hello", "protocol": messages.PROTOCOL_VERSION, "job": "train-1", "rank": 1, "local_rank": 1,
            "world_size": 4, "local_world_size": 2, "node": "node-a", "pid": 42}
    return {**base, **overrides}


def test_a_good_hello_passes():
    decoded = messages.decode(hello(), TO_SIDECAR)
    assert isinstance(decoded, messages.Hello) and decoded.rank == 1


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
        messages.decode(hello(**overrides), TO_SIDECAR)


@pytest.mark.parametrize(
    ("message", "error"),
    [
        ({"type": "launch"}, "unknown message type 'launch'"),
        ({"type": "register", "slot": 0}, "register message lacks field 'capacity'"),
        ({"type": "register", "slot": "0", "capacity": 1}, "register.slot must be int, got str"),
        ({"type": "register", "slot": True, "capacity": 1}, "register.slot must be int, got a boolean"),
        ({"type": "register", "slot": 0, "capacity": -1}, "register.capacity must be between 0 and"),
        ({"type": "persist", "run": "r", "step": 1, "slot": 0, "generation": 1, "nbytes": 1,
          "blocking_seconds": False, "slot_wait_seconds": 0},
         "persist.blocking_seconds must be int or float, got a boolean"),
        ({"type": "welcome"}, "unknown message type 'welcome'"),
        ({"type": "restored", "step": 3, "source": "disk", "seconds": 0.1},
         "restored.source must be 'memory' or 'storage', got 'disk'"),
        ({"type": "restored", "step": 3, "source": 1, "seconds": 0.1},
         "restored.source must be 'memory' or 'storage', got 1"),
        ({"type": "restored", "step": 3, "source": ["memory"], "seconds": 0.1},
         r"restored.source must be 'memory' or 'storage', got \['memory'\]"),
        ({"type": "restored", "step": 3, "source": True, "seconds": 0.1},
         "restored.source must be 'memory' or 'storage', got a boolean"),
        ({"type": "restored", "step": -1, "source": "memory", "seconds": 0.1}, "restored.step must be between 0"),
        ({"type": "restored", "step": 3, "source": "memory", "seconds": "fast"},
         "restored.seconds must be int or float, got str"),
    ],
)
def test_malformed_messages_are_rejected_with_the_field_named(message, error):
    with pytest.raises(messages.MessageError, match=error):
        messages.decode(message, TO_SIDECAR)


@pytest.mark.parametrize(
    ("message", "error"),
    [
        ({"type": "hello"}, "unknown message type 'hello'"),
        ({"type": "failed", "step": 1, "slot": "0", "reason": "r"}, "failed.slot must be int or NoneType, got str"),
        ({"type": "welcome", "protocol": 1, "node": "n", "busy": [0, True], "shm_dir": "/dev/shm"},
         r"welcome.busy\[1\] must be int, got a boolean"),
        ({"type": "inventory", "committed": [{"step": 1}], "memory": [], "other_world": []},
         r"inventory.committed\[0\] lacks field 'nbytes'"),
        ({"type": "inventory", "committed": [], "memory": [7], "other_world": []},
         r"inventory.memory\[0\] must be dict, got int"),
        ({"type": "released", "slot": 0, "step": 2**63, "generation": 1}, "released.step must be between 0 and"),
    ],
)
def test_malformed_answers_of_the_sidecar_are_rejected_with_the_field_named(message, error):
    with pytest.raises(messages.MessageError, match=error):
        messages.decode(message, TO_CLIENT)


def test_slot_indices_are_bounded():
    assert messages.Register(slot=64, capacity=1).slot == messages.POOLED_SLOT_BASE, "the first pooled spare"
    with pytest.raises(messages.MessageError, match=r"slot index 72 is outside 0\.\.71"):
        messages.Register(slot=72, capacity=1)
    with pytest.raises(messages.MessageError, match="slot index -1"):
        messages.decode({"type": "stage", "step": 1, "slot": -1}, TO_SIDECAR)
    with pytest.raises(messages.MessageError, match="slot index 99"):
        messages.decode({"type": "inventory", "committed": [], "memory": [{"step": 1, "slot": 99}],
                         "other_world": []}, TO_CLIENT)


# What each message looked like on the wire when messages were dicts: the typed ones must encode to exactly these.
WIRE = [
    (TO_SIDECAR, hello()),
    (TO_SIDECAR, {"type": "register", "slot": 1, "capacity": 4096}),
    (TO_SIDECAR, {"type": "persist", "run": "r", "step": 7, "slot": 1, "generation": 3, "nbytes": 100,
                  "blocking_seconds": 0.25, "slot_wait_seconds": 0}),
    (TO_SIDECAR, {"type": "persist", "run": "r", "step": 8, "slot": 0, "generation": 4, "nbytes": 100,
                  "blocking_seconds": 0.001, "slot_wait_seconds": 0, "staging_seconds": 0.5, "stall_seconds": 0.1}),
    (TO_SIDECAR, {"type": "query"}),
    (TO_SIDECAR, {"type": "stage", "step": 7, "slot": 0}),
    (TO_SIDECAR, {"type": "open", "step": 7, "ranks": [0, 3]}),
    (TO_SIDECAR, {"type": "open", "step": 7, "ranks": [0, 3], "from_memory": True}),
    (TO_SIDECAR, {"type": "restored", "step": 7, "source": "memory", "seconds": 0.031}),
    (TO_SIDECAR, {"type": "restored", "step": 7, "source": "storage", "seconds": 2}),
    (TO_CLIENT, {"type": "welcome", "protocol": 1, "node": "node-a", "busy": [0, 2], "shm_dir": "/dev/shm"}),
    (TO_CLIENT, {"type": "registered", "slot": 1}),
    (TO_CLIENT, {"type": "released", "slot": 1, "step": 7, "generation": 3}),
    (TO_CLIENT, {"type": "persisted", "step": 7}),
    (TO_CLIENT, {"type": "committed", "step": 7}),
    (TO_CLIENT, {"type": "failed", "step": 7, "slot": None, "reason": "commit timed out"}),
    (TO_CLIENT, {"type": "failed", "step": 7, "slot": 1, "reason": "storage is full"}),
    (TO_CLIENT, {"type": "inventory", "committed": [{"step": 7, "nbytes": 100}], "memory": [{"step": 7, "slot": 1}],
                 "other_world": [{"step": 9, "world_size": 8}], "files_passed": True}),
    (TO_CLIENT, {"type": "inventory", "committed": [], "memory": [], "other_world": [], "files_passed": False}),
    (TO_CLIENT, {"type": "staged", "step": 7, "slot": 0, "generation": 4, "nbytes": 100}),
    (TO_CLIENT, {"type": "opened", "step": 7, "ranks": [0, 3], "reason": None}),
    (TO_CLIENT, {"type": "opened", "step": 7, "ranks": [0, 3], "reason": None, "payload_offsets": [4096, 0]}),
    (TO_CLIENT, {"type": "opened", "step": 7, "ranks": [], "reason": "step 7 cannot be opened"}),
    (TO_CLIENT, {"type": "error", "reason": "hello sent twice on one connection"}),
]


@pytest.mark.parametrize(("direction", "wire"), WIRE, ids=[f"{wire['type']}-{i}" for i, (_, wire) in enumerate(WIRE)])
def test_every_message_decodes_to_its_class_and_encodes_to_the_same_frame_bytes(direction, wire):
    decoded = messages.decode(wire, direction)
    assert type(decoded) is direction.kinds[wire["type"]]
    assert frames.encode(messages.encode(decoded)) == frames.encode(wire)


def test_the_wire_examples_cover_every_message_type():
    for direction in messages.Direction:
        assert {wire["type"] for side, wire in WIRE if side is direction} == set(direction.kinds)


def test_keys_a_message_does_not_have_are_ignored():
    decoded = messages.decode({"type": "committed", "step": 3, "later": "field"}, TO_CLIENT)
    assert messages.encode(decoded) == {"type": "committed", "step": 3}


def test_messages_are_frozen_and_built_from_code_checked_like_from_the_wire():
    committed = messages.Committed(step=3)
    with pytest.raises(AttributeError):
        committed.step = 4
    with pytest.raises(messages.MessageError, match=r"committed\.step must be int, got str"):
        messages.Committed(step="3")
    welcome = messages.Welcome(protocol=1, node="n", busy=[2, 0], shm_dir="/s")
    assert welcome.busy == (2, 0), "a JSON list becomes a tuple"


def test_a_long_value_outside_a_literal_is_shortened_in_the_error():
    with pytest.raises(messages.MessageError) as refused:
        messages.decode({"type": "restored", "step": 3, "source": "x" * 60_000, "seconds": 0}, TO_SIDECAR)
    # The error goes back to the peer in one frame, which a 60 kB value would overflow.
    assert len(str(refused.value)) < 200


def test_a_persist_without_the_optional_staging_fields_is_a_blocking_save_and_encodes_without_them():
    """A client that predates them sends none; a sidecar that predates them never sees them for a blocking save."""
    wire = {"type": "persist", "run": "r", "step": 7, "slot": 1, "generation": 3, "nbytes": 100,
            "blocking_seconds": 0.25, "slot_wait_seconds": 0}
    decoded = messages.decode(wire, TO_SIDECAR)
    assert isinstance(decoded, messages.Persist)
    assert decoded.staging_seconds is None and decoded.stall_seconds is None and decoded.hidden_seconds is None
    assert messages.encode(decoded) == wire
    assert messages.decode({**wire, "staging_seconds": None}, TO_SIDECAR) == decoded


@pytest.mark.parametrize(("staging", "stall", "hidden"), [(0.5, 0.1, 0.15), (0.5, None, 0.25), (0.3, 0.2, 0.0)])
def test_the_hidden_copy_time_is_staging_less_blocking_less_stall_never_negative(staging, stall, hidden):
    persist = messages.Persist(run="r", step=1, slot=0, generation=1, nbytes=1, blocking_seconds=0.25,
                               slot_wait_seconds=0, staging_seconds=staging, stall_seconds=stall)
    assert persist.hidden_seconds == pytest.approx(hidden)


def test_optional_staging_fields_are_checked_like_the_others():
    wire = {"type": "persist", "run": "r", "step": 7, "slot": 1, "generation": 3, "nbytes": 100,
            "blocking_seconds": 0.25, "slot_wait_seconds": 0}
    with pytest.raises(messages.MessageError, match=r"persist.staging_seconds must be int or float or NoneType"):
        messages.decode({**wire, "staging_seconds": "slow"}, TO_SIDECAR)
    with pytest.raises(messages.MessageError, match=r"persist.stall_seconds must be int or float or NoneType, got a b"):
        messages.decode({**wire, "stall_seconds": True}, TO_SIDECAR)


def test_an_open_naming_more_files_than_one_message_can_pass_is_refused():
    with pytest.raises(messages.MessageError, match=r"open names 253 ranks; at most 252"):
        messages.decode({"type": "open", "step": 1, "ranks": list(range(253))}, TO_SIDECAR)
    with pytest.raises(messages.MessageError, match=r"open names 1 ranks"):
        messages.decode({"type": "open", "step": 1, "ranks": [-1]}, TO_SIDECAR)


def test_an_open_from_memory_takes_a_boolean_and_its_answer_one_offset_per_rank():
    with pytest.raises(messages.MessageError, match=r"open.from_memory must be bool or NoneType, got str"):
        messages.decode({"type": "open", "step": 1, "ranks": [0], "from_memory": "yes"}, TO_SIDECAR)
    with pytest.raises(messages.MessageError, match=r"opened gives 1 payload offsets for 2 ranks"):
        messages.decode({"type": "opened", "step": 1, "ranks": [0, 1], "reason": None, "payload_offsets": [0]},
                        TO_CLIENT)


def test_a_stage_of_a_range_names_rank_begin_and_size_together_and_a_plain_stage_still_decodes():
    plain = messages.decode({"type": "stage", "step": 3, "slot": 1}, TO_SIDECAR)
    assert isinstance(plain, messages.Stage) and plain.span is None
    assert messages.encode(plain) == {"type": "stage", "step": 3, "slot": 1}, "an older sidecar reads the same frame"
    ranged = messages.decode({"type": "stage", "step": 3, "slot": 1, "rank": 5, "begin": 64, "nbytes": 8}, TO_SIDECAR)
    assert isinstance(ranged, messages.Stage) and ranged.span == (5, 64, 8)
    with pytest.raises(messages.MessageError, match=r"stage of a range needs rank, begin and nbytes together"):
        messages.decode({"type": "stage", "step": 3, "slot": 1, "rank": 5, "begin": 64}, TO_SIDECAR)
    with pytest.raises(messages.MessageError, match=r"stage names rank -1"):
        messages.decode({"type": "stage", "step": 3, "slot": 1, "rank": -1, "begin": 0, "nbytes": 8}, TO_SIDECAR)
    with pytest.raises(messages.MessageError, match=r"stage.begin must be between 0"):
        messages.decode({"type": "stage", "step": 3, "slot": 1, "rank": 0, "begin": -4, "nbytes": 8}, TO_SIDECAR)
