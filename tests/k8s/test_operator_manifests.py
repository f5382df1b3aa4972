"""The chart and deploy/ install on a real API server, and deploy/ never drifts from the chart."""

from __future__ import annotations

import base64
import json
import re
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from kubernetes import client
from kubernetes.client.rest import ApiException

from stowaway.operator import injection

from .cluster import Cluster
from .operator_fixtures import CHART, CRD, REPO, render
from .wait import eventually

pytestmark = pytest.mark.k8s

DEPLOY = REPO / "deploy"
DASHBOARD = CHART / "dashboards" / "stowaway-dashboard.json"
ALERTS = CHART / "rules" / "stowaway-alerts.yaml"
MONITORING_CRDS = Path(__file__).with_name("monitoring-crds.yaml")
MONITORS = ("monitoring.coreos.com/v1/PodMonitor", "monitoring.coreos.com/v1/ServiceMonitor")
PROMETHEUS_RULE = "monitoring.coreos.com/v1/PrometheusRule"


def test_every_copy_of_the_crd_is_identical_to_the_chart_source() -> None:
    assert (DEPLOY / "00-crd.yaml").read_bytes() == CRD.read_bytes(), "run hack/render-deploy"


def test_deploy_is_exactly_what_hack_render_deploy_generates(k8s_cluster: Cluster, tmp_path: Path) -> None:
    subprocess.run([str(REPO / "hack" / "render-deploy"), str(tmp_path)], check=True,
                   env={**k8s_cluster.cli_env(), "HELM": str(k8s_cluster.helm)})
    generated = sorted(path.relative_to(tmp_path) for path in tmp_path.rglob("*") if path.is_file())
    assert Path("grafana/stowaway-dashboard.json") in generated
    assert Path("prometheus/stowaway-alerts.yaml") in generated
    for name in generated:
        assert (tmp_path / name).read_text() == (DEPLOY / name).read_text(), f"deploy/{name} drifted: " \
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
    k8s_cluster: Cluster, k8s_api: client.ApiClient, checkpointpolicy_crd: str
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
    k8s_cluster: Cluster, k8s_api: client.ApiClient, k8s_namespace: str, checkpointpolicy_crd: str
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


def test_every_copy_of_the_dashboard_and_the_alerts_is_identical_to_the_chart_source() -> None:
    assert (DEPLOY / "grafana" / "stowaway-dashboard.json").read_bytes() == DASHBOARD.read_bytes(), \
        "run hack/render-deploy"
    assert (DEPLOY / "prometheus" / "stowaway-alerts.yaml").read_bytes() == ALERTS.read_bytes(), \
        "run hack/render-deploy"


def test_monitors_are_not_rendered_where_the_prometheus_operator_is_not_installed(k8s_cluster: Cluster) -> None:
    kinds = {doc["kind"] for doc in render(k8s_cluster)}
    assert "Deployment" in kinds
    assert not kinds & {"PodMonitor", "ServiceMonitor", "PrometheusRule"}


def test_the_pod_monitor_scrapes_the_injected_sidecars_port_with_the_training_job_as_job(
    k8s_cluster: Cluster,
) -> None:
    rendered = render(k8s_cluster, *(arg for api in MONITORS for arg in ("--api-versions", api)))
    (pod_monitor,) = [d for d in rendered if d["kind"] == "PodMonitor"]
    assert pod_monitor["spec"]["selector"] == {"matchLabels": {injection.INJECT_LABEL: injection.INJECT_ENABLED}}
    assert pod_monitor["spec"]["namespaceSelector"] == {"any": True}
    (endpoint,) = pod_monitor["spec"]["podMetricsEndpoints"]
    assert endpoint["port"] == injection.METRICS_PORT_NAME
    # Prometheus's service discovery names a pod label __meta_kubernetes_pod_label_<label, [^a-zA-Z0-9_] as _>.
    discovered = "__meta_kubernetes_pod_label_" + re.sub(r"[^a-zA-Z0-9_]", "_", injection.JOB_LABEL)
    assert {"sourceLabels": [discovered], "regex": "(.+)", "targetLabel": "job"} in endpoint["relabelings"]

    (service_monitor,) = [d for d in rendered if d["kind"] == "ServiceMonitor"]
    (service,) = [d for d in rendered if d["kind"] == "Service"]
    labels = service["metadata"]["labels"]
    assert service_monitor["spec"]["selector"]["matchLabels"].items() <= labels.items()
    (scraped,) = service_monitor["spec"]["endpoints"]
    assert scraped["port"] in {port["name"] for port in service["spec"]["ports"]}


