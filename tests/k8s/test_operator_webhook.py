"""The real API server calls the operator's webhook over TLS and stores what it injects."""

from __future__ import annotations

import pytest
from kubernetes import client

from stowaway.operator import injection

from .operator_fixtures import (
    SIDECAR_IMAGE,
    RunningOperator,
    create_policy,
    denial,
    read_policy,
    ready_condition,
    training_pod,
)
from .wait import eventually

pytestmark = pytest.mark.k8s


def test_a_good_policy_goes_ready_with_observed_generation(k8s_api: client.ApiClient, ready_policy: str) -> None:
    policy = read_policy(k8s_api, ready_policy)
    assert policy["status"]["observedGeneration"] == policy["metadata"]["generation"]
    assert ready_condition(k8s_api, ready_policy)["reason"] == "Valid"
    # The server filled in the CRD's defaults the injection relies on.
    assert policy["spec"]["retention"] == {"keepLast": 3, "keepEvery": 0}
    assert policy["spec"]["sidecar"]["native"] is True
    assert policy["spec"]["sidecar"]["gracePeriodSeconds"] == 120
    assert policy["spec"]["persistence"] == {"concurrency": 4, "directIO": True, "checksum": "xxh3-64"}
    assert policy["spec"]["alerting"] == {"staleAfterSeconds": 7200}


