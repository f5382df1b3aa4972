"""A step saved on one number of ranks loads on another: each rank assembles its new shards from stored ranges.

Real torchrun jobs (gloo, CPU) next to a real sidecar: one saves, a later
one with another number of ranks loads, through descriptors the sidecar
passes, reading only the byte ranges its new shards need.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from s3server import S3Server, bucket_steps

from data_path.processes import SidecarProcess, local_job, wait_for
from stowaway.slots import header
from stowaway.storage import bucket, bucket_store, catalog, layout

WORKER = Path(__file__).with_name("reshard_worker.py")


def job(storage: Path, ranks: int, mode: str, out: Path, shape: str = "fsdp", step: int = 2) -> list[dict]:
    """A job with a sidecar of its own, as ``stowaway run`` starts it: a new pod, nothing in shared memory."""
    return finished(local_job(storage, "elastic", ranks, WORKER, mode, str(out), shape, str(step)), ranks, mode, out)


def torchrun_beside(sidecar: SidecarProcess, ranks: int, mode: str, out: Path, step: int = 2) -> list[dict]:
    """A job next to a sidecar that outlives it: a restart on the same pod, its slots still in shared memory."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks),
               str(WORKER), mode, str(out), "fsdp", str(step)]
    return finished(command, ranks, mode, out, STOWAWAY_SOCKET=str(sidecar.socket), STOWAWAY_JOB="elastic")


