"""The harness: helm installs and uninstalls a minimal chart of the tests' own against the test cluster.

Stowaway's chart is installed by tests/k8s/test_operator_manifests.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from kubernetes import client

from .cluster import Cluster

pytestmark = pytest.mark.k8s

CHART = Path(__file__).with_name("charts") / "minimal"


def _release_objects(api: client.CoreV1Api, namespace: str, release: str) -> set[str]:
    selector = f"app.kubernetes.io/instance={release}"
    maps = api.list_namespaced_config_map(namespace, label_selector=selector).items
    services = api.list_namespaced_service(namespace, label_selector=selector).items
    return {f"configmap/{m.metadata.name}" for m in maps} | {f"service/{s.metadata.name}" for s in services}


def test_the_harness_helm_installs_a_charts_objects_and_uninstall_removes_them(
    k8s_cluster: Cluster, k8s_api: client.ApiClient, k8s_namespace: str
) -> None:
    core = client.CoreV1Api(k8s_api)
    release = "minimal"
    k8s_cluster.run(
        "helm",
        "install",
        release,
        str(CHART),
        "--namespace",
        k8s_namespace,
        "--set",
        "greeting=hi",
        "--wait",
        "--timeout",
        "60s",
    )
    assert _release_objects(core, k8s_namespace, release) == {
        "configmap/minimal-config",
        "service/minimal-svc",
    }
    config_map = core.read_namespaced_config_map("minimal-config", k8s_namespace)
    assert config_map.data == {"greeting": "hi"}
    service = core.read_namespaced_service("minimal-svc", k8s_namespace)
    assert service.spec.cluster_ip  # allocated by the real API server

    listed = k8s_cluster.run("helm", "list", "--namespace", k8s_namespace, "--short").stdout
    assert listed.split() == [release]

    k8s_cluster.run("helm", "uninstall", release, "--namespace", k8s_namespace, "--wait")
    assert _release_objects(core, k8s_namespace, release) == set()
    listed = k8s_cluster.run("helm", "list", "--namespace", k8s_namespace, "--short").stdout
    assert listed.split() == []
