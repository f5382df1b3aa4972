"""One rank of the seed-race test: saves as fast as it can, with random pauses (``overlap``: copies overlapped).

Prints one JSON line: how many saves were answered how, and the steps that
committed. The Checkpointer raises ProtocolError on any duplicate or
misdirected answer, so a clean exit already proves no answer was doubled.
"""

from __future__ import annotations

import json
import os
import random
import sys
import time

import torch

from stowaway import Checkpointer


def main() -> None:
    saves = int(sys.argv[1])
    numel = int(sys.argv[2])
    overlap = sys.argv[3:] == ["overlap"]
    rank = int(os.environ["RANK"])
    rng = random.Random(rank)
    handles = []
    with Checkpointer(timeout=120) as ckpt:  # slots and pooled spares from the environment (2 and 0)
        for step in range(saves):
            state = {"x": torch.full((numel,), float(rank * 100_000 + step)), "step": step,
                     "tail": torch.arange(rng.randrange(1, 64), dtype=torch.int32) + step}
            handles.append(ckpt.save(step, state, overlap=overlap))
            time.sleep(rng.random() * 0.002)
        committed, failed = [], []
        for handle in handles:
            try:
                handle.wait(timeout=120)
                committed.append(handle.step)
            except Exception as exc:
                failed.append([handle.step, str(exc)])
        in_flight = ckpt.slots_in_flight
        print(json.dumps({
            "rank": rank, "saves": len(handles), "committed": committed, "failed": failed,
            "slot_waits": sum(1 for wait in ckpt.slot_wait_seconds if wait > 0.0005),
            "slots_in_flight": in_flight,
        }), flush=True)


if __name__ == "__main__":
    main()
