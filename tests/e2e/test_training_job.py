"""The whole product in real pods: the example training job of ``examples/kubernetes/`` on a kind node.

One run, observed by every test of this module (``training_run``): the chart's operator injects the sidecar
into a Job's pod whose trainer (``examples/train.py`` under ``torchrun``, two ranks, uid 1000, an fsGroup of
its own) saves every step into shared memory; the sidecar (uid 65532) commits into a claim the cluster
provisions. Its ranks are SIGKILLed: the container restarts in place and restores from shared memory. The
operator is killed and the pod deleted: its sidecar drains, the Job's next pod is injected once the operator is
back, restores from the claim and trains to the end. A second
Job runs the same training uninterrupted, and every step both print must be bit-identical. A real
Prometheus discovers the sidecars through the API server as the chart's PodMonitor would, and the dashboard
queries it with the job's labels.
"""

from __future__ import annotations

import re
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from k8s.cluster import Cluster
from k8s.wait import eventually
from kubernetes import client
from metrics import dashboard

from . import objects, training
from .chart import installed_chart
from .diagnostics import namespace_report
from .environment import PRODUCT_IMAGE, Environment
from .logs import FollowedLog
from .namespaces import fresh_namespace
from .scraping import prometheus_of_sidecars

pytestmark = pytest.mark.e2e

JOB = "tiny-lm"
REFERENCE = "tiny-lm-reference"
STEPS = 200
# Seconds after each step: time for the test to act between steps; the reference runs flat out.
PACE = 0.2
# Pod start (torch's import on two busy cores) and a whole run, with room to spare.
POD_START = 240
RUN_TIME = POD_START + STEPS * PACE * 3
TRAINER_UID, TRAINER_FS_GROUP, SIDECAR_UID = 1000, 2000, 65532


@dataclass
class TrainingRun:
    namespace: str
    reference: dict[int, training.StepRecord] = field(default_factory=dict)
    # The trainer container that was killed, the one that replaced it in place, and the next pod's.
    logs: list[str] = field(default_factory=list)
    identities: dict[str, str] = field(default_factory=dict)
    after_memory_restore: dict[str, float] = field(default_factory=dict)
    after_storage_restore: dict[str, float] = field(default_factory=dict)
    committed_before_delete: int = -1
    deleted_pod_sidecar_log: str = ""
    verify_output: str = ""
    dashboard: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    first_pod: str = ""
    # The operator's running pods before it was killed, and once the Job's next pod ran.
    killed_operator: list[str] = field(default_factory=list)
    operator_after: list[str] = field(default_factory=list)
    scraped_labels: list[dict[str, str]] = field(default_factory=list)


def _running_pod(cluster: Cluster, namespace: str, job: str, other_than: str | None = None) -> dict[str, Any]:
    def probe() -> dict[str, Any] | None:
        pods = [pod for pod in training.pods_of_job(cluster, namespace, job)
                if pod["metadata"]["name"] != other_than and "deletionTimestamp" not in pod["metadata"]]
        running = [pod for pod in pods if training.container_status(pod, training.TRAINER).get("state", {})
                   .get("running")]
        return running[0] if len(running) == 1 else None
    try:
        return eventually(probe, what=f"a running pod of job {job}", timeout=POD_START)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{namespace_report(cluster, namespace, 'batch.kubernetes.io/job-name')}") \
            from None


def _metric(cluster: Cluster, namespace: str, pod: dict[str, Any], series: str) -> float:
    return training.sidecar_metrics(cluster, namespace, pod).get(series, float("nan"))


def _restores(cluster: Cluster, namespace: str, pod: dict[str, Any], ranks: int) -> dict[str, float]:
    """The sidecar's samples once it has counted ``ranks`` restores, whatever their source."""
    found = training.sidecar_metrics(cluster, namespace, pod)
    counted = {series: value for series, value in found.items() if series.startswith("stowaway_restores_total")}
    assert sum(counted.values()) >= ranks, f"restores counted so far: {counted}"
    return found


def _committed(cluster: Cluster, namespace: str, pod: dict[str, Any], at_least: int) -> float:
    committed = _metric(cluster, namespace, pod, "stowaway_last_committed_step")
    return committed if committed >= at_least else 0


