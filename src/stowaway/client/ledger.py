"""Who owns each of this rank's slots: the one place that moves a slot from one owner to the next.

A slot is the rank's to write only between ``take`` and its hand-over; from a
``persist`` or a ``stage`` until the sidecar's answer it is the sidecar's. The
states, and the moves between them (any other move raises)::

    IDLE --take--> WRITING --persisting--> PERSISTING --released / failed--> IDLE
                      |    --staging-----> STAGING ----staged / failed---> IDLE
                      +--abandon--> IDLE             (written, but never handed over)
    IDLE --lend--> ALLOCATING --allocated--> IDLE    (the background allocator, spare_slots)

    PERSISTING, STAGING, HELD --lost--> UNCONFIRMED  (the connection ended; the sidecar may still hold it)
    UNCONFIRMED or IDLE --welcomed, busy--> HELD     (the sidecar still holds it, for an earlier connection
                                                      or an earlier process of this rank)
    UNCONFIRMED --welcomed, not busy--> IDLE
    HELD --released / staged / failed--> IDLE

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
from collections.abc import Collection
from dataclasses import dataclass

from stowaway.errors import ProtocolError


class SlotState(enum.Enum):
    IDLE = "idle"
    ALLOCATING = "allocating"
    WRITING = "writing"
    PERSISTING = "persisting"
    STAGING = "staging"
    HELD = "held"
    UNCONFIRMED = "unconfirmed"

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


class IllegalTransition(RuntimeError):
    """The rank tried a move its slot's state does not allow: a bug in the client, never the sidecar's doing."""


class SlotLedger:
    """The states of ``count`` slots; ``lock`` (over a reentrant lock, the default) is the one waits use."""

    def __init__(self, count: int, lock: threading.Condition) -> None:
        self._lock = lock
        self._slots = [_IDLE] * count

    def ownership(self, index: int) -> Ownership:
        with self._lock:
            return self._slots[index]

    def state(self, index: int) -> SlotState:
        return self.ownership(index).state

    def states(self) -> list[SlotState]:
        with self._lock:
            return [owned.state for owned in self._slots]

    def idle(self) -> list[int]:
        with self._lock:
            return [index for index, owned in enumerate(self._slots) if owned.state is SlotState.IDLE]

    def held_by_sidecar(self) -> list[Ownership]:
        """The slots the sidecar may hold, in slot order: what a save waiting for a free slot waits for."""
        with self._lock:
            return [owned for owned in self._slots if owned.state.sidecar_may_hold]

    # The rank's moves.

    def take(self, index: int) -> None:
        """The rank takes an idle slot to write it."""
        self._rank_moves(index, {SlotState.IDLE}, Ownership(SlotState.WRITING), "take")

    def abandon(self, index: int) -> None:
        self._rank_moves(index, {SlotState.WRITING}, _IDLE, "abandon")

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
            self._set(index, _IDLE)

    def staged(self, index: int, step: int) -> None:
        with self._lock:
            self._answered(index, step, "staged", {SlotState.STAGING, SlotState.HELD})
            self._set(index, _IDLE)

    def failed(self, index: int, step: int) -> SlotState:
        """Take the slot back from a failed persist or stage; return what it was (the answer's meaning)."""
        with self._lock:
            owned = self._answered(index, step, "failed", {SlotState.PERSISTING, SlotState.STAGING, SlotState.HELD})
            self._set(index, _IDLE)
            return owned.state

    def lost(self) -> None:
        """The connection ended: what the sidecar held, it may still hold, until the next welcome says."""
        with self._lock:
            for index, owned in enumerate(self._slots):
                if owned.state in (SlotState.PERSISTING, SlotState.STAGING, SlotState.HELD):
                    self._set(index, Ownership(SlotState.UNCONFIRMED, owned.step, owned.generation))

    def welcomed(self, busy: Collection[int]) -> None:
        """The sidecar's welcome lists the slots it still holds: those are HELD, the others it held come back.

        A listed slot beyond this rank's count is ignored: an earlier process
        of the rank may have had more slots.
        """
        with self._lock:
            for index, owned in enumerate(self._slots):
                if index in busy and owned.state in (SlotState.WRITING, SlotState.ALLOCATING):
                    raise ProtocolError(
                        f"the welcome lists slot {index} as the sidecar's, but this rank holds it ({owned.state.value})"
                    )
            for index, owned in enumerate(self._slots):
                if index in busy:
                    self._set(index, Ownership(SlotState.HELD, owned.step))
                elif owned.state.sidecar_may_hold:
                    self._set(index, _IDLE)

    def _rank_moves(self, index: int, allowed: set[SlotState], to: Ownership, move: str) -> None:
        with self._lock:
            state = self._slots[index].state
            if state not in allowed:
                raise IllegalTransition(
                    f"cannot {move} slot {index}: it is {state.value}, not {' or '.join(s.value for s in allowed)}"
                )
            self._set(index, to)

    def _answered(self, index: int, step: int, answer: str, allowed: set[SlotState]) -> Ownership:
        if not 0 <= index < len(self._slots):
            raise ProtocolError(f"{answer} for slot {index} step {step}: this rank has {len(self._slots)} slots")
        owned = self._slots[index]
        if not owned.state.sidecar_may_hold:
            raise ProtocolError(f"answer for slot {index} step {step}, which the sidecar does not hold "
                                f"({owned.state.value}): a duplicate answer")
        if owned.state not in allowed:
            raise ProtocolError(f"{answer} for slot {index} step {step}, which is {owned.state.value}: "
                                "not an answer for that")
        return owned

    def _set(self, index: int, owned: Ownership) -> None:
        self._slots[index] = owned
        self._lock.notify_all()
