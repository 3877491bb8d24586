"""The webhook's HTTPS server: ``POST /validate`` (an AdmissionReview in, its verdict out),
``/healthz`` and ``/readyz`` for probes.

Connections, TLS, threads, limits and timeouts are the project's connection engine
(:mod:`otel_dra.telemetry.httpserver`, the one that serves ``/metrics``), here with request bodies
on (``Limits.max_body_bytes``: an AdmissionReview carries the object, and the old one on an
update); certificates come from :class:`~otel_dra.telemetry.webconfig.TLSContexts`, so a renewed
certificate is served from the next connection on. What a request gets:

- ``POST /validate`` with a JSON body: 200 and an AdmissionReview that answers it (allowed or not);
  400 with a plain-text reason when the body is not an ``admission.k8s.io/v1`` AdmissionReview;
  415 for another content type; 413 (too large), 411 (chunked), 400 (bad length) from the engine.
- ``GET /healthz`` (``/livez``, ``/readyz``): 200 ``ok`` (the server answers: that is all there is
  to be ready for; it reads nothing at start-up).
- anything else: 404, or 501 for a method the server does not know.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from otel_dra.admission.metrics import WebhookMetrics
from otel_dra.admission.review import ReviewError, Verdict, decode_review, judge, response
from otel_dra.records import record
from otel_dra.telemetry.httpserver import HttpServer, Limits, RequestHandler
from otel_dra.telemetry.webconfig import TLSContexts

log = logging.getLogger(__name__)

VALIDATE_PATH = "/validate"
PROBE_PATHS = ("/healthz", "/livez", "/readyz")
JSON = "application/json"

# The engine's limits for the webhook, where they differ from the metrics server's. Each review
# costs well under a millisecond, so a few workers suffice; the API server's own webhook timeout is
# 10 s by default, so a client that has not sent its request in 5 s is no API server.
MAX_WORKERS = 4
# An AdmissionReview is decoded whole, and a hostile body of small JSON objects takes about 25 times
# its size once decoded (80 MB for 3 MiB of `{},`): at most this many are decoded at once, so that
# memory stays bounded (measured: docs/webhook.md, "Measured"); the other workers still answer
# probes and errors meanwhile.
MAX_DECODING = 1
MAX_CONNECTIONS = 256
HEADER_TIMEOUT = 5.0
WRITE_TIMEOUT = 10.0
# The API server refuses request bodies over 3 MiB; an update's review carries the object twice.
DEFAULT_MAX_REVIEW_BYTES = 3 << 20


def webhook_limits(max_review_bytes: int = DEFAULT_MAX_REVIEW_BYTES) -> Limits:
    """The engine's limits for a webhook that takes reviews of at most ``max_review_bytes``: the
    bodies held at once (received, queued or being answered), in total, at most eight of that size."""
    return Limits(
        max_connections=MAX_CONNECTIONS,
        max_workers=MAX_WORKERS,
        # Reviews are cheap and all come from the API servers' few addresses: one client may use
        # every worker.
        max_requests_per_client=MAX_WORKERS,
        header_timeout=HEADER_TIMEOUT,
        write_timeout=WRITE_TIMEOUT,
        max_body_bytes=max_review_bytes,
        max_pending_body_bytes=8 * max_review_bytes,
    )


@record(frozen=True)
class Decision:
    """What outlives a decoded review: what the log and the metrics say of it, and its answer."""

    kind: str
    operation: str
    what: str
    verdict: Verdict
    answer: bytes


class _Handler(RequestHandler):
    """The routes (see the module notes); the engine makes one per request."""

    decoding: threading.BoundedSemaphore  # the server's: MAX_DECODING
    driver: str
    gpu_config: bool = True
    metrics: WebhookMetrics | None = None
    server_version = "otel-dra-webhook"

    def _send(self, code: int, body: bytes, content_type: str = "text/plain; charset=utf-8") -> None:
        if code >= 400 and self.metrics is not None:
            self.metrics.invalid_request(code)
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        # The engine's refusals (a malformed, oversized or chunked request, too many bodies at once)
        # and the standard library's (an unknown method) come here: counted as the handler's own.
        if self.metrics is not None:
            self.metrics.invalid_request(code)
        super().send_error(code, message, explain)

    def do_HEAD(self) -> None:
        self.do_GET()

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0]
        if path in PROBE_PATHS:
            self._send(200, b"ok\n")
        elif path == VALIDATE_PATH:
            self._send(405, b"use POST with an AdmissionReview\n")
        else:
            self._send(404, b"not found\n")

    def do_POST(self) -> None:
        # The API server adds ?timeout=10s to the configured URL.
        if self.path.split("?", 1)[0] != VALIDATE_PATH:
            self._send(404, b"not found\n")
            return
        # The engine received exactly the body its Content-Length announced; it is what is left.
        body = self.rfile.read()
        content_type = (self.headers.get("Content-Type") or "").split(";", 1)[0].strip().lower()
        if content_type != JSON:
            self._send(415, f"expected Content-Type: {JSON}\n".encode())
            return
        with self.decoding:
            start = time.perf_counter()
            decided = self._decide(body)
            seconds = time.perf_counter() - start
        # The decoded review is gone (it lived in _decide); the answer is sent without the semaphore.
        if isinstance(decided, tuple):
            code, error = decided
            self._send(code, error)
            return
        if self.metrics is not None:
            self.metrics.review(decided.kind, decided.verdict.name, seconds)
        if decided.verdict.allowed:
            log.debug(
                "webhook: allowed %s (%s): %d entries decoded", decided.what, decided.operation, decided.verdict.checked
            )
        else:
            log.info("webhook: denied %s (%s): %s", decided.what, decided.operation, decided.verdict.message)
        self._send(200, decided.answer, JSON)

    def _decide(self, body: bytes) -> Decision | tuple[int, bytes]:
        """The verdict on ``body`` and its answer, or the error status and body to send instead."""
        try:
            review = decode_review(body)
        except ReviewError as exc:
            log.debug("webhook: %s from %s: %s", self.path, self.client_address[0], exc)
            return 400, f"invalid AdmissionReview: {exc}\n".encode()
        try:
            verdict = judge(review, self.driver, self.gpu_config)
            answer = response(review.uid, verdict)
        except Exception:  # a bug: the API server applies the webhook's failurePolicy
            log.exception("webhook: cannot judge %s (%s)", review.what, review.operation)
            return 500, b"internal error\n"
        return Decision(review.kind, review.operation, review.what, verdict, answer)


class WebhookServer:
    """The webhook on ``address:port`` (port 0 picks a free one), HTTPS with ``tls``, judging the
    opaque configuration entries of ``driver``: GpuConfigs, or (``gpu_config`` False) none at all."""

    def __init__(
        self,
        driver: str,
        tls: TLSContexts,
        *,
        address: str = "",
        port: int = 8443,
        gpu_config: bool = True,
        metrics: WebhookMetrics | None = None,
        limits: Limits | None = None,
    ) -> None:
        handler: Any = type(
            "Handler",
            (_Handler,),
            {
                "decoding": threading.BoundedSemaphore(MAX_DECODING),
                "driver": driver,
                "gpu_config": gpu_config,
                "metrics": metrics,
            },
        )
        self.driver = driver
        self._server = HttpServer(
            (address, port),
            handler,
            tls=tls,
            handshake_timeout=HEADER_TIMEOUT,
            limits=limits if limits is not None else webhook_limits(),
            name="webhook-https",
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

    def start(self) -> WebhookServer:
        self._server.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        """Stop accepting, end the idle connections, let answers being sent finish and wait (at most
        ``timeout`` seconds in total) for the server's threads."""
        self._server.stop(timeout)
