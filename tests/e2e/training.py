"""The example training job of ``examples/kubernetes/``, as the e2e tests run it and read what it prints."""

from __future__ import annotations

import copy
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from k8s.cluster import Cluster
from k8s.operator_fixtures import REPO
from metrics.promtools import samples

from stowaway.operator.injection import METRICS_PORT_NAME

from . import objects
from .environment import TRAINER_IMAGE

EXAMPLES = REPO / "examples" / "kubernetes"
SIDECAR = "stowaway-sidecar"
POLICY = "tiny-lm"
TRAINER = "trainer"
# rank 0 of examples/train.py --fingerprints, after each step
_STEP_LINE = re.compile(r"^step +(\d+) +loss (\S+) +model ([0-9a-f]+)$", re.MULTILINE)
_RESUMED = re.compile(r"^resumed from step (\d+); continuing at step (\d+)$", re.MULTILINE)


def example(name: str) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all((EXAMPLES / name).read_text()) if doc]


def policy_objects(size_limit: str | None = None, pooled: bool = False) -> list[dict[str, Any]]:
    """The example's claim and CheckpointPolicy; ``size_limit`` replaces its shared-memory size, ``pooled`` gives
    each rank one slot and the pod's ranks one pooled spare."""
    found = copy.deepcopy(example("10-policy.yaml"))
    for doc in found:
        if doc["kind"] == "CheckpointPolicy":
            if size_limit is not None:
                doc["spec"]["sharedMemory"]["sizeLimit"] = size_limit
            if pooled:
                doc["spec"]["sharedMemory"] |= {"slotsPerRank": 1, "pooledSpares": 1}
    return found


def job_object(name: str, *, steps: int, pace: float, width: int | None = None) -> dict[str, Any]:
    """The example's Job, renamed, running the trainer image built here, printing a fingerprint every step;
    ``width`` makes its model wider (and its checkpoints bigger)."""
    (job,) = copy.deepcopy(example("20-job.yaml"))
    job["metadata"]["name"] = name
    (container,) = job["spec"]["template"]["spec"]["containers"]
    assert container["name"] == TRAINER
    container["image"] = TRAINER_IMAGE
    container["imagePullPolicy"] = "Never"
    command = [arg for arg in container["command"] if not arg.startswith(("--steps=", "--pace="))]
    container["command"] = [*command, f"--steps={steps}", f"--pace={pace}", "--fingerprints",
                             *([f"--width={width}"] if width else [])]
    return dict(job)


def apply(cluster: Cluster, namespace: str, documents: list[dict[str, Any]], scratch: Path) -> None:
    path = scratch / "apply.json"
    path.write_text(json.dumps({"apiVersion": "v1", "kind": "List", "items": documents}))
    cluster.run("kubectl", "--namespace", namespace, "apply", "-f", str(path))


@dataclass(frozen=True)
class StepRecord:
    loss: str
    model: str


def fingerprints(log: str) -> dict[int, StepRecord]:
    """Step -> what rank 0 printed after it."""
    return {int(m.group(1)): StepRecord(m.group(2), m.group(3)) for m in _STEP_LINE.finditer(log)}


def resumed_at(log: str) -> int | None:
    """The step a trainer's log says it restored, if it resumed."""
    found = _RESUMED.search(log)
    return int(found.group(1)) if found else None


def pods_of_job(cluster: Cluster, namespace: str, job: str) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = objects.get(cluster, "pods", namespace=namespace,
                                              selector=f"batch.kubernetes.io/job-name={job}")["items"]
    return found


def container_status(pod: dict[str, Any], name: str) -> dict[str, Any]:
    statuses = pod["status"].get("containerStatuses", []) + pod["status"].get("initContainerStatuses", [])
    found = [status for status in statuses if status["name"] == name]
    assert found, f"pod {pod['metadata']['name']} has no status for container {name} yet"
    return dict(found[0])


def sidecar_metrics(cluster: Cluster, namespace: str, pod: dict[str, Any]) -> dict[str, float]:
    """The sidecar's samples, read through the API server's pod proxy as a user without Prometheus would."""
    ports = [port["containerPort"] for container in pod["spec"].get("initContainers", [])
             for port in container.get("ports", []) if port.get("name") == METRICS_PORT_NAME]
    assert len(ports) == 1, f"the sidecar declares metrics ports {ports}"
    name = pod["metadata"]["name"]
    exposition = cluster.run("kubectl", "get", "--raw",
                             f"/api/v1/namespaces/{namespace}/pods/{name}:{ports[0]}/proxy/metrics").stdout
    return samples(exposition)


# What examples/kubernetes/ tells a user to run: kill(-1) reaches every process of the container but PID 1
# (torchrun, which then exits with the ranks' failure) and the caller.
CRASH_RANKS = ["sh", "-c", "kill -KILL -1"]


def crash_ranks(cluster: Cluster, namespace: str, pod: str) -> None:
    """SIGKILL every rank in the trainer container, as an out-of-memory kill or a crash would end them."""
    cluster.run("kubectl", "--namespace", namespace, "exec", pod, "-c", TRAINER, "--", *CRASH_RANKS)
