"""Records of ``stowaway rollback``, kept in the job's directory on the claim.

Setting steps aside on the claim is not enough once another tier holds
copies: a bucket still holding the abandoned steps would, on a new cluster or
behind a claim that lost its newest steps, hand the job back the very steps
the user went back from, and its uploads of the steps saved again would wait
until the job passed the abandoned newest. A record says "everything newer
than step ``to`` committed before ``unix`` was abandoned", so the bucket tier
sets those copies aside too, whenever it next looks (the job is usually
stopped when it is rolled back, and so is its sidecar).

Times are wall-clock seconds of different machines (the CLI's, the sidecar's
that committed): a rollback is separated from the commits around it by the
minutes a person takes, far beyond any clock skew a cluster tolerates.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass
from pathlib import Path

from stowaway.storage import durable

_RECORD = re.compile(r"^rollback-(\d+)\.json$")


@dataclass(frozen=True)
class Rollback:
    to: int
    unix: float
    # Names the copies a tier sets aside for this rollback, so that a retry after a crash reuses the same names.
    stamp_ns: int

    def abandons(self, step: int, committed_unix: float) -> bool:
        """Whether a copy of ``step`` committed at ``committed_unix`` belongs to the timeline rolled back from."""
        return step > self.to and committed_unix < self.unix


def record(job_path: Path, to: int) -> Rollback:
    """Write the record of going back to step ``to`` (durably, before any step is set aside)."""
    stamp_ns = time.time_ns()
    rollback = Rollback(to=to, unix=stamp_ns / 1e9, stamp_ns=stamp_ns)
    body = json.dumps({"to": rollback.to, "unix": rollback.unix}).encode()
    durable.write_atomic(job_path / f"rollback-{stamp_ns}.json", body)
    return rollback


def recorded(job_path: Path) -> list[Rollback]:
    """Every rollback of the job, oldest first; a record that cannot be read is an error, not ignored."""
    if not job_path.is_dir():
        return []
    found = []
    for entry in job_path.iterdir():
        match = _RECORD.match(entry.name)
        if not match:
            continue
        try:
            raw = json.loads(entry.read_bytes())
            found.append(Rollback(to=int(raw["to"]), unix=float(raw["unix"]), stamp_ns=int(match.group(1))))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise OSError(f"the rollback record {entry} is unreadable ({exc}); restore it or remove it "
                          "if that rollback should no longer apply to the bucket") from exc
    return sorted(found, key=lambda rollback: rollback.stamp_ns)
