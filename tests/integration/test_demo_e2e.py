"""The whole stack as a user runs it: `otel-dra demo` (control plane, simulated GPU nodes running
the instrumented plugin, the kubelet emulator, a cycling workload, the exporter), with its OTLP going
to the real OpenTelemetry Collector (collector-config/gateway.yaml), traces on to a real Jaeger, and
a real Prometheus scraping the exporter, both plugins and the Collector.

Checked: Prometheus holds the seed metrics with the values the workload implies; every PromQL
expression of the dashboard and the alert rules parses and returns data (except where "no series"
is the healthy answer: the error-only selectors); the plugin metric names that reach Prometheus
through the Collector are those scraped directly; Jaeger returns a prepare trace with the RPC span,
its per-claim child and that child's steps; the Jaeger link the demo prints is a live claim's UID,
and Jaeger returns that claim's trace with the exporter's lifecycle spans and the plugin's prepare."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from otel_dra.kube.client import KubeClient, load_credentials
from otel_dra.telemetry.traceids import root_span_id
from tests import peers
from tests.helpers import free_port, free_ports, scrape, wait_until
from tests.integration.test_dashboard_and_rules import dashboard_expressions, rule_expressions

NODES, PODS = 2, 4
GIB = 1024**3

# Expressions whose healthy answer in the demo can be "no series": they select only failures (5xx,
# errors, retries, fatal errors, devices without a valid price: the demo's class has one) or states
# the workload does not produce for long (claims left unreserved: the garbage collector deletes a
# finished pod's claim within a second).
# Expressions of failure conditions, empty while the demo is healthy: errors, retries, and unhealthy
# devices (the demo's simulated devices stay healthy; tests/promtool and test_node_health cover those),
# dropped trace spans; and binding conditions, which the demo's devices have none of (tests/promtool).
MAY_BE_EMPTY = re.compile(
    r'code=~"5\.\."|result="error"|fatal_background_errors|_retries_total|reserved_total\)? == 0|unpriced'
    r'|health="Unhealthy"|spans_dropped_total|binding_duration_seconds'
)
# The kubelet's own DRA metrics (the dashboard's Kubelet row): the demo's kubelet emulator serves
# none; tests/integration/test_node.py checks them against a real kubelet of each release.
FROM_A_REAL_KUBELET = re.compile(r"\bdra_(grpc_)?operations_duration_seconds|\bdra_resource_claims_in_use|\bdra_node_")
# The alert rules select the exporter by the job label the chart's monitor gives it (release "rel").
EXPORTER_JOB = "rel-otel-dra"


def _demo_ports() -> tuple[int, int]:
    """A port for the demo's exporter and the first of NODES consecutive ones for its plugins."""
    plugin_port = free_ports(NODES)
    port = free_port()
    while plugin_port <= port < plugin_port + NODES:
        port = free_port()
    return port, plugin_port


