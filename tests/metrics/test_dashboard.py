"""The Grafana dashboard cannot silently go blank: every query is valid and names real series."""

from __future__ import annotations

import json
import subprocess

import pytest

from metrics import dashboard
from metrics.promtools import binary, http_get, sample_names
from stowaway.operator import metrics as operator_metrics


def test_the_dashboard_has_a_stable_uid_and_datasource_namespace_and_job_variables() -> None:
    board = dashboard.load()
    assert board["uid"] == "stowaway-checkpoints"
    variables = {variable["name"]: variable for variable in board["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    assert {"namespace", "job"} <= set(variables)
    titles = {panel["title"] for panel in dashboard.panels(board)}
    assert {"Save blocking time", "Persist time", "Commit time", "Throughput", "Slot wait", "Failures by reason",
            "Restores by source", "Overlapped saves", "Age of the last committed checkpoint", "Ranks connected",
            "Slots in flight", "Injections by result", "Webhook latency", "Policy reconcile errors"} <= titles


def test_only_the_bucket_tier_row_is_left_out_for_a_sidecar_without_a_bucket_tier() -> None:
    board = dashboard.load()
    row_titles, row = set(), None
    for panel in board["panels"]:  # an open row's panels follow it, up to the next row
        if panel["type"] == "row":
            row = panel["title"]
        elif row == "Bucket tier":
            row_titles.add(panel["title"])
    left_out = {where for where, _ in dashboard.queries(board)} - {where for where, _ in
                                                                   dashboard.queries(board, bucket_tier=False)}
    assert left_out and left_out <= row_titles, (left_out, row_titles)


def test_every_sidecar_panel_query_filters_by_namespace_and_job() -> None:
    board = dashboard.load()
    for panel in dashboard.panels(board):
        for target in panel.get("targets", []):
            for series in dashboard.SERIES.finditer(target["expr"]):
                if series.group().startswith(dashboard.OPERATOR_SERIES):
                    # The operator's job and namespace are its own, never a training job's.
                    assert "$job" not in target["expr"], f"{panel['title']}: {target['expr']}"
                    continue
                assert target["expr"][series.end():].startswith('{namespace=~"$namespace", job=~"$job"}'), (
                    f"{panel['title']}: {series.group()} is not filtered by the variables: {target['expr']}"
                )


def test_every_query_names_only_series_a_real_sidecar_or_the_operator_exposes(metrics_sidecar) -> None:
    sidecar = sample_names(http_get(f"{metrics_sidecar.url}/metrics").body)
    # The operator's own registry, as its /metrics serves it (tests/k8s/test_operator_metrics.py scrapes the process).
    operator = sample_names(operator_metrics.OperatorMetrics().exposition()[0].decode())
    board = dashboard.load()
    for where, expr in dashboard.queries(board) + dashboard.operator_queries(board):
        named = set(dashboard.SERIES.findall(expr))
        assert named, f"{where} names no stowaway series: {expr}"
        assert named <= sidecar | operator, (
            f"{where} uses {sorted(named - sidecar - operator)}, which neither the sidecar nor the operator exposes"
        )


@pytest.mark.prometheus
def test_every_query_is_valid_promql_for_promtool(tmp_path) -> None:
    board = dashboard.load()
    rules = {"groups": [{"name": "dashboard", "rules": [
        {"record": f"dashboard:query_{index}", "expr": dashboard.with_all_selected(expr)}
        for index, (_, expr) in enumerate(dashboard.queries(board) + dashboard.operator_queries(board))
    ]}]}
    path = tmp_path / "rules.yml"
    path.write_text(json.dumps(rules))  # JSON is YAML
    check = subprocess.run([binary("promtool"), "check", "rules", str(path)], capture_output=True, text=True,
                           timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr
