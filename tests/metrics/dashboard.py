"""The shipped Grafana dashboard, read the way Grafana reads it."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

# The source; deploy/grafana/ and the chart's ConfigMap are copies (tests/k8s check both).
PATH = Path(__file__).parents[2] / "charts" / "stowaway" / "dashboards" / "stowaway-dashboard.json"
SERIES = re.compile(r"\bstowaway_[a-z0-9_]+\b")
# The operator's series: one operator per cluster, so its panels are not filtered by the sidecars' variables.
OPERATOR_SERIES = "stowaway_operator_"
# Series a sidecar exports only with a bucket tier: the "Bucket tier" row is blank for a job without one.
BUCKET_TIER_SERIES = ("stowaway_bucket_", "stowaway_tier_")
# What Grafana puts in place of the variables when everything is selected.
ALL_SELECTED = {"$__rate_interval": "5m", "$namespace": ".*", "$job": ".*"}


def load() -> dict[str, Any]:
    return json.loads(PATH.read_text())


def panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    """Every panel, including those nested in rows."""
    found = []
    for panel in dashboard["panels"]:
        found.append(panel)
        found.extend(panel.get("panels", []))
    return found


def queries(dashboard: dict[str, Any], bucket_tier: bool = True) -> list[tuple[str, str]]:
    """(where, PromQL) of every panel target over the sidecars' series, and of every query variable; without
    the bucket tier's panels unless ``bucket_tier`` (for sidecars that run without one).

    Split from :func:`operator_queries` because each returns data only from a
    Prometheus that scraped its own kind of target.
    """
    found = [(where, expr) for where, expr in _targets(dashboard) if OPERATOR_SERIES not in expr
             and (bucket_tier or not any(series in expr for series in BUCKET_TIER_SERIES))]
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            selector = re.fullmatch(r"label_values\((.+), *\w+\)", variable["definition"])
            assert selector, f"variable {variable['name']}: {variable['definition']}"
            found.append((f"variable {variable['name']}", selector.group(1)))
    return found


def operator_queries(dashboard: dict[str, Any]) -> list[tuple[str, str]]:
    """(where, PromQL) of every panel target over the operator's series."""
    return [(where, expr) for where, expr in _targets(dashboard) if OPERATOR_SERIES in expr]


def _targets(dashboard: dict[str, Any]) -> list[tuple[str, str]]:
    return [(panel["title"], target["expr"]) for panel in panels(dashboard) for target in panel.get("targets", [])]


def with_all_selected(expr: str) -> str:
    return _substituted(expr, ALL_SELECTED)


def with_selected(expr: str, namespace: str, job: str) -> str:
    """``expr`` as Grafana sends it when one namespace and one job are picked (names with no regex characters)."""
    return _substituted(expr, {**ALL_SELECTED, "$namespace": namespace, "$job": job})


def _substituted(expr: str, values: dict[str, str]) -> str:
    for variable, value in values.items():
        expr = expr.replace(variable, value)
    assert "$" not in expr, f"unknown variable in {expr}"
    return expr
