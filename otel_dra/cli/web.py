"""The /metrics security flags shared by every command that serves /metrics:
``--web-config-file`` (TLS, basic auth, headers; otel_dra/telemetry/webconfig.py) and
``--authorization=kubernetes`` (TokenReview + SubjectAccessReview; otel_dra/kube/authz.py), their
wiring into the metrics server's :class:`~otel_dra.telemetry.http.Security`, and the server of one
OTel registry's /metrics that the plugin, the binding controller and the webhook start with them."""

from __future__ import annotations

import argparse
import logging
from typing import Any

from otel_dra.cli.flags import UsageError, add_flag, int_in, positive_seconds
from otel_dra.records import record

log = logging.getLogger("otel_dra")

AUTHORIZATION_MODES = ("none", "kubernetes")


def add_web_flags(parser: argparse.ArgumentParser) -> None:
    add_flag(
        parser,
        "--web-config-file",
        "OTEL_DRA_WEB_CONFIG_FILE",
        "Prometheus exporter-toolkit web config (tls_server_config, basic_auth_users, http_server_config."
        "headers) for /metrics; certificate files are re-read when they change",
        default=None,
    )
    add_flag(
        parser,
        "--authorization",
        "OTEL_DRA_AUTHORIZATION",
        "who may read /metrics: none (anyone), or kubernetes (a bearer token that a TokenReview accepts, "
        "whose user a SubjectAccessReview allows to get the non-resource URL /metrics)",
        default="none",
        choices=AUTHORIZATION_MODES,
    )
    add_flag(
        parser,
        "--authorization-allow-ttl",
        "OTEL_DRA_AUTHORIZATION_ALLOW_TTL",
        "seconds an allowed token's review is cached (--authorization=kubernetes)",
        default=120.0,
        type=positive_seconds,
    )
    add_flag(
        parser,
        "--authorization-deny-ttl",
        "OTEL_DRA_AUTHORIZATION_DENY_TTL",
        "seconds a rejected or forbidden token's review is cached (--authorization=kubernetes)",
        default=30.0,
        type=positive_seconds,
    )
    # The HTTP server's limits (otel_dra.telemetry.http.Limits): what one client may take.
    add_flag(
        parser,
        "--web-max-connections",
        "OTEL_DRA_WEB_MAX_CONNECTIONS",
        "open connections at most; further ones wait in the kernel's accept backlog",
        default=1024,
        type=int_in(1, 1_000_000),
    )
    add_flag(
        parser,
        "--web-max-requests",
        "OTEL_DRA_WEB_MAX_REQUESTS",
        "requests served at once (worker threads); further complete requests wait for a worker",
        default=32,
        type=int_in(1, 1024),
    )
    add_flag(
        parser,
        "--web-max-requests-per-client",
        "OTEL_DRA_WEB_MAX_REQUESTS_PER_CLIENT",
        "/metrics requests from one client address served at once (probes are never held); its further "
        "scrapes wait for its own earlier ones (so one client with many connections cannot crowd out the others)",
        default=1,
        type=int_in(1, 1024),
    )
    add_flag(
        parser,
        "--web-header-timeout",
        "OTEL_DRA_WEB_HEADER_TIMEOUT",
        "seconds a client may take to send a request's line and headers (from its first byte, or the "
        "connection's start); then 408 and closed",
        default=10.0,
        type=positive_seconds,
    )
    add_flag(
        parser,
        "--web-idle-timeout",
        "OTEL_DRA_WEB_IDLE_TIMEOUT",
        "seconds a keep-alive connection may wait for its next request before it is closed",
        default=120.0,
        type=positive_seconds,
    )
    add_flag(
        parser,
        "--web-write-timeout",
        "OTEL_DRA_WEB_WRITE_TIMEOUT",
        "seconds a response's send may make no progress (a client that stops reading) before the connection is closed",
        default=60.0,
        type=positive_seconds,
    )


@record(frozen=True)
class WebOptions:
    """What the flags ask of the metrics server; ``config`` is the parsed web config file."""

    config: Any = None  # otel_dra.telemetry.webconfig.WebConfig | None
    authorization: str = "none"
    allow_ttl: float = 120.0
    deny_ttl: float = 30.0
    limits: Any = None  # otel_dra.telemetry.http.Limits | None (None: its defaults)

    @property
    def scheme(self) -> str:
        return "https" if self.config is not None and self.config.tls is not None else "http"


def web_options(args: argparse.Namespace) -> WebOptions:
    """The flags' values, the web config file read and checked (an invalid one is a UsageError)."""
    from otel_dra.telemetry.webconfig import WebConfigError, load_web_config

    config = None
    if args.web_config_file:
        try:
            config = load_web_config(args.web_config_file)
        except WebConfigError as exc:
            raise UsageError(f"--web-config-file (OTEL_DRA_WEB_CONFIG_FILE): {exc}") from None
    from otel_dra.telemetry.http import Limits

    limits = Limits(
        max_connections=args.web_max_connections,
        max_workers=args.web_max_requests,
        max_requests_per_client=args.web_max_requests_per_client,
        header_timeout=args.web_header_timeout,
        idle_timeout=args.web_idle_timeout,
        write_timeout=args.web_write_timeout,
    )
    return WebOptions(config, args.authorization, args.authorization_allow_ttl, args.authorization_deny_ttl, limits)