def finished(command: list[str], ranks: int, mode: str, out: Path, **env: str) -> list[dict]:
    out.mkdir(exist_ok=True)
    done = subprocess.run(command, capture_output=True, text=True,
                          env=dict(os.environ, OMP_NUM_THREADS="1", **env), timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    return [json.loads((out / f"{mode}-{rank}.json").read_text()) for rank in range(ranks)]


def assert_identical(saved: dict, restored: dict) -> None:
    assert saved["model"].keys() == restored["model"].keys()
    for name, tensor in saved["model"].items():
        assert torch.equal(restored["model"][name], tensor), name
    assert saved["optimizer"].keys() == restored["optimizer"].keys()
    for index, entries in saved["optimizer"].items():
        for key, value in entries.items():
            assert torch.equal(restored["optimizer"][index][key], value), f"optimizer {index} {key}"


def stored_bytes(storage: Path) -> list[int]:
    step = layout.step_dir(storage / "elastic", 2)
    return [path.stat().st_size for path in sorted(step.glob("rank-*.safetensors"))]


@pytest.mark.timeout(900)
def test_fsdp2_saved_on_4_ranks_loads_on_2_3_and_4_bit_identical_reading_only_overlapping_ranges(short_tmp):
    storage = short_tmp / "s"
    job(storage, 4, "save", short_tmp / "saved")
    saved = torch.load(short_tmp / "saved" / "save.pt")
    files = stored_bytes(storage)
    for ranks, mode in ((2, "load"), (3, "load_into"), (3, "load"), (4, "load")):
        out = short_tmp / f"on{ranks}{mode}"
        restores = job(storage, ranks, mode, out)
        assert_identical(saved, torch.load(out / f"{mode}.pt"))
        if ranks == 4:
            assert restores == [{"saved_by": 4, "bytes_read": size, "source": "storage"} for size in files], \
                "on the same world size each rank reads its own file whole"
            continue
        assert [(restore["saved_by"], restore["source"]) for restore in restores] == [(4, "storage")] * ranks
        read = [restore["bytes_read"] for restore in restores]
        # Each rank reads its share of the tensor bytes, plus the headers and at most a piece each side of a range.
        share = sum(files) / ranks
        assert all(count < share + 4 * 256 * 2**10 + sum(files) * 0.1 for count in read), (read, files)
        assert all(count < sum(files) * 0.75 for count in read), (read, files)


@pytest.mark.timeout(900)
def test_a_restart_on_the_same_pod_with_fewer_or_more_ranks_reshards_from_shared_memory(start_sidecar, short_tmp):
    sidecar = start_sidecar()
    torchrun_beside(sidecar, 4, "save", short_tmp / "saved")
    saved = torch.load(short_tmp / "saved" / "save.pt")
    for ranks, mode in ((2, "load"), (3, "load_into")):
        out = short_tmp / f"on{ranks}"
        restores = torchrun_beside(sidecar, ranks, mode, out)
        assert_identical(saved, torch.load(out / f"{mode}.pt"))
        assert restores == [{"saved_by": 4, "bytes_read": 0, "source": "memory"}] * ranks, \
            "every range came from the old ranks' slots, none from storage"

    # A slot that no longer holds what the manifest says: the new ranks read the step from storage instead.
    for path in sidecar.shm_dir.glob("elastic.rank00003.slot*"):
        found = header.read(path.read_bytes()[: header.HEADER_BYTES])
        if found.complete and found.step == 2:
            with path.open("r+b") as handle:
                handle.seek(header.HEADER_BYTES + found.payload_nbytes // 2)
                byte = handle.read(1)[0]
                handle.seek(-1, os.SEEK_CUR)
                handle.write(bytes([byte ^ 0x01]))
    restores = torchrun_beside(sidecar, 2, "load", short_tmp / "rewritten")
    assert_identical(saved, torch.load(short_tmp / "rewritten" / "load.pt"))
    assert restores[1]["source"] == "storage" and restores[1]["bytes_read"] > 0, \
        f"rank 1 reads saved rank 3's rows, whose slot was changed: {restores}"


@pytest.mark.timeout(600)
def test_ddp_state_saved_on_4_ranks_loads_on_2_from_one_saved_file_each(short_tmp):
    storage = short_tmp / "s"
    job(storage, 4, "save", short_tmp / "saved", "ddp")
    files = stored_bytes(storage)
    restores = job(storage, 2, "load", short_tmp / "on2", "ddp")
    assert_identical(torch.load(short_tmp / "saved" / "save.pt"), torch.load(short_tmp / "on2" / "load.pt"))
    # Replicated state is read from one file (rank r of the new job reads saved rank r's), plus the small
    # tensors of the others, compared to be sure they hold the same.
    assert all(files[0] <= restore["bytes_read"] < files[0] * 1.2 for restore in restores), (restores, files)


@pytest.mark.timeout(600)
def test_fsdp_over_tensor_parallelism_2x2_loads_on_1x2_and_2x1(short_tmp):
    storage = short_tmp / "s"
    job(storage, 4, "save", short_tmp / "saved", "2d:2x2")
    saved = torch.load(short_tmp / "saved" / "save.pt")
    for shape in ("1x2", "2x1"):
        restores = job(storage, 2, "load", short_tmp / shape, f"2d:{shape}")
        assert [restore["saved_by"] for restore in restores] == [4, 4]
        assert_identical(saved, torch.load(short_tmp / shape / "load.pt"))


@pytest.mark.timeout(600)
def test_hsdp_2x2_loads_on_1x3_reading_one_replica(short_tmp):
    storage = short_tmp / "s"
    job(storage, 4, "save", short_tmp / "saved", "hsdp:2x2")
    files = stored_bytes(storage)
    restores = job(storage, 3, "load", short_tmp / "on3", "hsdp:1x3")
    assert_identical(torch.load(short_tmp / "saved" / "save.pt"), torch.load(short_tmp / "on3" / "load.pt"))
    # The two replicas hold the same shards: together the new ranks read about one replica's worth, not two.
    assert sum(restore["bytes_read"] for restore in restores) < sum(files) * 0.75, (restores, files)


@pytest.mark.timeout(600)
def test_a_corrupt_or_missing_saved_file_makes_every_new_rank_fall_back_to_the_older_step(short_tmp):
    storage = short_tmp / "s"
    job(storage, 4, "save", short_tmp / "saved")
    step_two = layout.step_dir(storage / "elastic", 2)
    stored = step_two / layout.rank_file_name(3, 4)
    data = bytearray(stored.read_bytes())
    data[-1] ^= 0x01
    stored.write_bytes(bytes(data))
    # Only the new rank that reads the last shard's rows finds it; every rank falls back with it.
    assert [restore["saved_by"] for restore in job(storage, 2, "load", short_tmp / "corrupt", step=1)] == [4, 4]
    stored.unlink()
    job(storage, 3, "load_into", short_tmp / "missing", step=1)


@pytest.mark.timeout(600)
def test_a_step_of_the_older_manifest_format_reshards_reading_each_file_whole(short_tmp):
    storage = short_tmp / "s"
    job(storage, 4, "save", short_tmp / "saved")
    step_two = layout.step_dir(storage / "elastic", 2)
    older = json.loads((step_two / layout.MANIFEST).read_text())
    older["format_version"] = 1
    older["files"] = [{key: entry[key] for key in ("rank", "name", "bytes", "xxh3_64")} for entry in older["files"]]
    (step_two / layout.MANIFEST).write_text(json.dumps(older))
    restores = job(storage, 2, "load", short_tmp / "older")
    assert_identical(torch.load(short_tmp / "saved" / "save.pt"), torch.load(short_tmp / "older" / "load.pt"))
    assert [restore["bytes_read"] for restore in restores] == [sum(stored_bytes(storage))] * 2, \
        "without piece checksums every file is read and checked whole"


@pytest.mark.timeout(600)
def test_a_job_that_loses_a_rank_resumes_on_fewer_ranks_from_its_newest_committed_step(short_tmp):
    storage, out = short_tmp / "s", short_tmp / "train"
    out.mkdir()
    command = local_job(storage, "elastic", 4, WORKER, "train", str(out), "fsdp", "6", "2")
    # The sidecar gives up at once on the step the lost rank never saved, instead of waiting out its grace.
    command[command.index("--") : command.index("--")] = ["--grace-period", "1"]
    lost = subprocess.run(command, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"),
                          timeout=300)
    assert lost.returncode != 0, "the job went on without its last rank"
    command[command.index("--nproc-per-node") + 1] = "3"
    command[command.index("2", command.index("fsdp"))] = "-1"
    resumed = subprocess.run(command, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"),
                             timeout=300)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-5000:]
    assert [json.loads((out / f"train-{rank}.json").read_text()) for rank in range(3)] == \
        [{"start": 3, "world": 3}] * 3, "every rank of the smaller job resumed after step 2, the last committed"
    committed = sorted(layout.step_of(path) for path in (storage / "elastic").glob("step-*")
                       if (path / layout.MANIFEST).exists())
    assert committed[-1] == 5, committed


@pytest.mark.s3
@pytest.mark.timeout(900)
def test_a_new_cluster_with_an_empty_claim_reshards_the_step_its_bucket_tier_holds(
        bucket_env: S3Server, s3_bucket: str, start_sidecar, short_tmp: Path) -> None:
    url = f"s3://{s3_bucket}/ckpt"
    first = start_sidecar("a", extra=["--bucket", url])
    torchrun_beside(first, 4, "save", short_tmp / "saved")
    saved = torch.load(short_tmp / "saved" / "save.pt")
    wait_for(lambda: 2 in bucket_steps(bucket_env, f"{url}/elastic"), "step 2 in the bucket", log=first.log)
    first.stop()

    empty = short_tmp / "empty"
    second = start_sidecar("b", extra=["--bucket", url], storage_dir=empty)
    restores = torchrun_beside(second, 2, "load", short_tmp / "on2")
    assert_identical(saved, torch.load(short_tmp / "on2" / "load.pt"))
    assert [(restore["saved_by"], restore["source"]) for restore in restores] == [(4, "storage")] * 2
    assert 2 in catalog.committed_steps(empty / "elastic"), "the step came onto the new claim from the bucket"


@pytest.mark.s3
@pytest.mark.timeout(900)
def test_a_bucket_alone_reshards_from_the_old_ranks_slots_or_a_new_pod_from_ranges_staged_into_its_own(
        bucket_env: S3Server, s3_bucket: str, start_sidecar, short_tmp: Path) -> None:
    url = f"s3://{s3_bucket}/alone"
    sidecar = start_sidecar("a", extra=["--bucket", url], claim=False)
    torchrun_beside(sidecar, 4, "save", short_tmp / "saved")
    saved = torch.load(short_tmp / "saved" / "save.pt")
    restores = torchrun_beside(sidecar, 2, "load", short_tmp / "on2")
    assert_identical(saved, torch.load(short_tmp / "on2" / "load.pt"))
    assert restores == [{"saved_by": 4, "bytes_read": 0, "source": "memory"}] * 2

    # A new pod: nothing in shared memory, and no claim whose files the sidecar could pass.
    store = bucket_store.open_bucket(url, bucket.Settings(endpoint=bucket_env.endpoint))
    stored = sum(entry.bytes for entry in store.read_manifest("elastic", 2).files)
    elsewhere = start_sidecar("b", extra=["--bucket", url], claim=False)
    for ranks, mode in ((2, "load"), (3, "load_into")):
        out = short_tmp / f"new{ranks}"
        restores = torchrun_beside(elsewhere, ranks, mode, out)
        assert_identical(saved, torch.load(out / f"{mode}.pt"))
        assert [(restore["saved_by"], restore["source"]) for restore in restores] == [(4, "storage")] * ranks
        assert all(0 < restore["bytes_read"] <= stored for restore in restores), (restores, stored)

    # A saved rank's object changed in the bucket: every new rank falls back to step 1 together.
    key = store.bucket.step_key("elastic", 2, layout.rank_file_name(3, 4))
    data = bytearray(store.bucket.read(key))
    data[-1] ^= 0x01
    store.bucket.put(key, bytes(data))
    restores = torchrun_beside(start_sidecar("c", extra=["--bucket", url], claim=False), 2, "load",
                               short_tmp / "corrupt", step=1)
    assert [restore["saved_by"] for restore in restores] == [4, 4]
