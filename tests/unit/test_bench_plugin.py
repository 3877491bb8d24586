"""The plugin benchmark's two derived figures: Prometheus-style histogram quantiles and the
driver's time per claim taken from exported spans."""

from __future__ import annotations

import time

import pytest
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from bench.plugin import histogram_quantile
from bench.sink import driver_seconds

INF = float("inf")


def test_histogram_quantile_interpolates_like_prometheus():
    # All observations in the first bucket: the quantile is a fraction of its upper bound. This is
    # how a dashboard turns "every prepare under 5 ms" into "p50 2.5 ms, p99 4.95 ms".
    first = {0.005: 100.0, 0.01: 100.0, INF: 100.0}
    assert histogram_quantile(0.5, first) == pytest.approx(0.0025)
    assert histogram_quantile(0.99, first) == pytest.approx(0.00495)
    # 90 under 5 ms, 10 between 5 and 10 ms: p50 inside the first bucket, p99 inside the second.
    spread = {0.005: 90.0, 0.01: 100.0, INF: 100.0}
    assert histogram_quantile(0.5, spread) == pytest.approx(0.005 * 50 / 90)
    assert histogram_quantile(0.99, spread) == pytest.approx(0.005 + 0.005 * 9 / 10)
    # A rank in the +Inf bucket answers the highest finite bound.
    assert histogram_quantile(0.99, {0.005: 50.0, 0.01: 60.0, INF: 100.0}) == pytest.approx(0.01)


def test_driver_seconds_from_exported_spans():
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("t")
    with tracer.start_as_current_span("prepare claim") as claim:
        with tracer.start_as_current_span("GET /apis/resource.k8s.io/v1/namespaces/{namespace}/resourceclaims/{name}"):
            time.sleep(0.002)
        with tracer.start_as_current_span("write checkpoint"):
            time.sleep(0.003)
    with tracer.start_as_current_span("prepare claim"):  # answered from the checkpoint: no read
        pass
    spans = exporter.get_finished_spans()
    (get,) = [s for s in spans if s.name.startswith("GET ")]
    body = encode_spans(spans).SerializeToString()
    (seconds,) = driver_seconds(body)
    assert seconds == (claim.end_time - get.end_time) / 1e9  # type: ignore[attr-defined]
    assert 0.003 <= seconds < 0.1


def test_span_seconds_by_name():
    from bench.sink import span_seconds

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("t")
    for _ in range(2):
        with tracer.start_as_current_span("prepare claim"), tracer.start_as_current_span("write checkpoint"):
            time.sleep(0.002)
    spans = exporter.get_finished_spans()
    got = span_seconds(encode_spans(spans).SerializeToString())
    assert sorted(got) == ["prepare claim", "write checkpoint"]
    assert len(got["prepare claim"]) == 2
    expected = sorted((s.end_time - s.start_time) / 1e9 for s in spans if s.name == "write checkpoint")  # type: ignore[operator]
    assert sorted(got["write checkpoint"]) == expected
    assert all(claim >= 0.002 for claim in got["prepare claim"])
