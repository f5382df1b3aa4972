"""The bucket tier's choices: what to upload, what to keep, what a torn upload is."""

from __future__ import annotations

from stowaway.sidecar import tier_plan
from stowaway.storage.rollbacks import Rollback


def test_only_the_newest_claim_step_above_the_bucket_is_uploaded() -> None:
    assert tier_plan.to_upload([10, 20, 30], [10], keep_every=0) == [30]


def test_steps_kept_every_m_are_uploaded_even_when_newer_ones_exist() -> None:
    assert tier_plan.to_upload([1000, 1100, 2000, 2100], [], keep_every=1000) == [1000, 2000, 2100]


def test_nothing_older_than_the_bucket_newest_is_uploaded_again() -> None:
    assert tier_plan.to_upload([10, 20], [20], keep_every=10) == []
    assert tier_plan.to_upload([], [5], keep_every=0) == []


def test_retention_keeps_the_last_k_and_every_m() -> None:
    committed = [100, 200, 1000, 1100, 1200, 2000, 2100]
    assert tier_plan.to_delete(committed, keep_last=2, keep_every=1000) == [100, 200, 1100, 1200]
    assert tier_plan.to_delete(committed, keep_last=2, keep_every=0) == [100, 200, 1000, 1100, 1200]


def test_retention_never_drops_the_newest_step() -> None:
    assert tier_plan.kept([7], keep_last=0, keep_every=0) == {7}
    assert tier_plan.to_delete([], keep_last=1, keep_every=0) == []


def test_torn_uploads_below_the_newest_committed_step_are_swept() -> None:
    assert tier_plan.to_sweep([10, 20, 30, 40], committed=[10, 30]) == [20]


def test_a_step_above_the_newest_committed_may_still_be_uploading_and_stays() -> None:
    assert tier_plan.to_sweep([10, 40], committed=[10]) == []
    assert tier_plan.to_sweep([40], committed=[]) == []


def test_bucket_steps_above_a_rollback_committed_before_it_are_abandoned_and_steps_saved_again_stay() -> None:
    back_to_5 = Rollback(to=5, unix=1000.0, stamp_ns=1)
    # 7 and 9 came from the abandoned run; 7 was saved again after the rollback (its copy is newer), 5 is the target.
    assert tier_plan.may_be_rolled_back([3, 5, 7, 9], [back_to_5]) == [7, 9]
    rolled = tier_plan.rolled_back({7: 1200.0, 9: 900.0}, [back_to_5])
    assert rolled == {9: back_to_5}


def test_the_earliest_rollback_that_abandoned_a_step_names_its_copy() -> None:
    first, second = Rollback(to=8, unix=1000.0, stamp_ns=1), Rollback(to=4, unix=2000.0, stamp_ns=2)
    assert tier_plan.rolled_back({6: 1500.0, 9: 500.0}, [first, second]) == {6: second, 9: first}


def test_without_a_rollback_nothing_is_read_or_abandoned() -> None:
    assert tier_plan.may_be_rolled_back([1, 2, 3], []) == []
    assert tier_plan.rolled_back({}, []) == {}


def test_a_rollback_undone_on_the_claim_is_no_longer_in_force() -> None:
    back_to_5 = Rollback(to=5, unix=1000.0, stamp_ns=1)
    # Steps 6 and 7 saved again after the rollback: it stands.
    assert tier_plan.in_force([back_to_5], {6: 1100.0, 7: 1200.0}) == [back_to_5]
    # Step 7 of the abandoned run renamed back into the step names: the user undid it.
    assert tier_plan.in_force([back_to_5], {7: 900.0}) == []
