"""``python -m bench.bucket``: uploads to and restores from a bucket against the same client used plainly, in one run.

For each size, the same file is moved five ways, ``--reps`` times each:

- ``upload``: the tier's upload of a committed rank file
  (``Bucket.upload_file``: streamed multipart, hashed while sent, checked
  against the manifest before the last part);
- ``reference_upload``: obstore's ``put`` of the same file as its docs show
  it (a path, multipart with its default part size and concurrency);
- ``slot_upload``: a bucket alone's save, the same bytes uploaded from a
  slot-like shared mapping (``bucket_store.SlotUpload``: parts copied out of
  the mapping, checksums computed beside them), against the same
  reference;
- ``restore``: the tier's copy of the object onto a claim
  (``Bucket.download_file``: streamed, hashed, fdatasync'ed, renamed);
- ``reference_download``: obstore's ``get`` streamed into a file, then
  fdatasync'ed, without a checksum.

The ratios (ours over the reference) are what to read: the same machine,
server and client in the same process. The bucket is reached as the sidecar
reaches it (``AWS_ENDPOINT_URL``, the credentials, ...), or is a SeaweedFS
started here for the run (``--bucket local``); its objects are deleted
afterwards. Prints a table; ``--out`` also writes the JSON. ``python -m
bench --bucket ...`` runs the same after its configurations, in the same
report.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import mmap
import os
import shutil
import statistics
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import obstore

from bench import report, s3server
from stowaway.storage import bucket, bucket_store, checksum, manifest


def _timed(action: Callable[[], None], reps: int) -> list[float]:
    times = []
    for _ in range(reps):
        started = time.perf_counter()
        action()
        times.append(time.perf_counter() - started)
    return times


def _download_plainly(store: Any, key: str, path: Path) -> None:
    with path.open("wb", buffering=0) as handle:
        for chunk in obstore.get(store, key).stream():
            handle.write(chunk)
        os.fdatasync(handle.fileno())


def measure(url: str, nbytes: int, reps: int, scratch: Path) -> dict[str, Any]:
    """Seconds of each way for ``nbytes``, ``reps`` times, and the ratios of ours to the references."""
    target = bucket.Bucket(bucket.Location.parse(url), bucket.Settings())
    store = bucket.open_store(target.location, target.settings)
    source = scratch / "rank.safetensors"
    with source.open("wb") as handle:
        for _ in range(0, nbytes, 64 * 2**20):
            handle.write(os.urandom(min(64 * 2**20, nbytes - handle.tell())))
    entry = manifest.FileEntry(0, source.name, nbytes, checksum.of_file(source))
    ours, theirs = target.location.key("bench", "ours"), target.location.key("bench", "reference")
    stop = threading.Event()
    slot = memoryview(mmap.mmap(-1, nbytes))
    with source.open("rb", buffering=0) as handle:
        filled = 0
        while filled < nbytes:
            filled += handle.readinto(slot[filled:])
    from_slot = bucket_store.SlotUpload(target, ours)
    seconds = {
        "upload": _timed(lambda: target.upload_file(ours, source, entry, stop, lambda _n: None), reps),
        "reference_upload": _timed(lambda: obstore.put(store, theirs, source), reps),
        "slot_upload": _timed(lambda: from_slot.write(slot, nbytes, lambda _n: None, lambda: None),
                              reps),
        "restore": _timed(lambda: target.download_file(ours, scratch / "restored", entry, lambda _n: None), reps),
        "reference_download": _timed(lambda: _download_plainly(store, theirs, scratch / "downloaded"), reps),
    }
    target.delete([ours, theirs])
    medians = {name: statistics.median(values) for name, values in seconds.items()}
    return {
        "bytes": nbytes, "seconds": seconds,
        "mb_per_s": {name: nbytes / value / 1e6 for name, value in medians.items()},
        "ratios": {"upload_vs_reference": medians["upload"] / medians["reference_upload"],
                   "slot_upload_vs_reference": medians["slot_upload"] / medians["reference_upload"],
                   "restore_vs_reference": medians["restore"] / medians["reference_download"]},
    }


def table(results: list[dict[str, Any]]) -> str:
    rows = ["| size | upload MB/s | reference upload MB/s | ratio | upload from a slot MB/s | ratio | restore MB/s "
            "| reference download MB/s | ratio |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for result in results:
        speed, ratio = result["mb_per_s"], result["ratios"]
        rows.append(f"| {result['bytes'] / 2**20:.0f} MiB | {speed['upload']:.0f} | {speed['reference_upload']:.0f} | "
                    f"{ratio['upload_vs_reference']:.2f} | {speed['slot_upload']:.0f} | "
                    f"{ratio['slot_upload_vs_reference']:.2f} | {speed['restore']:.0f} | "
                    f"{speed['reference_download']:.0f} | {ratio['restore_vs_reference']:.2f} |")
    return "\n".join(rows)


def measure_sizes(url: str, sizes: list[int], reps: int) -> list[dict[str, Any]]:
    """``measure`` for each size, from a scratch directory on disk that is removed afterwards."""
    scratch = Path(tempfile.mkdtemp(prefix="bench-bucket-", dir="/var/tmp"))
    try:
        return [measure(url, size, reps, scratch) for size in sizes]
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


@contextlib.contextmanager
def reachable(target: str) -> Iterator[str]:
    """The bucket URL to measure against: ``target`` itself, or for ``local`` a SeaweedFS started on this machine
    for the run (``bench.s3server``), with its endpoint and credentials in the environment meanwhile."""
    if target != "local":
        yield target
        return
    with s3server.running(s3server.build_weed()) as server:
        server.create_bucket("bench")
        with mock.patch.dict(os.environ, server.env()):
            yield "s3://bench/run"


def section(target: str, results: list[dict[str, Any]]) -> str:
    """The bucket tier's part of the harness's report."""
    where = "a SeaweedFS on this machine (bench.s3server)" if target == "local" else target
    return (f"### Bucket tier against {where} (medians; ratio: ours over the reference, below 1 is faster)\n\n"
            + table(results) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.bucket", description=__doc__.splitlines()[0])
    parser.add_argument("--bucket", required=True,
                        help="s3://BUCKET/PREFIX to write the objects under, or 'local' for a SeaweedFS started here")
    parser.add_argument("--sizes", default="64M,256M", help="file sizes, comma-separated")
    parser.add_argument("--reps", type=int, default=3, help="repetitions of each measurement")
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = parser.parse_args()
    with reachable(args.bucket) as url:
        results = measure_sizes(url, [report.parse_size(size) for size in args.sizes.split(",")], args.reps)
    if args.out is not None:
        args.out.write_text(json.dumps({"bucket": args.bucket, "results": results}, indent=1) + "\n")
    print(table(results))


if __name__ == "__main__":
    main()
