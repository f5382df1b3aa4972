"""The pure injection builder: what an opted-in Pod gets, and what it never gets twice."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stowaway.operator import injection, policy
from stowaway.protocol import messages

IMAGE = "stowaway:test"


def policy_spec(**overrides: Any) -> dict[str, Any]:
    """A spec as the API server stores it, with every CRD default filled in."""
    spec: dict[str, Any] = {
        "storage": {"persistentVolumeClaim": {"claimName": "ckpts", "subPath": ""}},
        "retention": {"keepLast": 3, "keepEvery": 0},
        "sharedMemory": {"sizeLimit": "8Gi", "slotsPerRank": 2},
        "sidecar": {"image": "", "resources": {"requests": {"cpu": "100m"}}, "metricsPort": 9464, "native": True,
                    "gracePeriodSeconds": 120},
        "persistence": {"concurrency": 4, "directIO": True, "checksum": "xxh3-64"},
        "commitTimeoutSeconds": 600,
        "alerting": {"staleAfterSeconds": 7200},
    }
    for key, value in overrides.items():
        spec[key] = {**spec[key], **value} if isinstance(value, dict) else value
    return spec


def job_pod(**spec: Any) -> dict[str, Any]:
    return {
        "metadata": {
            "generateName": "train-",
            "namespace": "ml",
            "labels": {"stowaway.dev/inject": "enabled", "batch.kubernetes.io/job-name": "train"},
        },
        "spec": {"containers": [{"name": "trainer", "image": "pytorch"}], **spec},
    }


def applied(pod: dict[str, Any], fragment: dict[str, Any]) -> dict[str, Any]:
    """The pod after a merge-patch fragment (lists replaced whole, dicts merged)."""
    result = copy.deepcopy(pod)

    def merge(into: dict[str, Any], patch: dict[str, Any]) -> None:
        for key, value in patch.items():
            if isinstance(value, dict) and isinstance(into.get(key), dict):
                merge(into[key], value)
            else:
                into[key] = copy.deepcopy(value)

    merge(result, fragment)
    return result


def injected(pod: dict[str, Any] | None = None, spec: dict[str, Any] | None = None) -> dict[str, Any]:
    pod = job_pod() if pod is None else pod
    return applied(pod, injection.build_patch(pod, "default", spec or policy_spec(), IMAGE))


def test_native_sidecar_is_the_first_init_container_with_restart_always_and_a_socket_startup_probe() -> None:
    sidecar = injected()["spec"]["initContainers"][0]
    assert sidecar["name"] == "stowaway-sidecar"
    assert sidecar["restartPolicy"] == "Always"
    assert sidecar["startupProbe"]["exec"]["command"] == ["test", "-S", "/var/run/stowaway/sidecar/sidecar.sock"]
    assert sidecar["image"] == IMAGE


def test_sidecar_command_carries_every_policy_setting() -> None:
    spec = policy_spec(retention={"keepLast": 5, "keepEvery": 100}, commitTimeoutSeconds=30,
                       persistence={"concurrency": 8}, sidecar={"metricsPort": 9999},
                       alerting={"staleAfterSeconds": 21600})
    command = injected(spec=spec)["spec"]["initContainers"][0]["command"]
    assert command == [
        "stowaway", "sidecar", "--storage", "/var/lib/stowaway/storage",
        "--socket", "/var/run/stowaway/sidecar/sidecar.sock",
        "--shm-dir", "/dev/shm/stowaway", "--keep-last", "5", "--keep-every", "100", "--commit-timeout", "30",
        "--stale-after", "21600", "--persist-workers", "8", "--metrics-port", "9999", "--grace-period", "120",
    ]


def test_direct_io_is_the_sidecars_default_and_a_policy_turning_it_off_adds_no_direct_io() -> None:
    assert "--no-direct-io" not in injected()["spec"]["initContainers"][0]["command"]
    command = injected(spec=policy_spec(persistence={"directIO": False}))["spec"]["initContainers"][0]["command"]
    assert command.count("--no-direct-io") == 1
    assert command[-1] == "--no-direct-io"


def test_the_pod_grace_period_leaves_the_sidecar_its_own_and_a_longer_one_is_kept() -> None:
    spec = policy_spec(sidecar={"gracePeriodSeconds": 300})
    pod = injected(spec=spec)
    assert pod["spec"]["initContainers"][0]["command"][-2:] == ["--grace-period", "300"]
    assert pod["spec"]["terminationGracePeriodSeconds"] == 315
    assert injected(job_pod(terminationGracePeriodSeconds=900), spec)["spec"]["terminationGracePeriodSeconds"] == 900
    assert injected(spec=policy_spec(sidecar={"gracePeriodSeconds": 10}))["spec"].get(
        "terminationGracePeriodSeconds") is None, "the default 30 s already covers a 10 s grace period"


def test_a_trainer_mounting_a_reserved_volume_name_it_did_not_declare_is_refused() -> None:
    pod = job_pod()
    pod["spec"]["containers"][0]["volumeMounts"] = [{"name": "stowaway-storage", "mountPath": "/steal"}]
    with pytest.raises(injection.InjectionError, match="'stowaway-storage', a name reserved for the Stowaway"):
        injection.build_patch(pod, "default", policy_spec(), IMAGE)


def test_sidecar_is_non_root_read_only_without_capabilities_confined_and_knows_its_node() -> None:
    sidecar = injected()["spec"]["initContainers"][0]
    assert sidecar["securityContext"] == {
        "runAsUser": 65532, "runAsGroup": 65532,
        "runAsNonRoot": True, "readOnlyRootFilesystem": True, "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"]}, "seccompProfile": {"type": "RuntimeDefault"},
    }
    node = {"fieldRef": {"apiVersion": "v1", "fieldPath": "spec.nodeName"}}
    assert sidecar["env"] == [{"name": "NODE_NAME", "valueFrom": node}]
    assert sidecar["resources"] == {"requests": {"cpu": "100m"}}
    assert sidecar["ports"] == [{"name": "ckpt-metrics", "containerPort": 9464, "protocol": "TCP"}]


def test_policy_image_overrides_the_operator_default() -> None:
    spec = policy_spec(sidecar={"image": "mirror/stowaway:1", "imagePullPolicy": "Always"})
    sidecar = injected(spec=spec)["spec"]["initContainers"][0]
    assert (sidecar["image"], sidecar["imagePullPolicy"]) == ("mirror/stowaway:1", "Always")


def test_fallback_appends_a_plain_container_when_native_sidecars_are_off() -> None:
    pod = injected(spec=policy_spec(sidecar={"native": False}))
    assert [c["name"] for c in pod["spec"]["containers"]] == ["trainer", "stowaway-sidecar"]
    assert "restartPolicy" not in pod["spec"]["containers"][1]
    assert "initContainers" not in pod["spec"]


def test_volumes_are_memory_shm_sized_by_policy_a_small_socket_dir_and_the_claim() -> None:
    volumes = injected(spec=policy_spec(sharedMemory={"sizeLimit": "32Gi"}))["spec"]["volumes"]
    assert volumes == [
        {"name": "stowaway-shm", "emptyDir": {"medium": "Memory", "sizeLimit": "32Gi"}},
        {"name": "stowaway-socket", "emptyDir": {"medium": "Memory", "sizeLimit": "1Mi"}},
        {"name": "stowaway-storage", "persistentVolumeClaim": {"claimName": "ckpts"}},
    ]


def test_every_container_mounts_shm_and_socket_but_only_the_sidecar_mounts_storage() -> None:
    pod = job_pod(initContainers=[{"name": "fetch", "image": "busybox"}])
    pod["spec"]["containers"].append({"name": "logger", "image": "busybox"})
    spec = injected(pod)["spec"]
    for container in [*spec["initContainers"], *spec["containers"]]:
        paths = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
        assert paths["/dev/shm"] == "stowaway-shm"
        assert paths["/var/run/stowaway"] == "stowaway-socket"
        has_storage = "stowaway-storage" in paths.values()
        assert has_storage == (container["name"] == "stowaway-sidecar")


def test_storage_sub_path_is_mounted_when_set() -> None:
    spec = policy_spec(storage={"persistentVolumeClaim": {"claimName": "ckpts", "subPath": "team/a"}})
    mounts = injected(spec=spec)["spec"]["initContainers"][0]["volumeMounts"]
    assert {"name": "stowaway-storage", "mountPath": "/var/lib/stowaway/storage", "subPath": "team/a"} in mounts


def test_existing_user_volumes_mounts_and_env_are_kept() -> None:
    pod = job_pod(volumes=[{"name": "data", "emptyDir": {}}])
    pod["spec"]["containers"][0]["volumeMounts"] = [{"name": "data", "mountPath": "/data"}]
    pod["spec"]["containers"][0]["env"] = [{"name": "EPOCHS", "value": "3"}]
    spec = injected(pod)["spec"]
    trainer = spec["containers"][0]
    assert trainer["volumeMounts"][0] == {"name": "data", "mountPath": "/data"}
    assert trainer["env"][0] == {"name": "EPOCHS", "value": "3"}
    assert spec["volumes"][0] == {"name": "data", "emptyDir": {}}


def test_trainer_gets_socket_job_and_slots_environment() -> None:
    env = injected(spec=policy_spec(sharedMemory={"slotsPerRank": 3}))["spec"]["containers"][0]["env"]
    assert env == [
        {"name": "STOWAWAY_SOCKET", "value": "/var/run/stowaway/sidecar/sidecar.sock"},
        {"name": "STOWAWAY_JOB", "value": "train"},
        {"name": "STOWAWAY_SLOTS_PER_RANK", "value": "3"},
        {"name": "STOWAWAY_POOLED_SPARES", "value": "0"},
    ]
    pooled = policy_spec(sharedMemory={"slotsPerRank": 1, "pooledSpares": 1})
    env = injected(spec=pooled)["spec"]["containers"][0]["env"]
    assert {"name": "STOWAWAY_POOLED_SPARES", "value": "1"} in env


def test_environment_the_user_already_set_wins() -> None:
    pod = job_pod()
    pod["spec"]["containers"][0]["env"] = [{"name": "STOWAWAY_JOB", "value": "mine"}]
    env = injected(pod)["spec"]["containers"][0]["env"]
    assert [e["value"] for e in env if e["name"] == "STOWAWAY_JOB"] == ["mine"]


@pytest.mark.parametrize(
    ("labels", "expected"),
    [
        ({"batch.kubernetes.io/job-name": "train"}, "train"),
        ({"job-name": "legacy"}, "legacy"),
        ({"training.kubeflow.org/job-name": "ptj", "batch.kubernetes.io/job-name": "x"}, "ptj"),
        ({"jobset.sigs.k8s.io/jobset-name": "js", "batch.kubernetes.io/job-name": "js-workers-0"}, "js"),
        ({}, "train"),
    ],
)
def test_job_name_comes_from_the_owning_workload_label_else_generate_name(labels: dict[str, str],
                                                                          expected: str) -> None:
    pod = job_pod()
    pod["metadata"]["labels"] = labels
    assert injection.job_name(pod) == expected


def test_job_name_falls_back_to_the_pod_name_and_refuses_a_pod_with_nothing() -> None:
    assert injection.job_name({"metadata": {"name": "solo"}}) == "solo"
    with pytest.raises(injection.InjectionError, match="which job"):
        injection.job_name({"metadata": {}})


def test_trainer_uids_are_allowed_on_the_socket() -> None:
    pod = job_pod(securityContext={"runAsUser": 1000})
    pod["spec"]["containers"][0]["securityContext"] = {"runAsUser": 2000}
    command = injected(pod)["spec"]["initContainers"][0]["command"]
    assert command[-4:] == ["--allow-uid", "1000", "--allow-uid", "2000"]


def test_the_sidecar_runs_as_its_own_uid_whatever_uid_the_pod_gives_its_trainer() -> None:
    pod = job_pod(securityContext={"runAsUser": 1000, "runAsGroup": 1000})
    sidecar = injected(pod)["spec"]["initContainers"][0]
    assert (sidecar["securityContext"]["runAsUser"], sidecar["securityContext"]["runAsGroup"]) == (65532, 65532)


def test_a_pod_without_an_fs_group_gets_the_sidecars_group_so_both_sides_share_files() -> None:
    pod = job_pod(securityContext={"runAsUser": 1000})
    assert injected(pod)["spec"]["securityContext"] == {
        "runAsUser": 1000, "fsGroup": 65532, "fsGroupChangePolicy": "OnRootMismatch",
    }


def test_a_pod_that_chose_its_fs_group_and_change_policy_keeps_them() -> None:
    pod = job_pod(securityContext={"fsGroup": 2000, "fsGroupChangePolicy": "Always"})
    assert injected(pod)["spec"]["securityContext"] == {"fsGroup": 2000, "fsGroupChangePolicy": "Always"}
    assert "securityContext" not in injection.build_patch(pod, "default", policy_spec(), IMAGE)["spec"]


def test_the_sidecar_keeps_slots_and_socket_in_subdirectories_of_the_world_writable_volumes() -> None:
    command = injected()["spec"]["initContainers"][0]["command"]
    assert command[command.index("--shm-dir") + 1] == "/dev/shm/stowaway"
    assert command[command.index("--socket") + 1] == "/var/run/stowaway/sidecar/sidecar.sock"


def test_marker_annotation_names_the_policy() -> None:
    pod = job_pod()
    pod["metadata"]["annotations"] = {"team": "a"}
    fragment = injection.build_patch(pod, "fast", policy_spec(), IMAGE)
    assert applied(pod, fragment)["metadata"]["annotations"] == {"team": "a", "stowaway.dev/injected": "fast"}


def test_reinvocation_on_an_injected_pod_injects_nothing() -> None:
    once = injected()
    assert injection.build_patch(once, "default", policy_spec(), IMAGE) == {}


@pytest.mark.parametrize("where", ["containers", "initContainers"])
def test_a_pod_bringing_its_own_container_of_the_sidecars_name_without_the_marker_is_refused(where: str) -> None:
    pod = job_pod()
    pod["spec"].setdefault(where, []).append({"name": "stowaway-sidecar", "image": IMAGE})
    with pytest.raises(injection.InjectionError, match=r"a container named stowaway-sidecar, a name reserved for the "
                       r"sidecar the Stowaway webhook injects, but not the annotation stowaway\.dev/injected"):
        injection.build_patch(pod, "default", policy_spec(), IMAGE)


def test_a_copy_of_an_injected_pod_whose_trainer_mounts_the_claim_is_refused() -> None:
    edited = injected()
    edited["spec"]["containers"][0]["volumeMounts"].append({"name": "stowaway-storage", "mountPath": "/ckpts"})
    with pytest.raises(injection.InjectionError, match="'trainer' mounts the CheckpointPolicy's storage claim 'ckpts' "
                       r"\(volume 'stowaway-storage'\)"):
        injection.build_patch(edited, "default", policy_spec(), IMAGE)


def test_a_pod_carrying_the_marker_without_the_sidecar_is_refused() -> None:
    pod = job_pod()
    pod["metadata"]["annotations"] = {"stowaway.dev/injected": "default"}
    with pytest.raises(injection.InjectionError, match="only the Stowaway webhook sets, but no stowaway-sidecar"):
        injection.build_patch(pod, "default", policy_spec(), IMAGE)


@pytest.mark.parametrize("where", ["containers", "initContainers"])
def test_a_container_mounting_the_policys_claim_is_refused_with_both_named(where: str) -> None:
    pod = job_pod(volumes=[{"name": "mine", "persistentVolumeClaim": {"claimName": "ckpts", "readOnly": True}}])
    pod["spec"].setdefault(where, []).append(
        {"name": "peek", "image": "busybox", "volumeMounts": [{"name": "mine", "mountPath": "/ckpts"}]}
    )
    with pytest.raises(injection.InjectionError, match="'peek' mounts the CheckpointPolicy's storage claim 'ckpts'"):
        injection.build_patch(pod, "default", policy_spec(), IMAGE)


def test_another_claim_and_the_claims_volume_left_unmounted_are_allowed() -> None:
    pod = job_pod(volumes=[{"name": "data", "persistentVolumeClaim": {"claimName": "dataset"}},
                           {"name": "unused", "persistentVolumeClaim": {"claimName": "ckpts"}}])
    pod["spec"]["containers"][0]["volumeMounts"] = [{"name": "data", "mountPath": "/data"}]
    assert injection.SIDECAR_NAME in [c["name"] for c in injected(pod)["spec"]["initContainers"]]


def test_the_job_name_becomes_a_pod_label_for_prometheus_unless_it_is_no_valid_label_value() -> None:
    assert injected()["metadata"]["labels"]["stowaway.dev/job"] == "train"
    long = job_pod()
    del long["metadata"]["labels"]["batch.kubernetes.io/job-name"]
    long["metadata"]["generateName"] = "x" * 70 + "-"
    result = injected(long)
    assert "stowaway.dev/job" not in result["metadata"]["labels"]
    assert {"name": "STOWAWAY_JOB", "value": "x" * 70} in result["spec"]["containers"][0]["env"]


def pod_setting_jobs(**jobs: str | dict[str, Any]) -> dict[str, Any]:
    """A Job's pod (job label "train") with an init container ``fetch`` and the containers named, each setting
    STOWAWAY_JOB to the value given (a dict: the whole env entry); ``trainer`` sets none unless named."""
    pod = job_pod(initContainers=[{"name": "fetch", "image": "busybox"}])
    pod["spec"]["containers"].append({"name": "logger", "image": "busybox"})
    for container in [*pod["spec"]["initContainers"], *pod["spec"]["containers"]]:
        if container["name"] in jobs:
            entry = jobs[container["name"]]
            container["env"] = [{"name": "LR", "value": "0.1"},
                                entry if isinstance(entry, dict) else {"name": "STOWAWAY_JOB", "value": entry}]
    return pod


def job_env(container: dict[str, Any]) -> list[str]:
    return [e["value"] for e in container["env"] if e["name"] == "STOWAWAY_JOB"]


def test_the_job_a_container_sets_labels_the_pod_and_is_given_to_the_containers_that_set_none() -> None:
    result = injected(pod_setting_jobs(trainer="mine"))
    assert result["metadata"]["labels"]["stowaway.dev/job"] == "mine", "the PodMonitor must file it under 'mine'"
    trainer, logger = result["spec"]["containers"]
    assert trainer["env"][:2] == [{"name": "LR", "value": "0.1"}, {"name": "STOWAWAY_JOB", "value": "mine"}]
    assert job_env(trainer) == job_env(logger) == job_env(result["spec"]["initContainers"][1]) == ["mine"]


def test_containers_that_set_the_same_job_are_injected_with_it() -> None:
    result = injected(pod_setting_jobs(trainer="mine", logger="mine"))
    assert result["metadata"]["labels"]["stowaway.dev/job"] == "mine"
    assert [job_env(c) for c in result["spec"]["containers"]] == [["mine"], ["mine"]]


def test_of_several_definitions_in_one_container_the_last_names_the_job_as_the_kubelet_gives_it() -> None:
    pod = pod_setting_jobs(trainer="old")
    pod["spec"]["containers"][0]["env"].append({"name": "STOWAWAY_JOB", "value": "new"})
    assert injected(pod)["metadata"]["labels"]["stowaway.dev/job"] == "new"


def test_containers_that_set_different_jobs_are_refused_with_each_container_and_value_named() -> None:
    pod = pod_setting_jobs(fetch="prep", trainer="mine", logger="mine")
    with pytest.raises(injection.InjectionError) as refused:
        injection.build_patch(pod, "default", policy_spec(), IMAGE)
    assert str(refused.value) == (
        "the containers of this pod set STOWAWAY_JOB to different values (container 'fetch' to 'prep'; containers "
        "'trainer' and 'logger' to 'mine'), but the checkpoints of one pod belong to one job: set the same value in "
        "each, or remove STOWAWAY_JOB and the webhook sets it to the job's name, 'train' (see docs/operator.md)"
    )


@pytest.mark.parametrize(("entry", "how"), [
    ({"name": "STOWAWAY_JOB", "valueFrom": {"fieldRef": {"fieldPath": "metadata.labels['team']"}}}, "with valueFrom"),
    ({"name": "STOWAWAY_JOB", "value": "$(TEAM)-train"}, "to '$(TEAM)-train', a reference to a variable"),
], ids=["valueFrom", "variable reference"])
def test_a_job_only_the_kubelet_can_resolve_is_refused_asking_for_a_literal_name(entry: dict[str, Any],
                                                                                 how: str) -> None:
    with pytest.raises(injection.InjectionError) as refused:
        injection.build_patch(pod_setting_jobs(trainer=entry), "default", policy_spec(), IMAGE)
    assert str(refused.value) == (
        f"container 'trainer' sets STOWAWAY_JOB {how}, which only the kubelet resolves, but the webhook must know "
        "the job's name when the pod is created, to label the pod stowaway.dev/job with it for the metrics, the "
        "dashboard and the alerts: give the name as a literal value, or remove STOWAWAY_JOB and the webhook sets it "
        "to the job's name, 'train' (see docs/operator.md)"
    )


@pytest.mark.parametrize("job", ["x" * 64, "ends-with-", "_starts", "team/train", "névé"])
def test_a_job_that_cannot_be_a_label_value_is_refused_with_the_rule(job: str) -> None:
    with pytest.raises(injection.InjectionError) as refused:
        injection.build_patch(pod_setting_jobs(trainer=job, logger=job), "default", policy_spec(), IMAGE)
    assert str(refused.value) == (
        f"containers 'trainer' and 'logger' set STOWAWAY_JOB={job!r}, but it cannot be the value of the pod's label "
        "stowaway.dev/job, by which the PodMonitor, the dashboard and the alerts find the job's checkpoints: a label "
        "value has at most 63 characters, letters, digits, '-', '_' and '.', and begins and ends with a letter or "
        "digit; choose such a name, or remove STOWAWAY_JOB and the webhook sets it to the job's name, 'train' "
        "(see docs/operator.md)"
    )


def test_an_empty_job_is_refused_as_naming_no_job() -> None:
    with pytest.raises(injection.InjectionError, match=r"container 'trainer' sets STOWAWAY_JOB='', but an empty "
                       r"name names no job; give the job a name, or remove STOWAWAY_JOB"):
        injection.build_patch(pod_setting_jobs(trainer={"name": "STOWAWAY_JOB"}), "default", policy_spec(), IMAGE)


def test_a_refusal_of_a_pod_without_a_job_of_its_own_says_how_to_get_one() -> None:
    pod = pod_setting_jobs(trainer="a", logger="b")
    pod["metadata"] = {"labels": pod["metadata"]["labels"] | {"batch.kubernetes.io/job-name": ""}}
    with pytest.raises(injection.InjectionError, match="remove STOWAWAY_JOB and create the pod from a Job, whose "
                       "name the webhook then sets"):
        injection.build_patch(pod, "default", policy_spec(), IMAGE)


@settings(max_examples=300)
@given(st.from_regex(injection.LABEL_VALUE, fullmatch=True).filter(lambda v: 0 < len(v) <= injection.LABEL_VALUE_MAX))
def test_every_label_value_the_webhook_accepts_for_a_job_is_a_job_name_the_protocol_accepts(job: str) -> None:
    """Why the webhook checks only the label's rule: it is the narrower of the two."""
    assert messages.JOB_NAME.match(job)


