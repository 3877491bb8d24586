"""The metrics application: ``/metrics``, ``/healthz`` (``/livez``), ``/readyz`` and ``/``.

It is told *what* to serve through callables (:class:`Endpoints`) and knows nothing about where the
data comes from; it negotiates the exposition format (text or OpenMetrics) and gzip, answers 500
with no partial data when a scrape fails, and marks scrapes in flight for background exports.
With a :class:`Security` it serves HTTPS (certificates re-read when their files change), asks
``/metrics`` clients for basic-auth credentials and/or a bearer token that a
:data:`TokenAuthorizer` checks, and adds response headers; ``/healthz``, ``/readyz`` and ``/`` stay
open so that probes need no credentials. Who checks a token (Kubernetes TokenReview and
SubjectAccessReview, otel_dra/kube/authz.py) is the caller's business.

Connections, threads, limits and timeouts are the engine's (:mod:`otel_dra.telemetry.httpserver`);
:class:`MetricsServer` puts the two together.
"""

from __future__ import annotations

import base64
import binascii
import logging
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import field

from otel_dra.records import record
from otel_dra.telemetry.exposition import (
    OPENMETRICS_CONTENT_TYPE,
    TEXT_CONTENT_TYPE,
    maybe_gzip,
    negotiate,
    wants_gzip,
)
from otel_dra.telemetry.httpserver import HttpServer, Limits, RequestHandler, send_buffers
from otel_dra.telemetry.priority import ScrapePriority
from otel_dra.telemetry.webconfig import BasicAuth, TLSContexts

# Limits and send_buffers are the engine's, named here too for the callers of this module.
__all__ = [
    "Endpoints",
    "Limits",
    "MetricsServer",
    "NotReady",
    "Security",
    "TokenAuthorizer",
    "TokenVerdict",
    "send_buffers",
]

log = logging.getLogger(__name__)


class NotReady(Exception):
    """Raised by a scrape source to answer 500 with no partial data."""


@record
class Endpoints:
    """``scrape(openmetrics, gzipped)`` returns the body as buffers to send in order (gzip members
    when ``gzipped``) or raises :class:`NotReady`; ``ready()`` returns None when ready, else the
    reason."""

    scrape: Callable[[bool, bool], list[bytes]]
    ready: Callable[[], str | None]
    on_scrape: Callable[[float, float, bool], None] | None = None  # (seconds, CPU seconds, ok)
    # Marks scrapes in flight (rendering and sending) so that background exports can step aside.
    priority: ScrapePriority | None = None


@record(frozen=True)
class TokenVerdict:
    """A :data:`TokenAuthorizer`'s answer: ``status`` 200 (allowed), 401 (not authenticated), 403
    (authenticated, not allowed) or 503 (cannot tell now); ``reason`` goes to the debug log."""

    status: int
    reason: str = ""


# Checks a bearer token for ``GET /metrics``; called from the connection's thread, may block.
TokenAuthorizer = Callable[[str], TokenVerdict]


@record(frozen=True)
class Security:
    """HTTPS, credentials for ``/metrics`` and extra response headers. With both ``basic_auth`` and
    ``authorize_token``, either kind of credential is accepted."""

    tls: TLSContexts | None = None
    basic_auth: BasicAuth | None = None
    authorize_token: TokenAuthorizer | None = None
    headers: Mapping[str, str] = field(default_factory=dict)
    # Seconds a new connection may take to complete the TLS handshake.
    handshake_timeout: float = 10.0

    @property
    def authenticates(self) -> bool:
        return self.basic_auth is not None or self.authorize_token is not None


_DENIED_BODY = {401: b"unauthorized\n", 403: b"forbidden\n", 503: b"authorization unavailable\n"}


