"""``otel-dra webhook``: the validating admission webhook for the example driver's opaque device
configuration; its flags, its wiring and its command (the webhook itself: :mod:`otel_dra.admission`)."""

from __future__ import annotations

import argparse
import logging
import ssl
import time
from pathlib import Path
from typing import Any

from otel_dra import __version__
from otel_dra.cli.flags import UsageError, add_flag, add_kubeconfig_flag, add_logging_flags, dns_subdomain, int_in
from otel_dra.cli.lifecycle import stop_on_signals, wait_for
from otel_dra.cli.web import (
    WebOptions,
    add_metrics_listen_flags,
    add_web_flags,
    describe,
    serve_registry,
    warn_if_metrics_off,
    web_options,
)
from otel_dra.records import record

log = logging.getLogger("otel_dra")

SERVICE_NAME = "otel-dra-webhook"
# What the driver's opaque parameters may be: a GpuConfig (the plugin's gpu and gpu-partitionable
# profiles), or nothing at all (its cpu and net profiles refuse every opaque entry at prepare).
OPAQUE_CONFIGS = ("GpuConfig", "none")
TLS_MIN_VERSIONS = ("TLS12", "TLS13")
# The size limit's bounds: an AdmissionReview of a small claim is a few KiB; beyond 64 MiB a body is
# no review the API server would send (it refuses request bodies over 3 MiB).
MIN_REVIEW_BYTES = 4096
MAX_REVIEW_BYTES = 64 << 20


def add_parser(sub: Any) -> None:
    from otel_dra.admission.server import DEFAULT_MAX_REVIEW_BYTES

    p = sub.add_parser(
        "webhook",
        help="reject DRA claims, claim templates and device classes whose opaque config the plugin cannot decode",
        description="A validating admission webhook (HTTPS, POST /validate, admission.k8s.io/v1): every opaque "
        "device configuration entry of --driver-name in a ResourceClaim (spec.devices.config), a "
        "ResourceClaimTemplate (spec.spec.devices.config) or a DeviceClass (spec.config) must be a GpuConfig "
        "that the plugin decodes at prepare; otherwise the object is refused at creation or update, with "
        "prepare's reason. /healthz for probes. Metrics on --metrics-port (Prometheus) and over OTLP, "
        "configured with the standard OTEL_* variables. It talks to no API server (but for "
        "--authorization=kubernetes).",
    )
    add_flag(
        p,
        "--driver-name",
        "OTEL_DRA_DRIVER_NAME",
        "the DRA driver whose opaque configuration entries are judged; other drivers' entries pass",
        default="gpu.example.com",
        type=dns_subdomain(63),
    )
    add_flag(
        p,
        "--opaque-config",
        "OTEL_DRA_OPAQUE_CONFIG",
        "what the driver's opaque parameters may be: GpuConfig (the plugin's gpu and gpu-partitionable device "
        "profiles), or none (its cpu and net profiles: every entry of the driver is refused)",
        default="GpuConfig",
        choices=OPAQUE_CONFIGS,
    )
    add_flag(
        p,
        "--port",
        "OTEL_DRA_WEBHOOK_PORT",
        "HTTPS port of /validate and /healthz (0: pick a free one)",
        default=8443,
        type=int_in(0, 65535),
    )
    add_flag(
        p, "--address", "OTEL_DRA_WEBHOOK_ADDRESS", "listen address of --port (default: all interfaces)", default=""
    )
    add_flag(
        p,
        "--tls-cert-file",
        "OTEL_DRA_TLS_CERT_FILE",
        "PEM certificate (chain) served on --port; required: the API server calls webhooks over HTTPS only. "
        "Re-read when it changes",
        default=None,
    )
    add_flag(
        p,
        "--tls-private-key-file",
        "OTEL_DRA_TLS_PRIVATE_KEY_FILE",
        "PEM private key of --tls-cert-file; required",
        default=None,
    )
    add_flag(
        p,
        "--tls-client-ca-file",
        "OTEL_DRA_TLS_CLIENT_CA_FILE",
        "PEM CA bundle: when set, a client must present a certificate it signed (the API server's, from its "
        "admission configuration's kubeConfigFile); default: any client",
        default=None,
    )
    add_flag(
        p,
        "--tls-min-version",
        "OTEL_DRA_TLS_MIN_VERSION",
        "lowest TLS version served",
        default="TLS12",
        choices=TLS_MIN_VERSIONS,
    )
    add_flag(
        p,
        "--max-review-bytes",
        "OTEL_DRA_MAX_REVIEW_BYTES",
        f"largest request body taken (413 beyond; {MIN_REVIEW_BYTES}..{MAX_REVIEW_BYTES})",
        default=DEFAULT_MAX_REVIEW_BYTES,
        type=int_in(MIN_REVIEW_BYTES, MAX_REVIEW_BYTES),
    )
    add_metrics_listen_flags(p)
    add_web_flags(p)
    add_kubeconfig_flag(p)
    add_logging_flags(p)
    p.set_defaults(func=cmd_webhook)


