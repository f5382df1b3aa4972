"""Saved ranks' files read through this rank's own slots, for a resharding ``load()`` from a bucket alone.

A sidecar whose storage is a bucket passes no descriptors of stored files:
the bytes are on no filesystem it could open. A resharding rank has the
sidecar stage each range it reads into one of its slots instead (``stage``
with a span), and copies it out. The memory is the rank's own slot, which
it needs for its next save anyway; nothing of the download counts against
the sidecar container's memory. ``StoredFile`` checks the bytes against the
manifest's pieces, as it does a passed file's.

A resharding rank reads a few saved files in turn (each DTensor's rows come
from several), each mostly from start to end (tensors lie in file order),
in ranges from a few bytes to a whole shard, and a few scattered small
ones (the rows where uneven shards of the old and new ranks overlap). So a
read reads ahead, per file, as a kernel's readahead does: a miss stages the
range and ``MIN_AHEAD_BYTES`` more, the next miss that continues where the
file's last window ended twice as much ahead, up to ``MAX_AHEAD_BYTES``;
the last two windows of each file (of the last ``KEPT_FILES`` files) are
kept, so that a piece straddling two windows is served without staging it
again. A read too large to keep goes in parts of up to ``STAGE_BYTES``
straight into the destination. No stage grows a slot beyond the rank's
share of the step, which its next save fills anyway.
"""

from __future__ import annotations

from stowaway.client.rank_slots import RankSlots
from stowaway.client.stored_files import ReadCounter
from stowaway.errors import SaveFailed
from stowaway.protocol import messages

MIN_AHEAD_BYTES = 256 * 2**10
# Large against a request's round trip to the bucket, small against a shard.
MAX_AHEAD_BYTES = 16 * 2**20
KEPT_FILES = 8
STAGE_BYTES = 64 * 2**20


class Readahead:
    """One saved file's last two windows (where each begins, and its bytes) and how far to read ahead next."""

    def __init__(self) -> None:
        self.windows: list[tuple[int, bytearray]] = []
        self.ahead = MIN_AHEAD_BYTES
        # Where the last range staged of the file ended, kept or not.
        self.last_end: int | None = None

    def find(self, position: int) -> tuple[int, bytearray] | None:
        for begin, data in self.windows:
            if begin <= position < begin + len(data):
                return begin, data
        return None

    def next_size(self, position: int, wanted: int) -> int:
        """How much to stage for a miss at ``position`` of ``wanted`` bytes: more when it continues the last
        window (a sequential reader), less when it jumps (a scattered one)."""
        self.ahead = min(self.ahead * 2, MAX_AHEAD_BYTES) if position == self.last_end else MIN_AHEAD_BYTES
        return wanted + self.ahead

    def keep(self, begin: int, data: bytearray) -> None:
        self.windows = [*self.windows[-1:], (begin, data)]
        self.last_end = begin + len(data)


class SlotWindows:
    """Ranges of one step's saved files staged through this rank's slots, read ahead per file."""

    def __init__(self, slots: RankSlots, step: int, counter: ReadCounter, share: int) -> None:
        self._slots = slots
        self._step = step
        # No stage grows a slot beyond this rank's share of the step (what its next save needs anyway), so a
        # shared memory sized for the job never runs out for a restore.
        self._most = max(MIN_AHEAD_BYTES, min(share, STAGE_BYTES))
        # Bytes staged from storage: what the restore reports as read from it.
        self._counter = counter
        # Per saved rank, what was read ahead of its file; the files read least recently first.
        self._files: dict[int, Readahead] = {}

    def file(self, rank: int, size: int) -> StagedFile:
        return StagedFile(self, rank, size)

    def readv(self, rank: int, size: int, buffers: list[memoryview], offset: int) -> int:
        done = 0
        for buffer in buffers:
            filled = 0
            while filled < len(buffer) and offset + done < size:
                count = self._copy(rank, size, offset + done, buffer[filled:])
                filled += count
                done += count
        return done

    def _copy(self, rank: int, size: int, position: int, into: memoryview) -> int:
        """Copy saved rank ``rank``'s bytes from ``position`` on into ``into``, as far as one window or one
        stage reaches; how many."""
        ahead = self._files.pop(rank, None) or Readahead()
        self._files[rank] = ahead
        while len(self._files) > KEPT_FILES:
            del self._files[next(iter(self._files))]
        found = ahead.find(position)
        if found is None:
            wanted = ahead.next_size(position, len(into))
            if wanted > MAX_AHEAD_BYTES:
                count = self._stage(rank, position, min(len(into), size - position, self._most), into)
                ahead.last_end = position + count
                return count
            found = (position, bytearray(min(wanted, size - position, self._most)))
            self._stage(rank, position, len(found[1]), memoryview(found[1]))
            ahead.keep(*found)
        begin, data = found
        count = min(len(into), begin + len(data) - position)
        into[:count] = memoryview(data)[position - begin : position - begin + count]
        return count

    def _stage(self, rank: int, position: int, nbytes: int, into: memoryview) -> int:
        """Have the sidecar stage ``nbytes`` of saved rank ``rank``'s file from ``position`` into a slot of this
        rank, and copy them into ``into``. No view of the slot's mapping outlives the copy: the next ``fit``
        may remap it."""
        with self._slots.taken(self._step) as slot:
            self._slots.fit(slot, nbytes)
            answer = self._slots.stage(slot, self._step, (rank, position, nbytes))
        if isinstance(answer, messages.Failed):
            raise SaveFailed(answer.reason)
        assert isinstance(answer, messages.Staged) and slot.file is not None
        slot.generation = max(slot.generation, answer.generation)
        into[:nbytes] = slot.file.payload(nbytes)
        if slot.file.read_header().generation != answer.generation:
            raise SaveFailed(f"slot {slot.index} changed while a range staged into it was read")
        self._counter.bytes += nbytes
        return nbytes


class StagedFile:
    """One saved rank's file read through ``SlotWindows`` (a ``stored_files.ByteSource``)."""

    def __init__(self, windows: SlotWindows, rank: int, size: int) -> None:
        self._windows = windows
        self._rank = rank
        self._size = size

    def readv(self, buffers: list[memoryview], offset: int) -> int:
        return self._windows.readv(self._rank, self._size, buffers, offset)

    def size(self) -> int | None:
        """None: the sidecar stages only ranges that lie within the manifest's size of the file."""
        return None

    def close(self) -> None:
        """Nothing is held open: the slots stay this rank's."""
