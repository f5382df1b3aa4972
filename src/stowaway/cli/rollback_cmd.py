"""``stowaway rollback``: go back to an older committed step, setting every newer step aside.

A job's steps must grow (``load()`` resumes from the newest, retention keeps
the newest), so a job that should continue from an older step (after a loss
spike, or a bad data shard) needs the newer steps out of the step names. They
are renamed, not deleted: ``stowaway ls`` lists them, and renaming one back
undoes the rollback. A record of the rollback stays in the job's directory,
written before anything is renamed: a bucket tier reads it and sets its
copies of the abandoned steps aside too, rather than restoring them.

On ``s3://`` (a bucket used without a claim) the steps are set aside in the
bucket itself: see ``bucket_cmds.run_rollback``.
"""

from __future__ import annotations

import argparse

from stowaway.cli import bucket_cmds
from stowaway.cli.catalog_cmds import single_job, target
from stowaway.cli.errors import CommandError
from stowaway.storage import catalog, layout, rollbacks
from stowaway.storage.set_aside import set_aside


def add_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    rollback = commands.add_parser(
        "rollback", help="make an older committed step the newest, setting newer steps aside",
        description="Make committed step --to the newest of the job, so that load() resumes from it and the job "
        "saves the steps after it again: every newer step directory, committed or partial, is renamed to "
        "rolled-back-step-<step>-<ns> with its files, and a bucket tier sets its copies of them aside at its next "
        "start or upload. On s3:// (a bucket without a claim) the newer steps are copied to "
        "rolled-back-step-<step>-<ns>/ in the bucket and then deleted; for a job whose sidecar has a claim, roll "
        "back on the claim instead, and the bucket follows. Run it while the job is stopped.")
    rollback.add_argument("dir", type=target,
                          help="one job's directory in the storage (or a storage holding one job), or its s3:// URL")
    rollback.add_argument("--to", type=int, required=True, metavar="STEP", help="the committed step to go back to")
    rollback.set_defaults(handler=run_rollback)


def run_rollback(args: argparse.Namespace) -> int:
    if isinstance(args.dir, str):
        return bucket_cmds.run_rollback(args.dir, args.to)
    job = single_job(args.dir)
    committed = catalog.committed_steps(job)
    if args.to not in committed:
        listed = ", ".join(str(step) for step in committed[-10:]) or "none"
        raise CommandError(f"step {args.to} is not committed in {job} (newest committed: {listed}); "
                           "nothing was set aside")
    newer = sorted((step for step in layout.step_dirs(job) if step > args.to), reverse=True)
    # Even with nothing newer here: a bucket may still hold newer steps, and must not bring them back.
    rollbacks.record(job, args.to)
    if not newer:
        print(f"step {args.to} is already the newest step of {job}; the rollback is recorded, so a bucket tier "
              "will not bring newer steps back")
        return 0
    for step in newer:
        target = set_aside(job, step, layout.ROLLED_BACK)
        if target is not None:
            print(f"step {step}: set aside as {target}")
    print(f"step {args.to} is now the newest committed step of {job}: load() resumes from it")
    return 0
