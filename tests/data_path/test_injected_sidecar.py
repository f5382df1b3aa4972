"""The sidecar exactly as the webhook injects it, run against volumes laid out as kubelet makes them.

kubelet creates emptyDirs world-writable (0777). The sidecar refuses such a
directory for its socket or slots, so the injected command must point it at
subdirectories it creates itself. Here the volume roots are real 0777
directories under a temp prefix that stands in for the pod's mount points.
"""

from __future__ import annotations

import copy
import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from data_path.processes import as_user, other_uids_unavailable, wait_for
from stowaway import Checkpointer
from stowaway.operator import injection
from stowaway.storage import catalog

POLICY_SPEC = {
    "storage": {"persistentVolumeClaim": {"claimName": "ckpts", "subPath": ""}},
    "retention": {"keepLast": 3, "keepEvery": 0},
    "sharedMemory": {"sizeLimit": "1Gi", "slotsPerRank": 2},
    "sidecar": {"image": "", "resources": {}, "metricsPort": 9464, "native": True, "gracePeriodSeconds": 120},
    "persistence": {"concurrency": 2, "directIO": True, "checksum": "xxh3-64"},
    "commitTimeoutSeconds": 60,
    "alerting": {"staleAfterSeconds": 7200},
}
POD = {
    "metadata": {"generateName": "train-", "labels": {"stowaway.dev/inject": "enabled", "job-name": "train"}},
    "spec": {"containers": [{"name": "trainer", "image": "pytorch"}]},
}
MOUNT_POINTS = (injection.SHM_PATH, injection.SOCKET_DIR, injection.STORAGE_PATH)
# The sidecar image's user (Dockerfile: USER 65532:65532), and a trainer image's non-root USER.
SIDECAR_UID = 65532
TRAINER_UID = 1000
# What a trainer does after a restart: restore from its slot, and from storage through the sidecar.
TRAINER = """
import json, os, sys, torch
from stowaway import Checkpointer
states = {step: {"w": torch.full((4096,), float(step))} for step in (1, 2)}
with Checkpointer(job=sys.argv[1], socket=sys.argv[2], rank=0, world_size=1, slots=1, timeout=30) as ckpt:
    for step, state in states.items():
        ckpt.save(step, state).wait()
    from_memory = ckpt.load()
    from_storage = ckpt.load(step=1)
print(json.dumps({
    "uid": os.getuid(),
    "from_memory": [from_memory[0], torch.equal(from_memory[1]["w"], states[2]["w"])],
    "from_storage": [from_storage[0], torch.equal(from_storage[1]["w"], states[1]["w"])],
}))
"""


def under(root: Path, path: str) -> str:
    """The pod path ``path`` as it lies under this test's stand-in for the pod's mounts."""
    for mount in MOUNT_POINTS:
        if path == mount or path.startswith(mount + "/"):
            return str(root / mount.lstrip("/")) + path[len(mount):]
    return path


def kubelet_volumes(root: Path, fs_group: int | None = None) -> None:
    """Volume roots as kubelet leaves them: emptyDirs 0777, handed to the fsGroup (group, setgid) when there is one."""
    for mount in MOUNT_POINTS:
        path = Path(under(root, mount))
        path.mkdir(parents=True)
        os.chmod(path, 0o777)
        if fs_group is not None:
            os.chown(path, 0, fs_group)
            os.chmod(path, 0o2777 if mount != injection.STORAGE_PATH else 0o2775)


def sidecar_argv(root: Path, command: list[str]) -> list[str]:
    argv = [sys.executable, "-m", "stowaway", *command[1:]]
    argv = [under(root, arg) for arg in argv]
    port = argv.index("--metrics-port") + 1
    argv[port] = "0"
    return argv


