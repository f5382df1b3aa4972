"""The bucket tier against a real S3 server (SeaweedFS): uploads behind the claim, its own retention, restores
into an empty claim, and the tools on ``s3://`` URLs."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from s3server import S3Server, bucket_steps

from data_path.processes import SidecarProcess, stowaway_cli, wait_for
from data_path.rank_driver import pattern
from stowaway import read_checkpoint
from stowaway.storage import bucket, catalog, layout

pytestmark = pytest.mark.s3



def test_committed_steps_reach_the_bucket_which_keeps_its_own_retention(
        bucket_env: S3Server, s3_bucket: str, start_sidecar, start_rank, storage: Path) -> None:
    url = f"s3://{s3_bucket}/ckpt"
    sidecar = start_sidecar(extra=["--keep-last", "2", "--bucket", url, "--bucket-keep-last", "1",
                                   "--bucket-keep-every", "4"])
    rank = start_rank(sidecar)
    for step in range(10):
        rank.save(step)
        assert rank.wait(step).get("committed"), f"step {step} was not committed"
        # One step at a time, so that the claim's shorter retention cannot drop a step before its upload.
        wait_for(lambda step=step: step in bucket_steps(bucket_env, f"{url}/job"), f"step {step} in the bucket")
    rank.exit()
    wait_for(lambda: bucket_steps(bucket_env, f"{url}/job") == [0, 4, 8, 9], "the bucket to keep 0, 4, 8 and 9")
    wait_for(lambda: catalog.committed_steps(storage / "job") == [8, 9], "the claim to keep 8 and 9")

    listed = stowaway_cli("ls", url)
    assert listed.returncode == 0, listed.stderr
    assert [line.split()[0] for line in listed.stdout.splitlines()[2:]] == ["0", "4", "8", "9"], listed.stdout
    verified = stowaway_cli("verify", f"{url}/job")
    assert verified.returncode == 0, verified.stdout + verified.stderr
    assert verified.stdout.splitlines() == [f"step {step}: ok" for step in (0, 4, 8, 9)]
    inspected = stowaway_cli("inspect", f"{url}/job", "--step", "9")
    assert inspected.returncode == 0, inspected.stderr
    assert "job job step 9: 1 rank(s)" in inspected.stdout
    assert "rank 0: rank-00000-of-00001.safetensors" in inspected.stdout


@pytest.mark.parametrize("claim_holds", [[], [3]], ids=["empty claim", "claim restored from an older backup"])
def test_a_pod_whose_claim_lacks_the_newest_step_restores_it_from_the_bucket(
        bucket_env: S3Server, s3_bucket: str, start_sidecar, start_rank, short_tmp: Path,
        claim_holds: list[int]) -> None:
    url = f"s3://{s3_bucket}/ckpt"
    first = start_sidecar("a", extra=["--bucket", url], storage_dir=short_tmp / "claim-a")
    rank = start_rank(first)
    for step in (3, 7):
        rank.save(step, numel=300_000)
        assert rank.wait(step).get("committed")
    rank.exit()
    wait_for(lambda: bucket_steps(bucket_env, f"{url}/job") == [3, 7], "steps 3 and 7 in the bucket")
    first.stop()

    # A new cluster (another claim, the same bucket), or a claim restored from a backup taken before step 7.
    for step in claim_holds:
        shutil.copytree(layout.step_dir(short_tmp / "claim-a" / "job", step),
                        layout.step_dir(short_tmp / "claim-b" / "job", step))
    second = start_sidecar("b", extra=["--bucket", url], storage_dir=short_tmp / "claim-b")
    restored = start_rank(second)
    loaded = restored.call(op="load")
    assert loaded == {"step": 7, "intact": True, "numel": 300_000}
    assert restored.last_restore()["source"] == "storage"
    assert catalog.committed_steps(short_tmp / "claim-b" / "job") == [*claim_holds, 7]
    assert (short_tmp / "claim-b" / "job" / layout.LATEST).read_text().strip() == "7"
    assert f"the claim's newest was {'step 3' if claim_holds else 'none'}" in second.log()
    restored.exit()


def rolled_back_to_5(bucket_env: S3Server, url: str, start_sidecar, start_rank, claim: Path) -> SidecarProcess:
    """Steps 3, 5 and 7 committed on the claim and in the bucket, then the job rolled back to 5 and its sidecar
    restarted, which sets the bucket's step 7 aside; the running sidecar."""
    sidecar = start_sidecar("a", extra=["--bucket", url], storage_dir=claim)
    rank = start_rank(sidecar, run_id="first-run")
    for step in (3, 5, 7):
        rank.save(step)
        assert rank.wait(step).get("committed")
        wait_for(lambda step=step: step in bucket_steps(bucket_env, f"{url}/job"), f"step {step} in the bucket")
    rank.exit()
    sidecar.stop()

    rolled = stowaway_cli("rollback", str(claim / "job"), "--to", "5")
    assert rolled.returncode == 0, rolled.stderr
    sidecar.start()
    wait_for(lambda: bucket_steps(bucket_env, f"{url}/job") == [3, 5], "step 7 to leave the bucket's step names",
             log=sidecar.log)
    return sidecar


