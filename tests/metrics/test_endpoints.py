"""The sidecar's HTTP endpoints, on a real sidecar process with real ranks."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import pytest
from data_path.mounts import tmpfs
from data_path.processes import wait_for

from metrics.promtools import binary, free_port, http_get, samples


def scrape(sidecar) -> dict[str, float]:
    answer = http_get(f"{sidecar.url}/metrics")
    assert answer.status == 200, answer
    return samples(answer.body)


def test_healthz_and_readyz_say_ok_on_a_serving_sidecar(metrics_sidecar) -> None:
    assert http_get(f"{metrics_sidecar.url}/healthz").status == 200
    ready = http_get(f"{metrics_sidecar.url}/readyz")
    assert (ready.status, ready.body) == (200, "ready\n")


def test_wrong_paths_methods_and_garbage_get_http_errors_and_the_sidecar_keeps_serving(metrics_sidecar) -> None:
    assert http_get(f"{metrics_sidecar.url}/nothing").status == 404
    assert http_get(f"{metrics_sidecar.url}/metrics", method="POST").status == 405
    with socket.create_connection(("127.0.0.1", int(metrics_sidecar.url.rsplit(":", 1)[1])), timeout=10) as raw:
        raw.sendall(b"not http at all\r\n\r\n")
        assert raw.recv(100).startswith(b"HTTP/1.1 400 ")
    assert http_get(f"{metrics_sidecar.url}/healthz").status == 200


@pytest.mark.prometheus
def test_a_real_scrape_after_saves_passes_promtool_check_metrics(metrics_sidecar, start_rank) -> None:
    rank = start_rank(metrics_sidecar.process)
    for step in range(3):
        rank.save(step)
    assert rank.wait(2)["committed"]
    answer = http_get(f"{metrics_sidecar.url}/metrics")
    assert answer.content_type.startswith("text/plain; version=")
    check = subprocess.run([binary("promtool"), "check", "metrics"], input=answer.body,
                           capture_output=True, text=True, timeout=60)
    assert check.returncode == 0 and not check.stdout.strip() and not check.stderr.strip(), check


def test_ranks_connected_and_slots_in_flight_follow_the_ranks(metrics_sidecar, start_rank) -> None:
    assert scrape(metrics_sidecar)["stowaway_ranks_connected_since_timestamp_seconds"] == 0
    before = time.time()
    first = start_rank(metrics_sidecar.process, rank=0, world_size=2)
    since = scrape(metrics_sidecar)["stowaway_ranks_connected_since_timestamp_seconds"]
    assert before <= since <= time.time()
    second = start_rank(metrics_sidecar.process, rank=1, world_size=2)
    found = scrape(metrics_sidecar)
    # A second rank joining does not restart the clock of the alerts that wait for a first commit.
    assert found["stowaway_ranks_connected"] == 2 and found["stowaway_ranks_connected_since_timestamp_seconds"] == since
    first.exit()
    wait_for(lambda: scrape(metrics_sidecar)["stowaway_ranks_connected"] == 1, "ranks_connected to drop to 1")
    assert scrape(metrics_sidecar)["stowaway_ranks_connected_since_timestamp_seconds"] == since
    second.exit()
    wait_for(lambda: scrape(metrics_sidecar)["stowaway_ranks_connected"] == 0, "ranks_connected to drop to 0")
    found = scrape(metrics_sidecar)
    assert found["stowaway_slots_in_flight"] == 0 and found["stowaway_ranks_connected_since_timestamp_seconds"] == 0


def test_the_stale_after_limit_of_the_alerts_is_exported_as_given(start_sidecar) -> None:
    port = free_port()
    start_sidecar("a", ["--metrics-port", str(port), "--metrics-address", "127.0.0.1", "--stale-after", "21600"])
    assert samples(http_get(f"http://127.0.0.1:{port}/metrics").body)["stowaway_stale_after_seconds"] == 21600


def test_the_stale_after_limit_defaults_to_two_hours(metrics_sidecar) -> None:
    assert scrape(metrics_sidecar)["stowaway_stale_after_seconds"] == 7200


def test_a_stale_after_limit_that_is_not_positive_is_refused_with_what_to_give(short_tmp) -> None:
    refused = subprocess.run(
        [sys.executable, "-m", "stowaway", "sidecar", "--storage", str(short_tmp / "st"), "--socket",
         str(short_tmp / "s.sock"), "--shm-dir", f"/dev/shm/{short_tmp.name}/x", "--stale-after", "0"],
        capture_output=True, text=True, timeout=60,
    )
    assert refused.returncode != 0
    assert "--stale-after must be a positive number of seconds, above the job's save interval" in refused.stderr
    assert not (short_tmp / "st").exists()


def test_a_slot_being_persisted_counts_as_in_flight_until_released(start_sidecar, start_rank) -> None:
    port = free_port()
    # 2 MiB at 1 MiB/s: the sidecar holds the slot for about two seconds.
    sidecar = start_sidecar("a", ["--metrics-port", str(port), "--write-rate-limit", str(2**20)])
    rank = start_rank(sidecar)
    rank.save(0, numel=2**18)
    url = f"http://127.0.0.1:{port}/metrics"
    wait_for(lambda: samples(http_get(url).body)["stowaway_slots_in_flight"] == 1, "the slot to be in flight")
    assert rank.wait(0)["committed"]
    assert samples(http_get(url).body)["stowaway_slots_in_flight"] == 0


def test_read_only_storage_makes_readyz_fail_and_a_save_count_as_storage_read_only(
    start_sidecar, start_rank, short_tmp
) -> None:
    with tmpfs(short_tmp / "ro", "16m") as mount:
        port = free_port()
        sidecar = start_sidecar("a", ["--metrics-port", str(port)], storage_dir=mount / "storage")
        rank = start_rank(sidecar)
        subprocess.run(["mount", "-o", "remount,ro", str(mount)], check=True)
        ready = http_get(f"http://127.0.0.1:{port}/readyz")
        assert ready.status == 503 and "not writable" in ready.body, ready
        rank.save(0)
        assert not rank.wait(0)["committed"]
        found = samples(http_get(f"http://127.0.0.1:{port}/metrics").body)
        assert found['stowaway_failures_total{reason="storage_read_only"}'] == 1
        rank.exit()
        sidecar.stop()


def test_a_metrics_port_in_use_stops_the_sidecar_with_a_message_naming_the_port(short_tmp) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run(
            [sys.executable, "-m", "stowaway", "sidecar", "--storage", str(short_tmp / "s"),
             "--socket", str(short_tmp / "x.sock"), "--shm-dir", f"/dev/shm/{short_tmp.name}/x",
             "--metrics-port", str(port), "--metrics-address", "127.0.0.1"],
            capture_output=True, text=True, timeout=60,
        )
    assert result.returncode != 0
    assert f"cannot serve metrics on 127.0.0.1:{port}" in result.stderr, result.stderr
    assert not (short_tmp / "x.sock").exists()
