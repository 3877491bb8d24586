"""The private names of the OpenTelemetry SDK that otel_dra uses, one test each, all wrapped by
otel_dra/telemetry/sdk_private.py (docs/design.md, "Homemade, and why"). Each fails with the name,
the installed version and the version it was tested with when an SDK upgrade moves the name, so
that the fence is mended (or the use dropped) before the upgrade ships; the last test fails when a
private name of the SDK is used anywhere else in otel_dra."""

from __future__ import annotations

import ast
import functools
import importlib.metadata
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter as GrpcMetricExporter
from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter as HttpMetricExporter
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpSpanExporter
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.id_generator import IdGenerator
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, Decision

from otel_dra.telemetry import sdk_private
from otel_dra.telemetry.otlp_encode import MetricHeader, PointEncoder, PointGroup, RequestBuilder
from otel_dra.telemetry.provider import NO_CARDINALITY_CAP
from tests.otlp_receiver import OtlpReceiver

ROOT = Path(__file__).resolve().parents[2]


def _moved(package: str, name: str, what: str) -> str:
    """The message of a failed check: what moved, in which version, and where the fence is."""
    try:
        installed = importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        installed = "not installed"
    return (
        f"{package} {installed} (otel_dra was tested with {sdk_private.TESTED_WITH.get(package)}): {name} {what}. "
        "Mend otel_dra/telemetry/sdk_private.py (or use a public API that does the same now) and its entry in "
        'docs/design.md, "Homemade, and why".'
    )


@pytest.fixture(scope="module")
def _receiver():
    receiver = OtlpReceiver().start()
    yield receiver
    receiver.stop()


@pytest.fixture
def receiver(_receiver):
    """One receiver for the module (stopping one takes half a second), emptied for each test."""
    _receiver.metrics.clear()
    _receiver.traces.clear()
    return _receiver


def test_sync_gauge_class_is_the_sdks_synchronous_gauge_and_its_cardinality_cap_applies():
    gauge = sdk_private.sync_gauge_class()
    assert gauge is not None, _moved("opentelemetry-sdk", "opentelemetry.sdk.metrics._Gauge", "cannot be imported")
    reader = InMemoryMetricReader(cardinality_limits=NO_CARDINALITY_CAP)
    provider = MeterProvider(metric_readers=[reader])
    try:
        instrument = provider.get_meter("t").create_gauge("g")
        assert isinstance(instrument, gauge), _moved(
            "opentelemetry-sdk", "opentelemetry.sdk.metrics._Gauge", "is no longer the class of a synchronous gauge"
        )
        for i in range(2100):  # past the SDK's default cap of 2000 series
            instrument.set(1.0, {"i": str(i)})
        (metric,) = reader.get_metrics_data().resource_metrics[0].scope_metrics[0].metrics
        overflow = [p for p in metric.data.data_points if "otel.metric.overflow" in (p.attributes or {})]
        assert len(metric.data.data_points) == 2100 and not overflow, _moved(
            "opentelemetry-sdk", "cardinality_limits={_Gauge: ...}", "no longer lifts a synchronous gauge's cap"
        )
    finally:
        provider.shutdown()


def test_urllib3_transport_is_the_exporters_transport():
    transport = sdk_private.urllib3_transport()
    assert transport is not None, _moved(
        "opentelemetry-exporter-http-transport",
        "opentelemetry.exporter.http.transport._urllib3.Urllib3HTTPTransport",
        "cannot be imported",
    )
    from opentelemetry.exporter.http.transport._base import BaseHTTPTransport

    assert isinstance(transport, BaseHTTPTransport), _moved(
        "opentelemetry-exporter-http-transport", "Urllib3HTTPTransport", "is no longer a BaseHTTPTransport"
    )
    transport.close()


def _counting_transport() -> Any:
    base = type(sdk_private.urllib3_transport())

    class Counting(base):  # type: ignore[misc,valid-type]
        requests = 0

        def request(self, *args: Any, **kwargs: Any) -> Any:
            Counting.requests += 1
            return super().request(*args, **kwargs)

    return Counting()


