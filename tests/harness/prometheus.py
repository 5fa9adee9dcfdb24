"""What config/prometheus/ ships, as the tests read it: the alert rules, the dashboard's
queries, and the metric names each expression uses."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import yaml

from tests.harness import REPO

PROMETHEUS = REPO / "config" / "prometheus"
ALERTS = PROMETHEUS / "alerts.yaml"
DASHBOARD = PROMETHEUS / "grafana-dashboard.json"
# The one series an expression may name that no cns process exports: Prometheus' own.
PROMETHEUS_SERIES = frozenset({"up"})
# PromQL words `metric_names` must not take for metric names.
_NOT_NAMES = frozenset(
    [
        "by",
        "without",
        "on",
        "ignoring",
        "group_left",
        "group_right",
        "bool",
        "and",
        "or",
        "unless",
        "offset",
        "le",
        "sum",
        "max",
        "min",
        "avg",
        "count",
        "rate",
        "increase",
        "irate",
        "histogram_quantile",
        "max_over_time",
        "min_over_time",
        "avg_over_time",
        "vector",
        "absent",
        "humanizePercentage",
    ]
)


def rule_file() -> dict[str, Any]:
    """The PrometheusRule's `spec`: a Prometheus rule file."""
    spec: dict[str, Any] = yaml.safe_load(ALERTS.read_text())["spec"]
    return spec


def write_rule_file(path: Path) -> Path:
    path.write_text(yaml.safe_dump(rule_file()))
    return path


def alerts() -> dict[str, str]:
    """Every alert's name -> its expression."""
    return {
        rule["alert"]: rule["expr"]
        for group in rule_file()["groups"]
        for rule in group["rules"]
        if "alert" in rule
    }


def dashboard_queries() -> dict[str, list[str]]:
    """Every panel's title -> its queries' expressions; every variable's ("$name") -> the
    metric its `label_values(METRIC, LABEL)` reads."""
    dashboard = json.loads(DASHBOARD.read_text())
    queries = {
        panel["title"]: [target["expr"] for target in panel.get("targets", ())]
        for panel in dashboard["panels"]
        if panel.get("type") != "row"
    }
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            found = re.fullmatch(r"label_values\((\w+), *\w+\)", variable["query"])
            assert found, f"${variable['name']}: {variable['query']!r} is not label_values(...)"
            queries[f"${variable['name']}"] = [found[1]]
    return queries


def metric_names(expression: str) -> set[str]:
    """The metric names a PromQL expression selects (label matchers and strings removed)."""
    bare = re.sub(r"\{[^}]*\}", " ", re.sub(r'"[^"]*"', '""', expression))
    bare = re.sub(r"\[[^\]]*\]", " ", bare)
    bare = re.sub(r"\b(by|without|on|ignoring)\s*\([^)]*\)", " ", bare)
    return {name for name in re.findall(r"[a-zA-Z_:][\w:]*", bare) if name not in _NOT_NAMES}
