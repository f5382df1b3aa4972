"""What a local attacker or a broken peer could try against the sidecar.

Covered elsewhere: a peer with another uid is refused (data_path/test_failures.py),
a world-writable socket or slot directory is refused (data_path/test_injected_sidecar.py).
"""

from __future__ import annotations

import os
import pickle
import stat
from pathlib import Path

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

from faults.wire import exchange
from stowaway import Checkpointer
from stowaway.protocol import frames, messages
from stowaway.slots import naming
from stowaway.storage import layout

pytestmark = pytest.mark.faults

HELLO = {"type": "hello", "protocol": messages.PROTOCOL_VERSION, "rank": 0, "local_rank": 0, "world_size": 1,
         "local_world_size": 1, "node": "n", "pid": 1}


class Tripwire:
    """Unpickling this touches ``path``: proof that somebody unpickled it."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (Path.touch, (str(self.path),))


def test_the_socket_slot_files_and_stored_files_are_closed_to_other_users(start_sidecar, start_rank, storage):
    sidecar = start_sidecar()
    rank = start_rank(sidecar, job="perms")
    rank.save(1)
    assert rank.wait(1)["committed"]

    assert stat.S_IMODE(sidecar.socket.stat().st_mode) == 0o660
    assert stat.S_IMODE(sidecar.shm_dir.stat().st_mode) == 0o2770
    slots = sorted(sidecar.shm_dir.glob(naming.job_slot_glob("perms")))
    assert slots and {stat.S_IMODE(path.stat().st_mode) for path in slots} == {0o660}
    stored = [storage / "perms", *(storage / "perms").rglob("*")]
    open_to_others = [f"{path} {stat.filemode(path.stat().st_mode)}" for path in stored if path.stat().st_mode & 0o007]
    assert not open_to_others, open_to_others


def test_a_pickle_sent_as_a_frame_is_refused_without_being_unpickled(start_sidecar, short_tmp):
    sidecar = start_sidecar()
    tripwire = short_tmp / "unpickled"
    payload = pickle.dumps({"type": "hello", "trap": Tripwire(tripwire)})
    answers = exchange(sidecar.socket, len(payload).to_bytes(4, "big") + payload)
    assert [answer["type"] for answer in answers] == ["error"]
    assert "frame is not UTF-8 JSON" in answers[0]["reason"]
    assert not tripwire.exists(), "the sidecar unpickled bytes from the wire"
    assert sidecar.alive()


def test_the_sidecar_stores_a_pickled_leaf_as_bytes_and_only_the_opted_in_rank_unpickles_it(start_sidecar, short_tmp):
    sidecar = start_sidecar()
    tripwire = short_tmp / "unpickled"
    with Checkpointer(job="pickles", socket=sidecar.socket, rank=0, world_size=1, timeout=30,
                      allow_pickle=True) as ckpt:
        ckpt.save(1, {"w": torch.ones(4), "trap": Tripwire(tripwire)}).wait()
        assert not tripwire.exists(), "the sidecar unpickled a rank's payload while persisting it"
        step, state = ckpt.load()
    assert step == 1 and torch.equal(state["w"], torch.ones(4))
    assert tripwire.exists(), "the tripwire must fire when unpickled, or the check above proves nothing"


@given(st.text(max_size=140))
@example("job\n")
@example("..")
@example("../escape")
@example("a/../../escape")
@example("/etc")
@example("job\x00")
def test_a_job_name_the_sidecar_accepts_names_one_entry_inside_the_storage_and_shared_memory_directories(
    job: str
) -> None:
    try:
        messages.decode({**HELLO, "job": job}, messages.Direction.TO_SIDECAR)
    except messages.MessageError as exc:
        assert f"job name {job!r} is invalid" in str(exc)
        return
    storage, shm = Path("/storage"), Path("/dev/shm/stowaway")
    assert layout.job_dir(storage, job).parent == storage
    assert naming.slot_path(shm, job, 0, 0).parent == shm
    assert job not in (".", "..") and job.isprintable() and "/" not in job


@pytest.mark.parametrize("job", ["../escape", "..", "job\n", "a/b", "/tmp/x"])
def test_a_live_sidecar_refuses_a_hello_whose_job_name_would_leave_its_directories(start_sidecar, storage, job):
    sidecar = start_sidecar()
    before = sorted(os.listdir(storage.parent)), sorted(os.listdir(sidecar.shm_dir.parent))
    answers = exchange(sidecar.socket, frames.encode({**HELLO, "job": job}) + frames.encode({"type": "query"}))
    assert [answer["type"] for answer in answers] == ["error"]
    assert f"job name {job!r} is invalid" in answers[0]["reason"]
    assert (sorted(os.listdir(storage.parent)), sorted(os.listdir(sidecar.shm_dir.parent))) == before


def test_a_slot_file_replaced_by_a_symlink_is_refused_and_its_target_left_alone(start_sidecar, short_tmp):
    sidecar = start_sidecar()
    target = short_tmp / "precious"
    target.write_bytes(b"not yours")
    naming.slot_path(sidecar.shm_dir, "evil", 0, 0).symlink_to(target)
    answers = exchange(sidecar.socket, frames.encode({**HELLO, "job": "evil"})
                       + frames.encode({"type": "register", "slot": 0, "capacity": 4096}))
    assert [answer["type"] for answer in answers] == ["welcome", "error"]
    assert "cannot open slot 0" in answers[1]["reason"]
    assert target.read_bytes() == b"not yours"
