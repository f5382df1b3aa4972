"""The bucket tier's choices: what to upload, what to keep, what a torn upload is."""

from __future__ import annotations

from stowaway.sidecar import tier_plan


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
