"""Fixtures and helpers for the operator's cluster tests: the CRD, a running operator, policies and pods.

The operator runs as a local process with the settings the chart's Deployment
gives it and the chart's RBAC; the API server reaches it through a MutatingWebhookConfiguration
rendered from the chart, with only ``clientConfig`` switched from the chart's
in-cluster Service to ``https://127.0.0.1:PORT`` (our API server has no
cluster network to route a Service through).
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import signal
import socket
import ssl
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from stowaway.operator import certificates, injection

from .cluster import Cluster
from .wait import eventually

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "stowaway"
CRD = CHART / "crds" / "checkpointpolicies.yaml"
CRD_NAME = "checkpointpolicies.stowaway.dev"
# The namespace the operator believes it runs in (never injected), as the chart's downward API would say.
OPERATOR_NAMESPACE = "stowaway-system"
SIDECAR_IMAGE = "stowaway/stowaway:test"


def render(cluster: Cluster, *args: str) -> list[dict[str, Any]]:
    """``helm template`` of the chart as the objects it would create."""
    out = cluster.run(
        "helm", "template", "stowaway", str(CHART), "--namespace", OPERATOR_NAMESPACE, "--kube-version", "1.36.0", *args
    ).stdout
    return [doc for doc in yaml.safe_load_all(out) if doc]


@pytest.fixture(scope="session")
def checkpointpolicy_crd(k8s_cluster: Cluster, k8s_api: client.ApiClient) -> str:
    """The CRD from the chart, applied and Established (left installed: other tests share it)."""
    k8s_cluster.run("kubectl", "apply", "--server-side", "-f", str(CRD))
    ext = client.ApiextensionsV1Api(k8s_api)

    def established() -> bool:
        conditions = ext.read_custom_resource_definition(CRD_NAME).status.conditions or []
        return any(c.type == "Established" and c.status == "True" for c in conditions)

    eventually(established, what=f"CRD {CRD_NAME} to be Established")
    return CRD_NAME


def webhook_answers(api: client.ApiClient) -> bool:
    """A dry-run create naming a missing policy: refused once the API server calls the webhook."""
    probe = {
        "metadata": {
            "generateName": "probe-",
            "labels": {"stowaway.dev/inject": "enabled"},
            "annotations": {"stowaway.dev/policy": "webhook-readiness-probe"},
        },
        "spec": {"containers": [{"name": "c", "image": "none"}]},
    }
    try:
        client.CoreV1Api(api).create_namespaced_pod("default", probe, dry_run="All")
    except client.exceptions.ApiException as exc:
        return "webhook-readiness-probe" in (exc.body or "")
    return False


@pytest.fixture(scope="session")
def operator_kubeconfig(
    k8s_cluster: Cluster, k8s_api: client.ApiClient, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Path]:
    """A kubeconfig for a ServiceAccount bound to the chart's ClusterRole, rendered from the chart.

    The operator under test authenticates with it, so a permission the chart
    forgot fails the operator's tests. The names are unique: ``kubectl apply -f
    deploy/`` in another test creates and deletes the chart's own.
    """
    name = f"stowaway-operator-{uuid.uuid4().hex[:6]}"
    objects = [d for d in render(k8s_cluster) if d["kind"] in ("ServiceAccount", "ClusterRole", "ClusterRoleBinding")]
    assert sorted(d["kind"] for d in objects) == ["ClusterRole", "ClusterRoleBinding", "ServiceAccount"]
    for doc in objects:
        doc["metadata"]["name"] = name
        if doc["kind"] == "ServiceAccount":
            doc["metadata"]["namespace"] = name
        if doc["kind"] == "ClusterRoleBinding":
            doc["roleRef"]["name"] = name
            (subject,) = doc["subjects"]
            subject.update(name=name, namespace=name)
    manifest = tmp_path_factory.mktemp("rbac") / "rbac.yaml"
    manifest.write_text(yaml.safe_dump_all(objects))
    core = client.CoreV1Api(k8s_api)
    core.create_namespace({"metadata": {"name": name, "labels": {"stowaway.test": "true"}}})
    try:
        k8s_cluster.run("kubectl", "apply", "-f", str(manifest))
        yield service_account_kubeconfig(k8s_cluster, name, name, manifest.with_name("operator.kubeconfig"))
    finally:
        k8s_cluster.run("kubectl", "delete", "-f", str(manifest), "--ignore-not-found", "--wait=false", check=False)
        core.delete_namespace(name)


def service_account_kubeconfig(cluster: Cluster, namespace: str, account: str, path: Path) -> Path:
    """Write a kubeconfig that authenticates as the ServiceAccount (a token from the real TokenRequest API)."""
    token = cluster.run("kubectl", "create", "token", account, "--namespace", namespace, "--duration", "6h").stdout
    config = yaml.safe_load(cluster.kubeconfig.read_text())
    config["users"] = [{"name": account, "user": {"token": token.strip()}}]
    for context in config["contexts"]:
        context["context"]["user"] = account
    path.write_text(yaml.safe_dump(config))
    path.chmod(0o600)
    return path


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def serves_tls(port: int, ca_pem: bytes, server_name: str, process: subprocess.Popen[bytes], log: Path) -> bytes | None:
    """The certificate the operator's webhook port presents to a client trusting ``ca_pem`` (DER), or None yet."""
    if process.poll() is not None:
        raise RuntimeError(f"operator exited with status {process.returncode}:\n{log.read_text()[-4000:]}")
    context = ssl.create_default_context(cadata=ca_pem.decode())
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=2) as raw, context.wrap_socket(
            raw, server_hostname=server_name
        ) as tls:
            return tls.getpeercert(binary_form=True)
    except OSError:
        return None


