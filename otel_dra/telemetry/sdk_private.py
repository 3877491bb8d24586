"""The one module that touches private names of the OpenTelemetry SDK and its OTLP exporters.

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
