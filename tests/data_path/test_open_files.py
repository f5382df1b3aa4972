"""The sidecar passes read-only descriptors of a committed step's files to a rank that asks (``open``), or stages
ranges of them into the rank's slot (``stage`` with a span) where its storage passes no files.

The storage is mounted only into the sidecar; a rank resharding a step reads
other ranks' files through these. Checked on a raw connection, as the
protocol specifies it: what arrives, that it cannot be written through, and
that the sidecar keeps none of them open.
"""

from __future__ import annotations

import errno
import os
import socket
from pathlib import Path

import pytest

from data_path.test_world_size_change import saved_and_committed
from stowaway.protocol import frames, messages
from stowaway.slots import naming, shm
from stowaway.storage import layout

HELLO = {"type": "hello", "protocol": messages.PROTOCOL_VERSION, "job": "opened", "rank": 0, "local_rank": 0,
         "world_size": 1, "local_world_size": 1, "node": "n", "pid": 1}


class RawRank:
    """A connection that receives frames and the descriptors that come with them, as the client does."""

    def __init__(self, path: Path) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(30)
        self.sock.connect(str(path))
        self.decoder = frames.FrameDecoder()
        self.frames: list[dict] = []
        self.fds: list[int] = []

    def next(self) -> dict:
        while not self.frames:
            data, fds, flags, _ = socket.recv_fds(self.sock, 65536, 253)
            assert data and not flags & socket.MSG_CTRUNC
            self.fds.extend(fds)
            self.frames.extend(self.decoder.feed(data))
        return self.frames.pop(0)

    def close(self) -> None:
        for fd in self.fds:
            os.close(fd)
        self.sock.close()


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def test_a_rank_gets_read_only_descriptors_of_the_files_it_names_and_the_sidecar_keeps_none(
        start_sidecar, start_rank, storage):
    sidecar = start_sidecar()
    two = [start_rank(sidecar, job="opened", rank=rank, world_size=2) for rank in range(2)]
    saved_and_committed(two, 1)
    step = layout.step_dir(storage / "opened", 1)
    raw = RawRank(sidecar.socket)
    try:
        raw.sock.sendall(frames.encode(HELLO))
        assert raw.next()["type"] == "welcome"
        before = open_fds(sidecar.process.pid)
        raw.sock.sendall(frames.encode({"type": "query"}) + frames.encode({"type": "open", "step": 1, "ranks": [1, 0]}))
        assert raw.next()["type"] == "inventory"
        assert raw.next() == {"type": "opened", "step": 1, "ranks": [1, 0], "reason": None}
        manifest, rank_one, rank_zero = raw.fds
        assert os.pread(manifest, 1 << 20, 0) == (step / layout.MANIFEST).read_bytes()
        for fd, rank in ((rank_one, 1), (rank_zero, 0)):
            assert os.pread(fd, 1 << 24, 0) == (step / layout.rank_file_name(rank, 2)).read_bytes()
        with pytest.raises(OSError) as refused:
            os.write(rank_one, b"x")
        assert refused.value.errno == errno.EBADF, "a rank cannot write the stored files through what it got"

        for _ in range(20):
            raw.sock.sendall(frames.encode({"type": "open", "step": 1, "ranks": [0]}))
            assert raw.next()["reason"] is None
        raw.sock.sendall(frames.encode({"type": "open", "step": 7, "ranks": []}) +
                         frames.encode({"type": "open", "step": 1, "ranks": [2]}))
        assert "step 7 cannot be opened" in raw.next()["reason"]
        assert "has no file for rank 2" in raw.next()["reason"]
        assert len(raw.fds) == 3 + 2 * 20, "an opened with a reason carries no descriptor"
        assert open_fds(sidecar.process.pid) == before, "the sidecar closed every descriptor it passed"
    finally:
        raw.close()


def test_descriptors_keep_their_frame_when_the_socket_is_full_of_earlier_answers(start_sidecar, start_rank):
    sidecar = start_sidecar()
    two = [start_rank(sidecar, job="opened", rank=rank, world_size=2) for rank in range(2)]
    saved_and_committed(two, 1)
    raw = RawRank(sidecar.socket)
    try:
        raw.sock.sendall(frames.encode(HELLO))
        assert raw.next()["type"] == "welcome"
        # Unread, thousands of answers fill the socket and the sidecar's stream buffer ahead of the opened.
        query = frames.encode({"type": "query"})
        raw.sock.sendall(query * 4000 + frames.encode({"type": "open", "step": 1, "ranks": [0, 1]}) + query * 5)
        kinds = [raw.next()["type"] for _ in range(4000 + 1 + 5)]
        assert kinds == ["inventory"] * 4000 + ["opened"] + ["inventory"] * 5
        assert len(raw.fds) == 3 and os.pread(raw.fds[2], 8, 0) == os.pread(raw.fds[1], 8, 0)
    finally:
        raw.close()


def test_a_ranged_stage_puts_those_bytes_of_another_ranks_file_in_the_slot_and_publishes_no_step(
        start_sidecar, start_rank, storage):
    sidecar = start_sidecar()
    two = [start_rank(sidecar, job="opened", rank=rank, world_size=2) for rank in range(2)]
    saved_and_committed(two, 1)
    stored = (layout.step_dir(storage / "opened", 1) / layout.rank_file_name(1, 2)).read_bytes()
    raw = RawRank(sidecar.socket)
    slot = None
    try:
        raw.sock.sendall(frames.encode(HELLO))
        welcome = raw.next()
        slot = shm.SlotFile.create(naming.slot_path(welcome["shm_dir"], "opened", 0, 7), 4096)
        raw.sock.sendall(frames.encode({"type": "register", "slot": 7, "capacity": slot.capacity}))
        assert raw.next() == {"type": "registered", "slot": 7}
        before = slot.read_header().generation

        raw.sock.sendall(frames.encode({"type": "stage", "step": 1, "slot": 7, "rank": 1, "begin": 100, "nbytes": 200}))
        staged = raw.next()
        assert staged == {"type": "staged", "step": 1, "slot": 7, "generation": staged["generation"], "nbytes": 200}
        assert staged["generation"] > before
        assert bytes(slot.payload(200)) == stored[100:300]
        published = slot.read_header()
        assert not published.complete and published.generation == staged["generation"], \
            "a range is no step in memory: nothing may take the slot for one"

        for begin, nbytes in ((len(stored) - 10, 200), (0, slot.capacity + 1)):
            raw.sock.sendall(frames.encode({"type": "stage", "step": 1, "slot": 7, "rank": 1, "begin": begin,
                                            "nbytes": nbytes}))
            failed = raw.next()
            assert failed["type"] == "failed" and failed["slot"] == 7, failed
            assert "do not fit in slot" in failed["reason"] and "or lie outside the file" in failed["reason"], failed
        assert raw.fds == [], "a staged range passes no descriptor"
        assert slot.read_header().generation == staged["generation"], \
            "a refused range leaves the slot as it was"
    finally:
        if slot is not None:
            slot.close()
        raw.close()
