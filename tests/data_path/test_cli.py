"""The ``stowaway`` command as a user meets it: help, listings, one-line errors, exit statuses."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from data_path.processes import stowaway_cli
from stowaway import Checkpointer


@pytest.mark.parametrize("command", [[], ["sidecar"], ["run"], ["ls"], ["verify"], ["inspect"], ["rollback"]])
def test_every_command_has_help(command):
    result = stowaway_cli(*command, "--help")
    assert result.returncode == 0
    assert "usage: stowaway" in result.stdout


@pytest.fixture
def saved(start_sidecar, storage):
    sidecar = start_sidecar()
    with Checkpointer(job="cli", socket=sidecar.socket, rank=0, world_size=1, timeout=30) as ckpt:
        for step in (10, 20):
            ckpt.save(step, {"layer": {"weight": torch.zeros(3, 4, dtype=torch.bfloat16)}, "count": step}).wait(30)
    return storage


def test_ls_lists_committed_steps_with_ranks_and_sizes(saved):
    result = stowaway_cli("ls", str(saved))
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("job cli")
    rows = [line.split() for line in lines[2:]]
    assert [row[0] for row in rows] == ["10", "20"]
    assert all(row[1] == "1" for row in rows)


def test_inspect_shows_tensors_dtypes_and_shapes_per_rank(saved):
    result = stowaway_cli("inspect", str(saved / "cli"), "--step", "20")
    assert result.returncode == 0, result.stderr
    assert "rank 0: rank-00000-of-00001.safetensors" in result.stdout
    assert any(line.split()[:3] == ["layer.weight", "BF16", "3x4"] for line in result.stdout.splitlines())


def test_inspect_shows_each_dtensor_shard_with_its_global_shape_placements_and_mesh(start_sidecar, storage):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    sidecar = start_sidecar()
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        grid = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "tp"))
        local = torch.zeros(3, 4)
        state = {"w": DTensor.from_local(local, grid, [Replicate(), Shard(1)], run_check=False, shape=(3, 8),
                                         stride=(8, 1)), "plain": torch.ones(2)}
        with Checkpointer(job="sharded", socket=sidecar.socket, rank=0, world_size=1, timeout=30) as ckpt:
            ckpt.save(1, state).wait(30)
    finally:
        dist.destroy_process_group()
    result = stowaway_cli("inspect", str(storage / "sharded"), "--step", "1")
    assert result.returncode == 0, result.stderr
    rows = {line.split()[0]: line for line in result.stdout.splitlines() if line.startswith("  ")}
    assert rows["w"].split()[:3] == ["w", "F32", "3x4"]
    assert rows["w"].endswith("shard of 3x8 (Replicate(), Shard(1)) on a cpu mesh (dp=1, tp=1), holds [0:3, 0:8]")
    assert rows["plain"].split()[-2:] == ["8", "B"], "a plain tensor has no shard column"


def test_a_reader_that_goes_away_ends_the_command_quietly(saved):
    """`stowaway inspect ... | head`: the reader closes the pipe; no traceback, the status of SIGPIPE."""
    command = subprocess.Popen([sys.executable, "-m", "stowaway", "inspect", str(saved / "cli"), "--step", "20"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert command.stdout is not None
    command.stdout.close()
    _, errors = command.communicate(timeout=120)
    assert command.returncode == 141 and errors == ""


def test_verify_passes_an_intact_checkpoint(saved):
    result = stowaway_cli("verify", str(saved))
    assert result.returncode == 0
    assert result.stdout.splitlines() == ["step 10: ok", "step 20: ok"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["ls", "/nonexistent/storage"], "stowaway ls: error: /nonexistent/storage is not a directory"),
        (["inspect", "/tmp", "--step", "1"], "stowaway inspect: error: /tmp holds 0 jobs"),
        (["sidecar", "--storage", "/tmp/s", "--shm-dir", "/tmp/m", "--socket", "/tmp/" + "x" * 120],
         "Unix sockets need a path shorter than 108 bytes"),
        (["run", "--storage", "/tmp/s"], "stowaway run: error: no command given"),
    ],
)
def test_errors_are_one_line_that_says_what_to_do(args, message):
    result = stowaway_cli(*args)
    assert result.returncode == 2
    assert message in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr


def test_run_exits_with_the_commands_status_and_shows_the_checkpoints(short_tmp):
    result = stowaway_cli("run", "--storage", str(short_tmp / "st"), "--", sys.executable, "-c",
                      "import os, sys; assert os.environ['STOWAWAY_SOCKET']; sys.exit(3)")
    assert result.returncode == 3, result.stderr
    assert "(no committed checkpoint)" in result.stderr
