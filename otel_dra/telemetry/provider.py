"""MeterProvider construction: one Prometheus pull reader, an optional OTLP push reader.

Histogram exemplars (trace and span id of the sampled span a measurement was recorded in) go out
over OTLP and, in an OpenMetrics scrape, on the Prometheus reader's ``_bucket`` lines
(``sdk_private.prometheus_exemplars``: the SDK's reader drops them).

The Prometheus registry also serves the standard ``process_*`` families (CPU seconds, resident and
virtual memory, open and maximum file descriptors, start time) that every Prometheus client library
exports: prometheus_client's own ProcessCollector, so names, HELP and TYPE are client_python's (the
same as client_golang's). It reads /proc/self at each scrape (about 0.3 ms, measured on the CI
machine) and keeps nothing between scrapes; they are not pushed over OTLP (like ``target_info``).

Providers are built here and passed to whoever needs a meter; nothing in the project uses the
global OpenTelemetry providers, so tests can build as many independent stacks as they like.
"""

from __future__ import annotations

import logging

from opentelemetry.exporter.prometheus import PrometheusMetricReader
from opentelemetry.sdk.metrics import (
    Counter,
    Histogram,
    MeterProvider,
    ObservableCounter,
    ObservableGauge,
    ObservableUpDownCounter,
    UpDownCounter,
)
from opentelemetry.sdk.metrics.export import MetricExporter, MetricReader, PeriodicExportingMetricReader
from opentelemetry.sdk.resources import SERVICE_NAME, SERVICE_VERSION, Resource
from prometheus_client import CollectorRegistry, ProcessCollector

from otel_dra.records import record
from otel_dra.telemetry.otlp import (
    OtlpSignalConfig,
    metric_export_interval_ms,
    metric_export_timeout_ms,
    otlp_config,
    plain_http_transport,
)
from otel_dra.telemetry.sdk_private import otlp_http_exporter, prometheus_exemplars, sync_gauge_class

log = logging.getLogger(__name__)

# The SDK folds every series past 2000 per instrument into one `otel_metric_overflow` series.
# We never want series dropped silently, so the limit is set far above any real cluster
# (10^5 claims x 32 results is 3.2 million).
UNLIMITED = 2**31 - 1
NO_CARDINALITY_CAP: dict[type, int] = {
    kind: UNLIMITED
    for kind in (
        Counter,
        UpDownCounter,
        Histogram,
        sync_gauge_class(),  # the synchronous Gauge: a private name of the SDK (sdk_private)
        ObservableCounter,
        ObservableUpDownCounter,
        ObservableGauge,
    )
    if kind is not None
}


def make_resource(default_service_name: str, version: str) -> Resource:
    """The service resource; ``OTEL_SERVICE_NAME`` and ``OTEL_RESOURCE_ATTRIBUTES`` win."""
    resource = Resource.create({SERVICE_VERSION: version})
    name = str(resource.attributes.get(SERVICE_NAME, ""))
    if not name or name.startswith("unknown_service"):
        resource = resource.merge(Resource({SERVICE_NAME: default_service_name}))
    return resource


def otlp_metric_exporter(config: OtlpSignalConfig) -> MetricExporter:
    """The OTLP exporter for the configured protocol; it reads endpoint/headers/TLS from env."""
    if config.protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter as Grpc

        return Grpc()
    from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter as Http

    return otlp_http_exporter(Http, plain_http_transport(config))


@record
class MetricsPipeline:
    """What a process exports: the pull side and, when configured, the push side.

    ``meter_provider`` feeds both readers. Per-object state does not go through it: its
    Prometheus exposition and OTLP points are rendered when objects change (see
    :mod:`otel_dra.telemetry.exposition` and :mod:`otel_dra.telemetry.otlp_encode`) and pushed with
    the same resource by :class:`otel_dra.telemetry.otlp_push.PreEncodedPusher`.
    """

    resource: Resource
    registry: CollectorRegistry
    meter_provider: MeterProvider
    otlp: OtlpSignalConfig | None = None

    def shutdown(self) -> None:
        """Flush OTLP and stop; safe to call twice."""
        try:
            self.meter_provider.shutdown()
        except Exception:  # shutdown is best effort at exit
            log.exception("meter provider shutdown failed")


def build_metrics_pipeline(
    *,
    service_name: str,
    version: str,
    target_info: bool = True,
    process_metrics: bool = True,
) -> MetricsPipeline:
    """Build the main MeterProvider from the environment: the Prometheus reader always, the OTLP
    reader when ``OTEL_EXPORTER_OTLP_(METRICS_)ENDPOINT`` is set; ``process_metrics`` adds the
    ``process_*`` families to the Prometheus registry (see the module notes)."""
    resource = make_resource(service_name, version)
    registry = CollectorRegistry(auto_describe=True)
    prom = PrometheusMetricReader(
        disable_target_info=not target_info,
        scope_info_enabled=False,
        registry=registry,
        cardinality_limits=NO_CARDINALITY_CAP,
    )
    # Histogram exemplars on the `_bucket` lines of an OpenMetrics scrape (the SDK's reader drops
    # them; a private name of its collector: sdk_private). Text 0.0.4 never carries exemplars.
    prometheus_exemplars(prom)
    if process_metrics:
        ProcessCollector(registry=registry)  # after the reader: the SDK's families come first
    readers: list[MetricReader] = [prom]
    config = otlp_config("metrics")
    if config is not None:
        readers.append(
            PeriodicExportingMetricReader(
                otlp_metric_exporter(config),
                metric_export_interval_ms(),
                metric_export_timeout_ms(),
                cardinality_limits=NO_CARDINALITY_CAP,
            )
        )
    provider = MeterProvider(metric_readers=readers, resource=resource, shutdown_on_exit=False)
    return MetricsPipeline(
        resource=resource,
        registry=registry,
        meter_provider=provider,
        otlp=config,
    )