@pytest.fixture(scope="module")
def demo(otelcol_gateway, jaeger, testbed_binaries) -> Iterator[dict[str, Any]]:
    # No OTel settings of the test run's own, but the same testbed Kubernetes (OTEL_DRA_*).
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_") or k.startswith("OTEL_DRA_")}
    env.update(
        OTEL_EXPORTER_OTLP_ENDPOINT=f"http://{otelcol_gateway.endpoint(4318)}",
        OTEL_EXPORTER_OTLP_PROTOCOL="http/protobuf",
        OTEL_METRIC_EXPORT_INTERVAL="1000",
        OTEL_TRACES_SAMPLER="always_on",
        OTEL_BSP_SCHEDULE_DELAY="500",
    )
    # A port free_port() picked can be taken by another socket before the demo binds it (tests
    # that open many connections make that likely): a demo that exits for "Address already in use"
    # is started again with new ports, up to 3 times, as tests/peers.py does for the peers.
    for attempt in range(3):
        port, plugin_port = _demo_ports()
        directory = Path(tempfile.mkdtemp(prefix="e2e-"))
        # Its output goes to a file: a pipe nobody reads while the demo runs would fill up and block it.
        log = directory / "demo.log"
        with log.open("w") as out:
            proc = subprocess.Popen(
                [
                    sys.executable, "-m", "otel_dra", "demo", "--dir", str(directory), "--nodes", str(NODES),
                    "--pods", str(PODS), "--port", str(port), "--plugin-metrics-port", str(plugin_port),
                    "--jaeger-ui", jaeger.url("query"),
                ],
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
            )  # fmt: skip
        wait_until(lambda proc=proc, port=port: proc.poll() is not None or (_listening(port) and scrape(port)[0] == 200),
                   180, what="the demo's exporter")  # fmt: skip
        if proc.poll() is None:
            break
        output = log.read_text()
        shutil.rmtree(directory, ignore_errors=True)
        assert "Address already in use" in output and attempt < 2, output
    try:
        yield {"port": port, "plugin_ports": [plugin_port + i for i in range(NODES)], "dir": directory, "log": log}
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=120)
        output = log.read_text()
        shutil.rmtree(directory, ignore_errors=True)
    assert proc.returncode == 0, output


def _listening(port: int) -> bool:
    from tests.helpers import listening

    return listening(port)


@pytest.fixture(scope="module")
def prom(prometheus, otelcol_gateway, demo) -> peers.Prometheus:
    prometheus.set_jobs(
        {
            EXPORTER_JOB: {
                "static_configs": [{"targets": [f"127.0.0.1:{demo['port']}"], "labels": {"path": "direct"}}]
            },
            "dra-example-driver": {
                "static_configs": [
                    {"targets": [f"127.0.0.1:{p}" for p in demo["plugin_ports"]], "labels": {"path": "direct"}}
                ]
            },
            "otel-collector": {
                "honor_labels": True,
                "static_configs": [{"targets": [otelcol_gateway.endpoint(8889)], "labels": {"path": "collector"}}],
            },
        }
    )
    for job in (EXPORTER_JOB, "dra-example-driver", "otel-collector"):
        wait_until(lambda job=job: prometheus.targets_up(job), 60, what=f"{job} targets up")
    return prometheus


def readme_expressions() -> list[tuple[str, str]]:
    """The PromQL examples of the README (its ```promql block), comments stripped."""
    text = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    block = text.split("```promql\n", 1)[1].split("```", 1)[0]
    queries = [line.split("  #", 1)[0].strip() for line in block.splitlines() if line.strip()]
    assert len(queries) >= 5
    return [(f"README {q!r}", q) for q in queries]


def _value(prom: peers.Prometheus, expr: str) -> float | None:
    result = prom.query(expr)
    return float(result[0]["value"][1]) if result else None


def test_prometheus_holds_what_the_workload_implies(prom):
    # Every simulated GPU of every node, with the example driver's 80Gi.
    wait_until(
        lambda: (
            _value(
                prom, 'count(kube_resourceslice_device_capacity_memory_bytes{path="direct",driver="gpu.example.com"})'
            )
            == NODES * 8
        ),
        60,
        what="all devices in Prometheus",
    )
    assert _value(prom, 'max(kube_resourceslice_device_capacity_memory_bytes{path="direct"})') == 80 * GIB
    assert _value(prom, 'kube_deviceclass_hourly_cost{path="direct",deviceclass_name="gpu.example.com"}') == 2.5
    # PODS pods keep running, each reserving one claim: at some scrape exactly PODS reservations.
    wait_until(
        lambda: _value(prom, 'sum(kube_resourceclaim_status_reserved_total{path="direct",namespace="demo"})') == PODS,
        90,
        what=f"{PODS} reservations in Prometheus",
    )
    # Both plugins prepare claims, and the counters keep moving as pods cycle.
    first = wait_until(
        lambda: _value(prom, 'sum(dra_example_driver_prepare_claims_total{path="direct",result="success"})'),
        60,
        what="prepared claims",
    )
    wait_until(
        lambda: (
            (_value(prom, 'sum(dra_example_driver_prepare_claims_total{path="direct",result="success"})') or 0) > first
        ),
        90,
        what="prepare counter moving",
    )
    assert _value(prom, 'sum(dra_example_driver_prepare_claims_total{path="direct",result="error"})') == 0
    assert _value(prom, 'count(count by (instance) (dra_example_driver_prepare_claims_total{path="direct"}))') == NODES