def shm_pod(volume: dict[str, Any], *mounts: dict[str, Any]) -> dict[str, Any]:
    """A pod with its own volume ``dshm``, mounted by an init container and the trainer as given."""
    pod = job_pod(volumes=[{"name": "data", "emptyDir": {}}, {"name": "dshm", **volume}])
    pod["spec"]["initContainers"] = [{"name": "fetch", "image": "busybox",
                                      "volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"}]}]
    pod["spec"]["containers"][0]["volumeMounts"] = [{"name": "data", "mountPath": "/data"}, *mounts]
    return pod


def test_a_memory_dev_shm_of_the_pod_is_taken_over_and_its_size_added_to_the_slots() -> None:
    pod = shm_pod({"emptyDir": {"medium": "Memory", "sizeLimit": "4Gi"}}, {"name": "dshm", "mountPath": "/dev/shm/"})
    result = injected(pod)
    volumes = {v["name"]: v for v in result["spec"]["volumes"]}
    assert "dshm" not in volumes and volumes["data"] == {"name": "data", "emptyDir": {}}
    assert volumes["stowaway-shm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": str(12 * 2**30)}
    for container in [*result["spec"]["initContainers"][1:], *result["spec"]["containers"]]:
        mounts = [(m["name"], m["mountPath"]) for m in container["volumeMounts"]]
        assert ("dshm", "/dev/shm") not in mounts and ("dshm", "/dev/shm/") not in mounts, container["name"]
        assert mounts.count(("stowaway-shm", "/dev/shm")) == 1, container["name"]
    assert ("data", "/data") in [(m["name"], m["mountPath"]) for m in result["spec"]["containers"][0]["volumeMounts"]]


