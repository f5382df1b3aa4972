"""``python -m bench.first_touch``: what this machine charges for touching memory the first time, and again.

A first save, a restore into new tensors and the copy-out reference all
write to pages the process has never touched; what the kernel hands out for
them decides how long that takes. On a VM that hands freed memory back to
its host (free page reporting), the host must back each such page again on
its next touch. This measures it outside any checkpoint: fresh anonymous
memory written one page at a time, unmapped, then mapped and written again at
once, in rounds.
"""

from __future__ import annotations

import argparse
import mmap
import time

from bench import system


def touch(nbytes: int) -> float:
    """Seconds to map ``nbytes`` of anonymous memory and write one byte per page."""
    started = time.perf_counter()
    mapping = mmap.mmap(-1, nbytes)
    for offset in range(0, nbytes, mmap.PAGESIZE):
        mapping[offset] = 1
    seconds = time.perf_counter() - started
    mapping.close()
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.first_touch", description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=2048, help="memory to touch in each round")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    reported = system.reported_to_host_bytes()
    print(f"freed memory handed back to the host since boot: {reported / 2**30:,.1f} GiB" if reported else
          "this kernel reports no memory handed back to a host")
    for index in range(args.rounds):
        seconds = touch(args.mib * 2**20)
        print(f"round {index}: {args.mib} MiB in {seconds * 1e3:,.0f} ms, {seconds * 1e3 / args.mib:.2f} ms per MiB")


if __name__ == "__main__":
    main()
