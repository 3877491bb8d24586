"""Histogram exemplars in the Prometheus pull exposition (OpenMetrics only) and over OTLP.

The SDK's Prometheus reader drops exemplars; ``sdk_private.prometheus_exemplars`` (wired by
``provider.build_metrics_pipeline``) adds them to the ``_bucket`` samples, which prometheus_client
writes in OpenMetrics and never in text 0.0.4."""

from __future__ import annotations

import logging
import shutil
import subprocess
from collections.abc import Iterator

import pytest
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.exporter.prometheus import PrometheusMetricReader
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags
from prometheus_client import CollectorRegistry
from prometheus_client.openmetrics.parser import text_string_to_metric_families
from prometheus_client.samples import Exemplar, Timestamp

from otel_dra.telemetry import sdk_private
from otel_dra.telemetry.exposition import assemble
from otel_dra.telemetry.provider import MetricsPipeline, build_metrics_pipeline
from tests.otlp_receiver import OtlpReceiver

TRACE_ID = 0x0AF7651916CD43DD8448EB211C80319C
SPAN_ID = 0xB7AD6B7169203331
OTHER_TRACE_ID = 0x4BF92F3577B34DA6A3CE929D0E0E4736
OTHER_SPAN_ID = 0x00F067AA0BA902B7
# When the measurements are recorded (the SDK stamps each with time_ns(); fixed below).
RECORDED_NS = 1_733_333_333_123_000_000
BOUNDS = [0.1, 0.5, 1.0]


def _context(trace_id: int = TRACE_ID, span_id: int = SPAN_ID, sampled: bool = True) -> Context:
    flags = TraceFlags(TraceFlags.SAMPLED if sampled else TraceFlags.DEFAULT)
    span = NonRecordingSpan(SpanContext(trace_id, span_id, is_remote=False, trace_flags=flags))
    return trace.set_span_in_context(span)


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """The SDK's measurement clock, fixed at ``now[0]`` (a private name of the SDK, in a test only:
    if it moves, this fails loudly)."""
    now = [RECORDED_NS]
    monkeypatch.setattr("opentelemetry.sdk.metrics._internal.instrument.time_ns", lambda: now[0])
    yield now


@pytest.fixture
def pipeline(monkeypatch: pytest.MonkeyPatch) -> Iterator[MetricsPipeline]:
    for name in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT"):
        monkeypatch.delenv(name, raising=False)
    built = build_metrics_pipeline(service_name="t", version="0", target_info=False, process_metrics=False)
    yield built
    built.shutdown()


def _histogram(provider: MeterProvider):
    return provider.get_meter("t").create_histogram(
        "otel_dra.test.duration", unit="s", description="A test latency.", explicit_bucket_boundaries_advisory=BOUNDS
    )


def _scrape(registry: CollectorRegistry, openmetrics: bool) -> str:
    return b"".join(assemble(registry, [], openmetrics)).decode()


def _bucket_lines(body: str) -> list[str]:
    return [line for line in body.splitlines() if line.startswith("otel_dra_test_duration_seconds_bucket")]


def test_openmetrics_bucket_line_carries_the_exemplar(pipeline, clock):
    histogram = _histogram(pipeline.meter_provider)
    histogram.record(0.42, {"result": "success"}, context=_context())
    body = _scrape(pipeline.registry, openmetrics=True)
    assert _bucket_lines(body) == [
        'otel_dra_test_duration_seconds_bucket{le="0.1",result="success"} 0.0',
        'otel_dra_test_duration_seconds_bucket{le="0.5",result="success"} 1.0 '
        '# {span_id="b7ad6b7169203331",trace_id="0af7651916cd43dd8448eb211c80319c"} 0.42 1733333333.123',
        'otel_dra_test_duration_seconds_bucket{le="1.0",result="success"} 1.0',
        'otel_dra_test_duration_seconds_bucket{le="+Inf",result="success"} 1.0',
    ]
    assert body.endswith("# EOF\n")


def test_each_bucket_gets_its_own_exemplar_matched_by_series(pipeline, clock):
    histogram = _histogram(pipeline.meter_provider)
    histogram.record(0.05, {"result": "success"}, context=_context())
    histogram.record(7, {"result": "error"}, context=_context(OTHER_TRACE_ID, OTHER_SPAN_ID))
    lines = _bucket_lines(_scrape(pipeline.registry, openmetrics=True))
    with_exemplars = [line for line in lines if " # " in line]
    assert with_exemplars == [
        'otel_dra_test_duration_seconds_bucket{le="0.1",result="success"} 1.0 '
        '# {span_id="b7ad6b7169203331",trace_id="0af7651916cd43dd8448eb211c80319c"} 0.05 1733333333.123',
        'otel_dra_test_duration_seconds_bucket{le="+Inf",result="error"} 1.0 '
        '# {span_id="00f067aa0ba902b7",trace_id="4bf92f3577b34da6a3ce929d0e0e4736"} 7.0 1733333333.123',
    ]


