"""A real rank's overlapped saves reach the sidecar's series: staging, stall and hidden seconds.

The copy is made slow on purpose (the rank's copy thread sleeps ``DELAY``
before copying), so each measurement has a known lower bound: a save whose
copy the loop waits for at once stalls for about ``DELAY``; one whose copy
ends while the loop does something else hides about ``DELAY``.
"""

from __future__ import annotations

import pytest
from data_path.processes import wait_for

from metrics.promtools import http_get, samples

DELAY = 0.3


def test_a_slow_overlapped_copy_shows_as_staging_stall_and_hidden_seconds(metrics_sidecar, start_rank) -> None:
    rank = start_rank(metrics_sidecar.process, job="overlap")
    # Waited for at once: the guarded change stalls the loop for the rest of the copy.
    rank.call(op="save", step=1, overlap=True, copy_delay=DELAY)
    assert rank.call(op="guarded") == {"copied_first": True}
    # Waited for only once it ended: the whole copy is hidden behind the loop's other work.
    rank.call(op="save", step=2, overlap=True, copy_delay=DELAY)
    wait_for(lambda: rank.call(op="staged", step=2)["staged"], "the copy of step 2 to end")
    assert rank.call(op="guarded") == {"copied_first": True}
    rank.save(3)  # a blocking save: counted in the blocking time only
    for step in (1, 2, 3):
        assert rank.wait(step)["committed"]

    measured = rank.call(op="overlap_seconds")
    found = samples(http_get(f"{metrics_sidecar.url}/metrics").body)
    assert found["stowaway_save_blocking_seconds_count"] == 3
    assert found["stowaway_save_staging_seconds_count"] == 2 == found["stowaway_save_stall_seconds_count"]
    staging = found["stowaway_save_staging_seconds_sum"]
    stall = found["stowaway_save_stall_seconds_sum"]
    hidden = found["stowaway_save_overlap_hidden_seconds_total"]
    assert staging == pytest.approx(sum(measured["staging"]), rel=1e-9), "the sidecar got the rank's staging times"
    assert hidden == pytest.approx(measured["hidden"], rel=1e-9), "the rank and the sidecar count hidden time alike"
    assert staging >= 2 * DELAY, f"staging {staging} s for two copies forced to last {DELAY} s each"
    # Step 1's copy was waited for from (a reply and a command after) its start to its end; step 2's not at all.
    assert DELAY / 2 <= stall <= staging - DELAY, f"stall {stall} s: one copy of {DELAY} s waited for, one not"
    assert hidden >= DELAY, f"hidden {hidden} s: one copy of {DELAY} s ran while the loop did other work"
    assert stall + hidden <= staging
    assert found['stowaway_save_staging_seconds_bucket{le="0.25"}'] == 0, "each copy lasts longer than 0.25 s"
