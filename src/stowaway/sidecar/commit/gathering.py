"""Gathering one step on this node: which local ranks handed it over, and whose files are durable.

Once every local rank's file is durable, the node writes a receipt listing
them; the commit then waits for the receipts of every node.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from stowaway.sidecar.commit import timing
from stowaway.storage import manifest


def spans_nodes(world_size: int, local_world_size: int) -> bool:
    """Other sidecars hold some of the job's ranks: their receipts and failure notices come through storage."""
    return world_size > local_world_size


@dataclass
class PendingStep:
    job: str
    run: str
    step: int
    world_size: int
    local_world_size: int
    started_unix: float
    started: float
    admitted: set[int] = field(default_factory=set)
    entries: dict[int, manifest.FileEntry] = field(default_factory=dict)
    # The wait for the commit, started once every local file is durable and the receipt is written.
    task: asyncio.Task[None] | None = None
    # The commit timeout while local ranks are still persisting.
    expiry: timing.Timer | None = None
    # The watch for other nodes' failure notices while local ranks are still persisting (multi-node only).
    watcher: asyncio.Task[None] | None = None
    # Set once the step is committed or failed.
    resolved: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def multi_node(self) -> bool:
        return spans_nodes(self.world_size, self.local_world_size)

    @property
    def committing(self) -> bool:
        """Every rank of a single-node job has handed the step over: it commits or fails without any rank's help."""
        return not self.multi_node and len(self.admitted) >= self.local_world_size

    @property
    def hosts_rank_zero(self) -> bool:
        """This node writes the manifest: it holds global rank 0's file."""
        return 0 in self.entries

    def admit(self, rank: int, local_world_size: int) -> None:
        self.admitted.add(rank)
        self.local_world_size = max(self.local_world_size, local_world_size)

    def add_durable(self, entry: manifest.FileEntry) -> bool:
        """Record a local rank's durable file; True when it completes this node's share and no commit waits yet."""
        self.entries[entry.rank] = entry
        return len(self.entries) >= self.local_world_size and self.task is None

    def receipt(self, node: str) -> manifest.Receipt:
        return manifest.Receipt(node, self.run, self.step, self.world_size,
                                sorted(self.entries.values(), key=lambda item: item.rank))


def describe_ranks(ranks: list[int]) -> str:
    """Ranks for a message, cut short where a large job would make it unreadable."""
    shown = ", ".join(str(rank) for rank in ranks[:16])
    return shown + (f" and {len(ranks) - 16} more" if len(ranks) > 16 else "")
