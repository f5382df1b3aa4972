"""A bucket as the only storage, without a claim, against a real S3 server (SeaweedFS): ranks' files uploaded
from their slots, committed in the bucket on one node and on two, restored from it, and refused clearly."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import safetensors.torch
from s3server import S3Server

from data_path.processes import collective, join_group, stowaway_cli, wait_for
from data_path.rank_driver import pattern
from stowaway.storage import bucket, bucket_store, layout, manifest, step_store

pytestmark = pytest.mark.s3


def store_at(server: S3Server, url: str) -> bucket_store.BucketStore:
    return bucket_store.open_bucket(url, bucket.Settings(endpoint=server.endpoint))



def test_a_job_saves_commits_and_restores_through_the_bucket_alone(
        bucket_env: S3Server, s3_bucket: str, start_sidecar, start_rank) -> None:
    url = f"s3://{s3_bucket}/ckpt"
    # Parts of 5 MiB (S3's least), so that a rank file of 8 MB goes up as a multipart upload.
    first = start_sidecar("a", extra=["--bucket", url, "--keep-last", "2", "--upload-part-size", str(5 * 2**20)],
                          claim=False)
    rank = start_rank(first)
    for step in (1, 2, 3):
        rank.save(step, numel=2_000_000)
        assert rank.wait(step).get("committed"), f"step {step} was not committed"
    rank.exit()
    store = store_at(bucket_env, url)
    wait_for(lambda: store.committed_steps("job") == [2, 3], "retention in the bucket to keep steps 2 and 3")
    found = store.read_manifest("job", 3)
    assert found.nodes == ["a"] and found.files[0].pieces, "piece checksums, for ranged reads"
    assert store.bucket.read(store.bucket.location.key("job", layout.LATEST)) == b"3\n"
    # Each rank object is a plain .safetensors file: the safetensors package reads its bytes as they are.
    [weights] = safetensors.torch.load(store.bucket.read(store.bucket.step_key("job", 3, found.files[0].name))).values()
    assert weights.numel() == 2_000_000 and bool((weights == pattern(0, 3)).all())
    first.stop()

    # Another pod: no slot of the job in its shared memory, nothing but the bucket.
    second = start_sidecar("b", extra=["--bucket", url], claim=False)
    restored = start_rank(second)
    assert restored.call(op="load") == {"step": 3, "intact": True, "numel": 2_000_000}
    assert restored.last_restore()["source"] == "storage"
    restored.save(4, numel=2_000_000)
    assert restored.wait(4).get("committed")
    restored.exit()

    verified = stowaway_cli("verify", f"{url}/job")
    assert verified.returncode == 0, verified.stdout + verified.stderr
    assert verified.stdout.splitlines() == [f"step {step}: ok" for step in (2, 3, 4)]


def test_two_nodes_commit_one_step_through_the_bucket_alone(
        bucket_env: S3Server, s3_bucket: str, start_sidecar, start_rank, short_tmp: Path) -> None:
    url = f"s3://{s3_bucket}/multi"
    node_a = start_sidecar("a", extra=["--bucket", url], claim=False)
    node_b = start_sidecar("b", extra=["--bucket", url], claim=False)
    ranks = [start_rank(node_a if rank < 2 else node_b, job="multi", rank=rank, world_size=4, local_world_size=2)
             for rank in range(4)]
    store = store_at(bucket_env, url)

    for rank in ranks[:3]:
        rank.save(1)
    wait_for(lambda: [r.node for r in store.read_notices("multi", 1).receipts] == ["a"],
             "node a's receipt in the bucket")
    assert store.committed_steps("multi") == [], "node b still misses rank 3"
    assert not any(rank.done(1) for rank in ranks[:3]), "three of four ranks must not commit"

    ranks[3].save(1)
    for rank in ranks:
        assert rank.wait(1)["committed"]
    found = store.read_manifest("multi", 1)
    assert found.world_size == 4 and found.nodes == ["a", "b"]
    join_group(ranks, short_tmp / "group")
    assert collective(ranks, op="load") == [{"step": 1, "intact": True, "numel": 1024}] * 4


def test_a_second_manifest_for_a_committed_step_is_refused_by_the_server(bucket_env: S3Server, s3_bucket: str) -> None:
    store = store_at(bucket_env, f"s3://{s3_bucket}/twice")
    entry = manifest.FileEntry(0, layout.rank_file_name(0, 1), 8, "0" * 16)
    first = manifest.Manifest("job", "run-1", 5, 1, [entry], ["a"], {})
    store.write_manifest("job", 5, first)
    with pytest.raises(step_store.ManifestExists):
        store.write_manifest("job", 5, manifest.Manifest("job", "run-2", 5, 1, [entry], ["b"], {}))
    assert store.read_manifest("job", 5).run == "run-1", "the first commit stands"


def test_wrong_credentials_fail_the_save_with_what_to_check_and_commit_nothing(
        bucket_env: S3Server, s3_bucket: str, start_sidecar, start_rank, monkeypatch: pytest.MonkeyPatch) -> None:
    url = f"s3://{s3_bucket}/denied"
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    sidecar = start_sidecar("a", extra=["--bucket", url, "--upload-retry-timeout", "2"], claim=False)
    rank = start_rank(sidecar)
    rank.save(1)
    answer = rank.wait(1, timeout=60)
    assert not answer["committed"]
    assert "bucket_denied" in answer["error"] and "check the credentials" in answer["error"], answer["error"]
    rank.exit()
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", bucket_env.env()["AWS_SECRET_ACCESS_KEY"])
    assert store_at(bucket_env, url).bucket.keys_below("denied/") == [], "nothing half-written is left"


def test_retention_in_a_bucket_alone_drops_old_steps_manifest_first_and_sweeps_only_abandoned_torn_ones(
        bucket_env: S3Server, s3_bucket: str) -> None:
    store = store_at(bucket_env, f"s3://{s3_bucket}/kept")
    entry = manifest.FileEntry(0, layout.rank_file_name(0, 1), 8, "0" * 16)
    for step in (1, 2, 3, 4, 6):
        store.bucket.put(store.bucket.step_key("job", step, entry.name), b"12345678")
    for step in (2, 3, 6):
        store.write_manifest("job", step, manifest.Manifest("job", "run-1", step, 1, [entry], ["a"], {}))

    # Steps 1 and 4 are torn (no manifest); 4 is still being saved.
    assert store.retain("job", keep_last=2, keep_every=0, abandoned_after=3600.0, busy=set()) == [2]
    # Any age counts as abandoned now, whatever the rounding of the server's timestamps.
    assert store.retain("job", keep_last=2, keep_every=0, abandoned_after=-60.0, busy={4}) == [1]
    assert store.committed_steps("job") == [3, 6]
    assert sorted(store.bucket.step_listing("job")) == [3, 4, 6], "a busy torn step stays"


def test_rollback_on_a_bucket_alone_sets_newer_steps_aside_and_the_job_resumes_from_the_older_one(
        bucket_env: S3Server, s3_bucket: str, start_sidecar, start_rank) -> None:
    url = f"s3://{s3_bucket}/back"
    sidecar = start_sidecar("a", extra=["--bucket", url], claim=False)
    rank = start_rank(sidecar)
    for step in (1, 2, 3, 4):
        rank.save(step)
        assert rank.wait(step).get("committed"), f"step {step} was not committed"
    rank.exit()
    sidecar.stop()
    store = store_at(bucket_env, url)
    # A torn step 5 (its rank file, no manifest) goes aside with the committed ones.
    store.bucket.put(store.bucket.step_key("job", 5, layout.rank_file_name(0, 1)), b"torn")

    refused = stowaway_cli("rollback", f"{url}/job", "--to", "7")
    assert refused.returncode != 0 and "step 7 is not committed" in refused.stderr, refused.stderr
    assert store.committed_steps("job") == [1, 2, 3, 4], "a refused rollback moves nothing"

    done = stowaway_cli("rollback", f"{url}/job", "--to", "2")
    assert done.returncode == 0, done.stdout + done.stderr
    assert store.committed_steps("job") == [1, 2]
    assert sorted(store.bucket.step_listing("job")) == [1, 2]
    assert store.bucket.read(store.bucket.location.key("job", layout.LATEST)) == b"2\n"
    listed = stowaway_cli("ls", f"{url}/job").stdout
    for step in (3, 4, 5):
        assert f"rolled-back-step-{step:012d}-" in listed, listed
    verified = stowaway_cli("verify", f"{url}/job")
    assert verified.stdout.splitlines() == ["step 1: ok", "step 2: ok"], verified.stdout + verified.stderr

    resumed = start_sidecar("b", extra=["--bucket", url], claim=False)
    again = start_rank(resumed)
    assert again.call(op="load") == {"step": 2, "intact": True, "numel": 1024}
    again.save(3)
    assert again.wait(3).get("committed"), "the job saves the steps after the rollback again"
    again.exit()
    assert store.committed_steps("job") == [1, 2, 3]


SAVE_THEN_LOAD = """
import sys, torch
from stowaway import Checkpointer
with Checkpointer() as ckpt:
    restored = ckpt.load()
    step = 0 if restored is None else restored[0]
    if restored is not None:
        assert torch.equal(restored[1]["w"], torch.full((1000,), float(step))), "the state saved comes back"
    ckpt.save(step + 1, {"w": torch.full((1000,), float(step + 1))}).wait()
    print("restored", step, "saved", step + 1, ckpt.last_restore.source if ckpt.last_restore else None)
"""


def test_stowaway_run_with_a_bucket_alone_saves_there_and_the_next_run_resumes_from_it(
        bucket_env: S3Server, s3_bucket: str) -> None:
    url = f"s3://{s3_bucket}/local"
    first = stowaway_cli("run", "--bucket", url, "--job", "demo", "--", sys.executable, "-c", SAVE_THEN_LOAD)
    assert first.returncode == 0, first.stdout + first.stderr
    assert "restored 0 saved 1 None" in first.stdout
    assert f"checkpoints of job 'demo' in {url}/demo" in first.stderr
    second = stowaway_cli("run", "--bucket", url, "--job", "demo", "--", sys.executable, "-c", SAVE_THEN_LOAD)
    assert second.returncode == 0, second.stdout + second.stderr
    assert "restored 1 saved 2 storage" in second.stdout, "a new run on a new sidecar restores from the bucket"
    assert store_at(bucket_env, url).committed_steps("demo") == [1, 2]

    refused = stowaway_cli("run", "--", sys.executable, "-c", "pass")
    assert refused.returncode == 2 and "pass --storage DIR, --bucket s3://BUCKET/PREFIX, or both" in refused.stderr
