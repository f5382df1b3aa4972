"""Faults of the bucket tier against a real S3 server: the server down or frozen, wrong credentials, a missing,
read-only or full bucket, a part failing, the sidecar killed mid-upload. The claim commits through all of them;
nothing torn counts as committed in the bucket; uploads resume."""

from __future__ import annotations

import os
import re
import signal
import socket
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import obstore
import pytest
from faulty_proxy import FaultyProxy
from s3server import ADMIN, READER, TRAINER, S3Server, bucket_steps, weed_binary

from data_path.processes import wait_for
from stowaway.storage import bucket, bucket_jobs, bucket_store, catalog

pytestmark = [pytest.mark.s3, pytest.mark.faults]
FAST_RETRIES = ["--upload-retry-timeout", "1", "--upload-retry-interval", "0.2"]


@pytest.fixture
def own_server(monkeypatch: pytest.MonkeyPatch) -> Iterator[S3Server]:
    """A server of this test's own, which it may stop, freeze and start again."""
    server = S3Server(weed_binary()).start()
    try:
        server.create_bucket("ckpt")
        for name, value in server.env().items():
            monkeypatch.setenv(name, value)
        yield server
    finally:
        if server.process is not None and server.process.poll() is None:
            os.killpg(server.process.pid, signal.SIGCONT)
        server.close()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def metric(port: int, name: str, labels: str = "") -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    match = re.search(rf"^{re.escape(name)}{re.escape('{' + labels + '}') if labels else ''} (\S+)$", text, re.M)
    assert match, f"{name}{{{labels}}} not exported:\n{text}"
    return float(match.group(1))


def failures(port: int) -> float:
    """Bucket failures counted, whatever the reason: servers differ in how they refuse a full bucket."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return sum(float(value) for value in re.findall(r"^stowaway_bucket_failures_total\{[^}]*\} (\S+)$", text, re.M))


def steps_in(server: S3Server, url: str) -> list[int]:
    """Committed steps, giving up on a server that is down after 5 s rather than the tools' minute."""
    return bucket_steps(server, url, retry_seconds=5)


def test_a_bucket_that_is_down_never_blocks_saves_and_gets_the_newest_step_once_back(
        own_server: S3Server, start_sidecar, start_rank, storage: Path) -> None:
    port = free_port()
    own_server.stop()
    sidecar = start_sidecar(extra=["--bucket", "s3://ckpt/p", "--metrics-port", str(port), *FAST_RETRIES])
    rank = start_rank(sidecar)
    for step in (1, 2, 3):
        rank.save(step)
        assert rank.wait(step, timeout=10).get("committed"), f"step {step} waited for the bucket"
    wait_for(lambda: metric(port, "stowaway_bucket_failures_total", 'reason="bucket_unreachable"') >= 1,
             "the unreachable bucket to be counted")
    assert metric(port, "stowaway_tier_newest_step", 'tier="claim"') == 3
    assert metric(port, "stowaway_tier_newest_step", 'tier="bucket"') == -1

    own_server.start()
    wait_for(lambda: metric(port, "stowaway_tier_newest_step", 'tier="bucket"') == 3, "step 3 in the bucket",
             timeout=120)
    # Only the newest step is uploaded: a bucket that was away does not replay what it missed.
    assert steps_in(own_server, "s3://ckpt/p/job") == [3]
    assert metric(port, "stowaway_bucket_uploaded_bytes_total") > 0
    assert catalog.committed_steps(storage / "job") == [1, 2, 3]
    rank.exit()


@pytest.mark.parametrize(("target", "identity", "reason"), [
    ("s3://ckpt/p", (TRAINER[0], "not-the-secret-at-all"), "bucket_denied"),
    ("s3://no-such-bucket/p", None, "bucket_missing"),
    ("s3://ckpt/p", READER, "bucket_denied"),
], ids=["wrong credentials", "missing bucket", "read-only bucket"])
def test_a_bucket_that_refuses_is_counted_and_logged_without_secrets_and_saves_commit(
        own_server: S3Server, start_sidecar, start_rank, monkeypatch: pytest.MonkeyPatch, target: str,
        identity: tuple[str, str] | None, reason: str) -> None:
    if identity is not None:
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", identity[0])
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", identity[1])
    used_secret = os.environ["AWS_SECRET_ACCESS_KEY"]
    port = free_port()
    sidecar = start_sidecar(extra=["--bucket", target, "--metrics-port", str(port), *FAST_RETRIES])
    rank = start_rank(sidecar)
    rank.save(1)
    assert rank.wait(1, timeout=10).get("committed")
    wait_for(lambda: metric(port, "stowaway_bucket_failures_total", f'reason="{reason}"') >= 1,
             f"the failure to be counted as {reason}")
    rank.exit()
    log = sidecar.log()
    assert "upload of job job to " in log and reason in log
    assert used_secret not in log
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    assert used_secret not in text
    assert [meta["path"] for chunk in obstore.list(own_server.store("ckpt")) for meta in chunk] == []


