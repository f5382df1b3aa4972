"""The failure model of DESIGN §7 that needs no Kubernetes, one test per failure."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from data_path.mounts import tmpfs
from data_path.processes import as_user, collective, join_group, other_uids_unavailable, wait_for
from stowaway.protocol import frames, messages
from stowaway.slots import header, naming
from stowaway.storage import catalog, layout

BIG = 32 * 2**20  # float64 elements: 256 MiB, so a copy takes long enough to be caught mid-way


def step_dir(storage, job, step):
    return layout.step_dir(storage / job, step)


def committed(storage, job, step):
    return (step_dir(storage, job, step) / layout.MANIFEST).exists()


def test_a_rank_killed_mid_write_leaves_a_torn_slot_that_is_never_persisted_or_restored(
    start_sidecar, start_rank, storage
):
    sidecar = start_sidecar()
    bystander = start_rank(sidecar, job="other")
    victim = start_rank(sidecar, job="victim")
    victim.save(1)
    assert victim.wait(1)["committed"]
    slots = [naming.slot_path(sidecar.shm_dir, "victim", 0, index) for index in range(2)]

    def states() -> list[header.SlotHeader]:
        found = []
        for path in slots:
            if path.exists():
                with open(path, "rb") as handle:
                    found.append(header.read(handle.read(64)))
        return found

    victim.send(op="save", step=2, numel=BIG)
    wait_for(lambda: any(s.state is header.SlotState.WRITING for s in states()), "the victim to start writing step 2",
             interval=0.0005)
    victim.kill()
    after = states()
    assert any(s.state is header.SlotState.WRITING for s in after), "the slot of step 2 must stay torn after the kill"
    assert not any(s.complete and s.step == 2 for s in after)

    for step in range(1, 6):
        bystander.save(step)
        assert bystander.wait(step)["committed"], "other ranks go on while one is killed"
    assert not step_dir(storage, "victim", 2).exists(), "a torn slot must never be persisted"
    restarted = start_rank(sidecar, job="victim")
    restored = restarted.call(op="load")
    assert restored == {"step": 1, "intact": True, "numel": 1024}
    restarted.save(3)
    assert restarted.wait(3)["committed"]


def test_a_rank_killed_right_after_persist_still_gets_its_checkpoint_committed(start_sidecar, start_rank, storage):
    sidecar = start_sidecar()
    rank = start_rank(sidecar, job="gone")
    rank.send(op="save_and_die", step=7, numel=2**20)
    rank.process.wait(timeout=60)
    assert rank.process.returncode == -signal.SIGKILL
    wait_for(lambda: committed(storage, "gone", 7), "the dead rank's step 7 to commit")
    assert catalog.verify_step(storage / "gone", 7) == []


def test_a_sidecar_killed_mid_persist_commits_nothing_partial_and_the_next_save_after_restart_commits(
    start_sidecar, start_rank, storage
):
    sidecar = start_sidecar(extra=["--write-rate-limit", str(2**20)])
    rank = start_rank(sidecar, job="crash")
    rank.save(1, numel=1024)
    assert rank.wait(1)["committed"]
    rank.save(2, numel=2**20)  # 8 MiB at 1 MiB/s: the persist is in flight for seconds
    partial = step_dir(storage, "crash", 2)
    wait_for(lambda: partial.exists() and any(p.name.endswith(layout.TMP_SUFFIX) for p in partial.iterdir()),
             "the persist of step 2 to start writing")
    sidecar.kill()
    answer = rank.wait(2)
    assert not answer["committed"] and "connection to the sidecar was lost" in answer["error"]
    assert not committed(storage, "crash", 2)
    assert catalog.committed_steps(storage / "crash") == [1]

    sidecar.extra = []
    sidecar.start()
    rank.save(3)
    assert rank.wait(3)["committed"], "the rank reconnects by itself and its next save commits"
    assert catalog.committed_steps(storage / "crash") == [1, 3]
    assert catalog.verify_step(storage / "crash", 3) == []


def test_full_storage_fails_the_save_with_the_reason_and_keeps_earlier_checkpoints(
    start_sidecar, start_rank, short_tmp
):
    with tmpfs(short_tmp / "small", "4m") as small:
        sidecar = start_sidecar(storage_dir=small)
        rank = start_rank(sidecar, job="full")
        rank.save(1, numel=1024)
        assert rank.wait(1)["committed"]
        rank.save(2, numel=2**20)  # 8 MiB into 4 MiB
        answer = rank.wait(2)
        assert not answer["committed"]
        assert "ENOSPC" in answer["error"] and "earlier checkpoints are untouched" in answer["error"]
        assert catalog.committed_steps(small / "full") == [1]
        assert catalog.verify_step(small / "full", 1) == []
        assert not any(p.name.endswith(layout.TMP_SUFFIX) for p in step_dir(small, "full", 2).iterdir())
        rank.save(3, numel=1024)
        assert rank.wait(3)["committed"], "once space is back, saving works again"
        rank.exit()
        assert sidecar.stop() == 0


def test_a_bit_flip_in_storage_is_found_by_verify_and_load_falls_back_to_the_older_checkpoint_and_saves_go_on(
    start_sidecar, start_rank, storage
):
    sidecar = start_sidecar()
    rank = start_rank(sidecar, job="flip")
    for step in (1, 2):
        rank.save(step)
        assert rank.wait(step)["committed"]
    rank.exit()
    assert sidecar.stop() == 0
    victim = step_dir(storage, "flip", 2) / layout.rank_file_name(0, 1)
    flip_a_bit(victim)
    flipped = victim.read_bytes()

    verify = subprocess.run([sys.executable, "-m", "stowaway", "verify", str(storage / "flip")],
                            capture_output=True, text=True)
    assert verify.returncode == 1
    assert f"step 2: BAD {victim}: xxh3-64" in verify.stdout
    assert "step 1: ok" in verify.stdout

    shutil.rmtree(sidecar.shm_dir)  # a rescheduled pod: nothing in shared memory
    sidecar.start()
    fresh = start_rank(sidecar, job="flip")
    assert fresh.call(op="load") == {"step": 1, "intact": True, "numel": 1024}
    assert "step 2 cannot be restored" in fresh.log_path.read_text()
    assert "is corrupt" in fresh.log_path.read_text()

    # Step 2 is set aside with its bytes, no longer committed; the job, back at step 1, saves step 2 again
    # (refused as already committed before, so that a job waiting for each save restarted into the same fallback).
    aside = layout.set_aside_dirs(storage / "flip")
    assert len(aside) == 1 and aside[0].name.startswith("corrupt-step-000000000002-"), aside
    assert (aside[0] / victim.name).read_bytes() == flipped
    assert catalog.committed_steps(storage / "flip") == [1]
    assert (storage / "flip" / layout.LATEST).read_text() == "1\n"
    assert "the step was set aside as" in fresh.log_path.read_text()
    fresh.save(2)
    assert fresh.wait(2)["committed"]
    assert fresh.call(op="load") == {"step": 2, "intact": True, "numel": 1024}
    listing = subprocess.run([sys.executable, "-m", "stowaway", "ls", str(storage / "flip")],
                             capture_output=True, text=True, check=True).stdout
    assert f"set aside (kept for inspection; delete it when done): {aside[0]}" in listing


def test_ranks_in_a_process_group_restore_the_same_step_when_one_ranks_newest_file_is_corrupt(
    start_sidecar, start_rank, storage, short_tmp
):
    """Without agreeing, rank 0 would resume from step 2 and rank 1 from step 1: a silently forked job."""
    sidecar = start_sidecar()
    ranks = [start_rank(sidecar, job="group", rank=rank, world_size=2) for rank in range(2)]
    join_group(ranks, short_tmp / "group-1")
    for step in (1, 2):
        for rank in ranks:
            rank.save(step)
        for rank in ranks:
            assert rank.wait(step)["committed"]
    assert collective(ranks, op="load") == [{"step": 2, "intact": True, "numel": 1024}] * 2, "from shared memory"
    for rank in ranks:
        rank.exit()
    assert sidecar.stop() == 0
    victim = step_dir(storage, "group", 2) / layout.rank_file_name(1, 2)
    flip_a_bit(victim)

    shutil.rmtree(sidecar.shm_dir)  # a rescheduled pod: nothing in shared memory
    sidecar.start()
    fresh = [start_rank(sidecar, job="group", rank=rank, world_size=2) for rank in range(2)]
    join_group(fresh, short_tmp / "group-2")
    assert collective(fresh, op="load") == [{"step": 1, "intact": True, "numel": 1024}] * 2
    assert "step 2 cannot be restored on rank 1" in fresh[0].log_path.read_text()

    found_corrupt_again(storage, "group", 2)
    # Step 1 is now in the ranks' slots, and step 2 is staged into those very slots before the ranks learn that
    # rank 1 cannot restore it: step 1 must then come from storage (a second load used to fail here).
    assert collective(fresh, op="load") == [{"step": 1, "intact": True, "numel": 1024}] * 2
    found_corrupt_again(storage, "group", 2)
    # Into tensors of their own: rank 0 reads step 2 from storage into its tensor before the ranks learn that
    # rank 1 cannot; the tensor must end up holding step 1, as rank 1's does.
    assert collective(fresh, op="load", into=1024) == [{"step": 1, "intact": True, "numel": 1024,
                                                         "in_place": True}] * 2


def test_a_load_into_the_state_that_finds_no_restorable_step_raises_instead_of_returning_none(
    start_sidecar, start_rank, storage, short_tmp
):
    """None means "start from scratch", but by then rank 0 has copied step 1 into the tensors it was given."""
    sidecar = start_sidecar()
    ranks = [start_rank(sidecar, job="none", rank=rank, world_size=2) for rank in range(2)]
    join_group(ranks, short_tmp / "group-1")
    for rank in ranks:
        rank.save(1)
    for rank in ranks:
        assert rank.wait(1)["committed"]
    for rank in ranks:
        rank.exit()
    assert sidecar.stop() == 0
    flip_a_bit(step_dir(storage, "none", 1) / layout.rank_file_name(1, 2))

    shutil.rmtree(sidecar.shm_dir)
    sidecar.start()
    fresh = [start_rank(sidecar, job="none", rank=rank, world_size=2) for rank in range(2)]
    join_group(fresh, short_tmp / "group-2")
    assert collective(fresh, op="load") == [{"step": None}] * 2, "without into, nothing to restore is None"
    found_corrupt_again(storage, "none", 1)
    for answer in collective(fresh, op="load", into=1024):
        assert answer["type"] == "SaveFailed", answer
        assert "no committed step of job none can be restored (step 1 rank 1:" in answer["error"]
        assert "re-initialise them before training from scratch" in answer["error"]


def found_corrupt_again(storage, job, step):
    """Put a step that a load set aside back, as a step that fails on some rank for another reason than
    corruption (an I/O error) stays committed, so that the next load meets it again."""
    (aside,) = layout.set_aside_dirs(storage / job)
    aside.rename(step_dir(storage, job, step))


def flip_a_bit(path):
    """One bit of the tensor data, which only the checksum can notice."""
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x10
    path.write_bytes(bytes(data))


def raw_connection(sidecar):
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(30)
    sock.connect(str(sidecar.socket))
    return sock


def read_error(sock) -> str:
    decoder = frames.FrameDecoder()
    received = []
    while chunk := sock.recv(65536):
        received.extend(decoder.feed(chunk))
    assert received and received[-1]["type"] == "error", received
    return received[-1]["reason"]


HELLO = {"type": "hello", "protocol": messages.PROTOCOL_VERSION, "job": "evil", "rank": 0, "local_rank": 0,
         "world_size": 1, "local_world_size": 1, "node": "n", "pid": 1}


@pytest.mark.parametrize(
    ("payload", "reason"),
    [
        (b"\x00\x00\x00\x05hello", "not UTF-8 JSON"),
        (struct.pack(">I", 2**31), "exceeds the 65536-byte limit"),
        # A client of the release before.
        (frames.encode({**HELLO, "protocol": messages.PROTOCOL_VERSION - 1}),
         f"protocol version {messages.PROTOCOL_VERSION - 1} is not supported"),
        (frames.encode({"type": "persist", "run": "r", "step": 1, "slot": 0, "generation": 1, "nbytes": 1,
                        "blocking_seconds": 0, "slot_wait_seconds": 0}), "expected hello as the first message"),
        (frames.encode(HELLO) + frames.encode({"type": "persist", "run": "r", "step": 1, "slot": 0, "generation": 1,
                                               "nbytes": 1, "blocking_seconds": 0, "slot_wait_seconds": 0}),
         "never registered"),
        (frames.encode(HELLO) + frames.encode({"type": "register", "slot": 99, "capacity": 1}), "slot index 99"),
        (frames.encode(HELLO) + frames.encode({"type": "stage", "step": "x", "slot": 0}), "stage.step must be int"),
    ],
    ids=["garbage", "oversized", "wrong-version", "out-of-order", "unregistered-slot", "slot-out-of-range",
         "bad-field"],
)
def test_bad_frames_are_refused_with_a_clear_error_while_another_rank_keeps_saving(
    start_sidecar, start_rank, payload, reason
):
    sidecar = start_sidecar()
    rank = start_rank(sidecar, job="good")
    rank.save(1)
    with raw_connection(sidecar) as sock:
        sock.sendall(payload)
        assert reason in read_error(sock)
    rank.save(2)
    for step in (1, 2):
        assert rank.wait(step)["committed"]
    assert sidecar.alive()


def test_a_truncated_frame_followed_by_a_hang_up_does_not_disturb_the_sidecar(start_sidecar, start_rank):
    sidecar = start_sidecar()
    rank = start_rank(sidecar, job="good")
    with raw_connection(sidecar) as sock:
        sock.sendall(frames.encode(HELLO)[:10])
    rank.save(1)
    assert rank.wait(1)["committed"]
    wait_for(lambda: "closed in the middle of a frame" in sidecar.log(), "the sidecar to log the truncation")


NOBODY = 65534


def connect_as_nobody(socket_path: Path, timeout: float) -> subprocess.CompletedProcess[str]:
    """A rank of uid 65534, in no group, constructing a Checkpointer; prints the SidecarUnavailable it gets."""
    rank = (
        "import sys\nfrom stowaway import Checkpointer\nfrom stowaway.errors import SidecarUnavailable\n"
        f"try:\n    Checkpointer(job='j', socket=sys.argv[1], rank=0, world_size=1, timeout={timeout})\n"
        "except SidecarUnavailable as exc:\n    print(exc)\n"
    )
    return subprocess.run([*as_user(NOBODY, []), sys.executable, "-c", rank, str(socket_path)],
                          capture_output=True, text=True, timeout=60)


def test_a_rank_of_another_uid_outside_the_sockets_group_is_refused_and_told_why_at_once(start_sidecar):
    """Members of the socket's group get in whatever their uid (``test_injected_sidecar``); others do not.

    The refusal is final, so the rank raises it at once instead of retrying
    until its timeout (600 s here, ten times the subprocess's limit).
    """
    if reason := other_uids_unavailable():
        pytest.skip(reason)
    sidecar = start_sidecar()
    os.chmod(sidecar.socket.parent, 0o777)
    os.chmod(sidecar.socket, 0o777)
    answer = connect_as_nobody(sidecar.socket, timeout=600)
    group = sidecar.socket.stat().st_gid
    assert "refused this rank" in answer.stdout, answer.stdout + answer.stderr
    assert f"uid {NOBODY} may not use this sidecar" in answer.stdout
    assert f"not in group {group}, which owns the socket" in answer.stdout


def test_a_rank_that_may_not_open_the_socket_is_told_which_group_to_join(start_sidecar):
    if reason := other_uids_unavailable():
        pytest.skip(reason)
    sidecar = start_sidecar()
    answer = connect_as_nobody(sidecar.socket, timeout=3)
    hint = f"uid {NOBODY} may not open the socket: run the rank in the socket's group"
    assert "Permission denied" in answer.stdout and hint in answer.stdout, answer.stdout + answer.stderr
    # Logged when it first happens, not only in the error at the end of the wait.
    assert answer.stderr.count(hint) == 1, answer.stderr


def test_read_only_storage_fails_the_save_with_the_reason_and_keeps_earlier_checkpoints(
    start_sidecar, start_rank, short_tmp
):
    with tmpfs(short_tmp / "ro", "16m") as volume:
        sidecar = start_sidecar(storage_dir=volume)
        rank = start_rank(sidecar, job="ro")
        rank.save(1)
        assert rank.wait(1)["committed"]
        subprocess.run(["mount", "-o", "remount,ro", str(volume)], check=True)
        rank.save(2)
        answer = rank.wait(2)
        assert not answer["committed"]
        assert "EROFS" in answer["error"] and "mount it read-write" in answer["error"]
        assert catalog.committed_steps(volume / "ro") == [1]
        assert catalog.verify_step(volume / "ro", 1) == []
        rank.exit()
        assert sidecar.stop() == 0


def test_sigterm_lets_an_in_flight_persist_finish_and_commit_before_the_sidecar_exits(
    start_sidecar, start_rank, storage
):
    sidecar = start_sidecar(extra=["--write-rate-limit", str(4 * 2**20), "--grace-period", "60"])
    rank = start_rank(sidecar, job="term")
    rank.save(1, numel=2**20)  # 8 MiB at 4 MiB/s
    partial = step_dir(storage, "term", 1)
    wait_for(lambda: partial.exists() and any(p.name.endswith(layout.TMP_SUFFIX) for p in partial.iterdir()),
             "the persist of step 1 to start writing")
    assert sidecar.stop() == 0
    assert rank.wait(1)["committed"], "the persist in flight at SIGTERM must still commit"
    assert catalog.verify_step(storage / "term", 1) == []
