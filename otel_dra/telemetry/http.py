"""The metrics HTTP server: ``/metrics``, ``/healthz``, ``/readyz``.

It is told *what* to serve through callables and knows nothing about where the data comes from.
With a :class:`Security` it serves HTTPS (certificates re-read when their files change), asks
``/metrics`` clients for basic-auth credentials and/or a bearer token that a
:data:`TokenAuthorizer` checks, and adds response headers; ``/healthz``, ``/readyz`` and ``/`` stay
open so that probes need no credentials. Who checks a token (Kubernetes TokenReview and
SubjectAccessReview, otel_dra/kube/authz.py) is the caller's business.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import logging
import socket
import ssl
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from otel_dra.telemetry.exposition import (
    OPENMETRICS_CONTENT_TYPE,
    TEXT_CONTENT_TYPE,
    maybe_gzip,
    negotiate,
    wants_gzip,
)
from otel_dra.telemetry.priority import ScrapePriority
from otel_dra.telemetry.webconfig import BasicAuth, TLSContexts

log = logging.getLogger(__name__)


class NotReady(Exception):
    """Raised by a scrape source to answer 500 with no partial data."""


@dataclass
class Endpoints:
    """``scrape(openmetrics, gzipped)`` returns the body as buffers to send in order (gzip members
    when ``gzipped``) or raises :class:`NotReady`; ``ready()`` returns None when ready, else the
    reason."""

    scrape: Callable[[bool, bool], list[bytes]]
    ready: Callable[[], str | None]
    on_scrape: Callable[[float, float, bool], None] | None = None  # (seconds, CPU seconds, ok)
    # Marks scrapes in flight (rendering and sending) so that background exports can step aside.
    priority: ScrapePriority | None = None


@dataclass(frozen=True)
class TokenVerdict:
    """A :data:`TokenAuthorizer`'s answer: ``status`` 200 (allowed), 401 (not authenticated), 403
    (authenticated, not allowed) or 503 (cannot tell now); ``reason`` goes to the debug log."""

    status: int
    reason: str = ""


# Checks a bearer token for ``GET /metrics``; called from the connection's thread, may block.
TokenAuthorizer = Callable[[str], TokenVerdict]


@dataclass(frozen=True)
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


class _Handler(BaseHTTPRequestHandler):
    endpoints: Endpoints
    security: Security | None = None
    server_version = "otel-dra"
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: object) -> None:
        log.debug("http: " + format, *args)

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


# Buffers per sendmsg call (Linux IOV_MAX is 1024).
_IOV_BATCH = 512
# Over TLS (no sendmsg): bytes joined into one write.
_TLS_WRITE = 1 << 18


def send_buffers(sock: socket.socket, parts: list[bytes]) -> None:
    """Send buffers as they are (no copy of a body that is 100 MB at 10^5 claims) with few system
    calls. Each call releases and re-acquires the GIL; while a watch thread is busy, re-acquiring
    can wait up to the interpreter's switch interval, so one call per buffer (~1,300 at 10^5
    claims) made scrapes under churn several times slower than a few batched calls. A TLS socket
    has no sendmsg: buffers are joined into writes of about 256 KiB (encryption copies them anyway)."""
    if isinstance(sock, ssl.SSLSocket):
        _send_tls(sock, parts)
        return
    views = [memoryview(p) for p in parts if p]
    i = 0
    while i < len(views):
        batch = views[i : i + _IOV_BATCH]
        sent = sock.sendmsg(batch)
        for view in batch:
            if sent >= len(view):
                sent -= len(view)
                i += 1
            else:
                views[i] = view[sent:]  # partial send: resume inside this buffer
                break


def _send_tls(sock: ssl.SSLSocket, parts: list[bytes]) -> None:
    pending: list[bytes] = []
    size = 0
    for part in parts:
        if not part:
            continue
        pending.append(part)
        size += len(part)
        if size >= _TLS_WRITE:
            sock.sendall(pending[0] if len(pending) == 1 else b"".join(pending))
            pending, size = [], 0
    if pending:
        sock.sendall(b"".join(pending))


class _Server(ThreadingHTTPServer):
    """A ThreadingHTTPServer that knows its open connections and their threads, so that stopping it
    can end idle keep-alive connections (a scraper such as Prometheus keeps one open between
    scrapes) and wait for those threads instead of leaving them behind."""

    daemon_threads = True

    def __init__(
        self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler], security: Security | None = None
    ) -> None:
        self._connections: dict[socket.socket, threading.Thread] = {}
        self._connections_lock = threading.Lock()
        self._security = security
        super().__init__(address, handler)

    def get_request(self) -> tuple[socket.socket, object]:
        sock, address = self.socket.accept()
        # The headers and the body go out in separate writes; with Nagle's algorithm the body of a
        # small response waits for the client's delayed ACK of the headers: ~40 ms per scrape of a
        # small /metrics (the plugin's), 0.4 ms without.
        with contextlib.suppress(OSError):  # not TCP (a test's socketpair)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        tls = self._security.tls if self._security is not None else None
        if tls is not None:
            # The handshake runs in the connection's thread (finish_request), not in the accept loop.
            sock = tls.current().wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
        return sock, address

    def finish_request(self, request: socket.socket, client_address: object) -> None:  # type: ignore[override]
        if isinstance(request, ssl.SSLSocket):
            assert self._security is not None
            request.settimeout(self._security.handshake_timeout)
            try:
                request.do_handshake()
            except (OSError, ValueError) as exc:  # a client that does not trust us, or speaks plain HTTP
                log.debug("http: TLS handshake with %s failed: %s", client_address, exc)
                return
            request.settimeout(None)
        super().finish_request(request, client_address)

    def handle_error(self, request: object, client_address: object) -> None:
        # A client that goes away mid-request (or a TLS peer that drops the connection without a
        # close_notify) is routine; anything else is a bug worth a traceback.
        if isinstance(sys.exc_info()[1], OSError):
            log.debug("http: connection from %s ended: %s", client_address, sys.exc_info()[1])
        else:
            log.warning("http: error serving %s", client_address, exc_info=True)

    def process_request(self, request: socket.socket, client_address: object) -> None:  # type: ignore[override]
        # As ThreadingMixIn's, but registered before the thread starts: stop() sees every connection.
        thread = threading.Thread(
            target=self.process_request_thread, args=(request, client_address), name="metrics-http-conn", daemon=True
        )
        with self._connections_lock:
            self._connections[request] = thread
        thread.start()

    def process_request_thread(self, request: socket.socket, client_address: object) -> None:  # type: ignore[override]
        try:
            super().process_request_thread(request, client_address)
        finally:
            with self._connections_lock:
                self._connections.pop(request, None)

    def end_connections(self) -> list[threading.Thread]:
        """Stop reading from every open connection (an idle one ends at once, a response being sent
        is still sent) and return their threads."""
        with self._connections_lock:
            connections = list(self._connections.items())
        for sock, _ in connections:
            with contextlib.suppress(OSError):  # already closed by its thread
                # socket.socket's own shutdown: SSLSocket.shutdown would drop the TLS state under a
                # response that is still being sent.
                socket.socket.shutdown(sock, socket.SHUT_RD)
        return [thread for _, thread in connections]


class MetricsServer:
    """A threaded HTTP(S) server on ``address:port`` (port 0 picks a free one)."""

    def __init__(
        self, endpoints: Endpoints, address: str = "", port: int = 8080, security: Security | None = None
    ) -> None:
        handler = type("Handler", (_Handler,), {"endpoints": endpoints, "security": security})
        self.security = security
        self._server = _Server((address, port), handler, security)
        self._thread = threading.Thread(target=self._server.serve_forever, name="metrics-http", daemon=True)

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    def start(self) -> MetricsServer:
        self._thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        """Stop accepting, end the open connections and wait (at most ``timeout`` seconds in total)
        for the server's threads."""
        self._server.shutdown()
        self._server.server_close()
        deadline = time.monotonic() + timeout
        for thread in [self._thread, *self._server.end_connections()]:
            thread.join(max(0.0, deadline - time.monotonic()))