def test_every_dashboard_and_alert_expression_returns_data(prom, helm):
    # Rates need two samples inside their window: wait until the prepare rate is there.
    wait_until(lambda: prom.query("sum(rate(dra_example_driver_unprepare_claims_total[5m])) > 0"), 90, what="rates")
    expressions = dashboard_expressions() + rule_expressions(helm) + readme_expressions()
    # An alert fires on a comparison; what must return data is the quantity it compares.
    pending = {
        where: re.sub(r"\s*(>|<|>=|<=|==|!=)\s*[0-9.e+-]+\s*$", "", expr.strip())
        for where, expr in expressions
        if not MAY_BE_EMPTY.search(expr) and not FROM_A_REAL_KUBELET.search(expr)
    }
    assert len(pending) >= 10

    def all_answered() -> bool:
        for where, quantity in list(pending.items()):
            if prom.query(quantity):
                del pending[where]
        return not pending

    try:
        wait_until(all_answered, 60, interval=2, what="data for every expression")
    except AssertionError:
        raise AssertionError(f"expressions without data against the demo: {pending}") from None


def test_plugin_metric_names_through_the_collector_equal_direct(prom):
    def names(selector: str) -> set[str]:
        return {n for n in prom.metric_names(selector) if n.startswith(("dra_example_driver_", "rest_client_"))}

    def both() -> tuple[set[str], set[str]] | None:
        # Through the gateway the job is the plugins' service name (honor_labels).
        direct, collector = names('{job="dra-example-driver"}'), names('{path="collector",job="otel-dra-plugin"}')
        return (direct, collector) if direct and direct <= collector else None

    direct, collector = wait_until(both, 60, what="plugin metrics through the Collector")
    assert collector == direct


def test_jaeger_has_a_prepare_trace_with_per_claim_children(prom, jaeger):
    """A claim's trace, looked up by its UID without the dashes (as docs/plugin.md tells users):
    the plugin's claim span is a child of the claim's derived root with its steps as children, and
    it links (FOLLOWS_FROM, in Jaeger's model) to the NodePrepareResources span of the call."""
    rpc_name = "k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/NodePrepareResources"

    def refs(s: dict[str, Any], kind: str) -> list[dict[str, Any]]:
        return [r for r in s.get("references", []) if r["refType"] == kind]

    def claim_trace() -> Any:
        for found in jaeger.traces("otel-dra-plugin", operation="prepare claim"):
            for span in found["spans"]:
                tags = {t["key"]: t["value"] for t in span["tags"]}
                if span["operationName"] != "prepare claim" or tags.get("dra.result") != "success":
                    continue
                trace = jaeger.trace(uuid.UUID(tags["dra.claim.uid"]).hex)  # the lookup by trace id
                if trace is None:
                    continue
                spans = {s["spanID"]: s for s in trace["spans"]}
                claim = spans.get(span["spanID"])
                if claim is None:
                    continue
                steps = [s for s in spans.values() if [r["spanID"] for r in refs(s, "CHILD_OF")] == [claim["spanID"]]]
                if len(steps) >= 3 and refs(claim, "FOLLOWS_FROM"):
                    return trace, claim, steps, tags
        return None

    trace, claim, steps, tags = wait_until(claim_trace, 60, interval=1, what="a claim's trace in Jaeger")
    trace_id = uuid.UUID(tags["dra.claim.uid"]).int
    assert int(trace["traceID"], 16) == trace_id
    (parent,) = refs(claim, "CHILD_OF")
    assert int(parent["spanID"], 16) == root_span_id(trace_id)
    assert tags["k8s.namespace.name"] == "demo"
    assert {s["operationName"] for s in steps} >= {"write CDI spec", "write checkpoint"}
    # The link leads to the call's trace, whose RPC span links back to the claim's span.
    (link,) = refs(claim, "FOLLOWS_FROM")
    call = wait_until(lambda: jaeger.trace(link["traceID"]), 60, interval=1, what="the linked call's trace")
    (rpc,) = [s for s in call["spans"] if s["spanID"] == link["spanID"]]
    assert rpc["operationName"] == rpc_name
    assert any(int(r["spanID"], 16) == int(claim["spanID"], 16) for r in refs(rpc, "FOLLOWS_FROM"))


