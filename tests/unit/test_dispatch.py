"""Each side hands every message of the other side to a handler of its table; one without a handler is an error."""

from __future__ import annotations

import pytest

from stowaway.client import answers, connection
from stowaway.protocol import dispatch, messages
from stowaway.sidecar import session


def test_every_message_a_rank_sends_has_a_handler_in_the_sidecar():
    assert session._HANDLERS.kinds() == set(messages.Direction.TO_SIDECAR.kinds.values())


def test_every_message_the_sidecar_sends_has_a_handler_in_the_rank():
    handled = answers.TABLE.kinds() | connection.HANDLED_HERE
    assert handled == set(messages.Direction.TO_CLIENT.kinds.values())
    assert not answers.TABLE.kinds() & connection.HANDLED_HERE, "one message, two places that handle it"


class Recorder:
    def __init__(self) -> None:
        self.seen: list[messages.Message] = []


TABLE: dispatch.Table[Recorder, str] = dispatch.Table("the test")


@TABLE.on(messages.Committed)
def committed(owner: Recorder, message: messages.Committed) -> str:
    owner.seen.append(message)
    return "handled"


def test_a_message_goes_to_the_handler_of_its_class():
    owner = Recorder()
    assert TABLE.handle(owner, messages.Committed(step=3)) == "handled"
    assert owner.seen == [messages.Committed(step=3)]


def test_a_message_without_a_handler_is_a_protocol_error_naming_it():
    owner = Recorder()
    with pytest.raises(messages.MessageError, match="the test has no handler for persisted messages"):
        TABLE.handle(owner, messages.Persisted(step=3))
    assert owner.seen == []


def test_a_second_handler_for_one_message_is_refused():
    table: dispatch.Table[Recorder, str] = dispatch.Table("the test")
    table.on(messages.Committed)(committed)
    with pytest.raises(ValueError, match="two handlers for committed messages"):
        table.on(messages.Committed)(committed)