def test_a_memory_dev_shm_without_a_limit_leaves_the_sidecars_volume_without_one() -> None:
    result = injected(shm_pod({"emptyDir": {"medium": "Memory"}}, {"name": "dshm", "mountPath": "/dev/shm"}))
    (shm,) = [v for v in result["spec"]["volumes"] if v["name"] == "stowaway-shm"]
    assert shm["emptyDir"] == {"medium": "Memory"}


@pytest.mark.parametrize(("volume", "mount"), [
    ({"hostPath": {"path": "/dev/shm"}}, {"name": "dshm", "mountPath": "/dev/shm"}),
    ({"emptyDir": {}}, {"name": "dshm", "mountPath": "/dev/shm"}),
    ({"emptyDir": {"medium": "Memory"}}, {"name": "dshm", "mountPath": "/scratch"}),
    ({"emptyDir": {"medium": "Memory"}}, {"name": "dshm", "mountPath": "/dev/shm", "subPath": "a"}),
], ids=["hostPath", "disk emptyDir", "also mounted elsewhere", "subPath"])
def test_anything_else_at_dev_shm_is_refused_with_the_container_named(volume: dict[str, Any],
                                                                     mount: dict[str, Any]) -> None:
    pod = shm_pod(volume, mount)
    with pytest.raises(injection.InjectionError, match="'fetch' already mounts /dev/shm") as caught:
        injection.build_patch(pod, "default", policy_spec(), IMAGE)
    assert "a memory emptyDir mounted only at /dev/shm, without subPath, is taken over" in str(caught.value)