def test_a_policy_whose_claim_is_missing_is_not_ready_and_says_why(
    k8s_api: client.ApiClient, k8s_namespace: str, stowaway_operator: RunningOperator
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
    assert stored_dict["metadata"]["labels"][injection.JOB_LABEL] == "train"  # the PodMonitor's `job`
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


def test_a_pod_bringing_its_own_container_of_the_sidecars_name_is_refused(
    k8s_api: client.ApiClient, ready_policy: str
) -> None:
    pod = training_pod()
    pod["spec"]["initContainers"] = [
        {"name": injection.SIDECAR_NAME, "image": SIDECAR_IMAGE, "restartPolicy": "Always"},
    ]
    message = denial(k8s_api, ready_policy, pod)
    assert f"a container named {injection.SIDECAR_NAME}, a name reserved for the sidecar" in message
    assert f"but not the annotation {injection.MARKER_ANNOTATION}" in message


def test_a_copy_of_an_injected_pod_is_stored_as_it_is_unless_its_trainer_mounts_the_claim(
    k8s_api: client.ApiClient, ready_policy: str
) -> None:
    core = client.CoreV1Api(k8s_api)
    injected = k8s_api.sanitize_for_serialization(core.create_namespaced_pod(ready_policy, training_pod()))
    copy = {"metadata": {key: injected["metadata"][key] for key in ("generateName", "labels", "annotations")},
            "spec": injected["spec"]}
    stored = core.create_namespaced_pod(ready_policy, copy)
    assert [c.name for c in stored.spec.init_containers] == [injection.SIDECAR_NAME]  # not injected twice
    assert [v.name for v in stored.spec.volumes] == [v["name"] for v in injected["spec"]["volumes"]]

    copy["spec"]["containers"][0]["volumeMounts"].append({"name": injection.STORAGE_VOLUME, "mountPath": "/ckpts"})
    message = denial(k8s_api, ready_policy, copy)
    assert f"container 'trainer' mounts the CheckpointPolicy's storage claim 'ckpts' (volume " \
        f"'{injection.STORAGE_VOLUME}')" in message


def test_a_missing_policy_is_an_admission_error_that_names_it(k8s_api: client.ApiClient, ready_policy: str) -> None:
    message = denial(k8s_api, ready_policy, training_pod(**{injection.POLICY_ANNOTATION: "no-such-policy"}))
    assert "CheckpointPolicy 'no-such-policy' not found" in message


def test_a_pod_forging_the_injected_marker_without_the_sidecar_is_refused(
    k8s_api: client.ApiClient, ready_policy: str
) -> None:
    message = denial(k8s_api, ready_policy, training_pod(**{injection.MARKER_ANNOTATION: "default"}))
    assert f"carries the annotation {injection.MARKER_ANNOTATION}, which only the Stowaway webhook sets" in message
    assert f"no {injection.SIDECAR_NAME} container" in message


def test_a_pod_mounting_the_policys_claim_into_its_trainer_is_refused(
    k8s_api: client.ApiClient, ready_policy: str
) -> None:
    pod = training_pod()
    pod["spec"]["volumes"] = [{"name": "mine", "persistentVolumeClaim": {"claimName": "ckpts"}}]
    pod["spec"]["containers"][0]["volumeMounts"] = [{"name": "mine", "mountPath": "/ckpts"}]
    message = denial(k8s_api, ready_policy, pod)
    assert "container 'trainer' mounts the CheckpointPolicy's storage claim 'ckpts' (volume 'mine')" in message
    assert "only the Stowaway sidecar may write it" in message


def test_pods_injected_follows_pods_as_they_are_created_and_deleted(
    k8s_api: client.ApiClient, ready_policy: str
) -> None:
    core = client.CoreV1Api(k8s_api)

    def pods_injected() -> int | None:
        return (read_policy(k8s_api, ready_policy).get("status") or {}).get("podsInjected")

    assert pods_injected() == 0
    names = [core.create_namespaced_pod(ready_policy, training_pod()).metadata.name for _ in range(2)]
    eventually(lambda: pods_injected() == 2, what="status.podsInjected to count both new pods")
    core.create_namespaced_pod(ready_policy, training_pod(labelled=False))  # not injected: not counted
    core.delete_namespaced_pod(names[0], ready_policy, grace_period_seconds=0)
    eventually(lambda: pods_injected() == 1, what="status.podsInjected to drop the deleted pod")
    assert read_policy(k8s_api, ready_policy)["metadata"]["generation"] == 1  # no spec change drove the updates


def test_a_policy_turning_direct_io_off_is_ready_and_its_sidecar_writes_buffered(
    k8s_api: client.ApiClient, ready_policy: str
) -> None:
    create_policy(k8s_api, ready_policy, "buffered", persistence={"directIO": False})
    eventually(lambda: (ready_condition(k8s_api, ready_policy, "buffered") or {}).get("status") == "True",
               what="CheckpointPolicy buffered to be Ready")
    pod = training_pod(**{injection.POLICY_ANNOTATION: "buffered"})
    (sidecar,) = client.CoreV1Api(k8s_api).create_namespaced_pod(ready_policy, pod).spec.init_containers
    assert sidecar.command[-1] == "--no-direct-io"


def test_a_pod_meeting_the_restricted_pod_security_standard_still_meets_it_once_injected(
    k8s_api: client.ApiClient, ready_policy: str
) -> None:
    core = client.CoreV1Api(k8s_api)
    core.patch_namespace(ready_policy, {"metadata": {"labels": {"pod-security.kubernetes.io/enforce": "restricted"}}})
    pod = training_pod()
    # Set per container, as many charts do, rather than once for the pod: every container must then carry it.
    pod["spec"]["containers"][0]["securityContext"] = {
        "runAsNonRoot": True, "runAsUser": 1000, "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"]}, "seccompProfile": {"type": "RuntimeDefault"},
    }
    unlabelled = {**pod, "metadata": {**pod["metadata"], "labels": {"batch.kubernetes.io/job-name": "train"}}}
    assert core.create_namespaced_pod(ready_policy, unlabelled).spec.init_containers is None, "the pod alone complies"
    stored = core.create_namespaced_pod(ready_policy, pod)
    assert [c.name for c in stored.spec.init_containers] == [injection.SIDECAR_NAME]