def test_the_http_exporters_send_through_the_transport_they_are_given(receiver, monkeypatch):
    package = "opentelemetry-exporter-otlp-proto-http"
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", f"http://127.0.0.1:{receiver.http_port}/v1/traces")
    transport = _counting_transport()
    exporter = sdk_private.otlp_http_exporter(HttpSpanExporter, transport)
    provider = TracerProvider(shutdown_on_exit=False)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    with provider.get_tracer("t").start_as_current_span("through the transport"):
        pass
    provider.shutdown()
    assert receiver.wait_for(lambda r: r.traces, timeout=10)
    assert type(transport).requests == 1, _moved(package, "OTLPSpanExporter(_transport=...)", "is not used to send")

    transport = _counting_transport()
    metrics = sdk_private.otlp_http_exporter(
        functools.partial(HttpMetricExporter, endpoint=f"http://127.0.0.1:{receiver.http_port}/v1/metrics"), transport
    )
    send = sdk_private.http_bytes_sender(metrics)
    assert send(ExportMetricsServiceRequest().SerializeToString())
    metrics.shutdown()
    assert type(transport).requests == 1, _moved(package, "OTLPMetricExporter(_transport=...)", "is not used to send")


def _request() -> bytes:
    points = PointEncoder(("k",)).encode([(("v",), 1.5)])
    header = MetricHeader("otel_dra_probe", "a probe", "1")
    builder = RequestBuilder(Resource.create({"service.name": "probe"}), "s", "1")
    (request,) = builder.requests([(header, [PointGroup.of(points)])], 1_700_000_000_000_000_000)
    return request


def test_the_grpc_metric_exporter_sends_pre_encoded_bytes(receiver):
    exporter = GrpcMetricExporter(endpoint=f"127.0.0.1:{receiver.grpc_port}", insecure=True, timeout=5)
    for name in ("_stub", "_initialize_channel_and_stub", "_translate_data", "_count_data", "_export"):
        assert hasattr(exporter, name), _moved(
            "opentelemetry-exporter-otlp-proto-grpc", f"OTLPMetricExporter.{name}", "is gone"
        )
    request = _request()
    try:
        ok = sdk_private.grpc_bytes_sender(exporter)(request)
    finally:
        exporter.shutdown()
    assert ok and receiver.metrics == [ExportMetricsServiceRequest.FromString(request)], _moved(
        "opentelemetry-exporter-otlp-proto-grpc", "OTLPMetricExporter's stub and _export", "no longer send our bytes"
    )


def test_the_http_metric_exporter_sends_pre_encoded_bytes(receiver):
    exporter = HttpMetricExporter(endpoint=f"http://127.0.0.1:{receiver.http_port}/v1/metrics", timeout=5)
    assert hasattr(exporter, "_client") and hasattr(exporter._client, "export"), _moved(
        "opentelemetry-exporter-otlp-proto-http", "OTLPMetricExporter._client.export", "is gone"
    )
    request = _request()
    try:
        ok = sdk_private.http_bytes_sender(exporter)(request)
    finally:
        exporter.shutdown()
    assert ok and receiver.metrics == [ExportMetricsServiceRequest.FromString(request)], _moved(
        "opentelemetry-exporter-otlp-proto-http", "OTLPMetricExporter._client.export", "no longer sends our bytes"
    )


class _Fixed(IdGenerator):
    def generate_span_id(self) -> int:
        return 0x1234

    def generate_trace_id(self) -> int:
        return 0x5678