def test_a_rollback_on_the_claim_sets_the_bucket_copies_aside_so_no_cluster_restores_them(
        bucket_env: S3Server, s3_bucket: str, start_sidecar, start_rank, short_tmp: Path) -> None:
    url = f"s3://{s3_bucket}/ckpt"
    sidecar = rolled_back_to_5(bucket_env, url, start_sidecar, start_rank, short_tmp / "claim-a")
    listed = stowaway_cli("ls", f"{url}/job")
    assert listed.returncode == 0, listed.stderr
    assert f"set aside (kept for inspection; delete it when done): {url}/job/rolled-back-step-000000000007-" \
        in listed.stdout, listed.stdout

    # A new cluster, with an empty claim, restores the step the job went back to, not the abandoned one.
    elsewhere = start_sidecar("b", extra=["--bucket", url], storage_dir=short_tmp / "claim-b")
    fresh = start_rank(elsewhere)
    assert fresh.call(op="load") == {"step": 5, "intact": True, "numel": 1024}
    fresh.exit()

    # The job goes on from step 5, and its new step 7 reaches the bucket under its own name.
    resumed = start_rank(sidecar, run_id="second-run")
    assert resumed.call(op="load") == {"step": 5, "intact": True, "numel": 1024}
    resumed.save(7)
    assert resumed.wait(7).get("committed")
    resumed.exit()
    store = bucket.Bucket(bucket.Location(s3_bucket, "ckpt"), bucket.Settings(endpoint=bucket_env.endpoint))
    wait_for(lambda: 7 in store.committed_steps("job") and store.read_manifest("job", 7).run == "second-run",
             "the new step 7 in the bucket", log=sidecar.log)


def test_a_rollback_undone_on_the_claim_brings_the_step_back_into_the_bucket(
        bucket_env: S3Server, s3_bucket: str, start_sidecar, start_rank, short_tmp: Path) -> None:
    url, claim = f"s3://{s3_bucket}/ckpt", short_tmp / "claim-a"
    sidecar = rolled_back_to_5(bucket_env, url, start_sidecar, start_rank, claim)
    sidecar.stop()
    # Undone by hand, as docs/troubleshooting.md says: the step renamed back, the record left where it is.
    (aside,) = layout.set_aside_dirs(claim / "job")
    aside.rename(layout.step_dir(claim / "job", 7))
    sidecar.start()
    wait_for(lambda: bucket_steps(bucket_env, f"{url}/job") == [3, 5, 7], "step 7 back in the bucket",
             log=sidecar.log)
    store = bucket.Bucket(bucket.Location(s3_bucket, "ckpt"), bucket.Settings(endpoint=bucket_env.endpoint))
    assert store.read_manifest("job", 7).run == "first-run"


def test_an_object_too_large_for_one_server_copy_is_copied_by_streaming(bucket_env: S3Server, s3_bucket: str) -> None:
    store = bucket.Bucket(bucket.Location(s3_bucket, "p"),
                          bucket.Settings(endpoint=bucket_env.endpoint, part_bytes=5 * 2**20, server_copy_bytes=0))
    data = bytes(range(256)) * (12 * 2**20 // 256 + 7)
    store.put("p/source", data)
    store.copy("p/source", "p/target", len(data))
    assert store.read("p/target") == data


def test_read_checkpoint_reads_a_step_from_the_bucket(
        bucket_env: S3Server, s3_bucket: str, start_sidecar, start_rank) -> None:
    url = f"s3://{s3_bucket}/ckpt"
    sidecar = start_sidecar(extra=["--bucket", url])
    ranks = [start_rank(sidecar, rank=rank, world_size=2) for rank in range(2)]
    for rank in ranks:
        rank.save(5, numel=1000)
    assert all(rank.wait(5).get("committed") for rank in ranks)
    for rank in ranks:
        rank.exit()
    wait_for(lambda: bucket_steps(bucket_env, f"{url}/job") == [5], "step 5 in the bucket", log=sidecar.log)

    step, state = read_checkpoint(f"{url}/job", rank=1)
    assert step == 5 and state["rank"] == 1 and state["step"] == 5
    assert bool((state["w"] == pattern(1, 5)).all()) and state["w"].numel() == 1000
