"""Errors raised to training code.

Every message says what failed, for which rank and step where known, and what
to check, because the person reading it is usually looking at a crashed job's
log with no other context.
"""

from __future__ import annotations


class StowawayError(Exception):
    """Base class of every error Stowaway raises."""


class ConfigurationError(StowawayError):
    """A setting is missing or invalid; the message names the setting."""


class WorldSizeChanged(ConfigurationError):
    """The step to restore was saved by another number of ranks than the job has now, and cannot be resharded
    onto this number: the message names the tensor or value, and why."""


class ShmCapacityError(StowawayError):
    """The shared-memory filesystem cannot hold the slots every local rank needs."""


class SidecarUnavailable(StowawayError):
    """The sidecar could not be reached within the timeout."""


class SlotWaitTimeout(StowawayError):
    """Every slot stayed in flight for longer than the timeout."""


class StagingTimeout(StowawayError):
    """A save(overlap=True) was still copying its state when the timeout ended a wait for it."""


class SaveFailed(StowawayError):
    """A checkpoint did not commit; the message carries the sidecar's reason."""


class ProtocolError(StowawayError):
    """A peer sent something the protocol does not allow."""


class UnsupportedState(StowawayError):
    """The state dict holds a value that cannot be stored without pickle."""


class CheckpointCorrupt(StowawayError):
    """Stored bytes do not match the checksums in the manifest."""
