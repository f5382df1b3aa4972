"""A real S3 server on this machine: SeaweedFS's ``weed server -s3`` on free ports in a short temp dir.

The harness (``python -m bench --bucket local``) measures the bucket tier
against it, and the tests marked ``s3`` run against it (``tests/s3server.py``).
``weed`` is built from the Go module proxy by ``hack/e2e/gobuild seaweedfs``
and cached outside the repository (``build_weed``).

Three identities: ``admin`` creates buckets (SeaweedFS creates one on an
admin's first upload), ``trainer`` is what the sidecar and the tools use: it
may read, write and list, but not create buckets, so a missing bucket stays
missing, as on a real service; ``reader`` may only read and list.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path

import obstore
from obstore.store import S3Store

TRAINER = ("stowaway-trainer", "trainer-secret-0123456789")
ADMIN = ("stowaway-admin", "admin-secret-0123456789")
# May read and list only: a read-only bucket, as far as a sidecar using it can tell.
READER = ("stowaway-reader", "reader-secret-0123456789")
START_TIMEOUT = 60.0
HACK = Path(__file__).resolve().parents[1] / "hack"


class NoWeed(Exception):
    """``weed`` cannot be built here; the message says why and what to install."""


def build_weed() -> Path:
    """``weed``, built (or found in the cache) by ``hack/e2e/gobuild seaweedfs``; its build log goes to stderr.

    ``NoWeed`` only for a missing Go toolchain; a build that fails otherwise raises ``RuntimeError``.
    """
    go = shutil.which("go") or ("/usr/local/go/bin/go" if Path("/usr/local/go/bin/go").exists() else None)
    if go is None:
        raise NoWeed("no Go toolchain (go on PATH or /usr/local/go/bin/go): install Go >= 1.26 to build SeaweedFS "
                     "from the Go module proxy")
    built = subprocess.run([str(HACK / "e2e" / "gobuild"), "seaweedfs"], stdout=subprocess.PIPE, text=True,
                           check=False)
    lines = [line for line in built.stdout.splitlines() if line.startswith("seaweedfs=")]
    if built.returncode != 0 or not lines:
        raise RuntimeError(f"hack/e2e/gobuild seaweedfs exited with {built.returncode}; its log is above")
    return Path(lines[-1].split("=", 1)[1]) / "weed"


def _free_ports(count: int) -> list[int]:
    sockets = []
    try:
        for _ in range(count):
            sock = socket.socket()
            sock.bind(("127.0.0.1", 0))
            sockets.append(sock)
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


class S3Server:
    """One ``weed server -s3``; ``stop`` and ``start`` again keep its data and ports."""

    def __init__(self, weed: Path) -> None:
        self.weed = weed
        self.root = Path(tempfile.mkdtemp(prefix="s3", dir="/tmp"))
        (self.root / "data").mkdir()
        self.ports = _free_ports(8)
        self.endpoint = f"http://127.0.0.1:{self.ports[6]}"
        config = {"identities": [
            {"name": "admin", "credentials": [{"accessKey": ADMIN[0], "secretKey": ADMIN[1]}],
             "actions": ["Admin", "Read", "Write", "List", "Tagging"]},
            {"name": "trainer", "credentials": [{"accessKey": TRAINER[0], "secretKey": TRAINER[1]}],
             "actions": ["Read", "Write", "List", "Tagging"]},
            {"name": "reader", "credentials": [{"accessKey": READER[0], "secretKey": READER[1]}],
             "actions": ["Read", "List"]},
        ]}
        (self.root / "s3.json").write_text(json.dumps(config))
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> S3Server:
        master, master_grpc, volume, volume_grpc, filer, filer_grpc, s3, s3_grpc = self.ports
        command = [
            str(self.weed), "server", f"-dir={self.root / 'data'}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
            f"-master.port={master}", f"-master.port.grpc={master_grpc}", "-master.telemetry=false",
            # Each bucket is a collection that takes several volumes at once: room for many buckets, each
            # volume small (and sparse on disk).
            f"-volume.port={volume}", f"-volume.port.grpc={volume_grpc}", "-volume.max=300",
            "-master.volumeSizeLimitMB=64",
            f"-filer.port={filer}", f"-filer.port.grpc={filer_grpc}",
            "-s3", f"-s3.port={s3}", f"-s3.port.grpc={s3_grpc}", "-s3.port.iceberg=0", "-s3.port.lance=0",
            f"-s3.config={self.root / 's3.json'}",
        ]
        log = (self.root / "weed.log").open("ab")
        self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=self.root,
                                        start_new_session=True)
        log.close()
        return self

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()

    def log(self) -> str:
        return (self.root / "weed.log").read_text(errors="replace")[-4000:]

    def store(self, bucket: str, identity: tuple[str, str] = TRAINER) -> S3Store:
        return S3Store(bucket, endpoint=self.endpoint, access_key_id=identity[0], secret_access_key=identity[1],
                       region="us-east-1", virtual_hosted_style_request=False,
                       client_options={"allow_http": True},
                       retry_config={"max_retries": 0, "retry_timeout": timedelta(seconds=5)})

    def create_bucket(self, bucket: str) -> None:
        """Create ``bucket`` (an admin's upload does), waiting for the server to take requests first."""
        store = self.store(bucket, ADMIN)

        def create() -> None:
            obstore.put(store, ".created", b"")
            obstore.delete(store, ".created")

        self._once_serving(create, "accept an upload")

    def wait_serving(self, bucket: str) -> None:
        """Return once the server, started again, answers a listing of ``bucket``: its ports open some time after
        ``start`` returns."""
        store = self.store(bucket)
        self._once_serving(lambda: obstore.list_with_delimiter(store), "answer a listing")

    def wait_writable(self, bucket: str) -> None:
        """Return once the server, started again, takes an upload to ``bucket``: it answers listings before its
        volumes take writes again."""
        store = self.store(bucket)

        def probe() -> None:
            obstore.put(store, ".probe", b"")
            obstore.delete(store, ".probe")

        self._once_serving(probe, "accept an upload")

    def _once_serving(self, request: Callable[[], object], what: str) -> None:
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            try:
                request()
                return
            except Exception as exc:
                if self.process is not None and self.process.poll() is not None:
                    raise RuntimeError(f"weed exited with {self.process.returncode}:\n{self.log()}") from exc
                if time.monotonic() > deadline:
                    raise RuntimeError(f"weed did not {what} within {START_TIMEOUT:.0f} s ({exc}):\n"
                                       f"{self.log()}") from exc
                time.sleep(0.2)  # polling a server that is starting: nothing to wait on but its answer

    def shell(self, command: str) -> str:
        """Run one ``weed shell`` command against this server (the administrator's tool); its output."""
        master, master_grpc = self.ports[:2]
        done = subprocess.run([str(self.weed), "shell", f"-master=127.0.0.1:{master}.{master_grpc}"],
                              input=command + "\n", capture_output=True, text=True, timeout=60, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"weed shell {command!r} exited with {done.returncode}: {done.stderr[-2000:]}")
        return done.stdout

    def usage(self, bucket: str) -> float:
        """How full ``bucket`` is against its quota, in percent, as the master last heard from the volumes."""
        for line in self.shell("s3.bucket.list").splitlines():
            fields = dict(field.split(":", 1) for field in line.split() if ":" in field)
            if line.split() and line.split()[0] == bucket and "usage" in fields:
                return float(fields["usage"].rstrip("%"))
        return 0.0

    def enforce_quota(self, bucket: str, megabytes: int | None) -> None:
        """Give ``bucket`` a quota (None: none) and apply it now: SeaweedFS makes a bucket over its quota
        read-only until the quota is raised, and its usage is only known once the volumes report it."""
        if megabytes is None:
            self.shell(f"s3.bucket.quota -name={bucket} -op=remove")
        else:
            self.shell(f"s3.bucket.quota -name={bucket} -op=set -sizeMB={megabytes}")
        self.shell("s3.bucket.quota.enforce -apply")

    def env(self) -> dict[str, str]:
        """What a sidecar or the CLI needs in its environment to reach the server as ``trainer``."""
        return {"AWS_ACCESS_KEY_ID": TRAINER[0], "AWS_SECRET_ACCESS_KEY": TRAINER[1],
                "AWS_ENDPOINT_URL": self.endpoint, "AWS_REGION": "us-east-1"}

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.root, ignore_errors=True)


@contextlib.contextmanager
def running(weed: Path) -> Iterator[S3Server]:
    server = S3Server(weed).start()
    try:
        yield server
    finally:
        server.close()