def test_the_text_format_is_unchanged(pipeline, clock):
    histogram = _histogram(pipeline.meter_provider)
    histogram.record(0.42, {"result": "success"}, context=_context())
    assert _scrape(pipeline.registry, openmetrics=False) == (
        "# HELP otel_dra_test_duration_seconds A test latency.\n"
        "# TYPE otel_dra_test_duration_seconds histogram\n"
        'otel_dra_test_duration_seconds_bucket{le="0.1",result="success"} 0.0\n'
        'otel_dra_test_duration_seconds_bucket{le="0.5",result="success"} 1.0\n'
        'otel_dra_test_duration_seconds_bucket{le="1.0",result="success"} 1.0\n'
        'otel_dra_test_duration_seconds_bucket{le="+Inf",result="success"} 1.0\n'
        'otel_dra_test_duration_seconds_count{result="success"} 1.0\n'
        'otel_dra_test_duration_seconds_sum{result="success"} 0.42\n'
    )


def test_the_same_samples_as_the_sdks_reader_apart_from_exemplars(pipeline, clock):
    plain_registry = CollectorRegistry(auto_describe=True)
    plain = PrometheusMetricReader(scope_info_enabled=False, disable_target_info=True, registry=plain_registry)
    other = MeterProvider(metric_readers=[plain], shutdown_on_exit=False)
    try:
        for provider in (pipeline.meter_provider, other):
            histogram = _histogram(provider)
            histogram.record(0.42, {"result": "success"}, context=_context())
            histogram.record(3, {"result": "error"}, context=_context())
            provider.get_meter("t").create_counter("otel_dra.test.calls").add(2, context=_context())
        ours = _scrape(pipeline.registry, openmetrics=True)
        theirs = _scrape(plain_registry, openmetrics=True)
        assert ours != theirs
        assert [line.split(" # ")[0] for line in ours.splitlines()] == theirs.splitlines()
        assert _scrape(pipeline.registry, openmetrics=False) == _scrape(plain_registry, openmetrics=False)
    finally:
        other.shutdown()


def test_no_exemplar_without_a_sampled_span(pipeline, clock):
    histogram = _histogram(pipeline.meter_provider)
    histogram.record(0.42, {"result": "success"})  # no span at all
    histogram.record(0.05, {"result": "success"}, context=_context(sampled=False))
    body = _scrape(pipeline.registry, openmetrics=True)
    assert _bucket_lines(body) and not [line for line in _bucket_lines(body) if " # " in line]


def test_the_newest_exemplar_per_bucket_stays_across_scrapes(pipeline, clock):
    histogram = _histogram(pipeline.meter_provider)
    histogram.record(0.42, {"result": "success"}, context=_context())
    first = _bucket_lines(_scrape(pipeline.registry, openmetrics=True))
    # The SDK's reservoir forgets at each collection; the bucket still shows its exemplar.
    assert _bucket_lines(_scrape(pipeline.registry, openmetrics=True)) == first
    clock[0] = RECORDED_NS + 1_500_000_000
    histogram.record(0.3, {"result": "success"}, context=_context(OTHER_TRACE_ID, OTHER_SPAN_ID))
    histogram.record(0.2, {"result": "success"})  # unsampled: does not replace it
    second = _bucket_lines(_scrape(pipeline.registry, openmetrics=True))
    assert second[1] == (
        'otel_dra_test_duration_seconds_bucket{le="0.5",result="success"} 3.0 '
        '# {span_id="00f067aa0ba902b7",trace_id="4bf92f3577b34da6a3ce929d0e0e4736"} 0.3 1733333334.623'
    )
    assert [line for line in second if " # " in line] == [second[1]]


def _record_two(pipeline: MetricsPipeline) -> None:
    histogram = _histogram(pipeline.meter_provider)
    histogram.record(0.42, {"result": "success"}, context=_context())
    histogram.record(3, {"result": "error"}, context=_context(OTHER_TRACE_ID, OTHER_SPAN_ID))


def test_the_openmetrics_body_is_valid_openmetrics(pipeline, clock):
    """prometheus_client's OpenMetrics parser is strict: exemplar syntax, its 128-character label
    limit, exemplars only on buckets and counters, ``# EOF``."""
    _record_two(pipeline)
    body = _scrape(pipeline.registry, openmetrics=True)
    (family,) = text_string_to_metric_families(body)
    exemplars = {s.labels["le"]: s.exemplar for s in family.samples if s.exemplar is not None}
    recorded = Timestamp(1733333333, 123_000_000)  # how the parser reads "1733333333.123"
    assert exemplars == {
        "0.5": Exemplar({"trace_id": f"{TRACE_ID:032x}", "span_id": f"{SPAN_ID:016x}"}, 0.42, recorded),
        "+Inf": Exemplar({"trace_id": f"{OTHER_TRACE_ID:032x}", "span_id": f"{OTHER_SPAN_ID:016x}"}, 3.0, recorded),
    }


