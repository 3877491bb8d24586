"""The one module that touches private names of the OpenTelemetry SDK and its OTLP and Prometheus
exporters.

Each function here wraps one name the SDK does not promise to keep (an underscore name, an
underscore keyword argument, an attribute or method it does not document) for which no public
API does the same at the same cost. ``tests/unit/test_sdk_private.py`` checks each of them against
the installed packages and fails naming the package, its version and the name when one of them
moves, so that an upgrade breaks a unit test rather than a running exporter. Why each is used, and
what it replaces: docs/design.md, "Homemade, and why". Nothing else in ``otel_dra`` may use a private
name of the SDK (the test also checks that).

Where a name may be missing at run time (a newer SDK than the one tested), the function falls back
to what the SDK does by default and logs once, so an upgrade costs memory or start-up time, never
a wrong answer; only the raw OTLP senders cannot fall back, and raise.
"""

from __future__ import annotations

import logging
import math
import threading
from bisect import bisect_left
from collections.abc import Callable
from typing import Any, TypeVar

log = logging.getLogger(__name__)

# The versions these names were checked against (tests/unit/test_sdk_private.py reports the
# installed ones next to these when a check fails).
TESTED_WITH = {
    "opentelemetry-sdk": "1.45.2",
    "opentelemetry-exporter-otlp-proto-grpc": "1.45.2",
    "opentelemetry-exporter-otlp-proto-http": "1.45.2",
    "opentelemetry-exporter-http-transport": "0.66b2",
    "opentelemetry-exporter-prometheus": "0.66b2",
}

_warned: set[str] = set()
_T = TypeVar("_T")


def _warn_once(name: str, exc: BaseException) -> None:
    if name not in _warned:
        _warned.add(name)
        log.warning("OpenTelemetry SDK: %s is not what this version was tested with (%s): %s", name, TESTED_WITH, exc)


# --- metrics ------------------------------------------------------------------------------------


def sync_gauge_class() -> type | None:
    """The SDK's synchronous Gauge instrument class, as a key of a reader's ``cardinality_limits``.
    The SDK exports it only as ``opentelemetry.sdk.metrics._Gauge`` (the synchronous gauge is still
    marked experimental in the Python API); None when it has gone (no sync gauge to cap)."""
    try:
        from opentelemetry.sdk.metrics import _Gauge
    except ImportError as exc:
        _warn_once("opentelemetry.sdk.metrics._Gauge", exc)
        return None
    return _Gauge


# --- Prometheus exemplars ------------------------------------------------------------------------
# The SDK's PrometheusMetricReader translates a histogram point's bucket counts and sum but drops
# its exemplars (opentelemetry-exporter-prometheus 0.66b2: ``_CustomCollector._collect_data_points``
# and ``_populate_histogram_family`` pass neither). prometheus_client writes a Sample's exemplar in
# OpenMetrics (never in text 0.0.4), so adding them to the translated ``_bucket`` samples is enough.

_READER_COLLECTOR = "PrometheusMetricReader._collector._translate_metric/_collect_data_points"
# The keyword arguments of ``_CustomCollector._translate_metric`` that the wrapper reads.
_TRANSLATE_ARGS = ("metric", "scope_attrs", "resource_attrs", "metric_family_id_metric_family")

# One histogram series' exemplars: the label set (sorted (key, value) pairs, ``le`` excluded) ->
# bucket upper bound (math.inf for the last) -> prometheus_client Exemplar.
_SeriesExemplars = dict[tuple[tuple[str, str], ...], dict[float, Any]]


