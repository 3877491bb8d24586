"""The metrics HTTP server: ``/metrics``, ``/healthz``, ``/readyz``.

It is told *what* to serve through callables and knows nothing about where the data comes from.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from otel_dra.telemetry.exposition import (
    OPENMETRICS_CONTENT_TYPE,
    TEXT_CONTENT_TYPE,
    maybe_gzip,
    negotiate,
    wants_gzip,
)
from otel_dra.telemetry.priority import ScrapePriority

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


class _Handler(BaseHTTPRequestHandler):
    endpoints: Endpoints
    server_version = "otel-dra"
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: object) -> None:
        log.debug("http: " + format, *args)

    def _send(self, code: int, body: bytes, content_type: str = "text/plain; charset=utf-8") -> None:
        gzipped = False
        if len(body) > 1024:
            body, gzipped = maybe_gzip(body, self.headers.get("Accept-Encoding"))
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        if gzipped:
            self.send_header("Content-Encoding", "gzip")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

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


def send_buffers(sock: socket.socket, parts: list[bytes]) -> None:
    """Send buffers as they are (no copy of a body that is 100 MB at 10^5 claims) with few system
    calls. Each call releases and re-acquires the GIL; while a watch thread is busy, re-acquiring
    can wait up to the interpreter's switch interval, so one call per buffer (~1,300 at 10^5
    claims) made scrapes under churn several times slower than a few batched calls."""
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


class _Server(ThreadingHTTPServer):
    """A ThreadingHTTPServer that knows its open connections and their threads, so that stopping it
    can end idle keep-alive connections (a scraper such as Prometheus keeps one open between
    scrapes) and wait for those threads instead of leaving them behind."""

    daemon_threads = True

    def __init__(self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler]) -> None:
        self._connections: dict[socket.socket, threading.Thread] = {}
        self._connections_lock = threading.Lock()
        super().__init__(address, handler)

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
                sock.shutdown(socket.SHUT_RD)
        return [thread for _, thread in connections]


class MetricsServer:
    """A threaded HTTP server on ``address:port`` (port 0 picks a free one)."""

    def __init__(self, endpoints: Endpoints, address: str = "", port: int = 8080) -> None:
        handler = type("Handler", (_Handler,), {"endpoints": endpoints})
        self._server = _Server((address, port), handler)
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
