"""Deleting old checkpoints and abandoned partial directories.

A committed checkpoint is removed manifest first (one atomic un-commit), so a
crash halfway through a deletion never leaves something that looks committed
but lacks files. The newest committed checkpoint is never removed.
"""

from __future__ import annotations

import logging
import shutil
import time
from pathlib import Path

from stowaway.storage import catalog, durable, layout

log = logging.getLogger(__name__)


def kept(committed: list[int], keep_last: int, keep_every: int) -> set[int]:
    """The steps a retention keeps: the last ``keep_last`` and every multiple of ``keep_every``.

    ``keep_last`` counts as at least 1, so the newest committed step is always kept.
    """
    keep = set(sorted(committed)[-max(keep_last, 1):]) if committed else set()
    if keep_every:
        keep.update(step for step in committed if step % keep_every == 0)
    return keep


def apply(job_path: Path, keep_last: int, keep_every: int, abandoned_after: float, busy: set[int]) -> list[int]:
    """Apply the policy; return the steps removed.

    A partial directory (no manifest) of a step below the newest committed
    one, not ``busy`` and untouched for ``abandoned_after`` seconds is swept:
    the sidecar passes its commit timeout, past which no commit can still
    complete that step.
    """
    committed = catalog.committed_steps(job_path)
    keep = kept(committed, keep_last, keep_every)
    removed = []
    for step in committed:
        if step not in keep:
            _remove_committed(layout.step_dir(job_path, step))
            removed.append(step)
    newest = committed[-1] if committed else None
    now = time.time()
    for step, path in layout.step_dirs(job_path).items():
        if (path / layout.MANIFEST).exists() or step in busy or newest is None or step > newest:
            continue
        try:
            idle = now - path.stat().st_mtime
        except FileNotFoundError:
            continue
        if idle > abandoned_after:
            log.info("removing partial checkpoint %s, untouched for %.0f s", path, idle)
            shutil.rmtree(path, ignore_errors=True)
            removed.append(step)
    return removed


def _remove_committed(path: Path) -> None:
    (path / layout.MANIFEST).unlink(missing_ok=True)
    durable.fsync_dir(path)
    shutil.rmtree(path, ignore_errors=True)