# What the demo prints once a claim is allocated and reserved (otel_dra/cli/demo.py, claim_trace_lines).
TRACE_LINK = re.compile(
    r"^claim demo/(?P<claim>\S+) \(pod (?P<pod>\S+), kept running until Ctrl-C\) is one trace.*\n"
    r"  (?P<ui>\S+)/trace/(?P<digits>[0-9a-f]{32})\n"
    r"  (?P<command>.+ \| tr -d -)   # any claim's trace id$",
    re.M,
)


def test_the_printed_jaeger_link_is_a_live_claims_whole_trace(demo, jaeger):
    """The link the demo prints (README, tour step 3): its digits are a real claim's UID without the
    dashes, as the printed kubectl line says; the claim is still in use (its pod kept); Jaeger returns
    its trace with the exporter's lifecycle spans and the plugin's prepare claim under its root."""
    found = wait_until(lambda: TRACE_LINK.search(demo["log"].read_text()), 120, what="the demo's trace link")
    name, pod, digits = found["claim"], found["pod"], found["digits"]
    assert found["ui"] == jaeger.url("query")
    client = KubeClient(load_credentials(str(demo["dir"] / "testbed" / "kubeconfig")))
    claim = client.get_json(f"/apis/resource.k8s.io/v1/namespaces/demo/resourceclaims/{name}")
    assert uuid.UUID(claim["metadata"]["uid"]).hex == digits
    # Kept: the other pods live 5-20 s, and this test runs after the module's others.
    assert [r["name"] for r in claim["status"]["reservedFor"]] == [pod]
    assert claim["status"].get("allocation") and not claim["metadata"].get("deletionTimestamp")
    # The printed line, run as printed, gives the same digits.
    printed = subprocess.run(["sh", "-c", found["command"]], capture_output=True, text=True, timeout=60)
    assert (printed.returncode, printed.stdout.strip()) == (0, digits), printed.stderr

    root_name = f"ResourceClaim demo/{name}"

    def whole_trace() -> tuple[dict[str, Any], dict[str, dict[str, Any]]] | None:
        trace = jaeger.trace(digits)
        if trace is None:
            return None
        spans = {s["operationName"]: s for s in trace["spans"]}
        wanted = (root_name, "allocation", f"reserved for pod/{pod}", "prepare claim")
        return (trace, spans) if all(op in spans for op in wanted) else None

    trace, spans = wait_until(whole_trace, 60, interval=1, what=f"claim {name}'s trace in Jaeger")

    def service(span: dict[str, Any]) -> str:
        return str(trace["processes"][span["processID"]]["serviceName"])

    assert {service(s) for s in trace["spans"]} >= {"otel-dra-exporter", "otel-dra-plugin"}
    root = spans[root_name]
    assert int(root["spanID"], 16) == root_span_id(int(digits, 16))
    for op, by in (("allocation", "otel-dra-exporter"), ("prepare claim", "otel-dra-plugin")):
        span = spans[op]
        assert service(span) == by, op
        assert [r["spanID"] for r in span["references"] if r["refType"] == "CHILD_OF"] == [root["spanID"]], op
    assert service(root) == "otel-dra-exporter"
