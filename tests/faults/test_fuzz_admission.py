"""Fuzzing the admission webhook's pure builder with the Pods an AdmissionReview can carry.

The kopf handler hands ``request.object`` to ``injection.build_patch`` after
fetching the policy, so this is where a hostile or odd Pod lands. Mutating
admission runs before the API server validates the Pod, so the Pods here
need not be valid: duplicate names and reserved names are fair game.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from unit.test_injection import applied, policy_spec

from stowaway.operator import injection

pytestmark = pytest.mark.faults

IMAGE = "stowaway:fuzz"
CLAIMS = ["ckpts", "data", "other"]
text = st.text(max_size=12)
# Ordinary names mostly, reserved ones often enough to meet them in every run.
volume_names = st.sampled_from(["data", "scratch", "ckpt"] * 4 + list(injection.OUR_VOLUMES))
mount_paths = st.sampled_from(["/data", "/x/", injection.SHM_PATH, injection.SHM_PATH + "/", injection.SOCKET_DIR,
                               injection.STORAGE_PATH, "/dev"])
volume_sources = st.one_of(
    st.just({"emptyDir": {}}),
    st.sampled_from(CLAIMS).map(lambda claim: {"persistentVolumeClaim": {"claimName": claim}}),
    st.just({"configMap": {"name": "settings"}}),
)
security_contexts = st.fixed_dictionaries({}, optional={"runAsUser": st.integers(0, 70000),
                                                        "fsGroup": st.integers(0, 70000)})


@st.composite
def containers(draw: st.DrawFn, volumes: list[str]) -> dict[str, Any]:
    container: dict[str, Any] = {
        "name": draw(st.sampled_from(["trainer", "worker", "prepare"] * 4 + [injection.SIDECAR_NAME])),
        "image": "pytorch",
    }
    if draw(st.booleans()):
        container["env"] = draw(st.lists(st.fixed_dictionaries(
            {"name": st.sampled_from(["STOWAWAY_JOB", "STOWAWAY_SOCKET", "LR"]), "value": text}), max_size=3))
    if volumes and draw(st.booleans()):
        container["volumeMounts"] = draw(st.lists(st.fixed_dictionaries(
            {"name": st.sampled_from(volumes), "mountPath": mount_paths}), max_size=3))
    if draw(st.booleans()):
        container["securityContext"] = draw(security_contexts)
    return container


@st.composite
def pods(draw: st.DrawFn) -> dict[str, Any]:
    volumes = [{"name": name, **draw(volume_sources)} for name in draw(st.lists(volume_names, max_size=3))]
    names = [volume["name"] for volume in volumes]
    spec: dict[str, Any] = {"containers": draw(st.lists(containers(names), min_size=1, max_size=3))}
    if draw(st.booleans()):
        spec["initContainers"] = draw(st.lists(containers(names), max_size=2))
    if volumes or draw(st.booleans()):
        spec["volumes"] = volumes
    if draw(st.booleans()):
        spec["securityContext"] = draw(security_contexts)
    label_keys = st.sampled_from([injection.INJECT_LABEL, *injection.JOB_LABELS, "app"])
    annotation_keys = st.sampled_from([injection.MARKER_ANNOTATION, injection.POLICY_ANNOTATION, "note"])
    metadata = draw(st.fixed_dictionaries({"generateName": st.sampled_from(["train-", "", "-"])}, optional={
        "name": text, "namespace": text,
        "labels": st.dictionaries(label_keys, text, max_size=3),
        "annotations": st.dictionaries(annotation_keys, text, max_size=2),
    }))
    return {"metadata": metadata, "spec": spec}


policies = st.builds(
    lambda claim, native, slots, sub_path: policy_spec(
        storage={"persistentVolumeClaim": {"claimName": claim, "subPath": sub_path}},
        sidecar={"native": native}, sharedMemory={"slotsPerRank": slots}),
    st.sampled_from(CLAIMS), st.booleans(), st.integers(1, 8), st.sampled_from(["", "team-a"]),
)


def every_container(pod: dict[str, Any]) -> list[dict[str, Any]]:
    return [*(pod["spec"].get("initContainers") or []), *(pod["spec"].get("containers") or [])]


def claim_of(pod: dict[str, Any], volume_name: str) -> str | None:
    """The claim a mount of ``volume_name`` reaches (the first volume of that name, as kubelet resolves it)."""
    for volume in pod["spec"].get("volumes") or []:
        if volume["name"] == volume_name:
            return (volume.get("persistentVolumeClaim") or {}).get("claimName")
    return None


@given(pods(), policies)
def test_every_pod_is_injected_once_with_storage_only_in_the_sidecar_or_refused_with_a_reason(
    pod: dict[str, Any], spec: dict[str, Any]
) -> None:
    try:
        patch = injection.build_patch(pod, "team-policy", spec, IMAGE)
    except injection.InjectionError as exc:
        assert str(exc).strip()
        return
    had_sidecar = any(c["name"] == injection.SIDECAR_NAME for c in every_container(pod))
    assert not (injection.MARKER_ANNOTATION in (pod["metadata"].get("annotations") or {}) and not had_sidecar), \
        "a pod with a forged marker and no sidecar must be refused"
    if patch == {}:
        assert had_sidecar, "only a pod that already runs the sidecar may be left alone"
        return

    result = applied(pod, patch)
    sidecars = [c for c in every_container(result) if c["name"] == injection.SIDECAR_NAME]
    assert len(sidecars) == 1
    assert result["metadata"]["annotations"][injection.MARKER_ANNOTATION] == "team-policy"
    assert injection.build_patch(result, "team-policy", spec, IMAGE) == {}, "reinvocation must change nothing"
    claim = spec["storage"]["persistentVolumeClaim"]["claimName"]
    # What each container's trainer sees (the kubelet gives it the last definition): one job, the label's.
    jobs = {[e for e in c["env"] if e["name"] == "STOWAWAY_JOB"][-1]["value"]
            for c in every_container(result) if c is not sidecars[0]}
    label = result["metadata"].get("labels", {}).get(injection.JOB_LABEL)
    assert len(jobs) == 1 and (label is None or label in jobs), (jobs, label)  # None: a name no label can hold
    for container in every_container(result):
        reached = {claim_of(result, mount["name"]) for mount in container.get("volumeMounts") or []}
        if container is sidecars[0]:
            assert claim in reached
            continue
        assert claim not in reached, f"container {container['name']} reaches the checkpoint storage"
        mounted = {(m["name"], m["mountPath"]) for m in container["volumeMounts"]}
        assert {(injection.SHM_VOLUME, injection.SHM_PATH), (injection.SOCKET_VOLUME, injection.SOCKET_DIR)} <= mounted
        assert {"STOWAWAY_SOCKET", "STOWAWAY_JOB", "STOWAWAY_SLOTS_PER_RANK"} <= {v["name"] for v in container["env"]}


@given(pods())
def test_naming_the_policy_and_the_job_returns_a_name_or_refuses_with_a_reason(pod: dict[str, Any]) -> None:
    assert injection.policy_name(pod)
    try:
        assert injection.job_name(pod)
    except injection.InjectionError as exc:
        assert "cannot tell which job this pod belongs to" in str(exc)