def _complete(cluster: Cluster, namespace: str, job: str) -> bool:
    conditions = objects.get(cluster, "job", job, namespace=namespace).get("status", {}).get("conditions", [])
    states = {c["type"]: c["status"] for c in conditions}
    assert states.get("Failed") != "True", f"job {job} failed: {conditions}"
    return states.get("Complete") == "True"


def _identity(cluster: Cluster, namespace: str, pod: str, container: str) -> str:
    return cluster.run("kubectl", "--namespace", namespace, "exec", pod, "-c", container, "--",
                       "id", "-u").stdout.strip() + " " + cluster.run(
        "kubectl", "--namespace", namespace, "exec", pod, "-c", container, "--", "id", "-G").stdout.strip()


def _operator_pods(cluster: Cluster, operator: Operator) -> list[str]:
    pods = objects.get(cluster, "pods", namespace=operator.namespace, selector=operator.selector)["items"]
    return sorted(pod["metadata"]["name"] for pod in pods
                  if pod["status"].get("phase") == "Running" and "deletionTimestamp" not in pod["metadata"])


def _verify_claim(cluster: Cluster, namespace: str, scratch: Path) -> str:
    """``stowaway verify`` over the claim, by the example's pod (the product image, the claim read-only)."""
    (pod,) = training.example("verify/pod.yaml")
    (container,) = pod["spec"]["containers"]
    container["image"], container["imagePullPolicy"] = PRODUCT_IMAGE, "Never"
    assert container["command"][-1] == f"/data/{JOB}"
    name = pod["metadata"]["name"]
    training.apply(cluster, namespace, [pod], scratch)

    def finished() -> str | None:
        phase = objects.get(cluster, "pod", name, namespace=namespace)["status"].get("phase")
        return phase if phase in ("Succeeded", "Failed") else None
    phase = eventually(finished, what="stowaway verify to finish", timeout=POD_START)
    output = cluster.run("kubectl", "--namespace", namespace, "logs", name).stdout
    assert phase == "Succeeded", f"stowaway verify failed:\n{output}"
    return output


@dataclass(frozen=True)
class Operator:
    namespace: str
    release: str

    @property
    def selector(self) -> str:
        return f"app.kubernetes.io/instance={self.release}"


@pytest.fixture(scope="module")
def operator(k8s_cluster: Cluster, k8s_api: client.ApiClient) -> Iterator[Operator]:
    """The chart, installed for this module's jobs (their namespaces are not the operator's: it skips its own)."""
    with fresh_namespace(k8s_api, "stowaway-e2e-system") as system, installed_chart(k8s_cluster, system) as release:
        yield Operator(system, release)


@pytest.fixture(scope="module")
def training_run(k8s_cluster: Cluster, k8s_api: client.ApiClient, operator: Operator,
                 e2e_environment: Environment) -> Iterator[TrainingRun]:
    assert e2e_environment.prometheus is not None, "no Prometheus was built for this session"
    scratch = Path(tempfile.mkdtemp(prefix="e2e", dir="/tmp"))
    with fresh_namespace(k8s_api, "stowaway-e2e-train") as namespace:
        run = TrainingRun(namespace)
        followed: list[FollowedLog] = []
        prometheus = prometheus_of_sidecars(e2e_environment.prometheus, k8s_cluster, namespace, scratch)
        try:
            _train(k8s_cluster, run, scratch, followed, prometheus, operator)
            yield run
        finally:
            for log in followed:
                log.stop()
            prometheus.stop()
            shutil.rmtree(scratch, ignore_errors=True)


def _policy_ready(cluster: Cluster, namespace: str, scratch: Path,
                  policy: list[dict[str, Any]] | None = None) -> None:
    """The example's claim and policy (or ``policy``) applied, waited for as the example's instructions do."""
    training.apply(cluster, namespace, policy or training.policy_objects(), scratch)
    waited = cluster.run("kubectl", "--namespace", namespace, "wait", f"checkpointpolicy/{training.POLICY}",
                         "--for=condition=Ready", "--timeout=120s", timeout=150, check=False)
    assert waited.returncode == 0, waited.stderr + namespace_report(cluster, namespace)


