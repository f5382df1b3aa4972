"""Page-locking a slot's mapping for CUDA, so that device-to-slot copies are DMA transfers.

Without registration a device-to-host copy goes through a driver staging
buffer, one chunk at a time, at a fraction of the link's bandwidth, and cannot
overlap. ``cudaHostRegister`` pins the slot's existing pages in place: no copy,
no second buffer. The mapping must be unregistered before it is unmapped.
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger("stowaway")
# cudaHostRegisterPortable: the pages count as pinned for every device of the process, not only the current one.
_PORTABLE = 1


def register(address: int, nbytes: int) -> bool:
    """Pin ``nbytes`` at ``address``; False (with a warning) when the driver refuses, and copies stay correct."""
    status = int(torch.cuda.cudart().cudaHostRegister(address, nbytes, _PORTABLE))
    if status != 0:
        log.warning("could not pin %d bytes of a slot for CUDA (cudaError %d); device-to-slot copies will be "
                    "slower but stay correct (is RLIMIT_MEMLOCK too low?)", nbytes, status)
        return False
    return True


def unregister(address: int) -> None:
    status = int(torch.cuda.cudart().cudaHostUnregister(address))
    if status != 0:
        log.warning("unpinning a slot for CUDA failed (cudaError %d)", status)
