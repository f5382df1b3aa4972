"""The API server itself rejects bad CheckpointPolicy objects, with messages a user understands."""

from __future__ import annotations

import json
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from .cluster import Cluster
from .operator_fixtures import create_policy
from .wait import eventually

pytestmark = pytest.mark.k8s


def rejection(api: client.ApiClient, namespace: str, spec: dict[str, Any]) -> str:
    body = {"apiVersion": "stowaway.dev/v1alpha1", "kind": "CheckpointPolicy", "metadata": {"name": "bad"},
            "spec": spec}

    def attempt() -> str:
        try:
            client.CustomObjectsApi(api).create_namespaced_custom_object(
                "stowaway.dev", "v1alpha1", namespace, "checkpointpolicies", body)
        except ApiException as exc:
            if exc.status == 404:  # CRD not routable yet
                raise
            assert exc.status == 422, exc.body
            return json.loads(exc.body)["message"]
        pytest.fail(f"the server accepted {spec}")

    return eventually(attempt, what="the server to answer the create")


CLAIM = {"persistentVolumeClaim": {"claimName": "ckpts"}}


@pytest.mark.parametrize(
    ("spec", "says"),
    [
        ({}, "spec.storage: Required value"),
        ({"storage": {}}, "storage needs a backend: set storage.persistentVolumeClaim.claimName, storage.bucket.url, "
                          "or both"),
        ({"storage": {"persistentVolumeClaim": {"claimName": "c", "subPath": "/abs"}}},
         "subPath must be relative to the claim's root"),
        ({"storage": {"persistentVolumeClaim": {"claimName": "c", "subPath": "a/../../etc"}}},
         "subPath must stay inside the claim"),
        ({"storage": CLAIM, "sharedMemory": {"sizeLimit": "lots"}}, "sizeLimit must be a quantity of at least 64Mi"),
        ({"storage": CLAIM, "sharedMemory": {"sizeLimit": "1Mi"}}, "sizeLimit must be a quantity of at least 64Mi"),
        ({"storage": CLAIM, "sharedMemory": {"pooledSpares": 9}}, "spec.sharedMemory.pooledSpares: Invalid value: 9"),
        ({"storage": CLAIM, "retention": {"keepLast": 0}}, "spec.retention.keepLast: Invalid value: 0"),
        ({"storage": CLAIM, "sidecar": {"metricsPort": 80}}, "spec.sidecar.metricsPort: Invalid value: 80"),
        ({"storage": CLAIM, "persistence": {"checksum": "md5"}}, 'supported values: "xxh3-64"'),
    ],
)
def test_server_rejects_a_bad_policy_with_a_readable_message(
    k8s_api: client.ApiClient, k8s_namespace: str, checkpointpolicy_crd: str, spec: dict[str, Any], says: str
) -> None:
    assert says in rejection(k8s_api, k8s_namespace, spec)


def test_kubectl_get_ckpol_shows_the_printer_columns(
    k8s_cluster: Cluster, k8s_api: client.ApiClient, k8s_namespace: str, checkpointpolicy_crd: str
) -> None:
    create_policy(k8s_api, k8s_namespace)
    table = k8s_cluster.run("kubectl", "get", "ckpol", "-n", k8s_namespace).stdout.split("\n")[0].split()
    assert table == ["NAME", "CLAIM", "BUCKET", "SHM", "KEEP", "READY", "PODS", "AGE"]