def test_a_user_volume_with_a_reserved_name_is_refused() -> None:
    pod = job_pod(volumes=[{"name": "stowaway-storage", "emptyDir": {}}])
    with pytest.raises(injection.InjectionError, match="stowaway-storage"):
        injection.build_patch(pod, "default", policy_spec(), IMAGE)


def test_build_patch_does_not_modify_the_pod_it_was_given() -> None:
    pod = job_pod()
    before = copy.deepcopy(pod)
    injection.build_patch(pod, "default", policy_spec(), IMAGE)
    assert pod == before


def test_policy_name_defaults_to_default() -> None:
    assert injection.policy_name(job_pod()) == "default"
    pod = job_pod()
    pod["metadata"]["annotations"] = {"stowaway.dev/policy": "fast"}
    assert injection.policy_name(pod) == "fast"


def test_a_policy_is_ready_with_its_claim_whether_direct_io_is_on_or_off() -> None:
    assert policy.judge(policy_spec(), claim_exists=True).ready
    assert policy.judge(policy_spec(persistence={"directIO": False}), claim_exists=True).ready
    missing = policy.judge(policy_spec(), claim_exists=False)
    assert (missing.ready, missing.reason) == (False, "ClaimNotFound")
    assert "'ckpts'" in missing.message


def test_ready_transition_time_moves_only_when_readiness_flips() -> None:
    ok = policy.Verdict(True, "Valid", "fine")
    first = policy.status(ok, 1, None, "t1")
    assert policy.status(ok, 2, first, "t2")["conditions"][0]["lastTransitionTime"] == "t1"
    flipped = policy.status(policy.Verdict(False, "ClaimNotFound", "gone"), 2, first, "t3")
    assert flipped["conditions"][0]["lastTransitionTime"] == "t3"