def test_a_tracers_id_generator_and_sampler_are_what_it_uses():
    provider = TracerProvider(sampler=ALWAYS_OFF, shutdown_on_exit=False)
    tracer = provider.get_tracer("t")
    generator = sdk_private.tracer_id_generator(tracer)
    assert isinstance(generator, IdGenerator), _moved("opentelemetry-sdk", "Tracer.id_generator", "is gone")
    sdk_private.set_tracer_id_generator(tracer, _Fixed())
    with tracer.start_as_current_span("fixed") as span:
        context = span.get_span_context()
    assert (context.trace_id, context.span_id) == (0x5678, 0x1234), _moved(
        "opentelemetry-sdk", "Tracer.id_generator", "is no longer where a Tracer draws its ids"
    )
    # Only that tracer: the provider's other tracers keep the generator they had.
    with provider.get_tracer("other").start_as_current_span("random") as span:
        assert span.get_span_context().span_id != 0x1234
    sampler = sdk_private.tracer_sampler(tracer)
    assert sampler is ALWAYS_OFF, _moved("opentelemetry-sdk", "Tracer.sampler", "is not its provider's sampler")
    assert sampler.should_sample(None, 1, "s").decision is Decision.DROP
    provider.shutdown()


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _private_uses(path: Path, source: str | None = None) -> list[str]:
    """Private names of other packages a module uses: imported (``from x import _y``, a module path
    with a ``_part``, outside otel_dra), passed as keywords (``f(_transport=...)``) and, in the
    telemetry layer (where the SDK is handled), private attributes the module never defines itself
    (``exporter._client``; its own ``self._x`` are defined where they are assigned)."""
    tree = ast.parse(path.read_text() if source is None else source, str(path))
    where = path.relative_to(ROOT)
    found = []
    defined: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            defined.add(node.attr)
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            defined.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            defined.add(node.id)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            defined.add(node.value)  # __slots__
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            if node.module.split(".")[0] in ("otel_dra", "__future__"):
                continue
            if any(_private(part) for part in node.module.split(".")):
                found.append(f"{where}:{node.lineno}: from {node.module} import ...")
            found += [
                f"{where}:{node.lineno}: from {node.module} import {a.name}" for a in node.names if _private(a.name)
            ]
        elif isinstance(node, ast.Import):
            found += [
                f"{where}:{node.lineno}: import {a.name}"
                for a in node.names
                if a.name.split(".")[0] != "otel_dra" and any(_private(p) for p in a.name.split("."))
            ]
        elif isinstance(node, ast.Call):
            found += [f"{where}:{node.lineno}: {k.arg}=" for k in node.keywords if k.arg and _private(k.arg)]
        elif (
            "telemetry" in path.parts
            and isinstance(node, ast.Attribute)
            and isinstance(node.ctx, ast.Load)
            and _private(node.attr)
            and node.attr not in defined
        ):
            found.append(f"{where}:{node.lineno}: .{node.attr}")
    return found


def test_no_module_but_sdk_private_uses_a_private_name_of_another_package():
    offenders = [
        use
        for path in sorted((ROOT / "otel_dra").rglob("*.py"))
        if "_generated" not in path.parts and path.name != "sdk_private.py"
        for use in _private_uses(path)
    ]
    assert offenders == [], "private names of other packages belong in otel_dra/telemetry/sdk_private.py"


def test_the_private_name_check_sees_each_kind():
    source = (
        "from socketserver import _SocketWriter\n"
        "from opentelemetry.exporter.http.transport._urllib3 import Urllib3HTTPTransport\n"
        "def f(exporter, cls):\n"
        "    exporter._client.export(b'')\n"
        "    return cls(_transport=None)\n"
    )
    # Parsed as if it were a telemetry module (nothing is written there).
    found = _private_uses(ROOT / "otel_dra" / "telemetry" / "probe.py", source)
    assert sorted(found) == [
        "otel_dra/telemetry/probe.py:1: from socketserver import _SocketWriter",
        "otel_dra/telemetry/probe.py:2: from opentelemetry.exporter.http.transport._urllib3 import ...",
        "otel_dra/telemetry/probe.py:4: ._client",
        "otel_dra/telemetry/probe.py:5: _transport=",
    ]
