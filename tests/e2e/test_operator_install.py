"""The operator installed the way users install it, running as a pod from the built image.

The API server reaches the operator's webhook through the chart's Service (no loopback override), with the
TLS material the operator made for itself (``webhook.tls.mode=operator``).
"""

from __future__ import annotations

import base64
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from k8s.cluster import Cluster
from k8s.operator_fixtures import CHART, webhook_answers
from k8s.wait import eventually
from kubernetes import client

from . import objects
from .diagnostics import namespace_report
from .environment import PRODUCT_IMAGE

pytestmark = pytest.mark.e2e


@pytest.fixture
def operator_namespace(k8s_api: client.ApiClient) -> Iterator[str]:
    """A fresh namespace with a short name.

    Short because the operator puts its Service's DNS name (<release>-stowaway.<namespace>.svc) into its
    certificate's common name, which X.509 limits to 64 characters: with a longer namespace it crashes at
    start (src/stowaway/operator/certificates.py), which the k8s_namespace fixture's names would trigger.
    """
    name = f"stowaway-{uuid.uuid4().hex[:6]}"
    core = client.CoreV1Api(k8s_api)
    core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=name, labels={"stowaway.test": "true"})))
    try:
        yield name
    finally:
        core.delete_namespace(name)


@pytest.fixture
def installed(k8s_cluster: Cluster, operator_namespace: str) -> Iterator[str]:
    """The chart installed, uninstalled afterwards (its webhook must not outlive the test)."""
    release = f"s{uuid.uuid4().hex[:6]}"
    repository, tag = PRODUCT_IMAGE.rsplit(":", 1)
    try:
        result = k8s_cluster.run(
            "helm", "install", release, str(CHART), "--namespace", operator_namespace,
            "--set", f"image.repository={repository}", "--set", f"image.tag={tag}",
            "--set", "image.pullPolicy=Never", "--set", "webhook.tls.mode=operator",
            "--wait", "--timeout", "180s", timeout=240, check=False)
        assert result.returncode == 0, f"helm install failed: {result.stderr}\n" + namespace_report(
            k8s_cluster, operator_namespace)
        yield release
    finally:
        k8s_cluster.run("helm", "uninstall", release, "--namespace", operator_namespace, "--wait", check=False)


def test_helm_install_runs_the_operator_and_the_api_server_reaches_its_webhook_through_the_service(
    k8s_cluster: Cluster, k8s_api: client.ApiClient, operator_namespace: str, installed: str
) -> None:
    pods = objects.get(k8s_cluster, "pods", namespace=operator_namespace,
                       selector=f"app.kubernetes.io/instance={installed}")["items"]
    assert [pod["status"]["phase"] for pod in pods] == ["Running"]
    (container,) = pods[0]["status"]["containerStatuses"]
    assert container["ready"] and container["image"].endswith(PRODUCT_IMAGE)

    def webhook() -> dict[str, Any]:
        found: dict[str, Any] = objects.get(k8s_cluster, "mutatingwebhookconfiguration",
                                            f"{installed}-stowaway")["webhooks"][0]
        return found

    assert "url" not in webhook()["clientConfig"]
    service = webhook()["clientConfig"]["service"]
    assert (service["namespace"], service["name"]) == (operator_namespace, f"{installed}-stowaway")

    # operator mode: the chart leaves the Secret and the caBundle empty; the operator fills both at its start.
    def made_ca() -> str:
        secret = objects.get(k8s_cluster, "secret", f"{installed}-stowaway-webhook-tls", namespace=operator_namespace)
        return str((secret.get("data") or {}).get("ca.crt", ""))

    ca = eventually(made_ca, what="the operator to fill its TLS Secret")
    ca_bundle = eventually(lambda: webhook()["clientConfig"].get("caBundle"), what="the operator to set the caBundle")
    assert base64.b64decode(ca_bundle) == base64.b64decode(ca)

    eventually(lambda: webhook_answers(k8s_api), what="the API server to call the webhook through the Service",
               timeout=120)
