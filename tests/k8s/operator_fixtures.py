"""Fixtures for the operator's cluster tests: the CheckpointPolicy CRD and a running operator.

The operator runs as a local process with the settings the chart's Deployment
gives it; the API server reaches it through a MutatingWebhookConfiguration
rendered from the chart, with only ``clientConfig`` switched from the chart's
in-cluster Service to ``https://127.0.0.1:PORT`` (our API server has no
cluster network to route a Service through).
"""

from __future__ import annotations

import base64
import contextlib
import os
import signal
import socket
import ssl
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client

from stowaway.operator import certificates

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


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _serves_tls(port: int, ca: Path, process: subprocess.Popen[bytes], log: Path) -> bool:
    if process.poll() is not None:
        raise RuntimeError(f"operator exited with status {process.returncode}:\n{log.read_text()[-4000:]}")
    context = ssl.create_default_context(cafile=str(ca))
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=2) as raw, context.wrap_socket(
            raw, server_hostname="127.0.0.1"
        ):
            return True
    except OSError:
        return False


def _webhook_answers(api: client.ApiClient) -> bool:
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
def stowaway_operator(
    k8s_cluster: Cluster, k8s_api: client.ApiClient, checkpointpolicy_crd: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Path]:
    """Run ``python -m stowaway.operator`` and register its webhook; yields the operator's log file."""
    if not k8s_cluster.managed:
        pytest.skip("the operator runs as a local process, which an external cluster's API server cannot call")
    folder = tmp_path_factory.mktemp("operator")
    made = certificates.self_signed(["127.0.0.1"])
    for name, pem in (("ca.crt", made.ca_pem), ("tls.crt", made.cert_pem), ("tls.key", made.key_pem)):
        (folder / name).write_bytes(pem)
    port = _free_port()
    env = {
        **os.environ,
        "KUBECONFIG": str(k8s_cluster.kubeconfig),
        "STOWAWAY_OPERATOR_NAMESPACE": OPERATOR_NAMESPACE,
        "STOWAWAY_SIDECAR_IMAGE": SIDECAR_IMAGE,
        "STOWAWAY_WEBHOOK_PORT": str(port),
        "STOWAWAY_WEBHOOK_CERT_DIR": str(folder),
        "STOWAWAY_HEALTH_PORT": str(_free_port()),
    }
    log = folder / "operator.log"
    with log.open("wb") as sink:
        process = subprocess.Popen(
            [sys.executable, "-m", "stowaway.operator"], env=env, stdout=sink, stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    admission = client.AdmissionregistrationV1Api(k8s_api)
    name = f"stowaway-test-{uuid.uuid4().hex[:8]}"
    try:
        eventually(lambda: _serves_tls(port, folder / "ca.crt", process, log), what="the operator's webhook TLS port")
        (config,) = [d for d in render(k8s_cluster) if d["kind"] == "MutatingWebhookConfiguration"]
        config["metadata"]["name"] = name
        for webhook in config["webhooks"]:
            path = webhook["clientConfig"]["service"]["path"]
            webhook["clientConfig"] = {
                "url": f"https://127.0.0.1:{port}{path}",
                "caBundle": base64.b64encode(made.ca_pem).decode(),
            }
        admission.create_mutating_webhook_configuration(config)
        eventually(lambda: _webhook_answers(k8s_api), what="the API server to start calling the new webhook")
        yield log
    finally:
        with contextlib.suppress(client.exceptions.ApiException):
            admission.delete_mutating_webhook_configuration(name)
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
