"""The sidecar's HTTP endpoints, on a real sidecar process with real ranks."""

from __future__ import annotations

import socket
import subprocess
import sys

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
    ranks = [start_rank(metrics_sidecar.process, rank=index, world_size=2) for index in range(2)]
    assert scrape(metrics_sidecar)["stowaway_ranks_connected"] == 2
    for rank in ranks:
        rank.exit()
    wait_for(lambda: scrape(metrics_sidecar)["stowaway_ranks_connected"] == 0, "ranks_connected to drop to 0")
    assert scrape(metrics_sidecar)["stowaway_slots_in_flight"] == 0


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