def test_readiness_counts_only_for_the_current_generation() -> None:
    stored = {"metadata": {"generation": 2}, "status": policy.status(policy.Verdict(True, "Valid", "ok"), 1, None, "t")}
    assert not policy.is_ready(stored)
    stored["metadata"]["generation"] = 1
    assert policy.is_ready(stored)


BUCKET = {"url": "s3://ckpts/team-a", "endpoint": "https://s3.internal:9000", "region": "eu-1",
          "virtualHostedStyle": False, "credentialsSecret": "s3-keys",
          "caBundle": {"configMapName": "s3-ca", "key": "ca.crt"}, "retention": {"keepLast": 2, "keepEvery": 1000}}


def bucket_spec(**bucket: Any) -> dict[str, Any]:
    return policy_spec(storage={"persistentVolumeClaim": {"claimName": "ckpts", "subPath": ""},
                                "bucket": {**BUCKET, **bucket}})


def test_a_policy_without_a_bucket_gives_the_sidecar_no_bucket_flag_credentials_or_ca() -> None:
    sidecar = injected()["spec"]["initContainers"][0]
    assert not [arg for arg in sidecar["command"] if arg.startswith("--bucket")]
    assert [e["name"] for e in sidecar["env"]] == ["NODE_NAME"]
    assert injection.bucket_tier.CA_VOLUME not in [v["name"] for v in injected()["spec"]["volumes"]]