def test_the_prometheus_rule_holds_the_chart_s_alerts_with_the_labels_asked_for(k8s_cluster: Cluster) -> None:
    rendered = render(k8s_cluster, "--api-versions", PROMETHEUS_RULE, "--set",
                      "monitoring.prometheusRule.labels.release=kube-prometheus-stack")
    (rule,) = [d for d in rendered if d["kind"] == "PrometheusRule"]
    assert rule["spec"] == yaml.safe_load(ALERTS.read_text()), "the alerts promtool tested, unchanged"
    assert rule["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    off = render(k8s_cluster, "--api-versions", PROMETHEUS_RULE, "--set", "monitoring.prometheusRule.enabled=false")
    assert "PrometheusRule" not in {doc["kind"] for doc in off}


@pytest.fixture
def monitoring_crds(k8s_cluster: Cluster, k8s_api: client.ApiClient) -> Iterator[None]:
    """The stand-in Prometheus Operator CRDs, Established, and removed afterwards."""
    k8s_cluster.run("kubectl", "apply", "--server-side", "-f", str(MONITORING_CRDS))
    ext = client.ApiextensionsV1Api(k8s_api)

    def established() -> bool:
        return all(
            any(c.type == "Established" and c.status == "True"
                for c in ext.read_custom_resource_definition(name).status.conditions or [])
            for name in ("podmonitors.monitoring.coreos.com", "servicemonitors.monitoring.coreos.com",
                         "prometheusrules.monitoring.coreos.com")
        )

    eventually(established, what="the monitoring CRDs to be Established")
    yield
    k8s_cluster.run("kubectl", "delete", "-f", str(MONITORING_CRDS), "--wait=false", "--ignore-not-found")
    # Gone before the next test: a chart installed while they linger renders monitors the server then refuses.
    eventually(lambda: not any(crd.spec.group == "monitoring.coreos.com"
                               for crd in ext.list_custom_resource_definition().items),
               what="the monitoring CRDs to be deleted")


def test_helm_install_creates_the_monitors_and_alerts_where_the_crds_exist_and_the_dashboard_config_map(
    k8s_cluster: Cluster, k8s_api: client.ApiClient, k8s_namespace: str, checkpointpolicy_crd: str,
    monitoring_crds: None,
) -> None:
    release = f"r{uuid.uuid4().hex[:6]}"
    custom = client.CustomObjectsApi(k8s_api)
    try:
        k8s_cluster.run("helm", "install", release, str(CHART), "--namespace", k8s_namespace, "--skip-crds")
        for plural in ("podmonitors", "servicemonitors", "prometheusrules"):
            listed = custom.list_namespaced_custom_object("monitoring.coreos.com", "v1", k8s_namespace, plural)
            assert [m["metadata"]["name"] for m in listed["items"]], f"helm install created no {plural}"
        dashboard = client.CoreV1Api(k8s_api).read_namespaced_config_map(f"{release}-stowaway-dashboard",
                                                                         k8s_namespace)
        assert dashboard.metadata.labels["grafana_dashboard"] == "1"
        assert dashboard.data == {"stowaway-dashboard.json": DASHBOARD.read_text()}
    finally:
        k8s_cluster.run("helm", "uninstall", release, "--namespace", k8s_namespace, check=False)


# What the operator does (docs/operator.md), as `kubectl auth can-i` arguments, cluster-wide.
OPERATOR_NEEDS = [
    ("get", "checkpointpolicies.stowaway.dev"), ("list", "checkpointpolicies.stowaway.dev"),
    ("watch", "checkpointpolicies.stowaway.dev"), ("patch", "checkpointpolicies.stowaway.dev", "--subresource=status"),
    ("get", "persistentvolumeclaims"), ("list", "pods"), ("watch", "pods"),
    ("list", "customresourcedefinitions.apiextensions.k8s.io"),
    ("watch", "customresourcedefinitions.apiextensions.k8s.io"),
]
# What it must never be able to do, even if compromised: change what users declared, read secrets, run code in
# pods, or rewrite admission (in its own TLS mode, only its webhook's caBundle: tls_permissions).
OPERATOR_MUST_NOT = [
    ("patch", "checkpointpolicies.stowaway.dev"), ("delete", "checkpointpolicies.stowaway.dev"),
    ("create", "pods"), ("delete", "pods"), ("patch", "pods"), ("create", "pods", "--subresource=exec"),
    ("get", "secrets"), ("list", "secrets"), ("create", "serviceaccounts", "--subresource=token"),
    ("patch", "mutatingwebhookconfigurations.admissionregistration.k8s.io"),
    ("create", "validatingwebhookconfigurations.admissionregistration.k8s.io"),
    ("update", "customresourcedefinitions.apiextensions.k8s.io"), ("delete", "persistentvolumeclaims"),
    ("create", "clusterrolebindings.rbac.authorization.k8s.io"), ("escalate", "clusterroles.rbac.authorization.k8s.io"),
    ("impersonate", "users"),
]


WEBHOOKS = "mutatingwebhookconfigurations.admissionregistration.k8s.io"


def tls_permissions(release: str, namespace: str) -> tuple[list[tuple[str, ...]], list[tuple[str, ...]]]:
    """webhook.tls.mode=operator: what the operator needs for its certificate, and the neighbours it must not touch.

    Its one Secret, in its own namespace only, read and updated but never created (the chart creates it), listed,
    watched or deleted; its one webhook configuration's caBundle, and no other admission configuration.
    """
    secret, configuration = f"secrets/{release}-stowaway-webhook-tls", f"{WEBHOOKS}/{release}-stowaway"
    needs = [("get", secret, "-n", namespace), ("update", secret, "-n", namespace),
             ("get", configuration), ("patch", configuration)]
    must_not = [
        ("create", "secrets", "-n", namespace), ("list", "secrets", "-n", namespace),
        ("watch", "secrets", "-n", namespace), ("delete", secret, "-n", namespace),
        ("get", "secrets/other", "-n", namespace), ("update", "secrets/other", "-n", namespace),
        ("get", secret, "-n", "default"), ("update", secret, "-n", "kube-system"),
        ("patch", f"{WEBHOOKS}/other"), ("get", f"{WEBHOOKS}/other"), ("delete", configuration),
        ("create", WEBHOOKS), ("list", WEBHOOKS),
        ("patch", f"validatingwebhookconfigurations.admissionregistration.k8s.io/{release}-stowaway"),
    ]
    return needs, must_not


@pytest.mark.parametrize("mode", ["selfSigned", "operator"])
def test_the_operators_service_account_can_do_what_it_needs_and_nothing_it_must_not(
    k8s_cluster: Cluster, k8s_namespace: str, checkpointpolicy_crd: str, mode: str
) -> None:
    release = f"r{uuid.uuid4().hex[:6]}"
    identity = f"system:serviceaccount:{k8s_namespace}:{release}-stowaway"
    needs, must_not = tls_permissions(release, k8s_namespace) if mode == "operator" else ([], [])
    try:
        k8s_cluster.run("helm", "install", release, str(CHART), "--namespace", k8s_namespace, "--skip-crds",
                        "--set", f"webhook.tls.mode={mode}")

        def can(*check: str) -> bool:
            scope = () if "-n" in check else ("--all-namespaces",)
            result = k8s_cluster.run("kubectl", "auth", "can-i", *check, *scope, "--as", identity, check=False)
            assert result.stdout.strip() in ("yes", "no"), result.stdout + result.stderr
            return result.stdout.strip() == "yes"

        assert [check for check in [*OPERATOR_NEEDS, *needs] if not can(*check)] == []
        assert [check for check in [*OPERATOR_MUST_NOT, *must_not] if can(*check)] == []
    finally:
        k8s_cluster.run("helm", "uninstall", release, "--namespace", k8s_namespace, check=False)


def test_helm_test_pod_checks_the_webhooks_tls_with_the_ca_the_webhook_trusts(k8s_cluster: Cluster) -> None:
    rendered = render(k8s_cluster)  # render() does not skip tests, as `helm test` would create them
    (pod,) = [d for d in rendered if (d["metadata"].get("annotations") or {}).get("helm.sh/hook") == "test"]
    (secret,) = [d for d in rendered if d["kind"] == "Secret"]
    (container,) = pod["spec"]["containers"]
    assert pod["spec"]["volumes"] == [{"name": "webhook-tls", "secret": {"secretName": secret["metadata"]["name"]}}]
    assert "cafile=\"/etc/stowaway/webhook-tls/ca.crt\"" in container["command"][-1]
    assert pod["spec"]["securityContext"]["runAsNonRoot"]
    assert container["securityContext"]["readOnlyRootFilesystem"]


def test_the_charts_pods_meet_the_restricted_pod_security_standard(
    k8s_cluster: Cluster, k8s_api: client.ApiClient, k8s_namespace: str
) -> None:
    """A namespace enforcing "restricted" admits the operator's pod and the helm test's pod.

    Each pod is created with a server-side dry run, so PodSecurity judges it
    as it would the real one (a Deployment alone is only warned about).
    """
    core = client.CoreV1Api(k8s_api)
    core.patch_namespace(k8s_namespace, {"metadata": {"labels": {"pod-security.kubernetes.io/enforce": "restricted"}}})
    rendered = render(k8s_cluster)
    pods = [d["spec"]["template"] for d in rendered if d["kind"] == "Deployment"]
    pods += [d for d in rendered if d["kind"] == "Pod"]
    assert len(pods) == 2, [d["kind"] for d in rendered]
    refused = []
    for pod in pods:
        # The ServiceAccount lives in the release's namespace, not this one; PodSecurity does not look at it.
        spec = {key: value for key, value in pod["spec"].items() if key != "serviceAccountName"}
        try:
            core.create_namespaced_pod(k8s_namespace, {"metadata": {"generateName": "pss-"}, "spec": spec},
                                       dry_run="All")
        except ApiException as exc:
            refused.append(json.loads(exc.body)["message"])
    assert refused == []
