"""A real, single-node-free Kubernetes control plane for the test suite.

:class:`ControlPlane` runs etcd, kube-apiserver and kube-controller-manager
(the latter so namespaces finalize and every namespace gets its ``default``
ServiceAccount, as on any real cluster). :class:`FakeNodes` adds
kube-scheduler and kwok: the real scheduler binds pods to kwok's fake nodes and
kwok reports them Running, so workloads behave as in a cluster without any
container runtime.

Everything listens on 127.0.0.1 only, with TLS everywhere and x509 client
authentication; the admin identity is a client certificate in
``system:masters``, the controller-manager and scheduler use their canonical
``system:kube-*`` identities so the default RBAC bootstrap policy applies.
"""

from __future__ import annotations

import json
import os
import shutil
import ssl
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from .pki import CertificateAuthority, KeyPair, service_account_keys
from .processes import (
    ManagedProcess,
    StartupError,
    free_port,
    http_get,
    tls_context,
    wait_http_ok,
    wait_until,
)
from .tools import Tools

SERVICE_CIDR = "10.0.0.0/24"
POD_CIDR = "10.1.0.0/16"
KWOK_STAGES = Path(__file__).with_name("kwok-stages.yaml")
FAKE_NODE_ANNOTATION = "kwok.x-k8s.io/node"
STARTUP_TIMEOUT = 90.0
PORT_RETRIES = 3
# Not $TMPDIR: it can be long, and Unix socket paths must stay below 108 bytes.
WORK_ROOT = Path("/tmp")
WORK_PREFIX = "k8s"


def stop_all(processes: list[ManagedProcess]) -> None:
    """Stop processes newest first; if interrupted, SIGKILL the remaining ones."""
    try:
        while processes:
            processes[-1].stop()
            processes.pop()
    finally:
        while processes:
            processes.pop().kill()


def sweep_stale_workdirs() -> None:
    """Remove temp dirs of earlier runs whose pytest process no longer exists.

    Teardown removes the dir normally; this catches runs that were SIGKILLed
    (their components died with them thanks to PR_SET_PDEATHSIG).
    """
    for owner in WORK_ROOT.glob(f"{WORK_PREFIX}*/owner.pid"):
        try:
            pid = int(owner.read_text())
            os.kill(pid, 0)
        except ProcessLookupError:
            shutil.rmtree(owner.parent, ignore_errors=True)
        except (OSError, ValueError):
            continue


def write_kubeconfig(path: Path, server: str, ca: Path, user: str, creds: KeyPair) -> Path:
    """Write a kubeconfig that authenticates with a client certificate."""
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {
                "name": "stowaway-test",
                "cluster": {"server": server, "certificate-authority": str(ca)},
            }
        ],
        "users": [
            {
                "name": user,
                "user": {"client-certificate": str(creds.cert), "client-key": str(creds.key)},
            }
        ],
        "contexts": [{"name": user, "context": {"cluster": "stowaway-test", "user": user}}],
        "current-context": user,
    }
    # JSON is valid YAML: every kubeconfig reader accepts it, no PyYAML needed.
    path.write_text(json.dumps(config, indent=2))
    path.chmod(0o600)
    return path


def secure_component_flags(kubeconfig: Path, port: int, serving: KeyPair) -> list[str]:
    """Flags kube-controller-manager and kube-scheduler share: one identity, HTTPS on loopback, no election."""
    return [
        f"--kubeconfig={kubeconfig}",
        f"--authentication-kubeconfig={kubeconfig}",
        f"--authorization-kubeconfig={kubeconfig}",
        "--bind-address=127.0.0.1",
        f"--secure-port={port}",
        f"--tls-cert-file={serving.cert}",
        f"--tls-private-key-file={serving.key}",
        "--leader-elect=false",
    ]


def _start_with_port_retry(
    start: Callable[[], ManagedProcess],
    ready: Callable[[ManagedProcess], None],
) -> ManagedProcess:
    """Start a component on freshly picked ports, retrying if a port got taken."""
    for attempt in range(PORT_RETRIES):
        proc = start()
        try:
            ready(proc)
            return proc
        except StartupError:
            proc.stop(grace=2.0)
            if attempt + 1 < PORT_RETRIES and proc.address_in_use():
                continue
            raise
        except BaseException:  # Ctrl-C while waiting: the caller does not own it yet
            proc.kill()
            raise
    raise AssertionError("unreachable")