def test_a_bucket_tier_passes_its_settings_and_retention_on_the_sidecars_command() -> None:
    command = injected(spec=bucket_spec())["spec"]["initContainers"][0]["command"]
    tail = command[command.index("--bucket"):]
    assert tail == ["--bucket", "s3://ckpts/team-a", "--bucket-endpoint", "https://s3.internal:9000",
                    "--bucket-region", "eu-1", "--bucket-ca-bundle", "/etc/stowaway/bucket-ca/ca.pem",
                    "--bucket-keep-last", "2", "--bucket-keep-every", "1000"]
    hosted = injected(spec=bucket_spec(virtualHostedStyle=True))["spec"]["initContainers"][0]["command"]
    assert "--bucket-virtual-hosted" in hosted


def test_bucket_credentials_come_from_the_secret_by_reference_and_never_appear_in_the_pod() -> None:
    pod = injected(spec=bucket_spec())
    sidecar = pod["spec"]["initContainers"][0]
    refs = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in sidecar["env"] if "valueFrom" in e
            and "secretKeyRef" in e["valueFrom"]}
    assert refs == {
        "AWS_ACCESS_KEY_ID": {"name": "s3-keys", "key": "AWS_ACCESS_KEY_ID", "optional": False},
        "AWS_SECRET_ACCESS_KEY": {"name": "s3-keys", "key": "AWS_SECRET_ACCESS_KEY", "optional": False},
        "AWS_SESSION_TOKEN": {"name": "s3-keys", "key": "AWS_SESSION_TOKEN", "optional": True},
    }
    assert all("value" not in e for e in sidecar["env"])
    # Only the sidecar gets them: the trainer never sees the bucket's keys.
    trainer = next(c for c in pod["spec"]["containers"] if c["name"] == "trainer")
    assert not [e for e in trainer.get("env", []) if e["name"].startswith("AWS_")]