def _train(cluster: Cluster, run: TrainingRun, scratch: Path, followed: list[FollowedLog],
           prometheus: Any, operator: Operator) -> None:
    ns = run.namespace
    _policy_ready(cluster, ns, scratch)
    training.apply(cluster, ns, [training.job_object(REFERENCE, steps=STEPS, pace=0),
                                 training.job_object(JOB, steps=STEPS, pace=PACE)], scratch)

    # 1. The first pod trains and commits; its trainer and sidecar run as the uids the pod and the webhook give.
    first = _running_pod(cluster, ns, JOB)
    name = first["metadata"]["name"]
    sidecar_log = FollowedLog(cluster, ns, name, training.SIDECAR, scratch / "sidecar-1.log")
    followed.append(sidecar_log)
    eventually(lambda: _committed(cluster, ns, first, 3), what="step 3 to commit", timeout=POD_START)
    run.identities = {container: _identity(cluster, ns, name, container)
                      for container in (training.TRAINER, training.SIDECAR)}

    # 2. The ranks die: the container restarts in place and restores from shared memory.
    training.crash_ranks(cluster, ns, name)
    eventually(lambda: training.container_status(objects.get(cluster, "pod", name, namespace=ns),
                                                 training.TRAINER)["restartCount"] >= 1 and
               training.container_status(objects.get(cluster, "pod", name, namespace=ns),
                                         training.TRAINER)["state"].get("running"),
               what="the trainer container to restart in place", timeout=POD_START)
    run.logs.append(cluster.run("kubectl", "--namespace", ns, "logs", name, "-c", training.TRAINER,
                                "--previous").stdout)
    restarted = FollowedLog(cluster, ns, name, training.TRAINER, scratch / "trainer-1b.log")
    followed.append(restarted)
    eventually(lambda: training.resumed_at(restarted.text()) is not None, what="the restarted trainer to resume",
               timeout=POD_START)
    resumed = training.resumed_at(restarted.text())
    assert resumed is not None
    run.after_memory_restore = eventually(lambda: _restores(cluster, ns, first, 2),
                                          what="the sidecar to count both ranks' restores", timeout=60)
    eventually(lambda: _committed(cluster, ns, first, resumed + 3), what="training to go on after the restore",
               timeout=POD_START)

    # 3. The dashboard, with this namespace and job picked, finds the sidecar's series (the example's policy has
    # no bucket tier, so that row stays blank, as it does in Grafana for such a job).
    def dashboard_answers() -> dict[str, list[dict[str, Any]]]:
        answers = {where: prometheus.query(dashboard.with_selected(expr, ns, JOB))
                   for where, expr in dashboard.queries(dashboard.load(), bucket_tier=False)}
        blank = sorted(where for where, result in answers.items() if not result)
        assert not blank, f"blank panels: {blank}"
        return answers
    run.dashboard = eventually(dashboard_answers, what="every dashboard query to return data", timeout=120)
    run.first_pod = name
    run.scraped_labels = [series["metric"] for series in
                          prometheus.query(f'stowaway_last_committed_step{{namespace="{ns}"}}')]

    # 4. The operator is killed, then the training pod is deleted: its sidecar drains; the Job's next pod is
    # admitted once the operator's Deployment has replaced it, restores from the claim and finishes.
    run.killed_operator = _operator_pods(cluster, operator)
    cluster.run("kubectl", "--namespace", operator.namespace, "delete", "pod", "--selector", operator.selector,
                "--grace-period=0", "--force", "--wait=false")
    run.committed_before_delete = int(_metric(cluster, ns, first, "stowaway_last_committed_step"))
    cluster.run("kubectl", "--namespace", ns, "delete", "pod", name, "--wait=false")
    grace = 30 + 15
    run.logs.append(restarted.ended(timeout=grace + 30))
    run.deleted_pod_sidecar_log = sidecar_log.ended(timeout=grace + 30)
    second = _running_pod(cluster, ns, JOB, other_than=name)
    run.operator_after = _operator_pods(cluster, operator)
    last = FollowedLog(cluster, ns, second["metadata"]["name"], training.TRAINER, scratch / "trainer-2.log")
    followed.append(last)
    eventually(lambda: training.resumed_at(last.text()) is not None, what="the next pod to resume",
               timeout=POD_START)
    run.after_storage_restore = eventually(lambda: _restores(cluster, ns, second, 2),
                                           what="the next pod's sidecar to count both ranks' restores", timeout=60)
    eventually(lambda: _complete(cluster, ns, JOB), what=f"job {JOB} to complete", timeout=RUN_TIME)
    run.logs.append(last.ended(timeout=60))
    eventually(lambda: _complete(cluster, ns, REFERENCE), what=f"job {REFERENCE} to complete", timeout=RUN_TIME)
    run.reference = training.fingerprints(cluster.run("kubectl", "--namespace", ns, "logs", f"job/{REFERENCE}",
                                                      "-c", training.TRAINER).stdout)
    run.verify_output = _verify_claim(cluster, ns, scratch)