def test_a_full_bucket_keeps_its_steps_intact_saves_commit_and_the_newest_step_follows_once_room_is_made(
        own_server: S3Server, start_sidecar, start_rank, storage: Path) -> None:
    port = free_port()
    sidecar = start_sidecar(extra=["--bucket", "s3://ckpt/p", "--metrics-port", str(port), *FAST_RETRIES])
    rank = start_rank(sidecar)
    rank.save(1)
    assert rank.wait(1).get("committed")
    wait_for(lambda: steps_in(own_server, "s3://ckpt/p/job") == [1], "step 1 in the bucket")

    # Other data fills the bucket past a quota of 1 MB, and the server enforces it.
    filler = own_server.store("ckpt", ADMIN)
    obstore.put(filler, "other-team/data", os.urandom(3 * 2**20))
    own_server.enforce_quota("ckpt", 1)
    wait_for(lambda: own_server.usage("ckpt") > 100, "the volumes to report the bucket's usage")
    own_server.enforce_quota("ckpt", 1)

    for step in (2, 3):
        rank.save(step)
        assert rank.wait(step, timeout=10).get("committed"), "a full bucket must not hold up the claim's commits"
    wait_for(lambda: failures(port) >= 2, "the refused uploads to be counted")
    assert steps_in(own_server, "s3://ckpt/p/job") == [1], "nothing of a refused upload counts as committed"
    job = bucket_jobs.jobs_at("s3://ckpt/p/job", bucket.Settings(endpoint=own_server.endpoint))[0]
    assert [job.verify_file(1, entry) for entry in job.read_manifest(1).files] == [None]

    own_server.enforce_quota("ckpt", None)
    wait_for(lambda: steps_in(own_server, "s3://ckpt/p/job") == [1, 3], "the newest step once there is room",
             log=sidecar.log)
    rank.exit()
    assert catalog.committed_steps(storage / "job") == [1, 2, 3]


def test_a_sidecar_killed_mid_upload_commits_nothing_torn_and_its_restart_uploads_the_step(
        own_server: S3Server, start_sidecar, start_rank, storage: Path) -> None:
    assert own_server.process is not None
    extra = ["--bucket", "s3://ckpt/p", "--upload-part-size", str(5 * 2**20), "--upload-concurrency", "2",
             "--upload-retry-timeout", "120"]
    sidecar = start_sidecar(extra=extra)
    rank = start_rank(sidecar)
    rank.save(1, numel=2_000_000)  # 16 MB: four parts
    assert rank.wait(1).get("committed")
    wait_for(lambda: steps_in(own_server, "s3://ckpt/p/job") == [1], "step 1 in the bucket")

    # Freeze the server, so that the next upload is certainly under way when the sidecar dies.
    os.killpg(own_server.process.pid, signal.SIGSTOP)
    rank.save(2, numel=2_000_000)
    assert rank.wait(2).get("committed")
    wait_for(lambda: "uploading step 2 of job job" in sidecar.log(), "the upload of step 2 to start")
    sidecar.kill()
    rank.kill()
    os.killpg(own_server.process.pid, signal.SIGCONT)
    assert steps_in(own_server, "s3://ckpt/p/job") == [1], "a torn upload counts as committed"

    sidecar.start()
    wait_for(lambda: steps_in(own_server, "s3://ckpt/p/job") == [1, 2], "the restart to upload step 2",
             timeout=120)
    job = bucket_jobs.jobs_at("s3://ckpt/p/job", bucket.Settings(endpoint=own_server.endpoint))[0]
    for step in (1, 2):
        found = job.read_manifest(step)
        assert [job.verify_file(step, entry) for entry in found.files] == [None]
    assert catalog.committed_steps(storage / "job") == [1, 2]


