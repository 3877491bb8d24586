"""Pushing pre-encoded OTLP metric requests on the standard export interval.

The transport is the SDK's own OTLP exporter, configured from the same ``OTEL_EXPORTER_OTLP_*``
variables (endpoint, headers, TLS, compression, timeout, retries with backoff); we only hand it
bytes that are already serialised. Over HTTP it gets the SDK's urllib3 transport where that sends
what its default requests session would (:func:`otel_dra.telemetry.provider.otlp_metric_exporter`).
Handing it bytes takes private hooks of opentelemetry-exporter-otlp 1.45 (pinned in
requirements.lock), all of them in :mod:`otel_dra.telemetry.sdk_private`, whose unit test
(tests/unit/test_sdk_private.py) sends through both protocols to a real OTLP receiver, so an
upgrade that moves them fails loudly.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol

from otel_dra.telemetry.otlp import OtlpSignalConfig, metric_export_interval_ms
from otel_dra.telemetry.otlp_encode import MetricHeader, PointGroup, RequestBuilder
from otel_dra.telemetry.priority import ScrapePriority

log = logging.getLogger(__name__)


class RawSender(Protocol):
    def send(self, request: bytes) -> bool: ...
    def shutdown(self) -> None: ...


class _ExporterSender:
    """Serialised requests through an SDK OTLP metric exporter (its configuration, retries, TLS);
    how the exporter is made to take bytes is private to the SDK (sdk_private)."""

    def __init__(self, exporter: Any, send: Callable[[bytes], bool]) -> None:
        self._exporter = exporter
        self._send = send

    def send(self, request: bytes) -> bool:
        return self._send(request)

    def shutdown(self) -> None:
        self._exporter.shutdown()


def raw_sender(config: OtlpSignalConfig) -> RawSender:
    """A sender over the SDK exporter that the metric reader would get for ``config`` (the same
    protocol and, over HTTP, the same transport choice), fed our bytes."""
    from otel_dra.telemetry.provider import otlp_metric_exporter
    from otel_dra.telemetry.sdk_private import grpc_bytes_sender, http_bytes_sender

    exporter = otlp_metric_exporter(config)
    sender = grpc_bytes_sender if config.protocol == "grpc" else http_bytes_sender
    return _ExporterSender(exporter, sender(exporter))


# What to push: (metric header, its point chunks), or None while there is nothing valid to push.
Source = Callable[[], Iterable[tuple[MetricHeader, Sequence[PointGroup]]] | None]


class PreEncodedPusher:
    """Every ``OTEL_METRIC_EXPORT_INTERVAL`` ms, push what ``source`` returns; once more at stop."""

    def __init__(
        self,
        source: Source,
        builder: RequestBuilder,
        sender: RawSender,
        *,
        interval_s: float | None = None,
        on_export: Callable[[float, float, bool], None] | None = None,
        on_dropped: Callable[[int], None] | None = None,
        pace_s: float = 0.005,
        priority: ScrapePriority | None = None,
        max_defer_s: float | None = None,
        max_share: float = 0.2,
    ) -> None:
        self._source = source
        self._builder = builder
        self._sender = sender
        self._interval = interval_s if interval_s is not None else metric_export_interval_ms() / 1000
        self._on_export = on_export  # (wall seconds, CPU seconds of this thread, ok)
        # Data points of requests the endpoint did not take (refused, failed, or no answer within
        # the exporter's timeout, retries included). They are not kept for later: the next push
        # carries the current state, so memory stays bounded however long the endpoint is away.
        self._on_dropped = on_dropped
        # A short pause between requests hands the CPU and the GIL to scrapes in between: at 10^5
        # claims a push is ~30 requests of 3 MiB, each built in C while holding the GIL.
        self._pace = pace_s
        # Scrapes in flight make each request wait (see priority.py), but a push is never deferred
        # by more than this in total, so that back-to-back scrapes cannot starve it.
        self._priority = priority
        self._max_defer = max_defer_s if max_defer_s is not None else min(10.0, self._interval / 2)
        # Once that budget is spent, while scrapes keep coming the push pauses between requests so
        # that building and sending take at most this share of its time: it still makes progress,
        # without taking the CPU from the scrapes it overlaps (with scrapes back to back and a
        # short interval, a full-speed push slowed them by over 20% at workload L).
        self._max_share = max_share
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="otlp-state-push", daemon=True)

    def start(self) -> PreEncodedPusher:
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            self.export()

    def export(self) -> bool:
        with self._lock:  # the final flush must not overlap a periodic export
            start, cpu = time.monotonic(), time.thread_time()
            ok = True
            try:
                metrics = self._source()
                if metrics is None:
                    return False
                defer_left = self._max_defer
                requests = iter(self._builder.counted(metrics, time.time_ns()))
                spent = 0.0  # building and sending the previous request
                for i in itertools.count():
                    if i and not self._stop.is_set():
                        pause = self._pace
                        if self._priority is not None and defer_left <= 0 and self._priority.busy():
                            pause = max(pause, spent * (1 / self._max_share - 1))
                        if pause:
                            time.sleep(pause)
                    if self._priority is not None and not self._stop.is_set():
                        defer_left -= self._priority.wait_idle(defer_left)
                    began = time.monotonic()
                    built = next(requests, None)  # built here, after any wait
                    if built is None:
                        break
                    request, points = built
                    sent = self._sender.send(request)
                    del request, built
                    if not sent and self._on_dropped is not None:
                        self._on_dropped(points)
                    ok = sent and ok
                    spent = time.monotonic() - began
            except Exception:  # an export failure must never end the pushing thread
                log.exception("OTLP export of cluster state failed")
                ok = False
            if self._on_export is not None:
                self._on_export(time.monotonic() - start, time.thread_time() - cpu, ok)
            return ok

    def shutdown(self) -> None:
        """Stop the periodic pushes and push the final state once."""
        self._stop.set()
        self._thread.join(timeout=self._interval + 60)
        self.export()
        self._sender.shutdown()
