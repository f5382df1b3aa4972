"""The shipped alerts are valid, fire on a sidecar in trouble and stay quiet otherwise, and watch real series."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml

from metrics import dashboard
from metrics.promtools import binary, http_get, sample_names

RULES = Path(__file__).parents[2] / "charts" / "stowaway" / "rules" / "stowaway-alerts.yaml"
UNIT_TESTS = Path(__file__).with_name("alerts-test.yaml")


def alerts() -> list[dict]:
    return [rule for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"]]


@pytest.mark.prometheus
def test_the_rule_file_is_valid_for_promtool() -> None:
    check = subprocess.run([binary("promtool"), "check", "rules", str(RULES)], capture_output=True, text=True,
                           timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr


@pytest.mark.prometheus
def test_each_alert_fires_on_a_job_in_trouble_and_stays_quiet_on_a_healthy_one() -> None:
    result = subprocess.run([binary("promtool"), "test", "rules", UNIT_TESTS.name], cwd=UNIT_TESTS.parent,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    tested = {case["alertname"] for test in yaml.safe_load(UNIT_TESTS.read_text())["tests"]
              for case in test["alert_rule_test"] if case["exp_alerts"]}
    assert tested == {rule["alert"] for rule in alerts()}, "every alert has a case where it fires"


def test_every_alert_names_only_series_a_real_sidecar_exposes_and_says_which_job(metrics_sidecar) -> None:
    exposed = sample_names(http_get(f"{metrics_sidecar.url}/metrics").body)
    for rule in alerts():
        named = set(dashboard.SERIES.findall(rule["expr"]))
        assert named and named <= exposed, f"{rule['alert']} uses {sorted(named - exposed)}, which no sidecar exposes"
        assert "{{ $labels.job }}" in rule["annotations"]["summary"] + rule["annotations"]["description"]