def test_promtool_check_metrics_passes(pipeline, clock):
    """``promtool check metrics`` lints text 0.0.4 only: its parser (expfmt.TextParser, through
    promlint) reads the " # {" of an OpenMetrics exemplar as a bad timestamp, whatever the body. So
    it checks the text body of a registry whose histogram has exemplars."""
    _record_two(pipeline)
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not on PATH (Debian package `prometheus`)")
    text = _scrape(pipeline.registry, openmetrics=False)
    check = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr


def test_the_exemplar_also_arrives_over_otlp(monkeypatch, clock):
    receiver = OtlpReceiver().start()
    try:
        monkeypatch.delenv("OTEL_EXPORTER_OTLP_ENDPOINT", raising=False)
        monkeypatch.delenv("OTEL_EXPORTER_OTLP_METRICS_PROTOCOL", raising=False)
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT", f"http://127.0.0.1:{receiver.http_port}/v1/metrics")
        pipeline = build_metrics_pipeline(service_name="t", version="0", target_info=False, process_metrics=False)
        try:
            assert pipeline.otlp is not None
            _histogram(pipeline.meter_provider).record(0.42, {"result": "success"}, context=_context())
            # Both readers have their own reservoir: a scrape does not take the push's exemplar.
            assert " # {" in _scrape(pipeline.registry, openmetrics=True)
            assert pipeline.meter_provider.force_flush(10_000)
        finally:
            pipeline.shutdown()
        assert receiver.wait_for(lambda r: r.metric_points().get("otel_dra.test.duration"), timeout=10)
        exemplars = [
            e
            for request in receiver.metrics
            for rm in request.resource_metrics
            for sm in rm.scope_metrics
            for metric in sm.metrics
            if metric.name == "otel_dra.test.duration"
            for point in metric.histogram.data_points
            for e in point.exemplars
        ]
        assert [(e.trace_id.hex(), e.span_id.hex(), e.as_double, e.time_unix_nano) for e in exemplars] == [
            (f"{TRACE_ID:032x}", f"{SPAN_ID:016x}", 0.42, RECORDED_NS)
        ]
    finally:
        receiver.stop()


# --- the SDK's layout ---------------------------------------------------------------------------


def test_the_reader_layout_is_the_one_tested():
    registry = CollectorRegistry()
    reader = PrometheusMetricReader(registry=registry)
    assert sdk_private.prometheus_exemplars(reader), (
        f"opentelemetry-exporter-prometheus (tested with {sdk_private.TESTED_WITH['opentelemetry-exporter-prometheus']}): "
        "PrometheusMetricReader._collector._translate_metric/_collect_data_points moved; mend "
        "otel_dra/telemetry/sdk_private.py prometheus_exemplars"
    )
    assert sdk_private.prometheus_exemplars(reader)  # a second call wraps nothing more
    reader.shutdown()


def test_a_different_layout_serves_without_exemplars(monkeypatch, caplog):
    monkeypatch.setattr(sdk_private, "_warned", set())

    class Elsewhere:
        pass

    with caplog.at_level(logging.WARNING, logger=sdk_private.__name__):
        assert not sdk_private.prometheus_exemplars(Elsewhere())
        assert not sdk_private.prometheus_exemplars(Elsewhere())
    assert len([r for r in caplog.records if "_translate_metric" in r.getMessage()]) == 1


def test_a_failure_while_adding_exemplars_never_fails_a_scrape(monkeypatch, caplog, clock):
    monkeypatch.setattr(sdk_private, "_warned", set())
    registry = CollectorRegistry(auto_describe=True)
    reader = PrometheusMetricReader(scope_info_enabled=False, disable_target_info=True, registry=registry)

    def broken(*args, **kwargs):
        raise RuntimeError("layout changed")

    # What the wrapper calls to label the points: broken, as if the SDK's internals had changed;
    # the SDK's own translation keeps its method (the instance attribute goes once installed).
    reader._collector._collect_data_points = broken
    assert sdk_private.prometheus_exemplars(reader)
    del reader._collector._collect_data_points
    provider = MeterProvider(metric_readers=[reader], shutdown_on_exit=False)
    try:
        _histogram(provider).record(0.42, {"result": "success"}, context=_context())
        with caplog.at_level(logging.WARNING, logger=sdk_private.__name__):
            first = _scrape(registry, openmetrics=True)
            _scrape(registry, openmetrics=True)
        assert 'otel_dra_test_duration_seconds_bucket{le="0.5",result="success"} 1.0\n' in first
        assert " # {" not in first
        assert len([r for r in caplog.records if "layout changed" in r.getMessage()]) == 1
    finally:
        provider.shutdown()