def test_the_trainer_runs_as_its_own_uid_and_shares_only_the_fsgroup_with_the_sidecar(
    training_run: TrainingRun,
) -> None:
    trainer_uid, *trainer_groups = training_run.identities[training.TRAINER].split()
    sidecar_uid, *sidecar_groups = training_run.identities[training.SIDECAR].split()
    assert (int(trainer_uid), int(sidecar_uid)) == (TRAINER_UID, SIDECAR_UID)
    assert str(TRAINER_FS_GROUP) in trainer_groups and str(TRAINER_FS_GROUP) in sidecar_groups


def test_killed_ranks_restart_the_container_in_place_and_restore_from_shared_memory(
    training_run: TrainingRun,
) -> None:
    killed, restarted, _ = training_run.logs
    resumed = training.resumed_at(restarted)
    assert resumed is not None and training.resumed_at(killed) is None
    assert resumed in training.fingerprints(killed), "it resumed from a step the killed container never took"
    metrics = training_run.after_memory_restore
    assert metrics['stowaway_restores_total{source="memory"}'] == 2
    assert metrics['stowaway_restores_total{source="storage"}'] == 0


def test_a_deleted_pod_drains_and_the_next_pod_restores_the_newest_commit_from_the_claim(
    training_run: TrainingRun,
) -> None:
    sidecar = training_run.deleted_pod_sidecar_log
    assert "stopping: waiting up to" in sidecar and "stopped:" in sidecar, sidecar[-3000:]
    assert "ended with work in flight" not in sidecar, sidecar[-3000:]
    resumed = training.resumed_at(training_run.logs[2])
    assert resumed is not None and resumed >= training_run.committed_before_delete
    assert f"committed step {resumed} of job {JOB}" in sidecar, "the step restored is not the drained sidecar's"
    metrics = training_run.after_storage_restore
    assert metrics['stowaway_restores_total{source="storage"}'] == 2
    assert metrics['stowaway_restores_total{source="memory"}'] == 0


def test_a_killed_operator_is_replaced_and_the_next_pod_is_injected_once_it_is_back(
    training_run: TrainingRun,
) -> None:
    killed, after = training_run.killed_operator, training_run.operator_after
    assert len(killed) == 1 and len(after) == 1 and killed != after, (killed, after)
    # The next pod restored from the claim through its sidecar: the webhook that injected it was the new one.
    assert training_run.after_storage_restore['stowaway_restores_total{source="storage"}'] == 2


def test_training_across_both_interruptions_is_bit_identical_to_an_uninterrupted_run(
    training_run: TrainingRun,
) -> None:
    reference = training_run.reference
    assert sorted(reference) == list(range(STEPS))
    taken: dict[int, list[training.StepRecord]] = {}
    for log in training_run.logs:
        for step, record in training.fingerprints(log).items():
            taken.setdefault(step, []).append(record)
    assert sorted(taken) == list(range(STEPS)), "some step was never taken"
    differing = [step for step, records in taken.items() if any(record != reference[step] for record in records)]
    assert not differing, f"steps differing from the uninterrupted run: {differing[:10]}"
    for later in training_run.logs[1:]:
        resumed = training.resumed_at(later)
        assert resumed is not None and min(training.fingerprints(later)) == resumed + 1


def test_stowaway_verify_finds_every_committed_step_on_the_claim_intact(training_run: TrainingRun) -> None:
    lines = training_run.verify_output.splitlines()
    assert f"step {STEPS - 1}: ok" in lines, training_run.verify_output
    assert all(line.endswith(": ok") for line in lines), training_run.verify_output