def start_operator(env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    """``python -m stowaway.operator`` with exactly ``env`` (plus this interpreter's), logging to ``log``."""
    with log.open("ab") as sink:
        return subprocess.Popen(
            [sys.executable, "-m", "stowaway.operator"], env={**os.environ, **env}, stdout=sink,
            stderr=subprocess.STDOUT, start_new_session=True,
        )


def stop_operator(process: subprocess.Popen[bytes]) -> None:
    """SIGTERM, as kubelet stops a pod, then SIGKILL if kopf has not finished within its grace."""
    os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=15)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()


@dataclass(frozen=True)
class RunningOperator:
    """The operator process's log file and the base URL of its metrics endpoint."""

    log: Path
    metrics_url: str


@pytest.fixture(scope="session")
def stowaway_operator(
    k8s_cluster: Cluster, k8s_api: client.ApiClient, checkpointpolicy_crd: str, operator_kubeconfig: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[RunningOperator]:
    """Run ``python -m stowaway.operator`` with the chart's RBAC and register its webhook."""
    if not k8s_cluster.managed:
        pytest.skip("the operator runs as a local process, which an external cluster's API server cannot call")
    folder = tmp_path_factory.mktemp("operator")
    made = certificates.self_signed(["127.0.0.1"])
    for name, pem in (("ca.crt", made.ca_pem), ("tls.crt", made.cert_pem), ("tls.key", made.key_pem)):
        (folder / name).write_bytes(pem)
    port, metrics_port = free_port(), free_port()
    log = folder / "operator.log"
    process = start_operator({
        "KUBECONFIG": str(operator_kubeconfig),
        "STOWAWAY_OPERATOR_NAMESPACE": OPERATOR_NAMESPACE,
        "STOWAWAY_SIDECAR_IMAGE": SIDECAR_IMAGE,
        "STOWAWAY_WEBHOOK_PORT": str(port),
        "STOWAWAY_WEBHOOK_CERT_DIR": str(folder),
        "STOWAWAY_HEALTH_PORT": str(free_port()),
        "STOWAWAY_METRICS_PORT": str(metrics_port),
    }, log)
    admission = client.AdmissionregistrationV1Api(k8s_api)
    name = f"stowaway-test-{uuid.uuid4().hex[:8]}"
    try:
        eventually(lambda: serves_tls(port, made.ca_pem, "127.0.0.1", process, log),
                   what="the operator's webhook TLS port")
        (config,) = [d for d in render(k8s_cluster) if d["kind"] == "MutatingWebhookConfiguration"]
        config["metadata"]["name"] = name
        for webhook in config["webhooks"]:
            path = webhook["clientConfig"]["service"]["path"]
            webhook["clientConfig"] = {
                "url": f"https://127.0.0.1:{port}{path}",
                "caBundle": base64.b64encode(made.ca_pem).decode(),
            }
        admission.create_mutating_webhook_configuration(config)
        eventually(lambda: webhook_answers(k8s_api), what="the API server to start calling the new webhook")
        yield RunningOperator(log, f"http://127.0.0.1:{metrics_port}")
    finally:
        with contextlib.suppress(client.exceptions.ApiException):
            admission.delete_mutating_webhook_configuration(name)
        stop_operator(process)


def create_policy(api: client.ApiClient, namespace: str, name: str = "default", **spec: Any) -> dict[str, Any]:
    body = {
        "apiVersion": "stowaway.dev/v1alpha1",
        "kind": "CheckpointPolicy",
        "metadata": {"name": name},
        "spec": {"storage": {"persistentVolumeClaim": {"claimName": "ckpts"}}, **spec},
    }
    return client.CustomObjectsApi(api).create_namespaced_custom_object(
        "stowaway.dev", "v1alpha1", namespace, "checkpointpolicies", body
    )


def read_policy(api: client.ApiClient, namespace: str, name: str = "default") -> dict[str, Any]:
    return client.CustomObjectsApi(api).get_namespaced_custom_object(
        "stowaway.dev", "v1alpha1", namespace, "checkpointpolicies", name
    )


def ready_condition(api: client.ApiClient, namespace: str, name: str = "default") -> dict[str, Any] | None:
    policy = read_policy(api, namespace, name)
    conditions = (policy.get("status") or {}).get("conditions") or []
    found = [c for c in conditions if c["type"] == "Ready"]
    return found[0] if found and found[0].get("observedGeneration") == policy["metadata"]["generation"] else None


def create_bound_claim(api: client.ApiClient, namespace: str) -> None:
    """A claim statically bound to a hostPath volume, so the scheduler can place pods using it."""
    volume = f"pv-{uuid.uuid4().hex[:8]}"
    core = client.CoreV1Api(api)
    core.create_persistent_volume({
        "metadata": {"name": volume},
        "spec": {
            "capacity": {"storage": "1Gi"}, "accessModes": ["ReadWriteMany"], "storageClassName": "",
            "persistentVolumeReclaimPolicy": "Delete", "hostPath": {"path": f"/tmp/{volume}"},
            "claimRef": {"namespace": namespace, "name": "ckpts"},
        },
    })
    core.create_namespaced_persistent_volume_claim(namespace, {
        "metadata": {"name": "ckpts"},
        "spec": {"accessModes": ["ReadWriteMany"], "storageClassName": "", "volumeName": volume,
                 "resources": {"requests": {"storage": "1Gi"}}},
    })
    eventually(lambda: core.read_namespaced_persistent_volume_claim("ckpts", namespace).status.phase == "Bound",
               what="claim ckpts to be Bound")


def training_pod(labelled: bool = True, **annotations: str) -> dict[str, Any]:
    return {
        "metadata": {
            "generateName": "train-",
            "labels": {"batch.kubernetes.io/job-name": "train", **({injection.INJECT_LABEL: "enabled"} if labelled
                                                                   else {})},
            "annotations": annotations,
        },
        "spec": {
            "automountServiceAccountToken": False,  # keep the stored volumes exactly ours
            "restartPolicy": "Never",
            "containers": [{"name": "trainer", "image": "pytorch", "env": [{"name": "EPOCHS", "value": "3"}]}],
        },
    }


@pytest.fixture
def ready_policy(k8s_api: client.ApiClient, k8s_namespace: str, stowaway_operator: RunningOperator) -> str:
    """A namespace with a bound claim and a Ready CheckpointPolicy named default."""
    create_bound_claim(k8s_api, k8s_namespace)
    create_policy(k8s_api, k8s_namespace, sharedMemory={"sizeLimit": "2Gi"})
    eventually(lambda: (ready_condition(k8s_api, k8s_namespace) or {}).get("status") == "True",
               what="CheckpointPolicy default to be Ready")
    return k8s_namespace


def denial(api: client.ApiClient, namespace: str, pod: dict[str, Any]) -> str:
    """The API server's message refusing ``pod``; fails the test if the pod was stored."""
    with pytest.raises(ApiException) as caught:
        client.CoreV1Api(api).create_namespaced_pod(namespace, pod)
    message = json.loads(caught.value.body)["message"]
    assert "admission webhook \"inject.stowaway.dev\" denied the request" in message
    return message
