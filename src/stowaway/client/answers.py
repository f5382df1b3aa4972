"""What each message from the sidecar does on this rank.

Called by the link on the connection's reader thread, with the shared lock
held: an answer to a request goes to the link's mailbox, a slot handed back
goes back through the ledger, and a step's fate goes to its save handle.
Every message the sidecar may send after its welcome has a handler in
``TABLE`` (``welcome`` and ``error`` are the connection's own); one without
is a protocol violation.
"""

from __future__ import annotations

from stowaway.client.handle import SavesInFlight
from stowaway.client.ledger import SlotLedger, SlotState
from stowaway.client.link import Link
from stowaway.client.rank_slots import RankSlots
from stowaway.protocol import dispatch, messages

TABLE: dispatch.Table[Answers, None] = dispatch.Table("the rank")


class Answers:
    def __init__(self, link: Link, ledger: SlotLedger, slots: RankSlots, saves: SavesInFlight) -> None:
        self._link = link
        self._ledger = ledger
        self._slots = slots
        self._saves = saves

    def welcomed(self, welcome: messages.Welcome) -> None:
        self._slots.welcomed(welcome)

    def lost(self, reason: str) -> None:
        self._ledger.lost()
        self._saves.lost(reason)

    def handle(self, message: messages.ToClient) -> None:
        TABLE.handle(self, message)

    @TABLE.on(messages.Registered)
    def _registered(self, message: messages.Registered) -> None:
        self._link.deliver(("register", message.slot), message)

    @TABLE.on(messages.Inventory)
    def _inventory(self, message: messages.Inventory) -> None:
        self._link.deliver(("query", 0), message)

    @TABLE.on(messages.Released)
    def _released(self, message: messages.Released) -> None:
        self._ledger.released(message.slot, message.step, message.generation)

    @TABLE.on(messages.Staged)
    def _staged(self, message: messages.Staged) -> None:
        self._ledger.staged(message.slot, message.step)
        self._link.deliver(("stage", message.slot), message)

    @TABLE.on(messages.Persisted)
    def _persisted(self, message: messages.Persisted) -> None:
        self._saves.persisted(message.step)

    @TABLE.on(messages.Committed)
    def _committed(self, message: messages.Committed) -> None:
        self._saves.committed(message.step)

    @TABLE.on(messages.Failed)
    def _failed(self, message: messages.Failed) -> None:
        """A persist or a stage failed and its slot is back, or the step failed (no slot): the step cannot commit."""
        if message.slot is not None:
            was = self._ledger.failed(message.slot, message.step)
            if was is SlotState.STAGING:
                self._link.deliver(("stage", message.slot), message)
                return
            if was is SlotState.HELD:
                # Held since before a reconnect: its save's handle was resolved when the connection was lost.
                return
        self._saves.failed(message.step, message.reason)
