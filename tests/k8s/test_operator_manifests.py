"""The chart and deploy/ install on a real API server, and deploy/ never drifts from the chart."""

from __future__ import annotations

import base64
import subprocess
import uuid
from pathlib import Path

import pytest
from kubernetes import client

from .cluster import Cluster
from .operator_fixtures import CHART, CRD, REPO, checkpointpolicy_crd  # noqa: F401

pytestmark = pytest.mark.k8s

DEPLOY = REPO / "deploy"


def test_every_copy_of_the_crd_is_identical_to_the_chart_source() -> None:
    assert (DEPLOY / "00-crd.yaml").read_bytes() == CRD.read_bytes(), "run hack/render-deploy"


def test_deploy_is_exactly_what_hack_render_deploy_generates(k8s_cluster: Cluster, tmp_path: Path) -> None:
    subprocess.run([str(REPO / "hack" / "render-deploy"), str(tmp_path)], check=True,
                   env={**k8s_cluster.cli_env(), "HELM": str(k8s_cluster.helm)})
    for generated in sorted(tmp_path.iterdir()):
        assert generated.read_text() == (DEPLOY / generated.name).read_text(), f"deploy/{generated.name} drifted: " \
            "run hack/render-deploy"


def test_helm_lint_is_clean(k8s_cluster: Cluster) -> None:
    result = k8s_cluster.run("helm", "lint", "--strict", str(CHART))
    assert "0 chart(s) failed" in result.stdout
    assert "[WARNING]" not in result.stdout and "[ERROR]" not in result.stdout


def test_values_schema_rejects_a_bad_value(k8s_cluster: Cluster) -> None:
    result = k8s_cluster.run("helm", "template", "x", str(CHART), "--kube-version", "1.36.0",
                             "--set", "webhook.failurePolicy=Sometimes", check=False)
    assert result.returncode != 0
    assert "webhook.failurePolicy" in result.stderr or "failurePolicy" in result.stderr, result.stderr


def test_kubectl_apply_of_deploy_creates_the_operator_objects(
    k8s_cluster: Cluster, k8s_api: client.ApiClient, checkpointpolicy_crd: str  # noqa: F811
) -> None:
    manifest = str(DEPLOY / "10-stowaway.yaml")
    try:
        k8s_cluster.run("kubectl", "apply", "-f", str(DEPLOY))
        deployment = client.AppsV1Api(k8s_api).read_namespaced_deployment("stowaway-stowaway", "stowaway-system")
        pod = deployment.spec.template.spec
        assert pod.security_context.run_as_non_root
        assert pod.containers[0].security_context.read_only_root_filesystem
        assert pod.containers[0].readiness_probe and pod.containers[0].liveness_probe
    finally:
        # The webhook (failurePolicy Fail, no operator running here) must not outlive this test.
        k8s_cluster.run("kubectl", "delete", "-f", manifest, "--wait=false", "--ignore-not-found")


def test_helm_install_provides_a_ca_bundle_that_survives_an_upgrade(
    k8s_cluster: Cluster, k8s_api: client.ApiClient, k8s_namespace: str, checkpointpolicy_crd: str  # noqa: F811
) -> None:
    release = f"r{uuid.uuid4().hex[:6]}"
    admission = client.AdmissionregistrationV1Api(k8s_api)
    core = client.CoreV1Api(k8s_api)
    try:
        k8s_cluster.run("helm", "install", release, str(CHART), "--namespace", k8s_namespace, "--skip-crds")
        secret = core.read_namespaced_secret(f"{release}-stowaway-webhook-tls", k8s_namespace)
        webhook = admission.read_mutating_webhook_configuration(f"{release}-stowaway").webhooks[0]
        assert webhook.client_config.ca_bundle == secret.data["ca.crt"]
        assert base64.b64decode(secret.data["ca.crt"]).startswith(b"-----BEGIN CERTIFICATE-----")
        assert (webhook.failure_policy, webhook.reinvocation_policy) == ("Fail", "IfNeeded")
        assert webhook.object_selector.match_labels == {"stowaway.dev/inject": "enabled"}

        k8s_cluster.run("helm", "upgrade", release, str(CHART), "--namespace", k8s_namespace, "--skip-crds")
        again = admission.read_mutating_webhook_configuration(f"{release}-stowaway").webhooks[0]
        assert again.client_config.ca_bundle == webhook.client_config.ca_bundle
    finally:
        k8s_cluster.run("helm", "uninstall", release, "--namespace", k8s_namespace, check=False)


def test_the_example_job_passes_server_side_dry_run(k8s_cluster: Cluster, k8s_namespace: str) -> None:
    k8s_cluster.run("kubectl", "apply", "--dry-run=server", "-n", k8s_namespace,
                    "-f", str(DEPLOY / "examples" / "train-job.yaml"))
