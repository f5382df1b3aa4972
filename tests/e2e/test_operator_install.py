"""The operator installed the way users install it, running as a pod from the built image.

The API server reaches the operator's webhook through the chart's Service (no loopback override), with the
TLS material the operator made for itself (``webhook.tls.mode=operator``).
"""

from __future__ import annotations

import base64
from collections.abc import Iterator
from typing import Any

import pytest
from k8s.cluster import Cluster
from k8s.operator_fixtures import REPO, webhook_answers
from k8s.wait import eventually
from kubernetes import client

from . import objects
from .chart import installed_chart
from .diagnostics import namespace_report
from .environment import DEPLOY_IMAGE, PRODUCT_IMAGE
from .namespaces import fresh_namespace

pytestmark = pytest.mark.e2e

DEPLOY = REPO / "deploy"


@pytest.fixture
def operator_namespace(k8s_api: client.ApiClient) -> Iterator[str]:
    """A fresh namespace with a long name, as users' namespaces can be.

    Long enough that the Service's DNS name (<release>-stowaway.<namespace>.svc) exceeds the 64 characters an
    X.509 common name may hold: the operator's certificate must carry it in its SANs only.
    """
    with fresh_namespace(k8s_api, "stowaway-e2e-operator-with-a-long-namespace") as name:
        yield name


@pytest.fixture
def installed(k8s_cluster: Cluster, operator_namespace: str) -> Iterator[str]:
    with installed_chart(k8s_cluster, operator_namespace) as release:
        yield release


def assert_operator_serves_its_webhook_through_the_service(
    cluster: Cluster, api: client.ApiClient, namespace: str, release: str, image: str
) -> None:
    """The operator of ``release`` runs from ``image``, made its own TLS, and the API server calls it via its
    Service (the chart names its objects <release>-stowaway)."""
    name = f"{release}-stowaway"
    pods = objects.get(cluster, "pods", namespace=namespace, selector=f"app.kubernetes.io/instance={release}")["items"]
    assert [pod["status"]["phase"] for pod in pods] == ["Running"]
    assert [c["image"] for c in pods[0]["spec"]["containers"]] == [image]
    assert [c["ready"] for c in pods[0]["status"]["containerStatuses"]] == [True]

    def webhook() -> dict[str, Any]:
        found: dict[str, Any] = objects.get(cluster, "mutatingwebhookconfiguration", name)["webhooks"][0]
        return found

    assert "url" not in webhook()["clientConfig"]
    service = webhook()["clientConfig"]["service"]
    assert (service["namespace"], service["name"]) == (namespace, name)

    # operator mode: the Secret and the caBundle start empty; the operator fills both at its start.
    def made_ca() -> str:
        secret = objects.get(cluster, "secret", f"{name}-webhook-tls", namespace=namespace)
        return str((secret.get("data") or {}).get("ca.crt", ""))

    ca = eventually(made_ca, what="the operator to fill its TLS Secret")
    ca_bundle = eventually(lambda: webhook()["clientConfig"].get("caBundle"), what="the operator to set the caBundle")
    assert base64.b64decode(ca_bundle) == base64.b64decode(ca)

    eventually(lambda: webhook_answers(api), what="the API server to call the webhook through the Service",
               timeout=120)


def test_helm_install_runs_the_operator_and_the_api_server_reaches_its_webhook_through_the_service(
    k8s_cluster: Cluster, k8s_api: client.ApiClient, operator_namespace: str, installed: str
) -> None:
    assert_operator_serves_its_webhook_through_the_service(
        k8s_cluster, k8s_api, operator_namespace, installed, PRODUCT_IMAGE)


def test_kubectl_apply_of_deploy_runs_the_operator_and_the_api_server_reaches_its_webhook(
    k8s_cluster: Cluster, k8s_api: client.ApiClient
) -> None:
    namespace = "stowaway-system"
    try:
        k8s_cluster.run("kubectl", "apply", "-f", str(DEPLOY))
        waited = k8s_cluster.run("kubectl", "--namespace", namespace, "rollout", "status", "deployment",
                                 "stowaway-stowaway", "--timeout=180s", timeout=240, check=False)
        assert waited.returncode == 0, waited.stderr + namespace_report(k8s_cluster, namespace)
        assert_operator_serves_its_webhook_through_the_service(
            k8s_cluster, k8s_api, namespace, "stowaway", DEPLOY_IMAGE)
    finally:
        # The CRD stays (other tests share it); the webhook (failurePolicy Fail) must go with its operator.
        k8s_cluster.run("kubectl", "delete", "-f", str(DEPLOY / "10-stowaway.yaml"), "--ignore-not-found",
                        "--wait=true", "--timeout=120s", timeout=180, check=False)