def prometheus_exemplars(reader: Any) -> bool:
    """Make a ``PrometheusMetricReader`` write histogram exemplars (OpenMetrics only): each
    translated ``_bucket`` sample gets the newest exemplar whose value falls in that bucket, as
    ``Exemplar({"trace_id": <32 hex>, "span_id": <16 hex>}, value, seconds)``; an exemplar without a
    valid span context (no sampled span when it was recorded) is left out, as are its filtered
    attributes (OpenMetrics allows 128 characters of exemplar labels; the ids take 63).

    The SDK's reservoir forgets its exemplars at each collection, so the newest one per bucket is
    remembered here, per series, for as long as the series is exported: every scrape (two
    Prometheus replicas, a person with curl) sees it, as with a prometheus_client histogram.

    Wraps the reader's collector's ``_translate_metric`` (an instance attribute, the collector
    stays registered as it is): histograms with neither exemplars nor remembered ones cost one
    pass over their points' ``exemplars``; other metrics an ``isinstance``. Returns False (and logs
    once) when the SDK's layout is not the one tested: the reader then serves without exemplars. A
    failure while adding exemplars at a scrape logs once and leaves that scrape's samples as the
    SDK made them; it never fails the scrape."""
    import inspect

    from opentelemetry.sdk.metrics.export import Histogram
    from prometheus_client.core import HistogramMetricFamily
    from prometheus_client.samples import Exemplar

    try:
        collector = reader._collector
        translate = collector._translate_metric
        points = collector._collect_data_points
        if getattr(translate, "otel_dra_exemplars", False):
            return True  # wrapped already
        signature = inspect.signature(translate)
        parameters = signature.parameters
        missing = [name for name in _TRANSLATE_ARGS if name not in parameters]
        if missing:
            raise TypeError(f"_translate_metric has no parameter {', '.join(missing)}")
        if not callable(points):
            raise TypeError("_collect_data_points is not callable")
    except (AttributeError, TypeError, ValueError) as exc:
        _warn_once(_READER_COLLECTOR, exc)
        return False
    lock = threading.Lock()
    remembered: dict[str, _SeriesExemplars] = {}

    def arguments(args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
        if len(kwargs) == len(_TRANSLATE_ARGS) and not args:  # how the SDK calls it
            return kwargs
        return dict(signature.bind(*args, **kwargs).arguments)

    def wanted(metric: Any) -> bool:
        data = metric.data
        if not isinstance(data, Histogram):
            return False
        return metric.name in remembered or any(point.exemplars for point in data.data_points)

    def newest(metric: Any, scope_attrs: Any, resource_attrs: Any) -> _SeriesExemplars:
        """This collection's exemplars of ``metric`` merged into the remembered ones, per series;
        series no longer exported are forgotten."""
        label_keys, label_rows, _ = points(metric.data, scope_attrs, resource_attrs)
        with lock:
            old = remembered.get(metric.name, {})
            new: _SeriesExemplars = {}
            for point, row in zip(metric.data.data_points, label_rows, strict=True):
                series = tuple(sorted(zip(label_keys, row, strict=True)))
                buckets = old.get(series)
                valid = [e for e in point.exemplars if e.trace_id and e.span_id]
                if valid:
                    buckets = dict(buckets) if buckets else {}
                    bounds = point.explicit_bounds
                    for e in valid:
                        i = bisect_left(bounds, e.value)  # bucket i holds bounds[i-1] < v <= bounds[i]
                        upper = float(bounds[i]) if i < len(bounds) else math.inf
                        whole, nanos = divmod(e.time_unix_nano, 1_000_000_000)
                        seconds = whole + nanos / 1e9  # rounded once (ns / 1e9 is rounded twice)
                        current = buckets.get(upper)
                        if current is None or current.timestamp <= seconds:
                            ids = {"trace_id": f"{e.trace_id:032x}", "span_id": f"{e.span_id:016x}"}
                            buckets[upper] = Exemplar(ids, float(e.value), seconds)
                if buckets:
                    new[series] = buckets
            if new:
                remembered[metric.name] = new
            else:
                remembered.pop(metric.name, None)
        return new

    def attach(families: dict[str, Any], before: dict[int, int], exemplars: _SeriesExemplars) -> None:
        """Give the ``_bucket`` samples that this translation added their exemplars."""
        for family in families.values():
            if not isinstance(family, HistogramMetricFamily):
                continue
            samples = family.samples
            for i in range(before.get(id(family), 0), len(samples)):
                sample = samples[i]
                if not sample.name.endswith("_bucket") or sample.exemplar is not None:
                    continue
                labels = sample.labels
                series = exemplars.get(tuple(sorted((k, v) for k, v in labels.items() if k != "le")))
                if series is None:
                    continue
                exemplar = series.get(float(labels["le"]))
                if exemplar is not None:
                    samples[i] = sample._replace(exemplar=exemplar)

    def translate_metric(*args: Any, **kwargs: Any) -> Any:
        plan = None
        try:
            given = arguments(args, kwargs)
            if wanted(given["metric"]):
                families = given["metric_family_id_metric_family"]
                before = {id(f): len(f.samples) for f in families.values() if isinstance(f, HistogramMetricFamily)}
                plan = given, families, before
        except Exception as exc:  # never fail a scrape over exemplars
            _warn_once(_READER_COLLECTOR, exc)
        result = translate(*args, **kwargs)
        if plan is not None:
            given, families, before = plan
            try:
                exemplars = newest(given["metric"], given["scope_attrs"], given["resource_attrs"])
                if exemplars:
                    attach(families, before, exemplars)
            except Exception as exc:  # never fail a scrape over exemplars
                _warn_once(_READER_COLLECTOR, exc)
        return result

    translate_metric.otel_dra_exemplars = True  # type: ignore[attr-defined]
    collector._translate_metric = translate_metric
    return True


# --- OTLP/HTTP transport --------------------------------------------------------------------------


def urllib3_transport() -> Any | None:
    """The exporters' urllib3 transport (``opentelemetry.exporter.http.transport._urllib3``), or None
    when that module is gone: the exporter then builds its default ``requests`` session."""
    try:
        from opentelemetry.exporter.http.transport._urllib3 import Urllib3HTTPTransport
    except ImportError as exc:
        _warn_once("opentelemetry.exporter.http.transport._urllib3", exc)
        return None
    return Urllib3HTTPTransport()


def otlp_http_exporter(cls: Callable[..., _T], transport: Any | None) -> _T:
    """``cls()`` (an OTLP/HTTP span or metric exporter) sending through ``transport`` (the
    exporters' ``_transport`` keyword); without one, or when the keyword is gone, ``cls()``."""
    if transport is None:
        return cls()
    try:
        return cls(_transport=transport)
    except TypeError as exc:  # the keyword is gone: the default transport
        _warn_once(f"{getattr(cls, '__qualname__', cls)}(_transport=...)", exc)
        transport.close()
        return cls()


# --- raw OTLP senders (pre-encoded requests) ------------------------------------------------------

_METRICS_EXPORT = "/opentelemetry.proto.collector.metrics.v1.MetricsService/Export"


def grpc_bytes_sender(exporter: Any) -> Callable[[bytes], bool]:
    """Turn the SDK's gRPC metric exporter into a sender of serialised ExportMetricsServiceRequests,
    with its channel, credentials, headers, compression, timeout and retries: its stub is replaced
    by one whose serialiser passes bytes through, and its translation step is the identity."""
    from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceResponse
    from opentelemetry.sdk.metrics.export import MetricExportResult

    class RawStub:
        def __init__(self, channel: Any) -> None:
            self.Export = channel.unary_unary(
                _METRICS_EXPORT,
                request_serializer=lambda data: data,
                response_deserializer=ExportMetricsServiceResponse.FromString,
            )

    exporter._stub = RawStub
    exporter._initialize_channel_and_stub()
    exporter._translate_data = lambda data: data
    exporter._count_data = lambda data: 0

    def send(request: bytes) -> bool:
        return bool(exporter._export(request) == MetricExportResult.SUCCESS)

    return send


def http_bytes_sender(exporter: Any) -> Callable[[bytes], bool]:
    """A sender of serialised requests through the SDK's OTLP/HTTP metric exporter's client (its
    endpoint, headers, compression, timeout, retries and transport)."""
    client = exporter._client

    def send(request: bytes) -> bool:
        return bool(client.export(request).success)

    return send


# --- tracing --------------------------------------------------------------------------------------
# Only for a TracerProvider that otel_dra.telemetry.spans.tracer_provider did not make (tests, a
# program embedding the plugin): the recorder's own providers get their id generator and sampler
# through the public constructor.


def tracer_id_generator(tracer: Any) -> Any:
    """The id generator an SDK ``Tracer`` draws its ids from (its ``id_generator`` attribute)."""
    return tracer.id_generator


def set_tracer_id_generator(tracer: Any, generator: Any) -> None:
    """Make an SDK ``Tracer`` draw its ids from ``generator`` (only that tracer, not its provider's
    other tracers)."""
    tracer.id_generator = generator


def tracer_sampler(tracer: Any) -> Any:
    """The sampler an SDK ``Tracer`` asks (its ``sampler`` attribute, its provider's sampler)."""
    return tracer.sampler
