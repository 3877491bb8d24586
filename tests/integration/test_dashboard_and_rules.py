"""The Grafana dashboard and the alert rules: their structure, and every PromQL expression in them
parsed by the real Prometheus (its query API answers 400 `bad_data` to an expression that does not
parse). Whether the expressions return data is checked by the end-to-end test with a workload."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.integration.test_chart import CHART, KUBE_VERSION, _helm

DASHBOARD = CHART / "files" / "dashboards" / "otel-dra.json"

# The seed's example queries (shared/reference/metrics.md §2): users already run these, so the
# dashboard carries them verbatim.
SEED_QUERIES = (
    'rate(dra_example_driver_prepare_claims_total{result="error"}[5m])',
    "histogram_quantile(0.99, sum(rate(dra_example_driver_prepare_claim_duration_seconds_bucket[5m])) by (le))",
    'sum(rate(rest_client_requests_total{code=~"5.."}[5m]))',
)

# Grafana variables the dashboard uses, and a value each that Grafana could substitute.
GRAFANA_VARIABLES = {"__rate_interval": "5m", "__interval": "1m", "__range": "6h", "job": ".*"}
_VARIABLE = re.compile(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)")


def grafana_to_promql(expr: str) -> str:
    def substitute(m: re.Match[str]) -> str:
        name = m.group(1) or m.group(2)
        if name not in GRAFANA_VARIABLES:
            raise AssertionError(f"dashboard uses an unknown variable ${name} in {expr!r}")
        return GRAFANA_VARIABLES[name]

    return _VARIABLE.sub(substitute, expr)


def _panels(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for panel in panels:
        yield panel
        yield from _panels(panel.get("panels", []))  # collapsed rows nest their panels


def dashboard() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return data


def dashboard_expressions() -> list[tuple[str, str]]:
    """(where, PromQL) for every panel target and every query variable of the dashboard."""
    dash = dashboard()
    out = []
    for panel in _panels(dash["panels"]):
        for target in panel.get("targets", []):
            out.append((f"panel {panel['title']!r} {target['refId']}", grafana_to_promql(target["expr"])))
    for variable in dash["templating"]["list"]:
        if variable["type"] == "query":
            # label_values(<selector>, <label>) is Grafana's; the selector inside is PromQL.
            m = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", variable["definition"])
            assert m, f"variable {variable['name']}: unexpected query {variable['definition']!r}"
            out.append((f"variable {variable['name']}", m.group(1)))
    return out


def rule_expressions(helm: Path) -> list[tuple[str, str]]:
    rendered = _helm(
        helm,
        "template",
        "rel",
        str(CHART),
        "--kube-version",
        KUBE_VERSION,
        "--set",
        "prometheusRule.enabled=true",
        "--show-only",
        "templates/prometheusrule.yaml",
    ).stdout
    rule = yaml.safe_load(rendered)
    return [
        (f"alert {r['alert']}" if "alert" in r else f"record {r['record']}", r["expr"])
        for g in rule["spec"]["groups"]
        for r in g["rules"]
    ]


def test_dashboard_rows_and_panels():
    dash = dashboard()
    rows: dict[str, list[dict[str, Any]]] = {}
    current = None
    for panel in dash["panels"]:
        if panel["type"] == "row":
            current = panel["title"]
            rows[current] = []
        else:
            assert current is not None, f"panel {panel['title']!r} is outside any row"
            rows[current].append(panel)
    assert list(rows) == [
        "Driver operations",
        "Prepare latency",
        "Kubernetes API",
        "Cluster state",
        "Device health",
        "Kubelet",
    ]
    stats = {p["title"] for p in rows["Driver operations"] if p["type"] == "stat"}
    assert stats == {"Prepares", "Unprepares", "Errors", "Fatal errors"}
    latency = " ".join(t["expr"] for p in rows["Prepare latency"] for t in p["targets"])
    assert "histogram_quantile(0.5," in latency and "histogram_quantile(0.99," in latency
    assert "dra_example_driver_unprepare_claims_total" in latency
    api = " ".join(t["expr"] for p in rows["Kubernetes API"] for t in p["targets"])
    assert "sum by (code) (rate(rest_client_requests_total" in api
    assert "rest_client_request_duration_seconds_bucket" in api
    state = " ".join(t["expr"] for p in rows["Cluster state"] for t in p["targets"])
    for name in ("kube_resourcepool_devices", "kube_resourcepool_devices_allocated", "kube_resourceclaim_hourly_cost"):
        assert name in state
    assert "kube_resourceclaim_status_reserved_total" in state
    health = " ".join(t["expr"] for p in rows["Device health"] for t in p["targets"])
    for name in (
        "otel_dra_plugin_device_health",
        "kube_resourceslice_device_taint",
        "kube_pod_resourceclaim_device_health",
        "otel_dra_plugin_health_streams",
        "kube_resourceclaim_status_allocated_device",
    ):
        assert name in health
    # The kubelet's own DRA metrics (no `kubelet_` prefix; unchanged from 1.34 to 1.38).
    kubelet = " ".join(t["expr"] for p in rows["Kubelet"] for t in p["targets"])
    for name in (
        "dra_grpc_operations_duration_seconds_bucket",
        "dra_operations_duration_seconds_bucket",
        "dra_resource_claims_in_use",
        "dra_node_prepare_skips_total",
        "dra_node_unprepare_skips_total",
    ):
        assert name in kubelet
    # Every panel and variable reads the data source chosen in the dashboard.
    for panel in _panels(dash["panels"]):
        if panel["type"] != "row":
            assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
    ids = [p["id"] for p in _panels(dash["panels"])]
    assert len(ids) == len(set(ids)), "panel ids must be unique"


def test_seed_queries_are_on_the_dashboard():
    def normal(expr: str) -> str:
        return " ".join(expr.split())

    shipped = {normal(expr) for _, expr in dashboard_expressions()}
    for query in SEED_QUERIES:
        assert normal(query) in shipped, query


def test_every_shipped_expression_parses_in_prometheus(prometheus, helm):
    expressions = dashboard_expressions() + rule_expressions(helm)
    assert len(expressions) > 20
    failures = []
    for where, expr in expressions:
        status, body = prometheus.api_raw("/api/v1/query", query=expr)
        answer = json.loads(body)
        if status != 200 or answer.get("status") != "success":
            failures.append(f"{where}: {expr}\n  -> HTTP {status} {answer.get('errorType')}: {answer.get('error')}")
    assert not failures, "\n".join(failures)


def test_prometheus_rejects_an_expression_that_does_not_parse(prometheus):
    """The check above can fail: Prometheus answers 400 bad_data to a parse error."""
    status, body = prometheus.api_raw("/api/v1/query", query="sum by (le (rate(x[5m]))")
    answer = json.loads(body)
    assert status == 400 and answer["errorType"] == "bad_data", answer
    with pytest.raises(AssertionError, match="unknown variable"):
        grafana_to_promql("rate(x{node=~'$node'}[5m])")
