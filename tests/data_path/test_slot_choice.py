"""Which slot a save writes: the newest committed step stays in shared memory while the next one is written.

When storage keeps up, every slot is idle at each save. Writing the same
slot every time would overwrite the newest committed step with the next one,
so a rank killed during that copy (a crash, an out-of-memory kill) could only
restore from storage; in a real pod on kind that happened to one rank of two.
"""

from __future__ import annotations

import torch

from stowaway import Checkpointer
from stowaway.slots import header, naming


def steps_in_slots(shm_dir, job: str, slots: int) -> list[int]:
    found = []
    for index in range(slots):
        with naming.slot_path(shm_dir, job, 0, index).open("rb") as slot:
            found.append(header.read(slot.read(header.HEADER_BYTES)).step)
    return sorted(found)


def test_each_save_writes_the_slot_least_recently_written_so_the_previous_step_stays_in_memory(start_sidecar):
    sidecar = start_sidecar()
    state = {"w": torch.zeros(4096)}
    with Checkpointer(job="choice", socket=sidecar.socket, rank=0, world_size=1, slots=2, timeout=30) as ckpt:
        ckpt.reserve(state, wait=True)
        for step in range(1, 6):
            state["w"].fill_(step)
            ckpt.save(step, state).wait(30)
            if step > 1:
                assert steps_in_slots(sidecar.shm_dir, "choice", 2) == [step - 1, step]