class _Handler(RequestHandler):
    """The routes (see the module notes); the engine makes one per request."""

    endpoints: Endpoints
    security: Security | None = None
    server_version = "otel-dra"

    def end_headers(self) -> None:
        if self.security is not None:
            for name, value in self.security.headers.items():
                self.send_header(name, value)
        super().end_headers()

    def _send(
        self,
        code: int,
        body: bytes,
        content_type: str = "text/plain; charset=utf-8",
        headers: Mapping[str, str] | None = None,
    ) -> None:
        gzipped = False
        if len(body) > 1024:
            body, gzipped = maybe_gzip(body, self.headers.get("Accept-Encoding"))
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        if gzipped:
            self.send_header("Content-Encoding", "gzip")
        self.send_header("Content-Length", str(len(body)))
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _denied(self) -> bool:
        """Whether the request lacks what ``/metrics`` asks for; if so, the answer has been sent."""
        security = self.security
        if security is None or not security.authenticates:
            return False
        scheme, _, credentials = (self.headers.get("Authorization") or "").strip().partition(" ")
        scheme, credentials = scheme.lower(), credentials.strip()
        status, reason = 401, "no credentials"
        if scheme == "basic" and security.basic_auth is not None:
            try:
                user, sep, password = base64.b64decode(credentials, validate=True).decode().partition(":")
            except (binascii.Error, UnicodeDecodeError):
                user, sep, password = "", "", ""
            if sep and security.basic_auth.check(user, password):
                return False
            reason = "basic auth: wrong user or password"
        elif scheme == "bearer" and credentials and security.authorize_token is not None:
            verdict = security.authorize_token(credentials)
            if verdict.status == 200:
                return False
            status = verdict.status if verdict.status in _DENIED_BODY else 503
            reason = verdict.reason
        log.debug("http: %s %s from %s: %d (%s)", self.command, self.path, self.client_address[0], status, reason)
        challenges = {}
        if status == 401:
            offered = []
            if security.basic_auth is not None:
                offered.append('Basic realm="otel-dra", charset="UTF-8"')
            if security.authorize_token is not None:
                offered.append('Bearer realm="otel-dra"')
            challenges["WWW-Authenticate"] = ", ".join(offered)
        self._send(status, _DENIED_BODY[status], headers=challenges)
        return True

    def do_HEAD(self) -> None:
        self.do_GET()

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0]
        if path == "/metrics":
            self._metrics()
        elif path in ("/healthz", "/livez"):
            self._send(200, b"ok\n")
        elif path == "/readyz":
            reason = self.endpoints.ready()
            if reason is None:
                self._send(200, b"ok\n")
            else:
                self._send(503, f"not ready: {reason}\n".encode())
        elif path == "/":
            self._send(200, b"otel-dra: see /metrics, /healthz, /readyz\n")
        else:
            self._send(404, b"not found\n")

    def _metrics(self) -> None:
        if self._denied():
            return
        if self.endpoints.priority is None:
            self._serve_metrics()
        else:
            with self.endpoints.priority.scraping():
                self._serve_metrics()

    def _serve_metrics(self) -> None:
        openmetrics = negotiate(self.headers.get("Accept"))
        gzipped = wants_gzip(self.headers.get("Accept-Encoding"))
        start, cpu = time.perf_counter(), time.thread_time()
        ok = False
        try:
            parts = self.endpoints.scrape(openmetrics, gzipped)
            ok = True
        except NotReady as exc:
            self._send(500, f"metrics unavailable: {exc}\n".encode())
            return
        except Exception as exc:  # never a partial scrape: any failure is a 500
            log.exception("scrape failed")
            self._send(500, f"metrics unavailable: internal error: {exc}\n".encode())
            return
        finally:
            if self.endpoints.on_scrape is not None:
                self.endpoints.on_scrape(time.perf_counter() - start, time.thread_time() - cpu, ok)
        self.send_response(200)
        self.send_header("Content-Type", OPENMETRICS_CONTENT_TYPE if openmetrics else TEXT_CONTENT_TYPE)
        if gzipped:
            self.send_header("Content-Encoding", "gzip")
        self.send_header("Content-Length", str(sum(len(p) for p in parts)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.flush()
            send_buffers(self.connection, parts)


# A request for /metrics (with or without a query), whatever the method: HEAD costs the same render.
# Only these count against Limits.max_requests_per_client.
_METRICS_REQUEST = re.compile(rb"[A-Z]+ /metrics(?:[?# ]|\r?\n)")


class MetricsServer:
    """A threaded HTTP(S) server on ``address:port`` (port 0 picks a free one), within ``limits``."""

    def __init__(
        self,
        endpoints: Endpoints,
        address: str = "",
        port: int = 8080,
        security: Security | None = None,
        limits: Limits | None = None,
    ) -> None:
        handler = type("Handler", (_Handler,), {"endpoints": endpoints, "security": security})
        self.security = security
        self._server = HttpServer(
            (address, port),
            handler,
            tls=security.tls if security is not None else None,
            handshake_timeout=security.handshake_timeout if security is not None else 10.0,
            limits=limits,
            per_client=_METRICS_REQUEST.match,
            name="metrics-http",
        )

    @property
    def port(self) -> int:
        return self._server.port

    @property
    def limits(self) -> Limits:
        return self._server.limits

    def connections(self) -> int:
        """Connections open now."""
        return self._server.open_connections()

    def start(self) -> MetricsServer:
        self._server.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        """Stop accepting, end the idle connections, let responses being sent finish and wait (at
        most ``timeout`` seconds in total) for the server's threads."""
        self._server.stop(timeout)
