"""Every restore a rank makes shows in its sidecar, and in the rank's ``last_restore``, by where the step came from.

A user proves that a restarted trainer came back from shared memory, and not
from storage, with the sidecar's log and /metrics alone; so these tests read
nothing else to tell the two apart, and then check that the trainer's own
``Checkpointer.last_restore`` says the same, with the time the sidecar logged. Ranks restart in place (the sidecar and
its shared memory stay, as when a container restarts in its pod) or next to
a new sidecar with empty shared memory (a rescheduled pod).
"""

from __future__ import annotations

import re
from typing import Any

from metrics.promtools import free_port, http_get, samples

from data_path.processes import wait_for
from stowaway.storage import layout

JOB = "tiny-lm"
SOURCES = ("memory", "storage")


def metrics_flags(port: int) -> list[str]:
    return ["--metrics-port", str(port), "--metrics-address", "127.0.0.1"]


def scrape(port: int) -> dict[str, float]:
    return samples(http_get(f"http://127.0.0.1:{port}/metrics").body)


def restores(port: int) -> dict[str, tuple[float, float]]:
    """Restores counted so far, and restore durations observed, by source."""
    found = scrape(port)
    return {source: (found[f'stowaway_restores_total{{source="{source}"}}'],
                     found[f'stowaway_restore_duration_seconds_count{{source="{source}"}}']) for source in SOURCES}


def reported(rank: int, step: int, source: str) -> re.Pattern[str]:
    """The sidecar's log line for one restore, as a user would grep it."""
    return re.compile(rf"rank {rank} of job {JOB} restored step {step} from {source} in \d+\.\d{{3}} s")


def logged_seconds(restore: dict[str, Any]) -> str:
    """The duration of ``last_restore`` as the sidecar's log line prints it: the same measurement, reported."""
    return f" in {restore['seconds']:.3f} s"


def test_ranks_restarted_in_place_are_logged_and_counted_as_restores_from_memory(start_sidecar, start_rank):
    port = free_port()
    sidecar = start_sidecar(extra=metrics_flags(port))
    ranks = [start_rank(sidecar, job=JOB, rank=rank, world_size=2) for rank in range(2)]
    for rank in ranks:
        assert rank.last_restore() is None, "no load() yet"
        assert rank.call(op="load") == {"step": None}
        assert rank.last_restore() is None, "a load() that found nothing restored nothing"
    for step in (11, 12):
        for rank in ranks:
            rank.save(step)
        for rank in ranks:
            assert rank.wait(step)["committed"]
    # Each rank's persists followed its load on the same connection, which the sidecar reads in order: a load
    # that restored nothing has reported nothing.
    assert restores(port) == {"memory": (0, 0), "storage": (0, 0)}

    for rank in ranks:
        rank.kill()  # the trainer container crashes; the pod, its sidecar and its shared memory stay
    restarted = [start_rank(sidecar, job=JOB, rank=rank, world_size=2) for rank in range(2)]
    for rank in restarted:
        assert rank.call(op="load") == {"step": 12, "intact": True, "numel": 1024}
    wait_for(lambda: restores(port)["memory"] == (2, 2), "the sidecar to count both ranks' restores from memory")
    assert restores(port)["storage"] == (0, 0)
    log = sidecar.log()
    for number, rank in enumerate(restarted):
        assert reported(number, 12, "memory").search(log), log
        restore = rank.last_restore()
        assert restore is not None and (restore["step"], restore["source"]) == (12, "memory"), restore
        assert f"rank {number} of job {JOB} restored step 12 from memory{logged_seconds(restore)}" in log, log
    assert "from storage" not in log, log


def test_a_rank_in_a_rescheduled_pod_is_logged_and_counted_once_as_a_restore_from_storage(
    start_sidecar, start_rank, storage
):
    old_pod = start_sidecar("a")
    rank = start_rank(old_pod, job=JOB)
    for step in (11, 12):
        rank.save(step)
        assert rank.wait(step)["committed"]
    rank.exit()
    assert old_pod.stop() == 0
    # A bit flip in the newest step: load() falls back to step 11, which is still one restore.
    newest = layout.step_dir(storage / JOB, 12) / layout.rank_file_name(0, 1)
    data = bytearray(newest.read_bytes())
    data[-3] ^= 0x10
    newest.write_bytes(bytes(data))

    port = free_port()
    new_pod = start_sidecar("b", extra=metrics_flags(port))  # the same storage, its own empty shared memory
    fresh = start_rank(new_pod, job=JOB)
    assert fresh.call(op="load") == {"step": 11, "intact": True, "numel": 1024}
    wait_for(lambda: restores(port)["storage"] == (1, 1), "the sidecar to count the restore from storage")
    found = scrape(port)
    assert restores(port)["memory"] == (0, 0)
    assert found['stowaway_failures_total{reason="restore_corrupt"}'] == 1
    log = new_pod.log()
    assert reported(0, 11, "storage").search(log), log
    restore = fresh.last_restore()
    assert restore is not None and (restore["step"], restore["source"]) == (11, "storage"), restore
    assert f"rank 0 of job {JOB} restored step 11 from storage{logged_seconds(restore)}" in log, log
    assert "restored step 12" not in log and "from memory" not in log, log