def test_a_pod_with_its_own_memory_dev_shm_is_stored_with_the_sidecars_volume_in_its_place(
    k8s_api: client.ApiClient, ready_policy: str
) -> None:
    pod = training_pod()
    pod["spec"]["volumes"] = [{"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "1Gi"}}]
    pod["spec"]["containers"][0]["volumeMounts"] = [{"name": "dshm", "mountPath": "/dev/shm"}]
    stored = client.CoreV1Api(k8s_api).create_namespaced_pod(ready_policy, pod)
    volumes = {v.name: v for v in stored.spec.volumes}
    assert "dshm" not in volumes
    # The policy's 2Gi for the slots, plus the 1Gi the pod had there.
    assert volumes[injection.SHM_VOLUME].empty_dir.size_limit == str(3 * 2**30)
    (trainer,) = stored.spec.containers
    assert [m.name for m in trainer.volume_mounts if m.mount_path == "/dev/shm"] == [injection.SHM_VOLUME]


def test_a_policy_with_a_bucket_tier_is_ready_and_its_sidecar_gets_the_bucket_and_the_secrets_keys(
    k8s_api: client.ApiClient, ready_policy: str
) -> None:
    create_policy(k8s_api, ready_policy, "tiered", storage={
        "persistentVolumeClaim": {"claimName": "ckpts"},
        "bucket": {"url": "s3://ckpts/team-a", "endpoint": "http://s3.storage:8333", "credentialsSecret": "s3-keys",
                   "retention": {"keepEvery": 1000}},
    })
    eventually(lambda: (ready_condition(k8s_api, ready_policy, "tiered") or {}).get("status") == "True",
               what="CheckpointPolicy tiered to be Ready")
    # The API server filled in the bucket's defaults, which the injection relies on.
    stored = read_policy(k8s_api, ready_policy, "tiered")["spec"]["storage"]["bucket"]
    assert stored["retention"] == {"keepLast": 3, "keepEvery": 1000}
    assert (stored["region"], stored["virtualHostedStyle"]) == ("", False)
    pod = training_pod(**{injection.POLICY_ANNOTATION: "tiered"})
    (sidecar,) = client.CoreV1Api(k8s_api).create_namespaced_pod(ready_policy, pod).spec.init_containers
    command = sidecar.command
    assert command[command.index("--bucket"):] == [
        "--bucket", "s3://ckpts/team-a", "--bucket-endpoint", "http://s3.storage:8333",
        "--bucket-keep-last", "3", "--bucket-keep-every", "1000"]
    keys = {e.name: e.value_from.secret_key_ref.name for e in sidecar.env if e.value_from and
            e.value_from.secret_key_ref}
    assert keys == dict.fromkeys(("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"), "s3-keys")


def test_a_policy_with_a_bucket_alone_is_ready_and_its_sidecar_stores_there_without_a_claim(
    k8s_api: client.ApiClient, ready_policy: str
) -> None:
    create_policy(k8s_api, ready_policy, "bucket-only", storage={
        "bucket": {"url": "s3://ckpts/team-b", "endpoint": "http://s3.storage:8333", "credentialsSecret": "s3-keys"},
    })
    eventually(lambda: (ready_condition(k8s_api, ready_policy, "bucket-only") or {}).get("status") == "True",
               what="CheckpointPolicy bucket-only to be Ready")
    assert "bucket 's3://ckpts/team-b' (no claim" in ready_condition(k8s_api, ready_policy, "bucket-only")["message"]
    pod = training_pod(**{injection.POLICY_ANNOTATION: "bucket-only"})
    stored = client.CoreV1Api(k8s_api).create_namespaced_pod(ready_policy, pod)
    (sidecar,) = stored.spec.init_containers
    assert "--storage" not in sidecar.command
    assert sidecar.command[sidecar.command.index("--bucket") + 1] == "s3://ckpts/team-b"
    assert not [v for v in stored.spec.volumes if v.persistent_volume_claim], "no claim is mounted"
    assert injection.STORAGE_VOLUME not in {m.name for m in sidecar.volume_mounts}


def test_a_bucket_url_that_is_not_s3_is_refused_by_the_api_server(
    k8s_api: client.ApiClient, ready_policy: str
) -> None:
    with pytest.raises(client.ApiException) as refused:
        create_policy(k8s_api, ready_policy, "bad-bucket", storage={
            "persistentVolumeClaim": {"claimName": "ckpts"}, "bucket": {"url": "gs://ckpts"}})
    assert "spec.storage.bucket.url" in refused.value.body
