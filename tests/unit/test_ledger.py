"""The slot ledger: every legal move, and every illegal one refused, the sidecar's as protocol errors."""

from __future__ import annotations

import threading

import pytest

from stowaway.client.ledger import IllegalTransition, Ownership, SlotLedger, SlotState
from stowaway.errors import ProtocolError
from stowaway.protocol.messages import POOLED_SLOT_BASE

IDLE, ALLOCATING, WRITING = SlotState.IDLE, SlotState.ALLOCATING, SlotState.WRITING
PERSISTING, STAGING, HELD, UNCONFIRMED = SlotState.PERSISTING, SlotState.STAGING, SlotState.HELD, SlotState.UNCONFIRMED
POOLED = SlotState.POOLED
SPARE = POOLED_SLOT_BASE


@pytest.fixture
def ledger() -> SlotLedger:
    return SlotLedger(3, threading.Condition())


def persisting(ledger: SlotLedger, index: int, step: int, generation: int) -> None:
    ledger.take(index)
    ledger.persisting(index, step, generation)


def test_a_save_takes_an_idle_slot_hands_it_over_and_gets_it_back_with_the_answer(ledger):
    ledger.take(1)
    assert ledger.states() == [IDLE, WRITING, IDLE] and ledger.idle() == [0, 2]
    ledger.persisting(1, step=7, generation=3)
    assert ledger.ownership(1) == Ownership(PERSISTING, 7, 3)
    assert ledger.held_by_sidecar() == [Ownership(PERSISTING, 7, 3)]
    ledger.released(1, step=7, generation=3)
    assert ledger.states() == [IDLE] * 3 and ledger.held_by_sidecar() == []


def test_a_restore_stages_a_taken_slot_and_gets_it_back_with_staged_or_failed(ledger):
    ledger.take(0)
    ledger.staging(0, step=4)
    assert ledger.ownership(0) == Ownership(STAGING, 4)
    ledger.staged(0, step=4)
    ledger.take(0)
    ledger.staging(0, step=3)
    assert ledger.failed(0, step=3) is STAGING, "the answer's meaning: a failed stage, not a failed save"
    assert ledger.states() == [IDLE] * 3


def test_a_failed_persist_gives_the_slot_back_and_says_it_was_a_persist(ledger):
    persisting(ledger, 2, step=5, generation=1)
    assert ledger.failed(2, step=5) is PERSISTING
    assert ledger.state(2) is IDLE


def test_a_slot_written_but_never_handed_over_is_abandoned_back_to_idle(ledger):
    ledger.take(0)
    ledger.abandon(0)
    assert ledger.state(0) is IDLE


def test_the_allocator_borrows_idle_slots_and_gives_them_back(ledger):
    ledger.lend(1)
    ledger.lend(2)
    assert ledger.states() == [IDLE, ALLOCATING, ALLOCATING] and ledger.idle() == [0]
    ledger.allocated(1)
    ledger.allocated(2)
    assert ledger.states() == [IDLE] * 3


@pytest.mark.parametrize(
    ("prepare", "move"),
    [
        ([], lambda ledger: ledger.abandon(0)),
        ([], lambda ledger: ledger.persisting(0, 1, 1)),
        ([], lambda ledger: ledger.staging(0, 1)),
        ([], lambda ledger: ledger.allocated(0)),
        (["take"], lambda ledger: ledger.take(0)),
        (["take"], lambda ledger: ledger.lend(0)),
        (["lend"], lambda ledger: ledger.take(0)),
        (["take", "persist"], lambda ledger: ledger.take(0)),
        (["take", "persist"], lambda ledger: ledger.abandon(0)),
        (["take", "persist"], lambda ledger: ledger.persisting(0, 2, 2)),
        (["take", "persist"], lambda ledger: ledger.lend(0)),
    ],
    ids=["abandon-idle", "persist-idle", "stage-idle", "allocated-idle", "take-writing", "lend-writing",
         "take-allocating", "take-persisting", "abandon-persisting", "persist-twice", "lend-persisting"],
)
def test_a_move_the_rank_may_not_make_raises_and_changes_nothing(ledger, prepare, move):
    steps = {"take": lambda: ledger.take(0), "lend": lambda: ledger.lend(0),
             "persist": lambda: ledger.persisting(0, 1, 1)}
    for name in prepare:
        steps[name]()
    before = ledger.ownership(0)
    with pytest.raises(IllegalTransition, match=r"cannot .* slot 0: it is"):
        move(ledger)
    assert ledger.ownership(0) == before


