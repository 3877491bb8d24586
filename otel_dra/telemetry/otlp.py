"""OTLP exporter configuration from the standard ``OTEL_*`` environment variables.

The SDK reads ``OTEL_EXPORTER_OTLP_PROTOCOL`` only in its auto-configuration, which we do not use
(providers are built explicitly), so the protocol choice happens here. Everything else
(endpoint, headers, certificates, compression, timeout) is read by the exporter classes
themselves; we validate the numeric variables up front so that a typo fails at start-up with a
clear message instead of inside an export thread.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from otel_dra.records import record

PROTOCOLS = ("grpc", "http/protobuf")
# The specification's default. Note that port 4317 is gRPC and 4318 is HTTP by convention.
DEFAULT_PROTOCOL = "http/protobuf"


class ConfigError(ValueError):
    """An invalid flag or environment variable; the message names it."""


@record(frozen=True)
class OtlpSignalConfig:
    signal: str  # "metrics" or "traces"
    protocol: str
    endpoint: str


def _positive_number(env: Mapping[str, str], name: str) -> float | None:
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return None
    try:
        value = float(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not a number") from None
    if not value > 0 or value != value or value == float("inf"):
        raise ConfigError(f"{name}={raw!r} must be a positive, finite number")
    return value


def otlp_config(signal: str, env: Mapping[str, str] | None = None) -> OtlpSignalConfig | None:
    """The OTLP settings for one signal, or None when no endpoint is configured for it."""
    env = os.environ if env is None else env
    upper = signal.upper()
    endpoint = env.get(f"OTEL_EXPORTER_OTLP_{upper}_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    if not endpoint:
        return None
    protocol = (
        env.get(f"OTEL_EXPORTER_OTLP_{upper}_PROTOCOL") or env.get("OTEL_EXPORTER_OTLP_PROTOCOL") or ""
    ).strip() or DEFAULT_PROTOCOL
    if protocol not in PROTOCOLS:
        raise ConfigError(
            f"OTEL_EXPORTER_OTLP_PROTOCOL={protocol!r} is not supported; use one of {', '.join(PROTOCOLS)}"
        )
    for name in ("OTEL_EXPORTER_OTLP_TIMEOUT", f"OTEL_EXPORTER_OTLP_{upper}_TIMEOUT"):
        _positive_number(env, name)
    if signal == "metrics":
        for name in ("OTEL_METRIC_EXPORT_INTERVAL", "OTEL_METRIC_EXPORT_TIMEOUT"):
            _positive_number(env, name)
    return OtlpSignalConfig(signal=signal, protocol=protocol, endpoint=endpoint)


def metric_export_interval_ms(env: Mapping[str, str] | None = None) -> float:
    env = os.environ if env is None else env
    return _positive_number(env, "OTEL_METRIC_EXPORT_INTERVAL") or 60_000.0


def metric_export_timeout_ms(env: Mapping[str, str] | None = None) -> float:
    env = os.environ if env is None else env
    return _positive_number(env, "OTEL_METRIC_EXPORT_TIMEOUT") or 30_000.0


def plain_http_transport(config: OtlpSignalConfig, env: Mapping[str, str] | None = None) -> Any | None:
    """The SDK's urllib3 transport for an OTLP/HTTP exporter of ``config``, where it sends exactly
    what the exporter's default transport (a ``requests`` session) would; None elsewhere, and the
    exporter builds its requests session as usual.

    Why: a requests session costs about 4 MiB of resident memory and 90 modules at start-up (the
    plugin's RSS with tracing on, issue 12), and urllib3 is loaded anyway (the Kubernetes client).
    Both transports come with the SDK (``opentelemetry-exporter-http-transport``: "requests" and
    "urllib3"); the exporter takes one through its private ``_transport`` argument (both private
    names live in :mod:`otel_dra.telemetry.sdk_private`; None when they are gone). They differ only in
    what requests adds from the environment, so the urllib3 one is used only when none of that
    applies: a plain ``http://`` endpoint (for TLS requests trusts certifi's bundle, urllib3 the
    system's), no proxy variable (requests honours ``*_proxy``), no netrc file (requests sends
    its credentials), no credential-provider session (``OTEL_PYTHON_EXPORTER_OTLP_HTTP_*``)."""
    env = os.environ if env is None else env
    if config.protocol != "http/protobuf" or not config.endpoint.strip().lower().startswith("http://"):
        return None
    if any(name.lower().endswith("_proxy") and value for name, value in env.items()):
        return None
    upper = config.signal.upper()
    for name in (
        "OTEL_PYTHON_EXPORTER_OTLP_HTTP_CREDENTIAL_PROVIDER",
        f"OTEL_PYTHON_EXPORTER_OTLP_HTTP_{upper}_CREDENTIAL_PROVIDER",
    ):
        if env.get(name):
            return None
    # As requests looks for one (requests.utils.get_netrc_auth): no error without a home directory.
    if env.get("NETRC") or any(os.path.exists(os.path.expanduser(name)) for name in ("~/.netrc", "~/_netrc")):
        return None
    from otel_dra.telemetry.sdk_private import urllib3_transport

    return urllib3_transport()