@record
class WebhookApp:
    """A running webhook (used by the CLI and by in-process tests)."""

    server: Any  # otel_dra.admission.server.WebhookServer
    metrics_pipeline: Any
    metrics_server: Any = None
    metrics_authorizer: Any = None
    _stopped: bool = False

    @property
    def port(self) -> int:
        return int(self.server.port)

    @property
    def metrics_port(self) -> int | None:
        return None if self.metrics_server is None else int(self.metrics_server.port)

    def stop(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        if self.metrics_server is not None:
            self.metrics_server.stop()
        self.server.stop()
        self.metrics_pipeline.shutdown()


def tls_contexts(
    cert_file: str | None, key_file: str | None, client_ca_file: str | None = None, min_version: str = "TLS12"
) -> Any:
    """The served certificate (re-read when its files change), checked now: a UsageError names the
    flag and the reason."""
    from otel_dra.telemetry.webconfig import TLS_VERSIONS, TLSContexts, TLSSettings

    if not cert_file or not key_file:
        raise UsageError(
            "--tls-cert-file and --tls-private-key-file are required: the API server calls admission webhooks "
            "over HTTPS only"
        )
    if min_version not in TLS_MIN_VERSIONS:
        raise UsageError(f"--tls-min-version {min_version!r}: expected one of {', '.join(TLS_MIN_VERSIONS)}")
    for flag, path in (
        ("--tls-cert-file", cert_file),
        ("--tls-private-key-file", key_file),
        ("--tls-client-ca-file", client_ca_file),
    ):
        if path is None:
            continue
        try:
            Path(path).read_bytes()
        except OSError as exc:
            raise UsageError(f"{flag} {path}: cannot read it: {exc.strerror or exc}") from None
    settings = TLSSettings(
        cert_file=Path(cert_file),
        key_file=Path(key_file),
        client_auth=ssl.CERT_REQUIRED if client_ca_file else ssl.CERT_NONE,
        client_ca_file=Path(client_ca_file) if client_ca_file else None,
        min_version=TLS_VERSIONS[min_version],
    )
    try:
        return TLSContexts(settings)
    except ssl.SSLError as exc:
        what = "--tls-client-ca-file" if client_ca_file else "--tls-cert-file/--tls-private-key-file"
        if client_ca_file:
            try:  # which of the two: the key pair alone
                ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(cert_file, key_file)
            except ssl.SSLError:
                what = "--tls-cert-file/--tls-private-key-file"
        raise UsageError(f"{what}: {exc.reason or exc}") from None


def start_webhook(
    *,
    cert_file: str | None,
    key_file: str | None,
    driver_name: str = "gpu.example.com",
    opaque_config: str = "GpuConfig",
    port: int = 8443,
    address: str = "",
    client_ca_file: str | None = None,
    min_version: str = "TLS12",
    max_review_bytes: int | None = None,
    metrics_port: int = -1,
    metrics_address: str = "",
    web: WebOptions | None = None,
    kubeconfig: str | None = None,
    meter_provider: Any = None,
) -> WebhookApp:
    """Start the webhook (and /metrics when ``metrics_port`` >= 0). ``meter_provider`` replaces the
    pipeline's (tests read an in-memory reader)."""
    from otel_dra.admission.metrics import WebhookMetrics
    from otel_dra.admission.server import DEFAULT_MAX_REVIEW_BYTES, WebhookServer, webhook_limits
    from otel_dra.telemetry.provider import build_metrics_pipeline

    if opaque_config not in OPAQUE_CONFIGS:
        raise UsageError(f"--opaque-config {opaque_config!r}: expected one of {', '.join(OPAQUE_CONFIGS)}")
    tls = tls_contexts(cert_file, key_file, client_ca_file, min_version)
    pipeline = build_metrics_pipeline(service_name=SERVICE_NAME, version=__version__)
    if pipeline.otlp is not None:
        log.info("pushing metrics over OTLP (%s) to %s", pipeline.otlp.protocol, pipeline.otlp.endpoint)
    metrics = WebhookMetrics(meter_provider if meter_provider is not None else pipeline.meter_provider)
    limits = webhook_limits(max_review_bytes or DEFAULT_MAX_REVIEW_BYTES)
    try:
        server = WebhookServer(
            driver_name,
            tls,
            address=address,
            port=port,
            gpu_config=opaque_config == "GpuConfig",
            metrics=metrics,
            limits=limits,
        )
    except OSError as exc:
        pipeline.shutdown()
        where = f"{address or '0.0.0.0'}:{port} (--port)"
        raise OSError(exc.errno, f"cannot listen on {where}: {exc.strerror}") from None
    except BaseException:
        pipeline.shutdown()
        raise
    app = WebhookApp(server.start(), pipeline)
    try:
        if metrics_port >= 0:
            _serve_metrics(app, web or WebOptions(), metrics_address, metrics_port, kubeconfig)
    except BaseException:
        app.stop()
        raise
    log.info(
        "serving /validate and /healthz on https://%s:%d for driver %s, opaque config %s (%s; reviews up to %d bytes)",
        address or "0.0.0.0",
        server.port,
        driver_name,
        opaque_config,
        "client certificates required" if client_ca_file else "any client",
        limits.max_body_bytes,
    )
    return app


def _serve_metrics(app: WebhookApp, web: WebOptions, address: str, port: int, kubeconfig: str | None) -> None:
    """/metrics of the webhook's registry; /readyz is always ready (nothing to wait for)."""
    client = None
    if web.authorization == "kubernetes":
        # The only case the webhook talks to an API server: the reviews of scrapers' tokens.
        from otel_dra.kube.client import KubeClient, load_credentials

        credentials = load_credentials(kubeconfig)
        log.info("using Kubernetes credentials from %s (server %s)", credentials.source, credentials.host)
        client = KubeClient(credentials, user_agent=f"{SERVICE_NAME}/{__version__}")
    try:
        app.metrics_server, access = serve_registry(
            app.metrics_pipeline.registry, lambda: None, client, web, address, port
        )
    except OSError as exc:
        raise OSError(
            exc.errno, f"cannot listen on {address or '0.0.0.0'}:{port} (--metrics-port): {exc.strerror}"
        ) from None
    app.metrics_authorizer = access.authorizer
    log.info(
        "serving /metrics, /healthz, /readyz on %s:%d (/metrics: %s)",
        address or "0.0.0.0",
        app.metrics_server.port,
        describe(access),
    )


def cmd_webhook(args: argparse.Namespace) -> int:
    from otel_dra.kube.client import CredentialsError
    from otel_dra.telemetry.otlp import ConfigError

    web = web_options(args)
    warn_if_metrics_off(args.metrics_port, web)
    stop = stop_on_signals()
    try:
        app = start_webhook(
            cert_file=args.tls_cert_file,
            key_file=args.tls_private_key_file,
            driver_name=args.driver_name,
            opaque_config=args.opaque_config,
            port=args.port,
            address=args.address,
            client_ca_file=args.tls_client_ca_file,
            min_version=args.tls_min_version,
            max_review_bytes=args.max_review_bytes,
            metrics_port=args.metrics_port,
            metrics_address=args.metrics_address,
            web=web,
            kubeconfig=args.kubeconfig,
        )
    except (CredentialsError, ConfigError) as exc:
        log.error("%s", exc)
        return 2
    except OSError as exc:
        log.error("%s", exc.strerror or exc)
        return 2
    wait_for(stop)
    started = time.monotonic()
    app.stop()
    log.info("stopped in %.1fs", time.monotonic() - started)
    return 0
