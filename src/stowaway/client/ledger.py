"""Who owns each of this rank's slots: the one place that moves a slot from one owner to the next.

A slot is the rank's to write only between ``take`` and its hand-over; from a
``persist`` or a ``stage`` until the sidecar's answer it is the sidecar's. The
states, and the moves between them (any other move raises)::

    IDLE --take--> WRITING --persisting--> PERSISTING --released / failed--> IDLE
                      |    --staging-----> STAGING ----staged / failed---> IDLE
                      +--abandon--> IDLE             (written, but never handed over)
    IDLE --lend--> ALLOCATING --allocated--> IDLE    (the background allocator, spare_slots)

    POOLED --borrow--> WRITING --persisting--> PERSISTING --released / failed--> POOLED
                      +--abandon--> POOLED           (a pooled spare: see below)

    PERSISTING, STAGING, HELD --lost--> UNCONFIRMED  (the connection ended; the sidecar may still hold it)
    UNCONFIRMED, IDLE or POOLED --welcomed, busy--> HELD  (the sidecar still holds it, for an earlier
                                                      connection or an earlier process of this rank)
    UNCONFIRMED --welcomed, not busy--> IDLE         (a spare: POOLED, as after every answer)
    HELD --released / staged / failed--> IDLE

A pooled spare (``pool``) is the pod's, not the rank's: POOLED says this rank
has no claim on it. The rank borrows it by taking its write lock (``borrow``),
and every move that gives it up goes back to POOLED instead of IDLE, where
the ledger calls ``returned`` so the rank lets go of the lock, under which
another rank may then write it.

The rank's own moves (``take`` ... ``staging``) come from the training thread
and the allocator; a move they may not make is a bug here and raises
``IllegalTransition``. The sidecar's moves (``released`` ... ``welcomed``) come
from its messages; one it may not make, such as a second answer for one
persist, raises ``ProtocolError``. Every move takes the shared lock and wakes
whoever waits on it, such as a save waiting for a free slot.
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Callable, Collection
from dataclasses import dataclass

from stowaway.errors import ProtocolError
from stowaway.protocol.messages import POOLED_SLOT_BASE


class SlotState(enum.Enum):
    IDLE = "idle"
    ALLOCATING = "allocating"
    WRITING = "writing"
    PERSISTING = "persisting"
    STAGING = "staging"
    HELD = "held"
    UNCONFIRMED = "unconfirmed"
    POOLED = "pooled"

    @property
    def sidecar_may_hold(self) -> bool:
        """Whether the sidecar may be reading or writing the slot: the rank must not touch it."""
        return self in _SIDECAR_MAY_HOLD


_SIDECAR_MAY_HOLD = frozenset({SlotState.PERSISTING, SlotState.STAGING, SlotState.HELD, SlotState.UNCONFIRMED})


@dataclass(frozen=True)
class Ownership:
    """A slot's state, with the step handed over for it and, for a persist, the generation its answer names.

    The step outlives a lost connection (it still says what the sidecar holds
    the slot for), the generation does not: after a reconnect, the sidecar's
    answer for a slot it held is taken whatever generation it names.
    """

    state: SlotState
    step: int | None = None
    generation: int | None = None


_IDLE = Ownership(SlotState.IDLE)
_POOLED = Ownership(SlotState.POOLED)


class IllegalTransition(RuntimeError):
    """The rank tried a move its slot's state does not allow: a bug in the client, never the sidecar's doing."""


class SlotLedger:
    """The states of ``count`` slots of the rank's own and ``pooled`` spares of the pod's (slot indices from
    ``POOLED_SLOT_BASE``); ``lock`` (over a reentrant lock, the default) is the one waits use. ``returned`` is
    called, lock held, with a spare's index once this rank has given it up.
    """

    def __init__(self, count: int, lock: threading.Condition, pooled: int = 0,
                 returned: Callable[[int], None] = lambda index: None) -> None:
        self._lock = lock
        self._returned = returned
        self._slots = dict.fromkeys(range(count), _IDLE) | dict.fromkeys(
            range(POOLED_SLOT_BASE, POOLED_SLOT_BASE + pooled), _POOLED)

    def ownership(self, index: int) -> Ownership:
        with self._lock:
            return self._slots[index]

    def state(self, index: int) -> SlotState:
        return self.ownership(index).state

    def states(self) -> list[SlotState]:
        with self._lock:
            return [owned.state for owned in self._slots.values()]

    def idle(self) -> list[int]:
        with self._lock:
            return [index for index, owned in self._slots.items() if owned.state is SlotState.IDLE]

    def pooled(self) -> list[int]:
        """The pod's spares this rank has no claim on: those it may try to borrow."""
        with self._lock:
            return [index for index, owned in self._slots.items() if owned.state is SlotState.POOLED]

    def held_by_sidecar(self) -> list[Ownership]:
        """The slots the sidecar may hold, in slot order: what a save waiting for a free slot waits for."""
        with self._lock:
            return [owned for owned in self._slots.values() if owned.state.sidecar_may_hold]

    # The rank's moves.

    def take(self, index: int) -> None:
        """The rank takes an idle slot to write it."""
        self._rank_moves(index, {SlotState.IDLE}, Ownership(SlotState.WRITING), "take")

    def borrow(self, index: int) -> None:
        """The rank holds the write lock of a pooled spare, and takes it to write it."""
        self._rank_moves(index, {SlotState.POOLED}, Ownership(SlotState.WRITING), "borrow")

    def abandon(self, index: int) -> None:
        self._rank_moves(index, {SlotState.WRITING}, self._rest(index), "abandon")

    def persisting(self, index: int, step: int, generation: int) -> None:
        self._rank_moves(index, {SlotState.WRITING}, Ownership(SlotState.PERSISTING, step, generation), "persist")

    def staging(self, index: int, step: int) -> None:
        self._rank_moves(index, {SlotState.WRITING}, Ownership(SlotState.STAGING, step), "stage")

    def lend(self, index: int) -> None:
        self._rank_moves(index, {SlotState.IDLE}, Ownership(SlotState.ALLOCATING), "allocate")

    def allocated(self, index: int) -> None:
        self._rank_moves(index, {SlotState.ALLOCATING}, _IDLE, "end the allocation of")

    # The sidecar's moves.

    def released(self, index: int, step: int, generation: int) -> None:
        with self._lock:
            owned = self._answered(index, step, "released", {SlotState.PERSISTING, SlotState.HELD})
            if owned.generation is not None and owned.generation != generation:
                raise ProtocolError(
                    f"released for slot {index} step {step} names generation {generation}, but the slot was handed "
                    f"over at generation {owned.generation}: a duplicate or stray answer"
                )
            self._set(index, self._rest(index))

    def staged(self, index: int, step: int) -> None:
        with self._lock:
            self._answered(index, step, "staged", {SlotState.STAGING, SlotState.HELD})
            self._set(index, self._rest(index))

    def failed(self, index: int, step: int) -> SlotState:
        """Take the slot back from a failed persist or stage; return what it was (the answer's meaning)."""
        with self._lock:
            owned = self._answered(index, step, "failed", {SlotState.PERSISTING, SlotState.STAGING, SlotState.HELD})
            self._set(index, self._rest(index))
            return owned.state

    def lost(self) -> None:
        """The connection ended: what the sidecar held, it may still hold, until the next welcome says."""
        with self._lock:
            for index, owned in self._slots.items():
                if owned.state in (SlotState.PERSISTING, SlotState.STAGING, SlotState.HELD):
                    self._set(index, Ownership(SlotState.UNCONFIRMED, owned.step, owned.generation))

    def welcomed(self, busy: Collection[int]) -> None:
        """The sidecar's welcome lists the slots it still holds: those are HELD, the others it held come back.

        A listed slot beyond this rank's count is ignored: an earlier process
        of the rank may have had more slots. A listed pooled spare is one an
        earlier process of the rank borrowed: HELD too, so that this one waits
        for its answer before it counts the persist as over.
        """
        with self._lock:
            for index, owned in self._slots.items():
                if index in busy and owned.state in (SlotState.WRITING, SlotState.ALLOCATING):
                    raise ProtocolError(
                        f"the welcome lists slot {index} as the sidecar's, but this rank holds it ({owned.state.value})"
                    )
            for index, owned in self._slots.items():
                if index in busy:
                    self._set(index, Ownership(SlotState.HELD, owned.step))
                elif owned.state.sidecar_may_hold:
                    self._set(index, self._rest(index))

    def _rank_moves(self, index: int, allowed: set[SlotState], to: Ownership, move: str) -> None:
        with self._lock:
            state = self._slots[index].state
            if state not in allowed:
                raise IllegalTransition(
                    f"cannot {move} slot {index}: it is {state.value}, not {' or '.join(s.value for s in allowed)}"
                )
            self._set(index, to)

    def _answered(self, index: int, step: int, answer: str, allowed: set[SlotState]) -> Ownership:
        if index not in self._slots:
            raise ProtocolError(f"{answer} for slot {index} step {step}: this rank has no such slot "
                                f"(slots {sorted(self._slots)})")
        owned = self._slots[index]
        if not owned.state.sidecar_may_hold:
            raise ProtocolError(f"answer for slot {index} step {step}, which the sidecar does not hold "
                                f"({owned.state.value}): a duplicate answer")
        if owned.state not in allowed:
            raise ProtocolError(f"{answer} for slot {index} step {step}, which is {owned.state.value}: "
                                "not an answer for that")
        return owned

    @staticmethod
    def _rest(index: int) -> Ownership:
        """Where a slot goes once this rank neither writes it nor waits for the sidecar to give it back."""
        return _POOLED if index >= POOLED_SLOT_BASE else _IDLE

    def _set(self, index: int, owned: Ownership) -> None:
        given_up = owned is _POOLED and self._slots[index] is not _POOLED
        self._slots[index] = owned
        if given_up:
            self._returned(index)
        self._lock.notify_all()
