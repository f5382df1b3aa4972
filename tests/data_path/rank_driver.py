"""A training rank under the test's control: JSON commands on stdin, JSON replies on stdout.

Each state it saves is predictable from (rank, step), so a test can check any
stored or restored checkpoint without trusting the code under test.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import sys
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

from stowaway import Checkpointer


def pattern(rank: int, step: int) -> float:
    return float(rank * 1_000_000 + step)


def state_for(rank: int, step: int, numel: int) -> dict[str, object]:
    return {"w": torch.full((numel,), pattern(rank, step), dtype=torch.float64), "step": step, "rank": rank}


def main() -> None:
    ckpt = Checkpointer(timeout=float(os.environ.get("STOWAWAY_TEST_TIMEOUT", "30")))
    handles = {}
    saved: dict[str, object] = {}  # the state of the last save, which "guarded" changes
    reply({"ready": True, "rank": ckpt.rank})
    for line in sys.stdin:
        command = json.loads(line)
        op = command["op"]
        try:
            if op == "save":
                # With "overlap", save(overlap=True): the reply comes while the copy thread may still be copying.
                # "copy_delay" makes its copy slow: the copy thread sleeps that long before copying.
                delay = command.get("copy_delay")
                ckpt._stager._before_copy = None if delay is None else lambda step, delay=delay: time.sleep(delay)
                saved = state_for(ckpt.rank, command["step"], command.get("numel", 1024))
                handle = ckpt.save(command["step"], saved, overlap=command.get("overlap", False))
                handles[command["step"]] = handle
                reply({"saved": command["step"], "blocking": handle.blocking_seconds})
            elif op == "guarded":
                # A change of the saved state, as a training step makes it: waits for an overlapped copy to end.
                with ckpt.guarded():
                    copied = all(handle.staged() for handle in handles.values())
                    saved["w"].add_(1)
                reply({"copied_first": copied})
            elif op == "staged":
                reply({"staged": handles[command["step"]].staged()})
            elif op == "overlap_seconds":
                reply({"staging": ckpt.staging_seconds, "stall": ckpt.stall_seconds, "hidden": ckpt.overlap_seconds})
            elif op == "save_and_die":
                ckpt.save(command["step"], state_for(ckpt.rank, command["step"], command.get("numel", 1024)))
                os.kill(os.getpid(), signal.SIGKILL)
            elif op == "wait":
                try:
                    handles[command["step"]].wait(command.get("timeout", 30))
                    reply({"committed": True})
                except Exception as exc:
                    reply({"committed": False, "error": str(exc)})
            elif op == "done":
                reply({"done": handles[command["step"]].done()})
            elif op == "load":
                # With "into", into a tensor of the rank's own: reports whether it came back in place.
                into = {"w": torch.zeros(command["into"], dtype=torch.float64)} if "into" in command else None
                found = ckpt.load(command.get("step"), into=into)
                if found is None:
                    reply({"step": None})
                else:
                    step, state = found
                    expected = pattern(ckpt.rank, step)
                    intact = bool((state["w"] == expected).all()) and state["step"] == step
                    answer = {"step": step, "intact": intact, "numel": state["w"].numel()}
                    if into is not None:
                        answer["in_place"] = state["w"] is into["w"]
                    reply(answer)
            elif op == "last_restore":
                last = ckpt.last_restore
                reply({"restore": None if last is None else dataclasses.asdict(last)})
            elif op == "join_group":
                # Blocks until every rank of the group has joined: send it to all of them before reading.
                dist.init_process_group("gloo", init_method=f"file://{command['store']}", rank=ckpt.rank,
                                        world_size=ckpt.world_size, timeout=timedelta(seconds=60))
                reply({"joined": True})
            elif op == "exit":
                ckpt.close()
                if dist.is_initialized():
                    dist.destroy_process_group()
                reply({"bye": True})
                return
        except Exception as exc:
            reply({"error": str(exc), "type": type(exc).__name__, "trace": traceback.format_exc()})


def reply(message: dict[str, object]) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
