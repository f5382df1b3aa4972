"""The real API server calls the operator's webhook over TLS and stores what it injects."""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from stowaway.operator import injection

from .operator_fixtures import SIDECAR_IMAGE, checkpointpolicy_crd, stowaway_operator  # noqa: F401
from .wait import eventually

pytestmark = pytest.mark.k8s


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
def ready_policy(k8s_api: client.ApiClient, k8s_namespace: str, stowaway_operator: Path) -> str:  # noqa: F811
    create_bound_claim(k8s_api, k8s_namespace)
    create_policy(k8s_api, k8s_namespace, sharedMemory={"sizeLimit": "2Gi"})
    eventually(lambda: (ready_condition(k8s_api, k8s_namespace) or {}).get("status") == "True",
               what="CheckpointPolicy default to be Ready")
    return k8s_namespace


def test_a_good_policy_goes_ready_with_observed_generation(k8s_api: client.ApiClient, ready_policy: str) -> None:
    policy = read_policy(k8s_api, ready_policy)
    assert policy["status"]["observedGeneration"] == policy["metadata"]["generation"]
    assert ready_condition(k8s_api, ready_policy)["reason"] == "Valid"
    # The server filled in the CRD's defaults the injection relies on.
    assert policy["spec"]["retention"] == {"keepLast": 3, "keepEvery": 0}
    assert policy["spec"]["sidecar"]["native"] is True


def test_a_policy_whose_claim_is_missing_is_not_ready_and_says_why(
    k8s_api: client.ApiClient, k8s_namespace: str, stowaway_operator: Path  # noqa: F811
) -> None:
    create_policy(k8s_api, k8s_namespace)
    condition = eventually(lambda: ready_condition(k8s_api, k8s_namespace), what="a Ready condition")
    assert (condition["status"], condition["reason"]) == ("False", "ClaimNotFound")
    assert "'ckpts' does not exist" in condition["message"]


def test_a_labelled_pod_is_stored_with_the_sidecar_volumes_mounts_and_env_and_runs_on_a_node(
    k8s_api: client.ApiClient, ready_policy: str, k8s_nodes: list[str]
) -> None:
    core = client.CoreV1Api(k8s_api)
    submitted = training_pod()
    stored = core.create_namespaced_pod(ready_policy, submitted)
    stored_dict = k8s_api.sanitize_for_serialization(stored)
    expected = injection.build_patch(
        {**submitted, "metadata": {**submitted["metadata"], "namespace": ready_policy}}, "default",
        read_policy(k8s_api, ready_policy)["spec"], SIDECAR_IMAGE,
    )
    assert stored_dict["metadata"]["annotations"] == {injection.MARKER_ANNOTATION: "default"}
    assert stored_dict["spec"]["volumes"] == expected["spec"]["volumes"]
    (sidecar,) = stored_dict["spec"]["initContainers"]
    want = expected["spec"]["initContainers"][0]
    for key in ("name", "image", "command", "env", "ports", "resources", "volumeMounts", "restartPolicy",
                "securityContext"):
        assert sidecar[key] == want[key], key
    assert sidecar["startupProbe"]["exec"] == want["startupProbe"]["exec"]
    (trainer,) = stored_dict["spec"]["containers"]
    assert trainer["env"] == expected["spec"]["containers"][0]["env"]
    assert trainer["volumeMounts"] == expected["spec"]["containers"][0]["volumeMounts"]
    assert {"name": "STOWAWAY_JOB", "value": "train"} in trainer["env"]

    name = stored.metadata.name
    running = eventually(lambda: core.read_namespaced_pod(name, ready_policy).status.phase in ("Running", "Succeeded"),
                         what=f"pod {name} to run on a kwok node")
    assert running
    assert core.read_namespaced_pod(name, ready_policy).spec.node_name in k8s_nodes


def test_an_unlabelled_pod_is_stored_unchanged(k8s_api: client.ApiClient, ready_policy: str) -> None:
    stored = client.CoreV1Api(k8s_api).create_namespaced_pod(ready_policy, training_pod(labelled=False))
    assert stored.spec.init_containers is None
    assert stored.spec.volumes is None
    assert [c.name for c in stored.spec.containers] == ["trainer"]
    assert stored.metadata.annotations is None
    assert [e.name for e in stored.spec.containers[0].env] == ["EPOCHS"]


def test_a_pod_that_already_carries_the_sidecar_is_not_injected_twice(
    k8s_api: client.ApiClient, ready_policy: str
) -> None:
    pod = training_pod()
    pod["spec"]["initContainers"] = [
        {"name": injection.SIDECAR_NAME, "image": SIDECAR_IMAGE, "restartPolicy": "Always"},
    ]
    stored = client.CoreV1Api(k8s_api).create_namespaced_pod(ready_policy, pod)
    assert [c.name for c in stored.spec.init_containers] == [injection.SIDECAR_NAME]
    assert stored.spec.volumes is None


def test_a_missing_policy_is_an_admission_error_that_names_it(k8s_api: client.ApiClient, ready_policy: str) -> None:
    pod = training_pod(**{injection.POLICY_ANNOTATION: "no-such-policy"})
    with pytest.raises(ApiException) as caught:
        client.CoreV1Api(k8s_api).create_namespaced_pod(ready_policy, pod)
    message = json.loads(caught.value.body)["message"]
    assert "admission webhook \"inject.stowaway.dev\" denied the request" in message
    assert "CheckpointPolicy 'no-such-policy' not found" in message
