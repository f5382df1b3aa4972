"""``stowaway ls``, ``verify`` and ``inspect``: read a storage directory without the sidecar."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TextIO

from stowaway.cli import bucket_cmds
from stowaway.cli.errors import CommandError
from stowaway.format import safetensors_header as st
from stowaway.format import shards
from stowaway.storage import bucket, catalog, layout, manifest


def add_parsers(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    ls = commands.add_parser("ls", help="list committed checkpoints",
                             description="List committed checkpoints: step, ranks, bytes, age.")
    ls.add_argument("dir", type=target, help="storage directory, or one job's directory in it (or s3://...)")
    ls.set_defaults(handler=run_ls)
    verify = commands.add_parser("verify", help="check stored files against their manifests",
                                 description="Check every file of committed checkpoints against the manifest's "
                                 "sizes and xxh3-64 checksums; exit 1 naming each bad file.")
    verify.add_argument("dir", type=target, help="storage directory, or one job's directory in it (or s3://...)")
    verify.add_argument("--step", type=int, help="only this step (default: every committed step)")
    verify.set_defaults(handler=run_verify)
    inspect = commands.add_parser("inspect", help="show the tensors of a checkpoint",
                                  description="Show tensors, dtypes, shapes and sizes per rank of one checkpoint.")
    inspect.add_argument("dir", type=target, help="storage directory, or one job's directory in it (or s3://...)")
    inspect.add_argument("--step", type=int, required=True, help="the committed step to inspect")
    inspect.set_defaults(handler=run_inspect)


def target(text: str) -> Path | str:
    """A directory, or an ``s3://`` URL kept as text (a Path would fold its ``//``): see ``bucket_cmds``."""
    return text if bucket.is_url(text) else Path(text)


def job_paths(path: Path) -> list[Path]:
    """The job directories under ``path`` (``path`` itself when it is one)."""
    if not path.is_dir():
        raise CommandError(f"{path} is not a directory; pass the --storage directory of the sidecar")
    if layout.is_job_dir(path):
        return [path]
    return sorted(child for child in path.iterdir() if child.is_dir() and layout.is_job_dir(child))


def single_job(path: Path) -> Path:
    jobs = job_paths(path)
    if len(jobs) != 1:
        names = ", ".join(job.name for job in jobs) or "none"
        raise CommandError(f"{path} holds {len(jobs)} jobs ({names}); pass one job's directory, e.g. {path}/<job>")
    return jobs[0]


def print_header(found: manifest.Manifest) -> None:
    print(f"job {found.job} step {found.step}: {found.world_size} rank(s), {_size(found.total_bytes)}")


def print_row(step: int, found: manifest.Manifest, out: TextIO) -> None:
    print(f"  {step:>10}  {found.world_size:>5}  {_size(found.total_bytes):>12}  "
          f"{_age(time.time() - found.created_unix)}", file=out)


def print_listing(job_path: Path, out: TextIO) -> None:
    print_steps(catalog.committed_steps(job_path), lambda step: manifest.read_manifest(layout.step_dir(job_path, step)),
                (manifest.ManifestError,), layout.set_aside_dirs(job_path), out)


def print_steps(steps: Sequence[int], read: Callable[[int], manifest.Manifest],
                unreadable: tuple[type[Exception], ...], set_aside: Sequence[object], out: TextIO) -> None:
    """A job's committed ``steps`` (each manifest from ``read``; one raising ``unreadable`` is shown as such) and
    the steps ``set_aside``: the listing of ``ls`` and of ``run``, on a claim and in a bucket alike."""
    if not steps:
        print("  (no committed checkpoint)", file=out)
    else:
        print(f"  {'STEP':>10}  {'RANKS':>5}  {'BYTES':>12}  AGE", file=out)
    for step in steps:
        try:
            found = read(step)
        except unreadable as exc:
            print(f"  {step:>10}  unreadable manifest: {exc}", file=out)
            continue
        print_row(step, found, out)
    for where in set_aside:
        print(f"  set aside (kept for inspection; delete it when done): {where}", file=out)


def run_ls(args: argparse.Namespace) -> int:
    if isinstance(args.dir, str):
        return bucket_cmds.run_ls(args.dir)
    jobs = job_paths(args.dir)
    if not jobs:
        print(f"no checkpoints under {args.dir}")
    for job in jobs:
        print(f"job {job.name} ({job})")
        print_listing(job, sys.stdout)
    return 0


def run_verify(args: argparse.Namespace) -> int:
    if isinstance(args.dir, str):
        return bucket_cmds.run_verify(args.dir, args.step)
    job = single_job(args.dir)
    steps = [args.step] if args.step is not None else catalog.committed_steps(job)
    if not steps:
        raise CommandError(f"{job} holds no committed checkpoint to verify")
    bad = 0
    for step in steps:
        step_path = layout.step_dir(job, step)
        if (step_path / layout.MANIFEST).exists():
            problems = catalog.verify_step(job, step)
        else:
            problems = [catalog.Problem(step_path, "not committed (no manifest)")]
        bad += print_verdict(step, problems)
    return verify_status(bad)


def print_verdict(step: int, problems: Sequence[object]) -> int:
    """One line per problem of ``step``, or one saying it is fine; how many problems there were."""
    for problem in problems:
        print(f"step {step}: BAD {problem}")
    if not problems:
        print(f"step {step}: ok")
    return len(problems)


def verify_status(bad: int) -> int:
    if bad:
        print(f"{bad} problem(s) found", file=sys.stderr)
    return 1 if bad else 0


def run_inspect(args: argparse.Namespace) -> int:
    if isinstance(args.dir, str):
        return bucket_cmds.run_inspect(args.dir, args.step)
    job = single_job(args.dir)
    step_path = layout.step_dir(job, args.step)
    try:
        found = manifest.read_manifest(step_path)
    except manifest.ManifestError as exc:
        raise CommandError(f"step {args.step} is not a committed checkpoint: {exc}") from None
    print_header(found)
    for entry in found.files:
        path = step_path / entry.name
        with path.open("rb") as handle:
            # print_rank reads in order, the length prefix and then the header: no seek needed.
            print_rank(entry, str(path), lambda _start, length: handle.read(length))
    return 0


def print_rank(entry: manifest.FileEntry, where: str, read: Callable[[int, int], bytes]) -> None:
    """One rank's tensors, from the safetensors header that ``read(start, length)`` returns the bytes of."""
    head = read(0, 8)
    length = int.from_bytes(head, "little") if len(head) == 8 else 0
    if length > st.MAX_HEADER_BYTES:
        raise CommandError(f"{where} has a corrupt header length {length}; run `stowaway verify`")
    parsed, metadata = st.parse(head + read(8, length), entry.bytes)
    sharded = shards.describe(metadata, entry.rank)
    print(f"rank {entry.rank}: {entry.name} ({_size(entry.bytes)})")
    for item in parsed.tensors:
        shape = "x".join(str(dim) for dim in item.spec.shape) or "scalar"
        row = f"  {item.spec.name:<48} {item.spec.dtype:<8} {shape:<20} {_size(item.spec.nbytes):<10}"
        print(f"{row} {sharded.get(item.spec.name, '')}".rstrip())


def _size(nbytes: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes} B"


def _age(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f}s"
    if seconds < 7200:
        return f"{seconds / 60:.0f}m"
    return f"{seconds / 3600:.1f}h"
