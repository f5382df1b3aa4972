"""The operator's /metrics, scraped from the running process, counts what the real API server asked of it."""

from __future__ import annotations

import math

import pytest
from kubernetes import client
from metrics import dashboard
from metrics.promtools import PrometheusServer, check_metrics, http_get, samples

from stowaway.operator import injection

from .operator_fixtures import SIDECAR_IMAGE, RunningOperator, denial, training_pod
from .wait import eventually

pytestmark = pytest.mark.k8s

RESULTS = ("injected", "skipped", "already_injected", "denied", "error")


def scrape(operator: RunningOperator) -> str:
    answer = http_get(f"{operator.metrics_url}/metrics")
    assert answer.status == 200, answer
    assert answer.content_type.startswith("text/plain"), answer.content_type
    return answer.body


def counts(exposition: str) -> dict[str, float]:
    """Injections by result, webhook answers timed, and policy reconcile errors, from one scrape."""
    found = samples(exposition)
    result = {r: found[f'stowaway_operator_injections_total{{result="{r}"}}'] for r in RESULTS}
    result["timed"] = found["stowaway_operator_webhook_duration_seconds_count"]
    result["reconcile_errors"] = found["stowaway_operator_policy_reconcile_errors_total"]
    return result


def test_admissions_through_the_api_server_move_the_counters_by_result(
    k8s_api: client.ApiClient, ready_policy: str, stowaway_operator: RunningOperator
) -> None:
    before = counts(scrape(stowaway_operator))
    core = client.CoreV1Api(k8s_api)
    core.create_namespaced_pod(ready_policy, training_pod())
    core.create_namespaced_pod(ready_policy, training_pod())
    carrying = training_pod(**{injection.MARKER_ANNOTATION: "default"})  # as a copy of an injected pod
    carrying["spec"]["initContainers"] = [
        {"name": injection.SIDECAR_NAME, "image": SIDECAR_IMAGE, "restartPolicy": "Always"},
    ]
    core.create_namespaced_pod(ready_policy, carrying)
    denial(k8s_api, ready_policy, training_pod(**{injection.POLICY_ANNOTATION: "no-such-policy"}))
    core.create_namespaced_pod(ready_policy, training_pod(labelled=False))  # never reaches the webhook

    after = counts(scrape(stowaway_operator))
    moved = {key: after[key] - before[key] for key in before}
    assert moved == {
        "injected": 2, "skipped": 0, "already_injected": 1, "denied": 1, "error": 0, "timed": 4,
        "reconcile_errors": 0,
    }


@pytest.mark.prometheus
def test_the_scrape_is_clean_for_promtool_and_has_every_series_from_the_start(
    ready_policy: str, stowaway_operator: RunningOperator
) -> None:
    exposition = scrape(stowaway_operator)
    check = check_metrics(exposition)
    assert check.returncode == 0 and not check.stdout.strip(), check.stdout + check.stderr
    assert "# TYPE stowaway_operator_webhook_duration_seconds histogram" in exposition
    assert set(counts(exposition)) == {*RESULTS, "timed", "reconcile_errors"}


@pytest.mark.prometheus
def test_every_operator_panel_of_the_dashboard_shows_data_once_prometheus_scraped_the_operator(
    k8s_api: client.ApiClient, ready_policy: str, stowaway_operator: RunningOperator
) -> None:
    injected = 'stowaway_operator_injections_total{result="injected"}'
    prometheus = PrometheusServer(stowaway_operator.metrics_url.removeprefix("http://"))
    try:
        # One more than the first scraped value (never 0, so `eventually` takes it).
        wanted = eventually(lambda: (seen := prometheus.value(injected)) is not None and seen + 1,
                            what="Prometheus to scrape the operator")
        # An admission between two scrapes, so that rates and the latency quantiles have something to show.
        client.CoreV1Api(k8s_api).create_namespaced_pod(ready_policy, training_pod())
        eventually(lambda: prometheus.value(injected) == wanted, what="Prometheus to see the injection")
        for where, expr in dashboard.operator_queries(dashboard.load()):
            result = prometheus.query(dashboard.with_all_selected(expr))
            assert result, f"{where}: {expr} returns nothing; the panel would be blank"
            values = [float(series["value"][1]) for series in result]
            assert all(math.isfinite(value) for value in values), f"{where}: {expr} returns {values}"
    finally:
        prometheus.stop()
