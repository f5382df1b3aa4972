"""Pod termination when storage is slower than the grace period (the drain itself: data_path/test_failures.py).

Kubernetes sends SIGTERM, waits terminationGracePeriodSeconds, then SIGKILLs.
A sidecar that overruns its own grace period is killed mid-write by kubelet
instead of exiting cleanly, so it must stop on time whatever storage does.
"""

from __future__ import annotations

import time

import pytest
from data_path.processes import wait_for

from stowaway.storage import catalog, layout

pytestmark = pytest.mark.faults

GRACE = 1.0
# Python start-up and the log flush: what a pod's grace period must leave on top of --grace-period.
EXIT_MARGIN = 4.0


def test_sigterm_with_a_persist_slower_than_the_grace_period_exits_0_on_time_and_commits_nothing_partial(
    start_sidecar, start_rank, storage
):
    # 16 MiB at 1 MiB/s: the persist needs 16 s, the grace period allows 1 s.
    sidecar = start_sidecar(extra=["--write-rate-limit", str(2**20), "--grace-period", str(GRACE)])
    rank = start_rank(sidecar, job="slow")
    rank.save(1, numel=1024)
    assert rank.wait(1)["committed"]
    rank.save(2, numel=2 * 2**20)
    partial = layout.step_dir(storage / "slow", 2)
    wait_for(lambda: partial.exists() and any(p.name.endswith(layout.TMP_SUFFIX) for p in partial.iterdir()),
             "the persist of step 2 to start writing")

    started = time.monotonic()
    assert sidecar.stop() == 0
    took = time.monotonic() - started
    assert took < GRACE + EXIT_MARGIN, f"the sidecar took {took:.1f} s to exit with a {GRACE} s grace period"
    assert "grace period of 1 s ended with work in flight (1 slot(s) still being copied" in sidecar.log()
    assert "Traceback" not in sidecar.log(), sidecar.log()

    answer = rank.wait(2)
    assert not answer["committed"] and "connection to the sidecar was lost" in answer["error"]
    assert catalog.committed_steps(storage / "slow") == [1]

    sidecar.extra = []
    sidecar.start()
    rank.save(3)
    assert rank.wait(3)["committed"], "the next sidecar commits the next save"
    assert catalog.verify_step(storage / "slow", 3) == []