def test_the_injected_sidecar_serves_ranks_from_subdirectories_of_world_writable_volumes(short_tmp):
    patch = injection.build_patch(POD, "default", POLICY_SPEC, "stowaway:test")
    sidecar_spec = patch["spec"]["initContainers"][0]
    trainer_env = {e["name"]: e["value"] for e in patch["spec"]["containers"][0]["env"]}
    root = short_tmp / "pod"
    kubelet_volumes(root)
    log = (short_tmp / "sidecar.log").open("wb")
    sidecar = subprocess.Popen(sidecar_argv(root, sidecar_spec["command"]), stdout=log, stderr=subprocess.STDOUT)
    socket_path = Path(under(root, trainer_env["STOWAWAY_SOCKET"]))
    try:
        def listening() -> bool:
            assert sidecar.poll() is None, (short_tmp / "sidecar.log").read_text()
            return socket_path.exists() and stat.S_ISSOCK(socket_path.stat().st_mode)

        wait_for(listening, "the injected sidecar's socket (what its startup probe tests)")
        for directory in (socket_path.parent, Path(under(root, injection.SLOT_DIR))):
            assert stat.S_IMODE(directory.stat().st_mode) == 0o2770, directory
        with Checkpointer(job=trainer_env["STOWAWAY_JOB"], socket=socket_path, rank=0, world_size=1,
                          slots=int(trainer_env["STOWAWAY_SLOTS_PER_RANK"]), timeout=30) as ckpt:
            ckpt.save(1, {"w": torch.ones(8)}).wait()
        assert catalog.committed_steps(Path(under(root, injection.STORAGE_PATH)) / "train") == [1]
    finally:
        sidecar.terminate()
        assert sidecar.wait(timeout=60) == 0, (short_tmp / "sidecar.log").read_text()


def test_a_sidecar_pointed_at_a_world_writable_directory_refuses_to_start(short_tmp):
    exposed = short_tmp / "exposed"
    exposed.mkdir()
    os.chmod(exposed, 0o777)
    result = subprocess.run(
        [sys.executable, "-m", "stowaway", "sidecar", "--storage", str(short_tmp / "st"), "--shm-dir", str(exposed),
         "--socket", str(short_tmp / "s.sock")],
        capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 2
    assert f"{exposed} is world-writable without the sticky bit" in result.stderr
    assert list(exposed.iterdir()) == [], "nothing may be created in a directory the sidecar refuses"


@pytest.mark.parametrize("own_fs_group", [None, 3000], ids=["the webhook's fsGroup", "the pod's own fsGroup"])
def test_a_trainer_of_another_non_root_uid_saves_and_restores_through_the_pods_fs_group(short_tmp, own_fs_group):
    if reason := other_uids_unavailable():
        pytest.skip(reason)
    pod = copy.deepcopy(POD)
    if own_fs_group is not None:
        pod["spec"]["securityContext"] = {"fsGroup": own_fs_group}
    patch = injection.build_patch(pod, "default", POLICY_SPEC, "stowaway:test")
    fs_group = own_fs_group or patch["spec"]["securityContext"]["fsGroup"]
    sidecar_command = patch["spec"]["initContainers"][0]["command"]
    trainer_env = {e["name"]: e["value"] for e in patch["spec"]["containers"][0]["env"]}
    assert "--allow-uid" not in sidecar_command, "the pod names no uid, so the webhook can allow none"
    os.chmod(short_tmp, 0o755)
    root = short_tmp / "pod"
    kubelet_volumes(root, fs_group)
    storage = Path(under(root, injection.STORAGE_PATH))
    log_path = short_tmp / "sidecar.log"
    with log_path.open("wb") as log:
        sidecar = subprocess.Popen(as_user(SIDECAR_UID, [fs_group]) + sidecar_argv(root, sidecar_command),
                                   stdout=log, stderr=subprocess.STDOUT)
    socket_path = Path(under(root, trainer_env["STOWAWAY_SOCKET"]))
    try:
        def listening() -> bool:
            assert sidecar.poll() is None, log_path.read_text()
            return socket_path.exists() and stat.S_ISSOCK(socket_path.stat().st_mode)

        wait_for(listening, "the sidecar running as its image's uid")
        trainer = subprocess.run(
            [*as_user(TRAINER_UID, [fs_group]), sys.executable, "-c", TRAINER, trainer_env["STOWAWAY_JOB"],
             str(socket_path)],
            capture_output=True, text=True, timeout=120,
        )
        assert trainer.returncode == 0, trainer.stderr + log_path.read_text()
        outcome = json.loads(trainer.stdout)
        assert outcome == {"uid": TRAINER_UID, "from_memory": [2, True], "from_storage": [1, True]}
        owners = {(slot.name, slot.stat().st_uid, slot.stat().st_gid, stat.S_IMODE(slot.stat().st_mode))
                  for slot in Path(under(root, injection.SLOT_DIR)).iterdir()}
        assert owners and all(owner[1:] == (TRAINER_UID, fs_group, 0o660) for owner in owners), owners
        assert catalog.committed_steps(storage / trainer_env["STOWAWAY_JOB"]) == [1, 2]
    finally:
        sidecar.terminate()
        assert sidecar.wait(timeout=60) == 0, log_path.read_text()
