"""The shipped Grafana dashboard, read the way Grafana reads it."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

PATH = Path(__file__).parents[2] / "deploy" / "grafana" / "stowaway-dashboard.json"
SERIES = re.compile(r"\bstowaway_[a-z0-9_]+\b")
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


def queries(dashboard: dict[str, Any]) -> list[tuple[str, str]]:
    """(where, PromQL) of every panel target and every query variable."""
    found = [(panel["title"], target["expr"]) for panel in panels(dashboard) for target in panel.get("targets", [])]
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            selector = re.fullmatch(r"label_values\((.+), *\w+\)", variable["definition"])
            assert selector, f"variable {variable['name']}: {variable['definition']}"
            found.append((f"variable {variable['name']}", selector.group(1)))
    return found


def with_all_selected(expr: str) -> str:
    for variable, value in ALL_SELECTED.items():
        expr = expr.replace(variable, value)
    assert "$" not in expr, f"unknown variable in {expr}"
    return expr
