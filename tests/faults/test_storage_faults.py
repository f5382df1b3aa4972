"""Storage that fails with EIO, or is slower than the training loop.

Full and read-only storage and a bit flip are in data_path/test_failures.py.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
from metrics.promtools import free_port, http_get, samples

from faults.devices import ext4_volume, remount, shut_down
from stowaway.storage import catalog

pytestmark = pytest.mark.faults


def metrics_flags(port: int) -> list[str]:
    return ["--metrics-port", str(port), "--metrics-address", "127.0.0.1"]


def test_an_io_error_fails_the_save_with_eio_and_a_metric_and_the_committed_checkpoint_survives_the_crash(
    start_sidecar, start_rank, short_tmp
):
    image = short_tmp / "disk.img"
    with ext4_volume(image, short_tmp / "vol") as volume:
        port = free_port()
        sidecar = start_sidecar(extra=metrics_flags(port), storage_dir=volume / "storage")
        rank = start_rank(sidecar, job="eio")
        rank.save(1)
        assert rank.wait(1)["committed"]

        shut_down(volume)  # like a disk that died: EIO on every access, nothing unsynced survives
        rank.save(2)
        answer = rank.wait(2)
        assert not answer["committed"]
        assert "storage error EIO" in answer["error"] and "check the storage volume" in answer["error"], answer
        scraped = samples(http_get(f"http://127.0.0.1:{port}/metrics").body)
        assert scraped['stowaway_failures_total{reason="storage_io"}'] == 1
        rank.exit()
        assert sidecar.stop() == 0

        remount(image, volume)
        verify = subprocess.run([sys.executable, "-m", "stowaway", "verify", str(volume / "storage" / "eio")],
                                capture_output=True, text=True, timeout=60)
        assert verify.returncode == 0 and verify.stdout == "step 1: ok\n", verify.stdout + verify.stderr
        sidecar.start()
        fresh = start_rank(sidecar, job="eio")
        assert fresh.call(op="load") == {"step": 1, "intact": True, "numel": 1024}
        fresh.save(2)
        assert fresh.wait(2)["committed"], "on a healthy volume again, the step that failed saves"
        fresh.exit()
        assert sidecar.stop() == 0


def test_storage_slower_than_saving_times_out_the_rank_with_errors_naming_storage_and_loses_nothing(
    start_sidecar, start_rank, storage
):
    port = free_port()
    # 4 MiB per save at 2 MiB/s: the two slots stay in flight for about 2 and 4 s; the rank waits at most 1 s.
    sidecar = start_sidecar(extra=["--write-rate-limit", str(2 * 2**20), *metrics_flags(port)])
    rank = start_rank(sidecar, job="slow", extra_env={"STOWAWAY_TEST_TIMEOUT": "1"})
    rank.save(1, numel=2**19)
    rank.save(2, numel=2**19)

    rank.send(op="save", step=3, numel=2**19)
    refused = rank.read()
    assert refused["type"] == "SlotWaitTimeout", refused
    assert "all 2 slots in flight, steps [1, 2]" in refused["error"], refused["error"]
    assert "the sidecar persists slower than this rank saves" in refused["error"]
    assert "check storage throughput" in refused["error"]
    scraped = samples(http_get(f"http://127.0.0.1:{port}/metrics").body)
    assert scraped["stowaway_slots_in_flight"] == 2

    late = rank.call(op="wait", step=1, timeout=0.5)
    assert not late["committed"] and "step 1 was not committed within 0.5 s" in late["error"], late

    for step in (1, 2):
        assert rank.wait(step)["committed"], "slow storage delays checkpoints but loses none"
    scraped = samples(http_get(f"http://127.0.0.1:{port}/metrics").body)
    assert scraped["stowaway_persist_duration_seconds_count"] == 2
    assert scraped['stowaway_persist_duration_seconds_bucket{le="1.0"}'] == 0, "both persists took over a second"
    assert catalog.committed_steps(storage / "slow") == [1, 2]