def test_a_second_answer_for_one_persist_is_a_protocol_error(ledger):
    persisting(ledger, 0, step=1, generation=1)
    ledger.released(0, step=1, generation=1)
    with pytest.raises(ProtocolError, match=r"answer for slot 0 step 1, which the sidecar does not hold .*duplicate"):
        ledger.released(0, step=1, generation=1)
    with pytest.raises(ProtocolError, match="duplicate"):
        ledger.failed(0, step=1)


def test_an_answer_naming_another_generation_than_the_persist_is_a_protocol_error(ledger):
    persisting(ledger, 0, step=1, generation=4)
    with pytest.raises(ProtocolError, match="names generation 3, but the slot was handed over at generation 4"):
        ledger.released(0, step=1, generation=3)
    assert ledger.state(0) is PERSISTING


@pytest.mark.parametrize(("handed", "answer"), [
    ("persist", lambda ledger: ledger.staged(0, 1)),
    ("stage", lambda ledger: ledger.released(0, 1, 1)),
])
def test_an_answer_that_does_not_fit_the_hand_over_is_a_protocol_error(ledger, handed, answer):
    ledger.take(0)
    if handed == "persist":
        ledger.persisting(0, 1, 1)
    else:
        ledger.staging(0, 1)
    with pytest.raises(ProtocolError, match=r"which is (persisting|staging): not an answer for that"):
        answer(ledger)


def test_an_answer_for_a_slot_this_rank_does_not_have_is_a_protocol_error(ledger):
    with pytest.raises(ProtocolError, match=r"released for slot 5 step 1: this rank has no such slot \(slots \[0"):
        ledger.released(5, step=1, generation=1)


def test_a_lost_connection_leaves_what_the_sidecar_held_unconfirmed_until_the_welcome_says(ledger):
    persisting(ledger, 0, step=1, generation=1)
    ledger.take(1)
    ledger.staging(1, step=2)
    ledger.take(2)
    ledger.lost()
    assert ledger.states() == [UNCONFIRMED, UNCONFIRMED, WRITING], "a slot being written stays the rank's"
    assert [owned.step for owned in ledger.held_by_sidecar()] == [1, 2]
    ledger.welcomed(busy={1})
    assert ledger.states() == [IDLE, HELD, WRITING]
    assert ledger.ownership(1) == Ownership(HELD, 2), "the step stays known, the generation no longer binds"


@pytest.mark.parametrize("answer", ["released", "staged", "failed"])
def test_a_slot_held_since_before_a_reconnect_comes_back_with_any_answer(ledger, answer):
    persisting(ledger, 0, step=1, generation=9)
    ledger.lost()
    ledger.welcomed(busy=[0])
    if answer == "released":
        ledger.released(0, step=1, generation=2)
    elif answer == "staged":
        ledger.staged(0, step=1)
    else:
        assert ledger.failed(0, step=1) is HELD
    assert ledger.state(0) is IDLE


def test_a_slot_an_earlier_process_handed_over_is_held_from_the_first_welcome(ledger):
    ledger.welcomed(busy=[2, 7])
    assert ledger.states() == [IDLE, IDLE, HELD], "slot 7 is beyond this rank's slots: ignored"
    with pytest.raises(IllegalTransition):
        ledger.take(2)


