"""The harness: pods of the test cluster are scheduled by the real scheduler and run on (fake) nodes."""

from __future__ import annotations

import pytest
from kubernetes import client

from .wait import eventually

pytestmark = pytest.mark.k8s


def test_the_harness_schedules_a_pod_onto_a_fake_node_that_reports_its_container_ready(
    k8s_api: client.ApiClient, k8s_nodes: list[str], k8s_namespace: str
) -> None:
    core = client.CoreV1Api(k8s_api)
    core.create_namespaced_pod(
        k8s_namespace,
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "sleeper"},
            "spec": {
                "containers": [{"name": "pause", "image": "registry.k8s.io/pause:3.10"}],
                "terminationGracePeriodSeconds": 0,
            },
        },
    )

    def running() -> client.V1Pod | None:
        pod = core.read_namespaced_pod("sleeper", k8s_namespace)
        return pod if pod.status.phase == "Running" else None

    pod = eventually(running, what="pod sleeper to be Running", timeout=90)
    assert pod.spec.node_name in k8s_nodes
    assert pod.status.pod_ip
    assert [(c.name, c.ready) for c in pod.status.container_statuses or []] == [("pause", True)]
