"""otel-dra with the real observability peers: the shipped Collector configs load in the real
Collector (built with ocb); the exporter's OTLP goes through the Collector gateway into a real
Prometheus, next to Prometheus scraping the exporter directly; an OTel SDK trace goes through the
Collector into a real Jaeger and comes back from Jaeger's query API."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from otel_dra.fixtures import apply_all, sample_objects
from tests import peers
from tests.helpers import PROCESS_FAMILIES, SEED_FAMILIES, free_port, listening, parse_samples, scrape, wait_until

GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "sample_seed_families.prom"

# What the agent config needs from the DaemonSet's environment (collector-config/agent.yaml).
AGENT_ENV = {"K8S_NODE_NAME": "node-a", "K8S_CLUSTER_NAME": "testbed", "OTEL_GATEWAY_ENDPOINT": "gw:4317"}

# Renames that the Collector's prometheus exporter makes and otel-dra's own exposition does not
# (collector-config/README.md): prometheus/otlptranslator appends `_ratio` to a gauge whose unit is
# "1". otel-dra gives no such unit to any instrument (docs/metrics.md), so there are none; a new
# instrument of unit "1" fails the name comparison below.
COLLECTOR_RENAMES: dict[str, str] = {}

# Series Prometheus itself adds for every target; the same on both paths, not part of the comparison.
PROMETHEUS_SYNTHETIC = frozenset(
    {"up", "scrape_duration_seconds", "scrape_samples_scraped", "scrape_samples_post_metric_relabeling"}
    | {"scrape_series_added"}
)
# Served on /metrics only, not pushed over OTLP (docs/metrics.md, "Process metrics").
PROMETHEUS_ONLY = frozenset(PROCESS_FAMILIES)


# --- the shipped configs ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["gateway.yaml", "agent.yaml"])
def test_shipped_collector_config_validates(otelcol_binary, name):
    peers.validate_collector_config(otelcol_binary, peers.COLLECTOR_CONFIGS / name, AGENT_ENV)


def test_validate_rejects_what_the_collector_lacks(otelcol_binary, tmp_path):
    """`validate` is a real check: a component not compiled in, or a bad setting, is an error."""
    config = peers.load_collector_config("gateway.yaml")
    config["exporters"]["file"] = {"path": "/tmp/out.json"}  # fileexporter is not in the distribution
    config["service"]["pipelines"]["metrics"]["exporters"].append("file")
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(config))
    with pytest.raises(peers.PeerError, match='unknown type: "file"'):
        peers.validate_collector_config(otelcol_binary, path)

    config = peers.load_collector_config("gateway.yaml")
    config["processors"]["memory_limiter"]["limit_percentage"] = 120
    path.write_text(yaml.safe_dump(config))
    with pytest.raises(peers.PeerError, match="memory_limiter"):
        peers.validate_collector_config(otelcol_binary, path)


def test_agent_config_enriches_and_forwards_to_the_gateway():
    """The agent adds Kubernetes attributes before batching and sends everything on to the gateway."""
    config = peers.load_collector_config("agent.yaml")
    for pipeline in config["service"]["pipelines"].values():
        processors = pipeline["processors"]
        assert processors[0] == "memory_limiter"
        assert processors.index("k8s_attributes") < processors.index("batch")
        assert pipeline["exporters"] == ["otlp_grpc/gateway"]
    assert config["processors"]["k8s_attributes"]["filter"]["node_from_env_var"] == "K8S_NODE_NAME"


# --- metrics: exporter -> Collector gateway -> Prometheus, and exporter -> Prometheus -----------------


@pytest.fixture(scope="module")
def exporter_via_collector(testbed, admin_client, otelcol_gateway, tmp_path_factory) -> Iterator[int]:
    """`otel-dra exporter` as a process, pushing OTLP/HTTP to the gateway every second; yields its
    /metrics port."""
    apply_all(admin_client, sample_objects())
    port = free_port()
    log = tmp_path_factory.mktemp("exporter") / "exporter.log"
    env = dict(
        os.environ,
        OTEL_EXPORTER_OTLP_ENDPOINT=f"http://{otelcol_gateway.endpoint(4318)}",
        OTEL_EXPORTER_OTLP_PROTOCOL="http/protobuf",
        OTEL_METRIC_EXPORT_INTERVAL="1000",
        OTEL_SERVICE_NAME="otel-dra-e2e",
    )
    cmd = [sys.executable, "-m", "otel_dra", "exporter", "--kubeconfig", str(testbed.kubeconfig)]
    cmd += ["--address", "127.0.0.1", "--port", str(port), "--log-format", "json"]
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_until(
            lambda: proc.poll() is not None or (listening(port) and scrape(port)[0] == 200),
            timeout=60,
            what="the exporter's first good scrape",
        )
        assert proc.poll() is None, log.read_text()
        yield port
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def scraped(prometheus, otelcol_gateway, exporter_via_collector) -> peers.Prometheus:
    """Prometheus scraping the exporter (`path="direct"`) and the gateway's prometheus exporter
    (`path="collector"`, honor_labels as the gateway config says)."""
    prometheus.set_jobs(
        {
            "otel-dra-direct": {
                "static_configs": [{"targets": [f"127.0.0.1:{exporter_via_collector}"], "labels": {"path": "direct"}}]
            },
            "otel-dra-collector": {
                "honor_labels": True,
                "static_configs": [{"targets": [otelcol_gateway.endpoint(8889)], "labels": {"path": "collector"}}],
            },
        }
    )
    return prometheus


def _identity(labels: dict[str, str]) -> tuple[tuple[str, str], ...]:
    """A series' labels without the scrape's own; empty values dropped, as Prometheus stores none."""
    skip = ("__name__", "job", "instance", "path")
    return tuple(sorted((k, v) for k, v in labels.items() if k not in skip and v != ""))


def _golden() -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(name, _identity(labels)): value for name, labels, value in parse_samples(GOLDEN.read_text())}


# The job label of this module's exporter on each path: the gateway is shared by the session's
# tests (the demo's exporter and plugins push through it too), so each path is narrowed to it.
PATH_JOB = {"direct": "otel-dra-direct", "collector": "otel-dra-e2e"}


def _held(prom: peers.Prometheus, path: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    selector = "|".join(SEED_FAMILIES)
    result = prom.query(f'{{__name__=~"{selector}", path="{path}", job="{PATH_JOB[path]}"}}')
    return {(r["metric"]["__name__"], _identity(r["metric"])): float(r["value"][1]) for r in result}


@pytest.mark.parametrize("path", ["direct", "collector"])
def test_prometheus_holds_the_seed_metrics(scraped, path):
    """Every seed series of the sample objects, with its value, reaches Prometheus on both paths."""
    expected = _golden()

    def missing() -> dict:
        held = _held(scraped, path)
        return {key: value for key, value in expected.items() if held.get(key) != value}

    wait_until(lambda: not missing(), timeout=60, what=f"the seed series on path {path}")
    assert {name for name, _ in expected} == set(SEED_FAMILIES)


def test_collector_path_has_the_same_metric_names(scraped):
    """The names reaching Prometheus through the Collector equal the names scraped directly."""
    direct_selector = f'{{path="direct", job="{PATH_JOB["direct"]}"}}'
    collector_selector = f'{{path="collector", job="{PATH_JOB["collector"]}"}}'

    def both() -> tuple[set[str], set[str]] | None:
        direct = scraped.metric_names(direct_selector) - PROMETHEUS_SYNTHETIC - PROMETHEUS_ONLY
        collector = scraped.metric_names(collector_selector) - PROMETHEUS_SYNTHETIC
        # The self-metrics appear once something happened (a scrape, a push): wait for both paths
        # to have seen a push and a scrape before comparing.
        wanted = {"otel_dra_collection_duration_seconds_count", *SEED_FAMILIES}
        return (direct, collector) if wanted <= direct and wanted <= collector else None

    direct, collector = wait_until(both, timeout=60, what="both paths to carry the self-metrics")
    assert scraped.metric_names(direct_selector) >= PROMETHEUS_ONLY  # scraped directly, they are there
    assert "target_info" in direct and "target_info" in collector

    def same() -> bool:
        # A counter that appeared after the last push (e.g. the spans exported, first added once the
        # claims' backfill went out) is scraped before it is pushed: wait a push or two for it.
        nonlocal direct, collector
        found = both()
        if found is not None:
            direct, collector = found
        return collector == {COLLECTOR_RENAMES.get(name, name) for name in direct}

    with contextlib.suppress(AssertionError):
        wait_until(same, timeout=60, what="the same names on both paths")
    expected = {COLLECTOR_RENAMES.get(name, name) for name in direct}
    assert collector == expected, (
        f"only direct (renamed as documented): {sorted(expected - collector)}; "
        f"only through the Collector: {sorted(collector - expected)}"
    )


def test_collector_target_info_carries_the_resource(scraped):
    """Through the Collector, job/instance come from service.name (honor_labels) and target_info
    carries the OTel resource, as it does when scraped directly."""
    [info] = wait_until(
        # The gateway is shared by the session's tests: other services push through it too.
        lambda: scraped.query('target_info{path="collector",job="otel-dra-e2e"}'),
        timeout=30,
        what="target_info via the Collector",
    )
    assert info["metric"]["service_version"]
    [direct] = scraped.query('target_info{path="direct",service_name="otel-dra-e2e"}')
    assert direct["metric"]["service_name"] == "otel-dra-e2e"


# --- traces: SDK -> Collector gateway -> Jaeger ------------------------------------------------------


@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
def test_trace_through_the_collector_reaches_jaeger(otelcol_gateway, jaeger, protocol):
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor

    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter

        exporter = GrpcExporter(endpoint=f"http://{otelcol_gateway.endpoint(4317)}", insecure=True)
    else:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter

        exporter = HttpExporter(endpoint=f"http://{otelcol_gateway.endpoint(4318)}/v1/traces")

    service = f"otel-dra-e2e-{uuid.uuid4().hex[:8]}"
    provider = TracerProvider(resource=Resource.create({"service.name": service}))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("tests.e2e")
    with tracer.start_as_current_span("NodePrepareResources") as rpc:
        for claim in ("claim-a", "claim-b"):
            with tracer.start_as_current_span("prepare claim", attributes={"k8s.resourceclaim.name": claim}):
                pass
    provider.shutdown()
    trace_id = format(rpc.get_span_context().trace_id, "032x")
    rpc_span_id = format(rpc.get_span_context().span_id, "016x")

    def found() -> list[dict]:
        return [t for t in jaeger.traces(service) if t["traceID"] == trace_id and len(t["spans"]) == 3]

    [trace] = wait_until(found, timeout=60, what=f"trace {trace_id} of {service} in Jaeger")
    spans = trace["spans"]
    [root] = [s for s in spans if s["operationName"] == "NodePrepareResources"]
    children = [s for s in spans if s["operationName"] == "prepare claim"]
    assert root["spanID"] == rpc_span_id and not root.get("references")
    assert len(children) == 2
    for child in children:
        assert child["references"] == [{"refType": "CHILD_OF", "traceID": trace_id, "spanID": rpc_span_id}]
    claims = {tag["value"] for c in children for tag in c["tags"] if tag["key"] == "k8s.resourceclaim.name"}
    assert claims == {"claim-a", "claim-b"}
    process = trace["processes"][root["processID"]]
    assert process["serviceName"] == service