def test_a_part_that_fails_is_retried_on_its_own_and_the_step_commits(
        s3_server: S3Server, s3_bucket: str, start_sidecar, start_rank, monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in s3_server.env().items():
        monkeypatch.setenv(name, value)
    # The third part of the upload fails once, with a 500.
    proxy = FaultyProxy(s3_server.endpoint, "PUT", "partNumber=3")
    with proxy.running():
        sidecar = start_sidecar(extra=["--bucket", f"s3://{s3_bucket}/p", "--bucket-endpoint", proxy.endpoint,
                                       "--upload-part-size", str(5 * 2**20)])
        rank = start_rank(sidecar)
        rank.save(1, numel=2_000_000)  # 16 MB: four parts
        assert rank.wait(1).get("committed")
        url = f"s3://{s3_bucket}/p/job"
        wait_for(lambda: steps_in(s3_server, url) == [1], "step 1 in the bucket", log=sidecar.log)
        rank.exit()
    assert len(proxy.failed) == 1 and "partNumber=3" in proxy.failed[0]
    part_puts = [line for line in proxy.forwarded if line.startswith("PUT") and "partNumber=" in line]
    assert sorted(int(line.split("partNumber=")[1].split("&")[0]) for line in part_puts) == [1, 2, 3, 4], \
        "only the failed part is sent again"
    assert "failed" not in sidecar.log(), "a retried part must not fail the upload"
    job = bucket_jobs.jobs_at(url, bucket.Settings(endpoint=s3_server.endpoint))[0]
    assert [job.verify_file(1, entry) for entry in job.read_manifest(1).files] == [None]


def test_on_several_nodes_only_the_one_hosting_rank_zero_uploads_and_resumes(
        own_server: S3Server, start_sidecar, start_rank) -> None:
    extra = ["--bucket", "s3://ckpt/p", *FAST_RETRIES]
    nodes = [start_sidecar("a", extra=extra), start_sidecar("b", extra=extra)]
    ranks = [start_rank(nodes[rank // 2], job="multi", rank=rank, world_size=4, local_world_size=2)
             for rank in range(4)]
    url = "s3://ckpt/p/multi"
    for rank in ranks:
        rank.save(1)
    assert all(rank.wait(1)["committed"] for rank in ranks)
    wait_for(lambda: steps_in(own_server, url) == [1], "step 1 in the bucket", log=nodes[0].log)

    own_server.stop()
    for rank in ranks:
        rank.save(2)
    assert all(rank.wait(2, timeout=10)["committed"] for rank in ranks), "the bucket held up a commit"
    for rank in ranks:
        rank.exit()
    for node in nodes:
        assert node.stop() == 0
    own_server.start()
    own_server.wait_serving("ckpt")
    for node in nodes:
        node.start()
    wait_for(lambda: steps_in(own_server, url) == [1, 2], "the restarted node a to upload step 2",
             timeout=120, log=nodes[0].log)
    assert nodes[0].log().count("uploading step 2 of job multi") >= 1
    assert "uploading" not in nodes[1].log(), "node b uploaded although node a hosts rank 0"


def bucket_alone_steps(server: S3Server) -> list[int]:
    return bucket_store.open_bucket("s3://ckpt/alone", bucket.Settings(endpoint=server.endpoint,
                                                                       retry_seconds=5)).committed_steps("job")


def test_without_a_claim_a_bucket_down_fails_the_step_hands_the_slot_back_and_the_next_one_commits(
        own_server: S3Server, start_sidecar, start_rank) -> None:
    sidecar = start_sidecar(extra=["--bucket", "s3://ckpt/alone", *FAST_RETRIES], claim=False)
    rank = start_rank(sidecar)
    rank.save(1)
    assert rank.wait(1).get("committed")

    own_server.stop()
    rank.save(2)
    failed = rank.wait(2, timeout=60)
    assert not failed["committed"]
    assert "bucket_unreachable" in failed["error"] and "check the endpoint" in failed["error"], failed["error"]
    # A restore meanwhile says why it cannot list the steps, rather than finding none and starting over.
    restoring = start_rank(sidecar, job="other")
    restoring.send(op="load")
    refused = restoring.read()
    assert refused["type"] == "SidecarUnavailable" and "bucket_unreachable" in refused["error"], refused
    restoring.exit()
    own_server.start()
    own_server.wait_writable("ckpt")
    # The slot came back with the failure: the rank saves on, and the bucket commits the next step.
    rank.save(3)
    assert rank.wait(3, timeout=60).get("committed"), sidecar.log()
    assert bucket_alone_steps(own_server) == [1, 3]
    rank.exit()


def test_without_a_claim_a_sidecar_killed_mid_upload_commits_nothing_torn_and_the_job_goes_on(
        own_server: S3Server, start_sidecar, start_rank) -> None:
    assert own_server.process is not None
    extra = ["--bucket", "s3://ckpt/alone", "--upload-part-size", str(5 * 2**20), "--upload-concurrency", "2"]
    sidecar = start_sidecar(extra=extra, claim=False)
    rank = start_rank(sidecar)
    rank.save(1, numel=2_000_000)
    assert rank.wait(1).get("committed")

    # Frozen, so that the upload of step 2 is certainly under way when the sidecar dies.
    os.killpg(own_server.process.pid, signal.SIGSTOP)
    rank.save(2, numel=2_000_000)
    wait_for(lambda: not rank.done(2) and sidecar.alive(), "the upload of step 2 to be under way")
    sidecar.kill()
    rank.kill()
    os.killpg(own_server.process.pid, signal.SIGCONT)
    assert bucket_alone_steps(own_server) == [1], "a torn upload counts as committed"

    sidecar.start()
    restarted = start_rank(sidecar, run_id="second-run")
    assert restarted.call(op="load") == {"step": 1, "intact": True, "numel": 2_000_000}
    restarted.save(2, numel=2_000_000)
    assert restarted.wait(2).get("committed"), "the step torn before is saved again"
    assert bucket_alone_steps(own_server) == [1, 2]
    restarted.exit()
