"""Build the patch that injects the Stowaway sidecar into a Pod (DESIGN §9).

Pure: a function of the Pod as submitted and the policy's spec (with the
CRD's defaults already applied by the API server). The kopf handler only
fetches the policy and hands the result to the admission response, so every
rule below is unit-tested without a cluster.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Mapping
from decimal import Decimal
from typing import Any

from kubernetes.utils.quantity import parse_quantity

from stowaway import sidecar_settings
from stowaway.operator import bucket_tier

INJECT_LABEL = "stowaway.dev/inject"
INJECT_ENABLED = "enabled"
POLICY_ANNOTATION = "stowaway.dev/policy"
DEFAULT_POLICY = "default"
# Present on every injected Pod, valued with the policy's name: the idempotency marker.
MARKER_ANNOTATION = "stowaway.dev/injected"
# The variable the client reads its job's name from; the job's storage directory is named after it.
JOB_ENV = "STOWAWAY_JOB"
# The job's name (as in STOWAWAY_JOB) as a pod label, so the chart's PodMonitor can make it Prometheus's `job`.
JOB_LABEL = "stowaway.dev/job"
LABEL_VALUE = re.compile(r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?")
LABEL_VALUE_MAX = 63
LABEL_VALUE_RULE = ("a label value has at most 63 characters, letters, digits, '-', '_' and '.', and begins and ends "
                    "with a letter or digit")

SIDECAR_NAME = "stowaway-sidecar"
# Kubernetes' default terminationGracePeriodSeconds, and the time the trainer's own shutdown may take
# out of the pod's grace period before the sidecar is asked to stop.
DEFAULT_TERMINATION_SECONDS = 30
TERMINATION_MARGIN_SECONDS = 15
# The sidecar's metrics port; the chart's PodMonitor scrapes ports of this name.
METRICS_PORT_NAME = "ckpt-metrics"
SHM_VOLUME = "stowaway-shm"
SOCKET_VOLUME = "stowaway-socket"
STORAGE_VOLUME = "stowaway-storage"
OUR_VOLUMES = (SHM_VOLUME, SOCKET_VOLUME, STORAGE_VOLUME, bucket_tier.CA_VOLUME)

# Volumes are mounted at SHM_PATH and SOCKET_DIR; kubelet makes an emptyDir's root world-writable, so the
# sidecar keeps its slots and socket in subdirectories it creates private to the pod's fsGroup.
SHM_PATH = "/dev/shm"
SLOT_DIR = f"{SHM_PATH}/stowaway"
SOCKET_DIR = "/var/run/stowaway"
SOCKET_PATH = f"{SOCKET_DIR}/sidecar/sidecar.sock"
STORAGE_PATH = "/var/lib/stowaway/storage"
# The user and group of the sidecar image (Dockerfile: USER 65532:65532); the group is the fsGroup of pods that
# set none.
SIDECAR_UID = 65532
SIDECAR_GID = 65532

# Labels naming the job a pod belongs to, most specific "whole job" first: a JobSet
# creates Jobs (whose pods also carry job-name), a PyTorchJob creates pods directly.
JOB_LABELS = (
    "jobset.sigs.k8s.io/jobset-name",
    "training.kubeflow.org/job-name",
    "batch.kubernetes.io/job-name",
    "job-name",
)

# A missing socket is normal for the first seconds; two minutes covers a slow image start.
STARTUP_PROBE = {
    "exec": {"command": ["test", "-S", SOCKET_PATH]},
    "periodSeconds": 1,
    "failureThreshold": 120,
}
# Everything the "restricted" Pod Security Standard asks of each container, so that injecting the sidecar
# never makes a compliant pod non-compliant (a pod may set seccomp per container rather than for the pod).
SIDECAR_SECURITY = {
    # Set on the container, or a pod-level runAsUser (the trainer's) would run the sidecar too, and the
    # checkpoints on the claim would belong to whichever uid each job's trainer has.
    "runAsUser": SIDECAR_UID,
    "runAsGroup": SIDECAR_GID,
    "runAsNonRoot": True,
    "readOnlyRootFilesystem": True,
    "allowPrivilegeEscalation": False,
    "capabilities": {"drop": ["ALL"]},
    "seccompProfile": {"type": "RuntimeDefault"},
}


class InjectionError(ValueError):
    """The Pod cannot be injected as submitted; the message says what to change."""


def policy_name(pod: Mapping[str, Any]) -> str:
    """The policy a Pod asks for: its ``stowaway.dev/policy`` annotation, else ``default``."""
    annotations = pod.get("metadata", {}).get("annotations") or {}
    return annotations.get(POLICY_ANNOTATION) or DEFAULT_POLICY


def already_injected(pod: Mapping[str, Any]) -> bool:
    """True if the sidecar itself is present (in containers or initContainers).

    A reinvoked webhook sees its own sidecar, and a Pod copied from an injected
    one carries it too. Neither the container nor the marker alone counts (see
    :func:`refuse_forgeries`), so after that check this means both are there.
    """
    return any(c.get("name") == SIDECAR_NAME for c in _all_containers(pod.get("spec", {})))


def injected_with(pod: Mapping[str, Any]) -> str | None:
    """The policy the marker names: the one that injected the Pod (or a copy of it), else None."""
    return (pod.get("metadata", {}).get("annotations") or {}).get(MARKER_ANNOTATION)


def refuse_forgeries(pod: Mapping[str, Any]) -> None:
    """Refuse a Pod that carries the marker without the sidecar, or the sidecar without the marker.

    The webhook always sets both together, and its reinvocation sees both in
    its own patch. The marker alone would be a way to opt out while looking
    injected (no checkpoints, yet counted in the policy's ``podsInjected``); a
    container of the reserved name alone would make the webhook skip the pod
    before it reads the policy, so whatever that container runs and mounts
    (the policy's claim included) would pass unchecked.
    """
    marked, present = injected_with(pod) is not None, already_injected(pod)
    if marked and not present:
        raise InjectionError(
            f"the pod carries the annotation {MARKER_ANNOTATION}, which only the Stowaway webhook sets, but no "
            f"{SIDECAR_NAME} container; remove the annotation (was the pod copied from an injected one?) and the "
            "sidecar is injected (see docs/operator.md)"
        )
    if present and not marked:
        raise InjectionError(
            f"the pod has a container named {SIDECAR_NAME}, a name reserved for the sidecar the Stowaway webhook "
            f"injects, but not the annotation {MARKER_ANNOTATION} the webhook sets with it; remove that container "
            "(the webhook adds the sidecar, configured by the CheckpointPolicy) or rename it (see docs/operator.md)"
        )


def job_name(pod: Mapping[str, Any]) -> str:
    """The job a Pod's checkpoints belong to: owning JobSet/PyTorchJob/Job label, else generateName.

    All pods of one job, and the replacements of a rescheduled pod, must agree on
    this name, which is why the pod's own (unique) name is the last resort.
    """
    metadata: Mapping[str, Any] = pod.get("metadata", {})
    labels: Mapping[str, str] = metadata.get("labels") or {}
    for label in JOB_LABELS:
        if labels.get(label):
            return labels[label]
    generate: str = (metadata.get("generateName") or "").rstrip("-.")
    if generate:
        return generate
    name: str = metadata.get("name") or ""
    if name:
        return name
    raise InjectionError(
        "cannot tell which job this pod belongs to: it has no Job/PyTorchJob/JobSet label, no generateName "
        "and no name; create it from a Job or set the label batch.kubernetes.io/job-name"
    )


def _job_the_containers_set(pod: Mapping[str, Any]) -> str | None:
    """The STOWAWAY_JOB the pod's containers set themselves, or None where none does.

    The trainer names its checkpoints with that value, so the pod's label (the
    `job` of the PodMonitor, the dashboard and the alerts) must be the same:
    refused are containers that disagree and a value that cannot be a label.
    A valid label value other than the empty one is also a valid job name of
    the protocol (docs/protocol.md), so the label's rule is the one to check.
    """
    setters = _job_setters(pod)
    if len(setters) > 1:
        each = "; ".join(f"{_containers(names)} to {value!r}" for value, names in setters.items())
        raise InjectionError(
            f"the containers of this pod set {JOB_ENV} to different values ({each}), but the checkpoints of one pod "
            f"belong to one job: set the same value in each, or {_without_job_env(pod)} (see docs/operator.md)"
        )
    if not setters:
        return None
    ((value, names),) = setters.items()
    if not value or len(value) > LABEL_VALUE_MAX or not LABEL_VALUE.fullmatch(value):
        why = "an empty name names no job; give the job a name" if not value else (
            f"it cannot be the value of the pod's label {JOB_LABEL}, by which the PodMonitor, the dashboard and the "
            f"alerts find the job's checkpoints: {LABEL_VALUE_RULE}; choose such a name")
        raise InjectionError(
            f"{_containers(names)} {'sets' if len(names) == 1 else 'set'} {JOB_ENV}={value!r}, but {why}, or "
            f"{_without_job_env(pod)} (see docs/operator.md)"
        )
    return value


def _job_setters(pod: Mapping[str, Any]) -> dict[str, list[str]]:
    """Each STOWAWAY_JOB value the containers set, with the names of the containers that set it.

    Refuses a value the webhook cannot read when the pod is created: a
    ``valueFrom`` or a ``$(VAR)`` reference, which only the kubelet resolves.
    """
    setters: dict[str, list[str]] = {}
    for container in _all_containers(pod.get("spec", {})):
        entries = [e for e in container.get("env") or [] if e.get("name") == JOB_ENV]
        if not entries:
            continue
        entry = entries[-1]  # of several definitions, the kubelet gives the container the last
        value = entry.get("value") or ""
        if entry.get("valueFrom") is not None or "$(" in value:
            how = "with valueFrom" if entry.get("valueFrom") is not None else f"to {value!r}, a reference to a variable"
            raise InjectionError(
                f"container {container.get('name')!r} sets {JOB_ENV} {how}, which only the kubelet resolves, but "
                f"the webhook must know the job's name when the pod is created, to label the pod {JOB_LABEL} with it "
                f"for the metrics, the dashboard and the alerts: give the name as a literal value, or "
                f"{_without_job_env(pod)} (see docs/operator.md)"
            )
        setters.setdefault(value, []).append(str(container.get("name")))
    return setters


def _without_job_env(pod: Mapping[str, Any]) -> str:
    """What a pod that sets no STOWAWAY_JOB gets, as the alternative a refusal above offers."""
    try:
        return f"remove {JOB_ENV} and the webhook sets it to the job's name, {job_name(pod)!r}"
    except InjectionError:
        return f"remove {JOB_ENV} and create the pod from a Job, whose name the webhook then sets"


def _containers(names: list[str]) -> str:
    quoted = [repr(name) for name in names]
    if len(quoted) == 1:
        return f"container {quoted[0]}"
    return f"containers {', '.join(quoted[:-1])} and {quoted[-1]}"


def claim_of(spec: Mapping[str, Any]) -> str | None:
    """The policy's claim; None where its bucket alone is the storage."""
    claim: str | None = (spec["storage"].get("persistentVolumeClaim") or {}).get("claimName")
    return claim


def build_patch(pod: Mapping[str, Any], policy: str, spec: Mapping[str, Any], default_image: str) -> dict[str, Any]:
    """Return the merge-patch fragment that injects the sidecar, or ``{}`` if already injected.

    Lists are returned whole (containers, initContainers, volumes): the caller
    diffs them against the submitted Pod into a JSON patch. Existing settings of
    the user win: an env var the container already sets is left alone, and a
    STOWAWAY_JOB one sets names the job of the whole pod (its label, the
    other containers' STOWAWAY_JOB). An
    already injected Pod (a reinvocation, or a copy of an injected Pod) is
    still refused if another container mounts the claim: a copy may have been edited.
    """
    refuse_forgeries(pod)
    pod_spec = pod.get("spec", {})
    claim = claim_of(spec)
    if already_injected(pod):
        _refuse_claim_mounts(pod_spec, claim)
        return {}
    pod_spec, shm_limit = _adopt_own_shm(pod_spec, str(spec["sharedMemory"]["sizeLimit"]))
    _refuse_conflicts(pod_spec, claim)
    # Containers that set no STOWAWAY_JOB get the one the others set, so that the whole pod saves as one job.
    chosen = _job_the_containers_set(pod)
    job = job_name(pod) if chosen is None else chosen
    client_env = [
        {"name": "STOWAWAY_SOCKET", "value": SOCKET_PATH},
        {"name": JOB_ENV, "value": job},
        {"name": "STOWAWAY_SLOTS_PER_RANK", "value": str(spec["sharedMemory"]["slotsPerRank"])},
        {"name": "STOWAWAY_POOLED_SPARES", "value": str(spec["sharedMemory"].get("pooledSpares", 0))},
    ]
    containers = [_with_client_mounts(c, client_env) for c in pod_spec.get("containers") or []]
    init_containers = [_with_client_mounts(c, client_env) for c in pod_spec.get("initContainers") or []]
    sidecar = _sidecar(pod_spec, spec, default_image)
    if spec["sidecar"]["native"]:
        # First, so that the sidecar is up before any later init container or the trainer starts.
        init_containers.insert(0, sidecar)
    else:
        containers.append(sidecar)
    patch: dict[str, Any] = {
        "metadata": {"annotations": {MARKER_ANNOTATION: policy}},
        "spec": {"containers": containers,
                 "volumes": [*(pod_spec.get("volumes") or []), *_volumes(spec, shm_limit)]},
    }
    if init_containers:
        patch["spec"]["initContainers"] = init_containers
    termination = sidecar_settings.GRACE_PERIOD.policy_value(spec) + TERMINATION_MARGIN_SECONDS
    if (pod_spec.get("terminationGracePeriodSeconds") or DEFAULT_TERMINATION_SECONDS) < termination:
        # The kubelet stops the trainer first and the sidecar last, all within the pod's grace period.
        patch["spec"]["terminationGracePeriodSeconds"] = termination
    if len(job) <= LABEL_VALUE_MAX and LABEL_VALUE.fullmatch(job):
        # A name the containers set always is a label value (else refused above); a generateName too long or odd
        # for one leaves Prometheus's job to the PodMonitor's default.
        patch["metadata"]["labels"] = {JOB_LABEL: job}
    shared_group = _shared_group(pod_spec)
    if shared_group:
        patch["spec"]["securityContext"] = shared_group
    return patch


def _shared_group(pod_spec: Mapping[str, Any]) -> dict[str, Any]:
    """A pod fsGroup, so trainer and sidecar can open each other's files whatever their uids.

    kubelet adds the fsGroup to every container's groups and makes the pod's volumes group-owned by it
    (setgid on emptyDirs): the socket, the slot files and the storage volume then stay readable and
    writable by both sides. A pod that chose its own fsGroup keeps it; the sidecar is in it too.
    """
    context = pod_spec.get("securityContext") or {}
    if context.get("fsGroup") is not None:
        return {}
    shared: dict[str, Any] = {"fsGroup": SIDECAR_GID}
    if "fsGroupChangePolicy" not in context:
        # Only re-own the storage volume when its root is not the group yet, not on every start.
        shared["fsGroupChangePolicy"] = "OnRootMismatch"
    return shared


def _refuse_conflicts(pod_spec: Mapping[str, Any], claim: str | None) -> None:
    """Refuse a Pod whose own volumes or mounts would collide with ours, rather than inject a broken one."""
    taken = {v.get("name") for v in pod_spec.get("volumes") or []} & set(OUR_VOLUMES)
    if taken:
        raise InjectionError(
            f"the pod already has volume(s) {', '.join(sorted(taken))}, names reserved for the Stowaway sidecar; "
            "rename them"
        )
    _refuse_claim_mounts(pod_spec, claim)
    for container in _all_containers(pod_spec):
        for mount in container.get("volumeMounts") or []:
            if mount.get("name") in OUR_VOLUMES:
                raise InjectionError(
                    f"container {container.get('name')!r} mounts volume {mount['name']!r}, a name reserved for "
                    "the Stowaway sidecar's volumes (after injection it would be the sidecar's storage or "
                    "memory); remove that mount"
                )
            if _mount_path(mount) in (SHM_PATH, SOCKET_DIR):
                raise InjectionError(
                    f"container {container.get('name')!r} already mounts {mount['mountPath']} (volume "
                    f"{mount.get('name')!r}); remove that mount: Stowaway provides it, sized by the CheckpointPolicy "
                    "(a memory emptyDir mounted only at /dev/shm, without subPath, is taken over and its size added)"
                )


def _refuse_claim_mounts(pod_spec: Mapping[str, Any], claim: str | None) -> None:
    """Refuse a Pod in which any container but the sidecar mounts the policy's claim (if it names one).

    The claim is the sidecar's alone: a trainer writing into it could corrupt
    or delete committed checkpoints behind the sidecar's retention and commit
    protocol. Checked for injected Pods too (the sidecar's own storage volume
    is the claim's, so the sidecar is the one container exempt).
    """
    if claim is None:
        return
    claim_volumes = {
        v.get("name") for v in pod_spec.get("volumes") or []
        if (v.get("persistentVolumeClaim") or {}).get("claimName") == claim
    }
    for container in _all_containers(pod_spec):
        if container.get("name") == SIDECAR_NAME:
            continue
        for mount in container.get("volumeMounts") or []:
            if mount.get("name") in claim_volumes:
                raise InjectionError(
                    f"container {container.get('name')!r} mounts the CheckpointPolicy's storage claim {claim!r} "
                    f"(volume {mount['name']!r}); only the Stowaway sidecar may write it: remove that mount and "
                    "read checkpoints with the client's load() (see docs/operator.md)"
                )


def _with_client_mounts(container: Mapping[str, Any], client_env: list[dict[str, str]]) -> dict[str, Any]:
    result = copy.deepcopy(dict(container))
    result["volumeMounts"] = [
        *(result.get("volumeMounts") or []),
        {"name": SHM_VOLUME, "mountPath": SHM_PATH},
        {"name": SOCKET_VOLUME, "mountPath": SOCKET_DIR},
    ]
    env = result.get("env") or []
    present = {e.get("name") for e in env}
    result["env"] = [*env, *(e for e in client_env if e["name"] not in present)]
    return result


def _all_containers(pod_spec: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    return [*(pod_spec.get("initContainers") or []), *(pod_spec.get("containers") or [])]


def _mount_path(mount: Mapping[str, Any]) -> str:
    """Where a volumeMount puts its volume, written the one way ("/dev/shm/" is "/dev/shm")."""
    path: str = mount.get("mountPath", "")
    return path.rstrip("/")


def _adopt_own_shm(pod_spec: Mapping[str, Any], slots_limit: str) -> tuple[Mapping[str, Any], str | None]:
    """The pod without its own memory ``/dev/shm``, and the size limit of the sidecar's (None: unlimited).

    PyTorch pods commonly mount a memory emptyDir at /dev/shm, so that
    DataLoader workers and NCCL get more than the runtime's 64 MiB. The
    sidecar's volume takes its place, sized for the slots plus that volume's
    own limit (unlimited if it had none), rather than every such pod being
    refused until edited. Anything else at /dev/shm is left to
    ``_refuse_conflicts``.
    """
    containers = _all_containers(pod_spec)
    mounts = [m for c in containers for m in c.get("volumeMounts") or []]
    at_shm = {m.get("name") for m in mounts if _mount_path(m) == SHM_PATH}
    if len(at_shm) != 1:
        return pod_spec, slots_limit
    (name,) = at_shm
    volume: Mapping[str, Any] = next((v for v in pod_spec.get("volumes") or [] if v.get("name") == name), {})
    empty_dir = volume.get("emptyDir")
    only_at_shm = all(_mount_path(m) == SHM_PATH and not m.get("subPath")
                      for m in mounts if m.get("name") == name)
    if name in OUR_VOLUMES or empty_dir is None or empty_dir.get("medium") != "Memory" or not only_at_shm:
        return pod_spec, slots_limit
    adopted = copy.deepcopy(dict(pod_spec))
    adopted["volumes"] = [v for v in adopted["volumes"] if v.get("name") != name]
    for key in ("initContainers", "containers"):
        for container in adopted.get(key) or []:
            container["volumeMounts"] = [m for m in container.get("volumeMounts") or [] if m.get("name") != name]
    own = empty_dir.get("sizeLimit")
    return adopted, None if own is None else str(int(_quantity(slots_limit) + _quantity(str(own))))


def _quantity(text: str) -> Decimal:
    """A Kubernetes quantity ("8Gi") as a number."""
    value: Decimal = parse_quantity(text)
    return value


def _volumes(spec: Mapping[str, Any], shm_limit: str | None) -> list[dict[str, Any]]:
    claim = claim_of(spec)
    shm: dict[str, Any] = {"medium": "Memory"} if shm_limit is None else {"medium": "Memory", "sizeLimit": shm_limit}
    storage = [] if claim is None else [{"name": STORAGE_VOLUME, "persistentVolumeClaim": {"claimName": claim}}]
    return [
        {"name": SHM_VOLUME, "emptyDir": shm},
        {"name": SOCKET_VOLUME, "emptyDir": {"medium": "Memory", "sizeLimit": "1Mi"}},
        *storage,
        *bucket_tier.volumes(spec),
    ]


def _trainer_uids(pod_spec: Mapping[str, Any]) -> list[int]:
    """uids the trainer containers run as, which the sidecar must accept on its socket."""
    contexts = [pod_spec.get("securityContext") or {}]
    contexts += [c.get("securityContext") or {} for c in pod_spec.get("containers") or []]
    return sorted({ctx["runAsUser"] for ctx in contexts if ctx.get("runAsUser") is not None})


def _sidecar_command(pod_spec: Mapping[str, Any], spec: Mapping[str, Any]) -> list[str]:
    """The sidecar's command line: the pod's paths, every setting the policy sets, the trainers' uids."""
    command = [
        "stowaway", "sidecar",
        *(sidecar_settings.STORAGE.command_line(STORAGE_PATH) if claim_of(spec) is not None else []),
        *sidecar_settings.SOCKET.command_line(SOCKET_PATH),
        *sidecar_settings.SHM_DIR.command_line(SLOT_DIR),
    ]
    for setting in sidecar_settings.FROM_POLICY:
        command += setting.command_line(setting.policy_value(spec))
    for uid in _trainer_uids(pod_spec):
        command += sidecar_settings.ALLOWED_UIDS.command_line(uid)
    return command + bucket_tier.command_line(spec)


def _sidecar(pod_spec: Mapping[str, Any], spec: Mapping[str, Any], default_image: str) -> dict[str, Any]:
    sidecar_spec = spec["sidecar"]
    metrics_port = sidecar_settings.METRICS_PORT.policy_value(spec)
    claim = spec["storage"].get("persistentVolumeClaim")
    storage_mount = [] if claim is None else [{"name": STORAGE_VOLUME, "mountPath": STORAGE_PATH}]
    if claim is not None and claim.get("subPath"):
        storage_mount[0]["subPath"] = claim["subPath"]
    sidecar: dict[str, Any] = {
        "name": SIDECAR_NAME,
        "image": sidecar_spec.get("image") or default_image,
        "command": _sidecar_command(pod_spec, spec),
        "env": [{"name": "NODE_NAME", "valueFrom": {"fieldRef": {"apiVersion": "v1", "fieldPath": "spec.nodeName"}}},
                *bucket_tier.env(spec)],
        "ports": [{"name": METRICS_PORT_NAME, "containerPort": metrics_port, "protocol": "TCP"}],
        "resources": copy.deepcopy(sidecar_spec.get("resources") or {}),
        "volumeMounts": [
            {"name": SHM_VOLUME, "mountPath": SHM_PATH},
            {"name": SOCKET_VOLUME, "mountPath": SOCKET_DIR},
            *storage_mount,
            *bucket_tier.mounts(spec),
        ],
        "startupProbe": copy.deepcopy(STARTUP_PROBE),
        "securityContext": copy.deepcopy(SIDECAR_SECURITY),
    }
    if sidecar_spec.get("imagePullPolicy"):
        sidecar["imagePullPolicy"] = sidecar_spec["imagePullPolicy"]
    if sidecar_spec["native"]:
        sidecar["restartPolicy"] = "Always"
    return sidecar
