"""The copy thread of ``save(overlap=True)``: what it does with a copy that fails, hangs, or ends."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from stowaway.client.handle import SaveHandle
from stowaway.client.staging import INLINE_HOST_BYTES, Stager, Staging, copies_host_tensors_itself
from stowaway.errors import SaveFailed, StagingTimeout


def staging(step: int, rank: int = 0) -> Staging:
    return Staging(SaveHandle(step, rank, 0.0, 0.0, 5.0, staged=False), {}, True, time.perf_counter())


def test_a_copy_is_staged_before_it_is_handed_over_and_finished_after():
    stager = Stager(rank=0, timeout=5)
    job = staging(1)
    seen: list[tuple[bool, bool]] = []
    stager.start(job, lambda: None, lambda: seen.append((job.handle.staged(), job.finished.is_set())), lambda: None)
    stager.wait("the test")
    assert seen == [(True, False)], "the persist must follow the copy, and the next save follow the persist"
    assert len(stager.staging_seconds) == 1
    assert stager.close()


def test_a_failed_copy_gives_its_slot_back_fails_its_save_and_is_raised_once_by_the_next():
    stager = Stager(rank=3, timeout=5)
    job = staging(7, rank=3)
    given_back = threading.Event()

    def broken() -> None:
        raise OSError("no space")

    stager.start(job, broken, lambda: pytest.fail("a failed copy was handed over"), given_back.set)
    stager.wait("the test")
    assert given_back.is_set() and job.handle.done() and not job.handle.committed
    with pytest.raises(SaveFailed, match="rank 3: step 7 could not be copied into shared memory: OSError: no space"):
        stager.raise_failure()
    stager.raise_failure()  # told once
    assert stager.close()


def test_a_failure_the_handle_raised_is_not_raised_again():
    stager = Stager(rank=0, timeout=5)
    job = staging(2)
    stager.start(job, lambda: (_ for _ in ()).throw(RuntimeError("bad")), lambda: None, lambda: None)
    with pytest.raises(SaveFailed, match="step 2 could not be copied"):
        job.handle.wait_staged(5)
    stager.raise_failure()
    assert stager.close()


def test_a_stuck_copy_ends_waits_with_a_timeout_and_close_leaves_it_alone():
    stager = Stager(rank=1, timeout=0.2)
    release = threading.Event()
    stager.start(staging(4, rank=1), lambda: release.wait(30) and None, lambda: None, lambda: None)
    with pytest.raises(StagingTimeout, match=r"rank 1: the next save waited 0\.2 s for step 4 to be copied"):
        stager.wait("the next save")
    assert stager.stall_seconds and stager.stall_seconds[0] >= 0.2
    assert not stager.close(), "close() said the copy ended while it still runs"
    release.set()


def test_a_wait_that_begins_during_the_copy_is_its_stall_known_before_the_persist():
    stager = Stager(rank=0, timeout=5)
    job = staging(5)
    release = threading.Event()
    at_hand_over: list[tuple[float | None, float]] = []

    def copy_until_someone_waits() -> None:
        release.wait(5)

    def release_once_waited() -> None:
        deadline = time.monotonic() + 5
        while job.stalled_since is None and time.monotonic() < deadline:
            time.sleep(0.001)  # polls what the waiter records; the wait itself is what is measured
        release.set()

    stager.start(job, copy_until_someone_waits, lambda: at_hand_over.append((job.seconds, job.stall)), lambda: None)
    releaser = threading.Thread(target=release_once_waited)
    releaser.start()
    stager.wait("the guard")
    releaser.join()
    assert release.is_set() and job.stalled_since is not None
    [(seconds, stall)] = at_hand_over
    assert seconds is not None and 0 < stall <= seconds
    assert stall <= stager.stall_seconds[0], "the stall ends with the copy, the wait only once it is handed over"
    assert stager.close()


def test_a_wait_that_begins_after_the_copy_ended_is_no_stall_of_it():
    stager = Stager(rank=0, timeout=5)
    job = staging(6)
    handing_over, hand_over_done = threading.Event(), threading.Event()

    def slow_hand_over() -> None:
        handing_over.set()
        hand_over_done.wait(5)

    stager.start(job, lambda: None, slow_hand_over, lambda: None)
    assert handing_over.wait(5)
    finisher = threading.Thread(target=hand_over_done.set)  # the wait below begins while the persist is sent, or after
    finisher.start()
    stager.wait("the next save")
    finisher.join()
    assert job.stalled_since is None and job.stall == 0.0
    assert stager.close()


def test_save_copies_the_host_tensors_itself_only_beside_gpu_tensors_and_only_a_few_bytes_of_them():
    steps = [torch.tensor(3.0), torch.tensor(7.0)]  # what Adam keeps on the host beside device moments
    assert copies_host_tensors_itself(steps, on_gpu=True)
    assert not copies_host_tensors_itself(steps, on_gpu=False), "without a GPU the copy thread copies everything"
    offloaded = [torch.empty(INLINE_HOST_BYTES + 1, dtype=torch.uint8, device="meta")]  # sized, never allocated
    assert not copies_host_tensors_itself(offloaded, on_gpu=True), "a large host part is left to the copy thread"