@dataclass
class ControlPlane:
    """etcd + kube-apiserver + kube-controller-manager in a private temp dir."""

    tools: Tools
    workdir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix=WORK_PREFIX, dir=WORK_ROOT)))
    processes: list[ManagedProcess] = field(default_factory=list)
    server: str = ""

    def __post_init__(self) -> None:
        # Short paths matter: Unix socket paths must stay below 108 bytes.
        sweep_stale_workdirs()
        (self.workdir / "owner.pid").write_text(str(os.getpid()))
        self.pki_dir = self.workdir / "pki"
        self.pki_dir.mkdir(parents=True, exist_ok=True)
        self.ca = CertificateAuthority(self.pki_dir)
        self.serving = self.ca.issue(
            "serving",
            "kube-apiserver",
            dns_names=(
                "localhost",
                "kubernetes",
                "kubernetes.default",
                "kubernetes.default.svc",
                "kubernetes.default.svc.cluster.local",
            ),
            ip_addresses=("127.0.0.1", "::1", "10.0.0.1"),
            server=True,
        )
        self.etcd_client = self.ca.issue("etcd-client", "kube-apiserver-etcd-client", client=True)
        self.admin = self.ca.issue("admin", "kubernetes-admin", organizations=("system:masters",), client=True)
        # The aggregation layer authenticates proxied requests with a separate
        # CA, as kubeadm sets it up; components read it from the
        # extension-apiserver-authentication ConfigMap and complain without it.
        self.front_proxy_ca = CertificateAuthority(self.pki_dir, "stowaway-test-front-proxy-ca", stem="front-proxy-ca")
        self.front_proxy_client = self.front_proxy_ca.issue("front-proxy-client", "front-proxy-client", client=True)
        self.sa = service_account_keys(self.pki_dir)
        self.kubeconfig = self.workdir / "admin.kubeconfig"

    # -- lifecycle -----------------------------------------------------------
    def start(self) -> ControlPlane:
        """Start all components and return once each reports ready.

        On failure the components are stopped but the temp dir with their logs
        is kept for inspection (the next run sweeps it).
        """
        try:
            self._start_etcd()
            self._start_apiserver()
            self._start_controller_manager()
        except BaseException:
            self.stop(keep_workdir=True)
            raise
        return self

    def stop(self, keep_workdir: bool = False) -> None:
        """Stop components in reverse start order and remove the temp dir."""
        try:
            stop_all(self.processes)
        finally:
            if not keep_workdir:
                shutil.rmtree(self.workdir, ignore_errors=True)

    # -- helpers for clients -------------------------------------------------
    def admin_tls(self) -> ssl.SSLContext:
        """TLS context that authenticates as the cluster admin."""
        return tls_context(self.ca.cert_path, self.admin.cert, self.admin.key)

    def component_kubeconfig(self, name: str, user: str, groups: tuple[str, ...] = ()) -> Path:
        """Kubeconfig for a component identity (CN=user, O=groups)."""
        creds = self.ca.issue(name, user, organizations=groups, client=True)
        return write_kubeconfig(self.workdir / f"{name}.kubeconfig", self.server, self.ca.cert_path, user, creds)

    def log(self, name: str) -> Path:
        """Log file of a component."""
        return self.workdir / f"{name}.log"

    # -- components ----------------------------------------------------------
    def _start_etcd(self) -> None:
        # etcd's gRPC gateway dials etcd itself with this certificate, so it
        # needs the client-auth usage as well (as kubeadm issues it).
        etcd_pair = self.ca.issue(
            "etcd",
            "etcd",
            dns_names=("localhost",),
            ip_addresses=("127.0.0.1",),
            server=True,
            client=True,
        )
        ctx = tls_context(self.ca.cert_path, self.etcd_client.cert, self.etcd_client.key)

        def start() -> ManagedProcess:
            client, peer = f"https://127.0.0.1:{free_port()}", f"http://127.0.0.1:{free_port()}"
            self.etcd_url = client
            argv = [
                self.tools.etcd,
                "--name=etcd0",
                f"--data-dir={self.workdir / 'etcd'}",
                f"--listen-client-urls={client}",
                f"--advertise-client-urls={client}",
                f"--listen-peer-urls={peer}",
                f"--initial-advertise-peer-urls={peer}",
                f"--initial-cluster=etcd0={peer}",
                f"--cert-file={etcd_pair.cert}",
                f"--key-file={etcd_pair.key}",
                f"--trusted-ca-file={self.ca.cert_path}",
                "--client-cert-auth",
                # Tests do not need durability; fsync dominates etcd latency.
                "--unsafe-no-fsync",
                "--log-level=warn",
            ]
            return ManagedProcess("etcd", argv, self.log("etcd")).start()

        def ready(proc: ManagedProcess) -> None:
            wait_http_ok(proc, f"{self.etcd_url}/health", ctx, STARTUP_TIMEOUT, '"health":"true"')

        self.processes.append(_start_with_port_retry(start, ready))

    def _start_apiserver(self) -> None:
        def start() -> ManagedProcess:
            port = free_port()
            self.server = f"https://127.0.0.1:{port}"
            argv = [
                self.tools.kube_apiserver,
                f"--etcd-servers={self.etcd_url}",
                f"--etcd-cafile={self.ca.cert_path}",
                f"--etcd-certfile={self.etcd_client.cert}",
                f"--etcd-keyfile={self.etcd_client.key}",
                "--bind-address=127.0.0.1",
                "--advertise-address=127.0.0.1",
                f"--secure-port={port}",
                f"--tls-cert-file={self.serving.cert}",
                f"--tls-private-key-file={self.serving.key}",
                f"--client-ca-file={self.ca.cert_path}",
                f"--service-cluster-ip-range={SERVICE_CIDR}",
                "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
                f"--service-account-key-file={self.sa.cert}",
                f"--service-account-signing-key-file={self.sa.key}",
                "--authorization-mode=Node,RBAC",
                # Webhooks are on by default; listing them documents that the
                # suite relies on them (Stowaway's operator installs webhooks).
                "--enable-admission-plugins=NodeRestriction,MutatingAdmissionWebhook,ValidatingAdmissionWebhook",
                "--allow-privileged=true",
                f"--requestheader-client-ca-file={self.front_proxy_ca.cert_path}",
                "--requestheader-allowed-names=front-proxy-client",
                "--requestheader-username-headers=X-Remote-User",
                "--requestheader-group-headers=X-Remote-Group",
                "--requestheader-extra-headers-prefix=X-Remote-Extra-",
                f"--proxy-client-cert-file={self.front_proxy_client.cert}",
                f"--proxy-client-key-file={self.front_proxy_client.key}",
                # Endpoints may not point at loopback, so the default "lease"
                # reconciler would fail forever publishing 127.0.0.1 for the
                # `kubernetes` Service; nothing in-cluster needs to reach us.
                "--endpoint-reconciler-type=none",
                # A webhook's `service:` clientConfig goes to the Service's
                # EndpointSlice address rather than its ClusterIP (which no
                # kube-proxy routes here), so the chart's own webhook
                # configuration reaches an operator run on this machine.
                "--enable-aggregator-routing=true",
                f"--cert-dir={self.workdir / 'apiserver-certs'}",
                "--profiling=false",
                "--v=1",
            ]
            return ManagedProcess("kube-apiserver", argv, self.log("kube-apiserver")).start()

        def ready(proc: ManagedProcess) -> None:
            wait_http_ok(proc, f"{self.server}/readyz", self.admin_tls(), STARTUP_TIMEOUT, "ok")

        self.processes.append(_start_with_port_retry(start, ready))
        write_kubeconfig(self.kubeconfig, self.server, self.ca.cert_path, "kubernetes-admin", self.admin)

    def _start_controller_manager(self) -> None:
        kubeconfig = self.component_kubeconfig("kube-controller-manager", "system:kube-controller-manager")

        def start() -> ManagedProcess:
            self.kcm_port = free_port()
            argv = [
                self.tools.kube_controller_manager,
                *secure_component_flags(kubeconfig, self.kcm_port, self.serving),
                "--use-service-account-credentials=true",
                f"--service-account-private-key-file={self.sa.key}",
                f"--root-ca-file={self.ca.cert_path}",
                f"--cluster-signing-cert-file={self.ca.cert_path}",
                f"--cluster-signing-key-file={self.ca.pair.key}",
                f"--service-cluster-ip-range={SERVICE_CIDR}",
                "--v=1",
            ]
            return ManagedProcess("kube-controller-manager", argv, self.log("kube-controller-manager")).start()

        def ready(proc: ManagedProcess) -> None:
            url = f"https://127.0.0.1:{self.kcm_port}/healthz"
            wait_http_ok(proc, url, tls_context(self.ca.cert_path), STARTUP_TIMEOUT, "ok")
            # Ready for tests means the ServiceAccount controller has run.
            sa_url = f"{self.server}/api/v1/namespaces/default/serviceaccounts/default"

            def default_sa() -> str | None:
                status, body = http_get(sa_url, self.admin_tls())
                return None if status == 200 else f"GET {sa_url} -> {status} {body[-200:]}"

            wait_until(proc, "created the default ServiceAccount", default_sa, STARTUP_TIMEOUT)

        self.processes.append(_start_with_port_retry(start, ready))