@record
class MetricsAccess:
    """The metrics server's Security, and the Kubernetes authorizer behind it (None unless
    --authorization=kubernetes), kept for its counters."""

    security: Any  # otel_dra.telemetry.http.Security | None
    authorizer: Any = None  # otel_dra.kube.authz.KubernetesAuthorizer | None


def build_access(options: WebOptions, client: Any) -> MetricsAccess:
    """The Security for ``options``; ``client`` (a KubeClient) sends the reviews."""
    from otel_dra.telemetry.http import Security, TokenVerdict
    from otel_dra.telemetry.webconfig import BasicAuth, TLSContexts

    if options.authorization not in AUTHORIZATION_MODES:
        raise UsageError(f"--authorization {options.authorization!r}: expected one of {', '.join(AUTHORIZATION_MODES)}")
    config = options.config
    if config is None and options.authorization == "none":
        return MetricsAccess(None)
    authorizer = None
    authorize_token = None
    if options.authorization == "kubernetes":
        from otel_dra.kube.authz import KubernetesAuthorizer, ReviewUnavailable

        authorizer = KubernetesAuthorizer(client, allow_ttl=options.allow_ttl, deny_ttl=options.deny_ttl)

        def authorize_token(token: str) -> TokenVerdict:
            try:
                review = authorizer(token)
            except ReviewUnavailable as exc:
                log.warning("cannot authorize a /metrics request: %s", exc)
                return TokenVerdict(503, str(exc))
            if not review.authenticated:
                return TokenVerdict(401, review.reason)
            if not review.allowed:
                return TokenVerdict(403, f"{review.user}: {review.reason}")
            return TokenVerdict(200)

        if config is None or config.tls is None:
            log.warning(
                "--authorization=kubernetes without TLS (--web-config-file tls_server_config): scrapers send "
                "their tokens in clear"
            )
    if config is not None and config.basic_auth_users and config.tls is None:
        log.warning("basic_auth_users without tls_server_config: scrapers send their passwords in clear")
    security = Security(
        tls=TLSContexts(config.tls) if config is not None and config.tls is not None else None,
        basic_auth=BasicAuth(config.basic_auth_users) if config is not None and config.basic_auth_users else None,
        authorize_token=authorize_token,
        headers=dict(config.headers) if config is not None else {},
    )
    return MetricsAccess(security, authorizer)


def describe(access: MetricsAccess) -> str:
    """For the start-up log line: how /metrics is protected."""
    security = access.security
    if security is None:
        return "http, no authentication"
    parts = ["https" if security.tls is not None else "http"]
    if security.basic_auth is not None:
        parts.append("basic auth")
    if access.authorizer is not None:
        parts.append("Kubernetes TokenReview/SubjectAccessReview")
    if not security.authenticates:
        parts.append("no authentication")
    return ", ".join(parts)


def add_metrics_listen_flags(parser: argparse.ArgumentParser) -> None:
    """``--metrics-port`` (off by default) and ``--metrics-address`` of a command whose main port
    is something else (the binding controller, the webhook)."""
    add_flag(
        parser,
        "--metrics-port",
        "OTEL_DRA_METRICS_PORT",
        "port for /metrics, /healthz and /readyz (-1: off, 0: pick a free one)",
        default=-1,
        type=int_in(-1, 65535),
    )
    add_flag(
        parser,
        "--metrics-address",
        "OTEL_DRA_METRICS_ADDRESS",
        "listen address of --metrics-port (default: all interfaces)",
        default="",
    )


def warn_if_metrics_off(metrics_port: int, options: WebOptions) -> None:
    """The security flags of a /metrics that is off (--metrics-port -1) do nothing: say so."""
    if metrics_port < 0 and (options.config is not None or options.authorization != "none"):
        log.warning("--web-config-file / --authorization have no effect: /metrics is off (--metrics-port -1)")


def serve_registry(
    registry: Any,
    not_ready: Any,
    client: Any,
    options: WebOptions,
    address: str,
    port: int,
) -> tuple[Any, MetricsAccess]:
    """/metrics of one OTel registry (the command's own instruments), with /healthz and /readyz
    (``not_ready()``: why not ready yet, None once ready), behind ``options``' security; started.
    Returns the server and its access (the caller logs where it listens, ``describe(access)``)."""
    from otel_dra.telemetry.exposition import assemble
    from otel_dra.telemetry.http import Endpoints, MetricsServer

    def scrape(openmetrics: bool, gzipped: bool) -> list[bytes]:
        return assemble(registry, [], openmetrics, gzipped)

    access = build_access(options, client)
    server = MetricsServer(Endpoints(scrape, not_ready), address, port, access.security, options.limits)
    return server.start(), access
