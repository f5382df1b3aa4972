"""The harness: the API server the suite starts is a real, secured kube-apiserver of the pinned release.

These tests check the test cluster, not Stowaway: they say where to look first when the operator's
cluster tests fail.
"""

from __future__ import annotations

import itertools
import json
import re

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from .cluster import Cluster
from .wait import eventually

pytestmark = pytest.mark.k8s


def test_the_harness_api_server_reports_the_pinned_release(k8s_cluster: Cluster, k8s_api: client.ApiClient) -> None:
    info = client.VersionApi(k8s_api).get_code()
    assert re.fullmatch(r"v\d+\.\d+\.\d+.*", info.git_version), info
    if k8s_cluster.managed:
        assert info.git_version == k8s_cluster.pinned_version
        major, minor = k8s_cluster.pinned_version.lstrip("v").split(".")[:2]
        assert (info.major, info.minor) == (major, minor)


def test_the_harness_kubectl_reports_the_same_release_as_the_api_server(k8s_cluster: Cluster) -> None:
    out = k8s_cluster.run("kubectl", "version", "--output=json").stdout
    versions = json.loads(out)
    assert versions["serverVersion"]["gitVersion"].startswith("v")
    if k8s_cluster.managed:
        assert versions["clientVersion"]["gitVersion"] == k8s_cluster.pinned_version
        assert versions["serverVersion"]["gitVersion"] == k8s_cluster.pinned_version


def test_the_harness_api_server_denies_a_service_account_without_rbac_bindings(
    k8s_cluster: Cluster, k8s_namespace: str
) -> None:
    who = f"system:serviceaccount:{k8s_namespace}:default"
    denied = k8s_cluster.run(
        "kubectl",
        "auth",
        "can-i",
        "list",
        "secrets",
        "-n",
        k8s_namespace,
        f"--as={who}",
        check=False,
    )
    assert denied.stdout.strip() == "no", denied
    admin = k8s_cluster.run("kubectl", "auth", "can-i", "list", "secrets", "-n", k8s_namespace)
    assert admin.stdout.strip() == "yes"


def test_the_harness_api_server_calls_validating_admission_webhooks(
    k8s_api: client.ApiClient, k8s_namespace: str
) -> None:
    # A webhook nobody serves, with failurePolicy Fail, scoped to our
    # namespace: if the API server really runs the ValidatingAdmissionWebhook
    # plugin, creates there fail with the server's "failed calling webhook".
    admission = client.AdmissionregistrationV1Api(k8s_api)
    name = f"deny-{k8s_namespace}"
    admission.create_validating_webhook_configuration(
        {
            "metadata": {"name": name},
            "webhooks": [
                {
                    "name": "deny.test.stowaway.dev",
                    "admissionReviewVersions": ["v1"],
                    "sideEffects": "None",
                    "failurePolicy": "Fail",
                    "timeoutSeconds": 2,
                    # Port 1 on the API server's own loopback: connection refused.
                    "clientConfig": {"url": "https://127.0.0.1:1/validate"},
                    "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": k8s_namespace}},
                    "rules": [
                        {
                            "apiGroups": [""],
                            "apiVersions": ["v1"],
                            "operations": ["CREATE"],
                            "resources": ["configmaps"],
                        }
                    ],
                }
            ],
        }
    )
    core = client.CoreV1Api(k8s_api)
    attempts = itertools.count()
    try:

        def rejected() -> ApiException | None:
            body = {"metadata": {"name": f"probe-{next(attempts)}"}}
            try:
                core.create_namespaced_config_map(k8s_namespace, body)
            except ApiException as exc:
                return exc
            return None  # webhook configuration not picked up yet

        exc = eventually(rejected, what="the webhook to be called", timeout=30)
        assert "failed calling webhook" in exc.body, exc.body
        assert "deny.test.stowaway.dev" in exc.body
    finally:
        admission.delete_validating_webhook_configuration(name)