def test_without_a_secret_the_sidecar_relies_on_the_pods_workload_identity() -> None:
    sidecar = injected(spec=bucket_spec(credentialsSecret=""))["spec"]["initContainers"][0]
    assert [e["name"] for e in sidecar["env"]] == ["NODE_NAME"]


def test_the_ca_bundle_configmap_is_mounted_read_only_into_the_sidecar_only() -> None:
    pod = injected(spec=bucket_spec())
    assert {"name": "stowaway-bucket-ca", "configMap": {"name": "s3-ca", "items": [{"key": "ca.crt",
            "path": "ca.pem"}]}} in pod["spec"]["volumes"]
    sidecar = pod["spec"]["initContainers"][0]
    assert {"name": "stowaway-bucket-ca", "mountPath": "/etc/stowaway/bucket-ca", "readOnly": True} in \
        sidecar["volumeMounts"]
    trainer = next(c for c in pod["spec"]["containers"] if c["name"] == "trainer")
    assert "stowaway-bucket-ca" not in [m["name"] for m in trainer["volumeMounts"]]


def test_the_injected_bucket_command_is_one_the_sidecar_accepts() -> None:
    from stowaway.cli import build_parser
    from stowaway.sidecar.config import SidecarConfig

    command = injected(spec=bucket_spec())["spec"]["initContainers"][0]["command"]
    args = build_parser().parse_args(command[1:])
    config = SidecarConfig(**{s.name: getattr(args, s.name) for s in injection.sidecar_settings.ALL
                              if getattr(args, s.name) is not None and s.name != "allowed_uids"})
    assert (config.bucket, config.bucket_keep_last, config.bucket_keep_every) == ("s3://ckpts/team-a", 2, 1000)


def test_a_bucket_alone_gives_the_sidecar_the_bucket_as_its_storage_and_no_claim() -> None:
    spec = policy_spec()
    spec["storage"] = {"bucket": BUCKET}
    verdict = policy.judge(spec, claim_exists=False)
    assert verdict.ready and "bucket 's3://ckpts/team-a' (no claim" in verdict.message
    pod = injected(spec=spec)
    sidecar = pod["spec"]["initContainers"][0]
    assert "--storage" not in sidecar["command"]
    assert not [v for v in pod["spec"]["volumes"] if "persistentVolumeClaim" in v]
    assert injection.STORAGE_VOLUME not in [m["name"] for m in sidecar["volumeMounts"]]

    from stowaway.cli import build_parser
    from stowaway.sidecar.config import SidecarConfig

    args = build_parser().parse_args(sidecar["command"][1:])
    config = SidecarConfig(**{s.name: getattr(args, s.name) for s in injection.sidecar_settings.ALL
                              if getattr(args, s.name) is not None and s.name != "allowed_uids"})
    assert (config.storage, config.bucket, config.bucket_tier) == (None, "s3://ckpts/team-a", False)

