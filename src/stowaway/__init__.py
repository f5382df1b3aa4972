"""Stowaway: memory-speed checkpoints for PyTorch training.

    ckpt = Checkpointer()                 # job, socket and ranks from the environment
    restored = ckpt.load()                # (step, state) or None
    ckpt.last_restore                     # Restore(step, source="memory" or "storage", seconds) or None
    handle = ckpt.save(step, state)       # returns once the state is in shared memory
    handle.wait()                         # optional: until the checkpoint is committed
    ckpt.guard(optimizer)                 # then save(step, state, overlap=True) copies behind the next step

    step, state = read_checkpoint("STORAGE/JOB")   # offline, DTensors gathered whole

The client is imported lazily: the sidecar and the operator live in this
distribution too and must start without importing torch.
"""

from typing import TYPE_CHECKING, Any

from stowaway.errors import (
    CheckpointCorrupt,
    ConfigurationError,
    ProtocolError,
    SaveFailed,
    ShmCapacityError,
    SidecarUnavailable,
    SlotWaitTimeout,
    StagingTimeout,
    StowawayError,
    UnsupportedState,
    WorldSizeChanged,
)

if TYPE_CHECKING:
    from stowaway.client.checkpointer import Checkpointer
    from stowaway.client.handle import SaveHandle
    from stowaway.client.offline import read_checkpoint
    from stowaway.client.restorer import Restore

__all__ = [
    "CheckpointCorrupt",
    "Checkpointer",
    "ConfigurationError",
    "ProtocolError",
    "Restore",
    "SaveFailed",
    "SaveHandle",
    "ShmCapacityError",
    "SidecarUnavailable",
    "SlotWaitTimeout",
    "StagingTimeout",
    "StowawayError",
    "UnsupportedState",
    "WorldSizeChanged",
    "read_checkpoint",
]


def __getattr__(name: str) -> Any:
    if name == "Checkpointer":
        from stowaway.client.checkpointer import Checkpointer

        return Checkpointer
    if name == "SaveHandle":
        from stowaway.client.handle import SaveHandle

        return SaveHandle
    if name == "Restore":
        from stowaway.client.restorer import Restore

        return Restore
    if name == "read_checkpoint":
        from stowaway.client.offline import read_checkpoint

        return read_checkpoint
    raise AttributeError(f"module 'stowaway' has no attribute {name!r}")