@pytest.mark.parametrize("hold", ["take", "lend"])
def test_a_welcome_claiming_a_slot_the_rank_holds_is_a_protocol_error_and_changes_nothing(ledger, hold):
    persisting(ledger, 1, step=1, generation=1)
    ledger.lost()
    getattr(ledger, hold)(0)
    before = ledger.states()
    with pytest.raises(ProtocolError, match="the welcome lists slot 0 as the sidecar's, but this rank holds it"):
        ledger.welcomed(busy=[0, 1])
    assert ledger.states() == before


def test_every_move_wakes_whoever_waits_on_the_lock():
    lock = threading.Condition()
    ledger = SlotLedger(1, lock)
    persisting(ledger, 0, step=1, generation=1)
    waiting, woken = threading.Event(), threading.Event()

    def wait_for_a_free_slot() -> None:
        with lock:
            waiting.set()
            if lock.wait_for(lambda: ledger.idle() == [0], timeout=10):
                woken.set()

    waiter = threading.Thread(target=wait_for_a_free_slot)
    waiter.start()
    assert waiting.wait(10)
    with lock:
        pass  # taken only once the waiter sleeps in wait_for, which releases it: the release below must wake it
    ledger.released(0, step=1, generation=1)
    waiter.join(timeout=30)
    assert woken.is_set(), "the waiter slept through the slot's return"


class _Returns(list[int]):
    """The spares the ledger said this rank gave up, in order: the rank lets go of their locks then."""


@pytest.fixture
def pooled() -> tuple[SlotLedger, _Returns]:
    returns = _Returns()
    return SlotLedger(1, threading.Condition(), pooled=2, returned=returns.append), returns


def test_a_pooled_spare_is_never_idle_and_goes_back_to_the_pool_with_its_answer(pooled):
    ledger, returns = pooled
    assert ledger.states() == [IDLE, POOLED, POOLED] and ledger.idle() == [0]
    assert ledger.pooled() == [SPARE, SPARE + 1]
    ledger.borrow(SPARE)
    ledger.persisting(SPARE, step=3, generation=4)
    assert ledger.held_by_sidecar() == [Ownership(PERSISTING, 3, 4)] and returns == []
    ledger.released(SPARE, step=3, generation=4)
    assert ledger.state(SPARE) is POOLED and returns == [SPARE], "released: the rank lets go of the spare's lock"


@pytest.mark.parametrize("how", ["abandon", "failed", "lost, welcomed not busy"])
def test_a_spare_given_up_in_any_way_is_returned_once(pooled, how):
    ledger, returns = pooled
    ledger.borrow(SPARE + 1)
    if how == "abandon":
        ledger.abandon(SPARE + 1)
    else:
        ledger.persisting(SPARE + 1, step=1, generation=1)
        if how == "failed":
            assert ledger.failed(SPARE + 1, step=1) is PERSISTING
        else:
            ledger.lost()
            assert ledger.state(SPARE + 1) is UNCONFIRMED and returns == [], "the sidecar may still read it"
            ledger.welcomed(busy=[])
    assert ledger.states() == [IDLE, POOLED, POOLED] and returns == [SPARE + 1]


def test_a_spare_an_earlier_process_of_the_rank_handed_over_is_held_until_answered(pooled):
    ledger, returns = pooled
    ledger.welcomed(busy=[SPARE])
    assert ledger.state(SPARE) is HELD
    with pytest.raises(IllegalTransition, match="cannot borrow slot 64: it is held"):
        ledger.borrow(SPARE)
    ledger.released(SPARE, step=5, generation=1)
    assert ledger.state(SPARE) is POOLED and returns == [SPARE]


def test_a_rank_cannot_take_a_spare_it_has_not_borrowed(pooled):
    ledger, _ = pooled
    with pytest.raises(IllegalTransition, match="cannot take slot 64: it is pooled"):
        ledger.take(SPARE)
