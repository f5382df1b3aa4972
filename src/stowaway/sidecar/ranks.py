"""Which ranks the sidecar knows, their slots, and who owns each slot.

A slot listed in ``busy`` belongs to the sidecar: a persist or a stage is
reading or writing it. Every other slot belongs to its rank. The sidecar
never touches a slot it does not own, and it answers about a slot only on the
rank's current connection, so an answer cannot reach another rank.

A pooled spare is the pod's: the rank that borrowed it holds its lock
(``slots.pooled_lock``), and the sidecar holds a read lock of its own for as
long as the spare is busy, so no rank can take it to write meanwhile, even
one whose borrower died mid-persist.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from stowaway.protocol import messages
from stowaway.slots import naming
from stowaway.slots.shm import SlotFile

if TYPE_CHECKING:
    from stowaway.sidecar.session import Session


@dataclass
class RankState:
    job: str
    rank: int
    world_size: int
    local_world_size: int
    slots: dict[int, SlotFile] = field(default_factory=dict)
    busy: set[int] = field(default_factory=set)
    session: Session | None = None
    # Slot index -> (generation, step, xxh3-64) of the payload it was last known to hold, so that
    # load() does not hash a slot the persist (or a stage) has just hashed. One entry per slot.
    memory_digests: dict[int, tuple[int, int, str]] = field(default_factory=dict)

    def send(self, message: messages.ToClient) -> None:
        """Deliver to the rank's current connection; a rank that is gone gets nothing."""
        if self.session is not None:
            self.session.send(message)

    def hold(self, index: int) -> bool:
        """Make the registered slot ``index`` the sidecar's; False for a pooled spare another process writes."""
        if naming.is_pooled(index) and not self.slots[index].try_lock(exclusive=False):
            return False
        self.busy.add(index)
        return True

    def let_go(self, index: int) -> None:
        """Give slot ``index`` back to the rank, before the answer that tells it so."""
        self.busy.discard(index)
        if naming.is_pooled(index) and index in self.slots:
            self.slots[index].unlock()

    def open_slot(self, shm_dir: Path, index: int) -> SlotFile:
        old = self.slots.pop(index, None)
        if old is not None:
            old.close()
        slot = SlotFile.open(naming.slot_path(shm_dir, self.job, self.rank, index), writable=True)
        self.slots[index] = slot
        return slot

    def close(self) -> None:
        for slot in self.slots.values():
            slot.close()
        self.slots.clear()


class Registry:
    def __init__(self) -> None:
        self._ranks: dict[tuple[str, int], RankState] = {}
        # Unix time since which some rank has been connected without a break: before a job's first commit,
        # how long it has trained without one.
        self._connected_since: float | None = None

    def attach(self, session: Session, hello: messages.Hello) -> tuple[RankState, Session | None]:
        """Make ``session`` the rank's connection; return the connection it replaces, if any."""
        key = (hello.job, hello.rank)
        state = self._ranks.get(key)
        if state is None or state.world_size != hello.world_size:
            if state is not None and not state.busy:
                state.close()
            state = RankState(hello.job, hello.rank, hello.world_size, hello.local_world_size)
            self._ranks[key] = state
        state.local_world_size = hello.local_world_size
        previous, state.session = state.session, session
        if self._connected_since is None:
            self._connected_since = time.time()
        return state, previous

    def detach(self, state: RankState, session: Session) -> None:
        if state.session is session:
            state.session = None
            if not self.connected():
                self._connected_since = None

    def job_ranks(self, job: str) -> list[RankState]:
        return [state for (name, _), state in self._ranks.items() if name == job]

    def connected(self) -> int:
        return sum(1 for state in self._ranks.values() if state.session is not None)

    def connected_since(self) -> float | None:
        return self._connected_since

    def in_flight(self) -> int:
        return sum(len(state.busy) for state in self._ranks.values())

    def close(self) -> None:
        for state in self._ranks.values():
            state.close()