def test_prometheus_finds_the_sidecar_as_the_podmonitor_does_and_the_dashboard_shows_the_job(
    training_run: TrainingRun,
) -> None:
    (labels,) = training_run.scraped_labels
    assert (labels["namespace"], labels["pod"], labels["container"], labels["job"]) == (
        training_run.namespace, training_run.first_pod, training.SIDECAR, JOB)
    # Every query returned data with this namespace and job picked (checked while the pod ran).
    assert training_run.dashboard and all(training_run.dashboard.values())


def test_a_dev_shm_smaller_than_the_slots_fails_the_first_save_saying_which_setting_to_raise(
    k8s_cluster: Cluster, k8s_api: client.ApiClient, operator: Operator,
) -> None:
    scratch = Path(tempfile.mkdtemp(prefix="e2e", dir="/tmp"))
    with fresh_namespace(k8s_api, "stowaway-e2e-shm") as ns:
        # The smallest size the CRD allows, 64 MiB, and a model whose state (its Adam moments included) is
        # about 42 MiB per rank: two ranks' two slots need 167 MiB.
        _policy_ready(k8s_cluster, ns, scratch, training.policy_objects("64Mi"))
        job = training.job_object(JOB, steps=5, pace=0, width=384)
        job["spec"]["backoffLimit"] = 0
        job["spec"]["template"]["spec"]["restartPolicy"] = "Never"
        training.apply(k8s_cluster, ns, [job], scratch)
        eventually(lambda: objects.get(k8s_cluster, "job", JOB, namespace=ns).get("status", {}).get("failed"),
                   what="the job to fail", timeout=POD_START)
        log = k8s_cluster.run("kubectl", "--namespace", ns, "logs", f"job/{JOB}", "-c", training.TRAINER).stdout
    shutil.rmtree(scratch, ignore_errors=True)
    # What docs/troubleshooting.md tells a user to look for, and the setting it names.
    assert "ShmCapacityError" in log, log[-3000:]
    assert "shared memory at /dev/shm" in log and "is too small" in log, log[-3000:]
    assert "spec.sharedMemory.sizeLimit" in log, log[-3000:]


def test_one_slot_per_rank_and_a_pooled_spare_train_where_two_slots_per_rank_do_not_fit(
    k8s_cluster: Cluster, k8s_api: client.ApiClient, operator: Operator,
) -> None:
    scratch = Path(tempfile.mkdtemp(prefix="e2e", dir="/tmp"))
    with fresh_namespace(k8s_api, "stowaway-e2e-pool") as ns:
        # About 42 MiB of state per rank, as above: two ranks' two slots need 167 MiB, which 150 MiB cannot
        # hold; one slot each and a spare they share need 126 MiB. The trainer saves every step without waiting,
        # and the sidecar, held to 20 millicores, persists slower than it trains, so a rank saves again while its
        # slot persists and borrows the spare, whose lock the trainer's container and the sidecar's take on one
        # file of the pod's memory volume.
        policy = training.policy_objects("150Mi", pooled=True)
        for doc in policy:
            if doc["kind"] == "CheckpointPolicy":
                doc["spec"]["sidecar"] = {"resources": {"requests": {"cpu": "20m"}, "limits": {"cpu": "20m"}}}
        _policy_ready(k8s_cluster, ns, scratch, policy)
        job = training.job_object(JOB, steps=12, pace=0, width=384)
        job["spec"]["backoffLimit"] = 0
        job["spec"]["template"]["spec"]["restartPolicy"] = "Never"
        training.apply(k8s_cluster, ns, [job], scratch)
        eventually(lambda: _complete(k8s_cluster, ns, JOB), what="the job to complete", timeout=POD_START)
        log = k8s_cluster.run("kubectl", "--namespace", ns, "logs", f"job/{JOB}", "-c", training.TRAINER).stdout
        sidecar = k8s_cluster.run("kubectl", "--namespace", ns, "logs", f"job/{JOB}", "-c",
                                  training.SIDECAR).stdout
    shutil.rmtree(scratch, ignore_errors=True)
    assert "committed steps 0..11" in log, log[-3000:]
    # The sidecar's summary as it stopped: saves written into the spare.
    borrowed = re.search(r"'pooled_spare_saves': (\d+)", sidecar)
    assert borrowed and int(borrowed.group(1)) > 0, sidecar[-3000:]
