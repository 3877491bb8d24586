"""TracerProvider construction from the standard ``OTEL_*`` environment.

Like the MeterProvider (:mod:`otel_dra.telemetry.provider`), the TracerProvider is built here and
passed to whoever makes spans; nothing sets the global provider. The SDK's auto-configuration is
not used, so the variables it would read are read here, and validated: the SDK silently falls
back to defaults on a misspelt sampler, which would leave a user wondering why nothing is sampled.

- ``OTEL_TRACES_EXPORTER``: ``otlp`` (default), ``console`` or ``none``.
- ``OTEL_EXPORTER_OTLP_(TRACES_)ENDPOINT``: without one (and without ``console``) tracing is off and
  a no-op provider is returned, so instrumented code costs next to nothing.
- ``OTEL_EXPORTER_OTLP_(TRACES_)PROTOCOL``: ``grpc`` or ``http/protobuf`` (default); endpoint,
  headers, TLS, compression and timeout are read by the exporter classes.
- ``OTEL_TRACES_SAMPLER`` / ``OTEL_TRACES_SAMPLER_ARG``: the specification's six built-in samplers;
  the default is ``traceidratio`` (ratio 1.0 unless ``OTEL_TRACES_SAMPLER_ARG`` says), deciding by the
  trace id alone, so that every process that adds to one trace (a claim's, whose trace id is its UID)
  samples it whole or not at all. Both ratio samplers read the trace id's low 56 bits, not the SDK's
  64 (see :mod:`otel_dra.telemetry.traceids`: a UUID's low 64 bits are not random).
- ``OTEL_SERVICE_NAME`` / ``OTEL_RESOURCE_ATTRIBUTES``: the resource, as for metrics.
- ``OTEL_BSP_*``: batching, read by the SDK's BatchSpanProcessor.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping

from opentelemetry import trace
from opentelemetry.metrics import MeterProvider
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter
from opentelemetry.sdk.trace.sampling import (
    ALWAYS_OFF,
    ALWAYS_ON,
    DEFAULT_OFF,
    DEFAULT_ON,
    Sampler,
)

from otel_dra.records import record
from otel_dra.telemetry.otlp import ConfigError, OtlpSignalConfig, otlp_config, plain_http_transport
from otel_dra.telemetry.provider import make_resource
from otel_dra.telemetry.sdk_private import otlp_http_exporter
from otel_dra.telemetry.spans import tracer_provider
from otel_dra.telemetry.spansink import SpanSink
from otel_dra.telemetry.traceids import ParentBasedTraceIdRatio, TraceIdRatio

log = logging.getLogger(__name__)

EXPORTERS = ("otlp", "console", "none")
SAMPLERS = (
    "always_on",
    "always_off",
    "traceidratio",
    "parentbased_always_on",
    "parentbased_always_off",
    "parentbased_traceidratio",
)
# By the trace id alone: see the module notes.
DEFAULT_SAMPLER = "traceidratio"


def sampler_from_env(env: Mapping[str, str] | None = None) -> Sampler:
    """``OTEL_TRACES_SAMPLER`` (default ``traceidratio``) and its ratio argument (default 1.0)."""
    env = os.environ if env is None else env
    name = (env.get("OTEL_TRACES_SAMPLER") or DEFAULT_SAMPLER).strip().lower()
    if name not in SAMPLERS:
        raise ConfigError(f"OTEL_TRACES_SAMPLER={name!r} is not supported; use one of {', '.join(SAMPLERS)}")
    if name.endswith("traceidratio"):
        raw = (env.get("OTEL_TRACES_SAMPLER_ARG") or "1.0").strip()
        try:
            ratio = float(raw)
        except ValueError:
            raise ConfigError(f"OTEL_TRACES_SAMPLER_ARG={raw!r} is not a number") from None
        if not 0.0 <= ratio <= 1.0:
            raise ConfigError(f"OTEL_TRACES_SAMPLER_ARG={raw!r} must be between 0 and 1")
        return TraceIdRatio(ratio) if name == "traceidratio" else ParentBasedTraceIdRatio(ratio)
    return {
        "always_on": ALWAYS_ON,
        "always_off": ALWAYS_OFF,
        "parentbased_always_on": DEFAULT_ON,
        "parentbased_always_off": DEFAULT_OFF,
    }[name]


def otlp_span_exporter(config: OtlpSignalConfig) -> SpanExporter:
    """The OTLP span exporter for the configured protocol; it reads endpoint/headers/TLS from env."""
    if config.protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as Grpc

        return Grpc()
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as Http

    return otlp_http_exporter(Http, plain_http_transport(config))


def _configured(
    env: Mapping[str, str], exporter: SpanExporter | None
) -> tuple[Sampler, SpanExporter | None, OtlpSignalConfig | None, str]:
    """The sampler, the span exporter (None: tracing off), its OTLP settings and its name."""
    sampler = sampler_from_env(env)  # validated even when tracing is off: a typo should not hide
    name = (env.get("OTEL_TRACES_EXPORTER") or "otlp").strip().lower()
    if name not in EXPORTERS:
        raise ConfigError(f"OTEL_TRACES_EXPORTER={name!r} is not supported; use one of {', '.join(EXPORTERS)}")
    config = otlp_config("traces", env) if name == "otlp" else None
    if exporter is None:
        if name == "console":
            exporter = ConsoleSpanExporter()
        elif config is not None:
            exporter = otlp_span_exporter(config)
    return sampler, exporter, config, name


@record
class TracingPipeline:
    """The provider to hand to instrumented code; ``enabled`` is False for the no-op provider."""

    tracer_provider: trace.TracerProvider
    resource: Resource
    otlp: OtlpSignalConfig | None = None
    exporter_name: str = "none"

    @property
    def enabled(self) -> bool:
        return isinstance(self.tracer_provider, TracerProvider)

    def shutdown(self) -> None:
        """Flush what is batched and stop; safe to call twice. Bounded by the exporter timeout."""
        if isinstance(self.tracer_provider, TracerProvider):
            try:
                self.tracer_provider.shutdown()
            except Exception:  # best effort at exit
                log.exception("tracer provider shutdown failed")


def build_tracing_pipeline(
    *,
    service_name: str,
    version: str,
    env: Mapping[str, str] | None = None,
    exporter: SpanExporter | None = None,
) -> TracingPipeline:
    """A TracerProvider from the environment; ``exporter`` replaces the configured one (tests)."""
    env = os.environ if env is None else env
    resource = make_resource(service_name, version)
    sampler, exporter, config, name = _configured(env, exporter)
    if exporter is None:
        return TracingPipeline(trace.NoOpTracerProvider(), resource)
    # With the id generator a SpanRecorder presets (public constructor argument; see spans.py).
    provider = tracer_provider(sampler=sampler, resource=resource, shutdown_on_exit=False)
    provider.add_span_processor(BatchSpanProcessor(exporter))
    return TracingPipeline(provider, resource, config, name)


@record
class SpanSinkPipeline:
    """A :class:`~otel_dra.telemetry.spansink.SpanSink` from the environment (None: tracing off)
    and the sampler its producer decides with."""

    sink: SpanSink | None
    sampler: Sampler
    resource: Resource
    otlp: OtlpSignalConfig | None = None

    def shutdown(self) -> None:
        if self.sink is not None:
            self.sink.shutdown()


def build_span_sink(
    *,
    service_name: str,
    scope: str,
    version: str,
    meter_provider: MeterProvider | None = None,
    env: Mapping[str, str] | None = None,
    exporter: SpanExporter | None = None,
) -> SpanSinkPipeline:
    """The same ``OTEL_*`` variables as :func:`build_tracing_pipeline`, for a producer whose spans
    are finished when handed over (see spansink.py); ``exporter`` replaces the configured one."""
    env = os.environ if env is None else env
    resource = make_resource(service_name, version)
    sampler, exporter, config, _name = _configured(env, exporter)
    if exporter is None:
        return SpanSinkPipeline(None, sampler, resource)
    sink = SpanSink(exporter, resource, scope, version, meter_provider=meter_provider).start()
    return SpanSinkPipeline(sink, sampler, resource, config)
