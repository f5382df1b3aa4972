"""Handing each message to its handler through a table, on either side of the socket.

A message whose class has no handler in the table is a ``MessageError``, like
an unknown type on the wire: a message that one side sends and the other
silently drops is a bug that no test would see. ``kinds`` lets a test check
that a table covers every message of its direction.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Generic, TypeVar

from stowaway.protocol import messages

_Owner = TypeVar("_Owner")
_Result = TypeVar("_Result")
_Kind = TypeVar("_Kind", bound=messages.Message)
_Handler = Callable[[_Owner, _Kind], _Result]


class Table(Generic[_Owner, _Result]):
    """Message class -> the method of ``_Owner`` that handles it, filled by decorating the methods with ``on``."""

    def __init__(self, side: str) -> None:
        self._side = side
        # Any: each handler takes the one class it is filed under, which ``handle`` looks up by the message's class.
        self._handlers: dict[type[messages.Message], Callable[[_Owner, Any], _Result]] = {}

    def on(self, kind: type[_Kind]) -> Callable[[_Handler[_Owner, _Kind, _Result]], _Handler[_Owner, _Kind, _Result]]:
        """Decorate the method that handles ``kind``."""

        def register(handler: _Handler[_Owner, _Kind, _Result]) -> _Handler[_Owner, _Kind, _Result]:
            if kind in self._handlers:
                raise ValueError(f"{self._side} has two handlers for {kind.TYPE} messages")
            self._handlers[kind] = handler
            return handler

        return register

    def handle(self, owner: _Owner, message: messages.Message) -> _Result:
        handler = self._handlers.get(type(message))
        if handler is None:
            raise messages.MessageError(f"{self._side} has no handler for {message.TYPE} messages")
        return handler(owner, message)

    def kinds(self) -> frozenset[type[messages.Message]]:
        return frozenset(self._handlers)