@dataclass
class FakeNodes:
    """kube-scheduler plus kwok managing ``count`` fake nodes."""

    plane: ControlPlane
    count: int = 2
    processes: list[ManagedProcess] = field(default_factory=list)
    names: list[str] = field(default_factory=list)

    def start(self) -> FakeNodes:
        """Start scheduler and kwok, register the nodes, wait until Ready."""
        try:
            self._start_scheduler()
            self._start_kwok()
            self._register_nodes()
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """Stop kwok and the scheduler (the nodes die with the control plane)."""
        stop_all(self.processes)

    def _start_scheduler(self) -> None:
        plane = self.plane
        kubeconfig = plane.component_kubeconfig("kube-scheduler", "system:kube-scheduler")

        def start() -> ManagedProcess:
            self.port = free_port()
            argv = [
                plane.tools.kube_scheduler,
                *secure_component_flags(kubeconfig, self.port, plane.serving),
                "--v=1",
            ]
            return ManagedProcess("kube-scheduler", argv, plane.log("kube-scheduler")).start()

        def ready(proc: ManagedProcess) -> None:
            url = f"https://127.0.0.1:{self.port}/readyz"
            wait_http_ok(proc, url, tls_context(plane.ca.cert_path), STARTUP_TIMEOUT, "ok")

        self.processes.append(_start_with_port_retry(start, ready))

    def _start_kwok(self) -> None:
        plane = self.plane

        def start() -> ManagedProcess:
            self.kwok_port = free_port()
            argv = [
                plane.tools.kwok,
                f"--kubeconfig={plane.kubeconfig}",
                f"--config={KWOK_STAGES}",
                "--manage-all-nodes=false",
                f"--manage-nodes-with-annotation-selector={FAKE_NODE_ANNOTATION}=fake",
                f"--cidr={POD_CIDR}",
                "--node-ip=127.0.0.1",
                "--node-lease-duration-seconds=40",
                f"--server-address=127.0.0.1:{self.kwok_port}",
            ]
            return ManagedProcess("kwok", argv, plane.log("kwok")).start()

        def ready(proc: ManagedProcess) -> None:
            # kwok serves plain HTTP here (no --tls-cert-file); the context is unused.
            url = f"http://127.0.0.1:{self.kwok_port}/healthz"
            wait_http_ok(proc, url, tls_context(None), STARTUP_TIMEOUT)

        self.processes.append(_start_with_port_retry(start, ready))

    def _register_nodes(self) -> None:
        from kubernetes import client, config

        api = client.CoreV1Api(config.new_client_from_config(str(self.plane.kubeconfig)))
        for i in range(self.count):
            name = f"kwok-node-{i}"
            api.create_node(fake_node(name))
            self.names.append(name)

        def all_ready() -> str | None:
            not_ready = []
            for name in self.names:
                node = api.read_node(name)
                conditions = {c.type: c.status for c in (node.status.conditions or [])}
                if conditions.get("Ready") != "True":
                    not_ready.append(name)
            return f"nodes not Ready yet: {not_ready}" if not_ready else None

        wait_until(self.processes[-1], "made the fake nodes Ready", all_ready, STARTUP_TIMEOUT)


def fake_node(name: str) -> dict[str, object]:
    """A Node object kwok will manage (selected by annotation)."""
    resources = {"cpu": "32", "memory": "256Gi", "pods": "110"}
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "annotations": {FAKE_NODE_ANNOTATION: "fake", "node.alpha.kubernetes.io/ttl": "0"},
            "labels": {
                "kubernetes.io/hostname": name,
                "kubernetes.io/os": "linux",
                "kubernetes.io/arch": "amd64",
                "kubernetes.io/role": "agent",
                "type": "kwok",
            },
        },
        "status": {"allocatable": resources, "capacity": resources},
    }
