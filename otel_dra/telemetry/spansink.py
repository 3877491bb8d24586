"""Spans whose times and ids are known when they are handed over: queued as plain tuples, exported
in batches by one worker thread, never blocking the caller.

Why not the SDK's Tracer: a watch that reports what already happened (a phase that began at an
object's timestamp and ended at another) knows every field of the span at once, and its producer
is a watch loop that must never wait. The Tracer's path (context, sampler, processor, a mutable
span and its lock) costs ~15 us a span on the caller's thread; here the caller appends a tuple to a
bounded deque (C, under the GIL: no lock of ours), and the worker builds the SDK's
:class:`~opentelemetry.sdk.trace.ReadableSpan` (its public constructor) and hands batches to the
span exporter the ``OTEL_*`` variables configured. A full queue drops the newest span and counts
it (``otel_dra.tracing.spans.dropped``); what the exporter refused is counted by result in
``otel_dra.tracing.spans.exported``.

A backlog that must not be dropped (the spans of everything a first list showed) is not queued:
the worker pulls it from a source (:meth:`SpanSink.backfill_from`) while the queue is empty, paced,
so it never crowds out live spans nor takes the process's GIL for long.

Sampling is the caller's: a span is handed over only when its trace is sampled (the caller decides
by trace id, see :mod:`otel_dra.telemetry.traceids`). Nothing here knows what is traced.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

from opentelemetry.metrics import Counter, MeterProvider, Observation
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import SpanContext, SpanKind, Status, StatusCode, TraceFlags

log = logging.getLogger(__name__)

MAX_QUEUE = 65536  # spans: ~20 MB of tuples at the most; a burst beyond it is dropped and counted
BATCH = 512
INTERVAL_S = 1.0  # the longest a span waits for its batch
# Spans per second taken from a backfill source (see backfill_from): ~0.2 of a core to encode, so
# a backlog of 10^5 claims neither starves scrapes of the GIL nor floods the backend.
BACKFILL_RATE = 5000.0
_SAMPLED = TraceFlags(TraceFlags.SAMPLED)


class SpanData(NamedTuple):
    """One finished span. ``parent_span_id`` 0: a root. Times in Unix nanoseconds."""

    name: str
    trace_id: int
    span_id: int
    parent_span_id: int
    start_ns: int
    end_ns: int
    attributes: Mapping[str, Any]
    kind: SpanKind = SpanKind.INTERNAL
    error: str | None = None  # the status description of a span that failed


class SpanSink:
    """Takes :class:`SpanData` from any thread (:meth:`emit`) and exports it in the background."""

    def __init__(
        self,
        exporter: SpanExporter,
        resource: Resource,
        scope: str,
        version: str,
        *,
        meter_provider: MeterProvider | None = None,
        max_queue: int = MAX_QUEUE,
        batch: int = BATCH,
        interval: float = INTERVAL_S,
    ) -> None:
        self._exporter = exporter
        self._resource = resource
        self._scope = InstrumentationScope(scope, version)
        self._queue: deque[SpanData] = deque()
        self._max_queue = max_queue
        self._batch = batch
        self._interval = interval
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()  # one export at a time (worker, flush)
        self._backfill: Callable[[int], list[SpanData]] | None = None
        self._backfill_rate = BACKFILL_RATE
        self.dropped = 0
        self.exported = 0
        self.failed = 0
        self._dropped_counter: Counter | None = None
        self._exported_counter: Counter | None = None
        if meter_provider is not None:
            meter = meter_provider.get_meter(scope, version)
            self._dropped_counter = meter.create_counter(
                "otel_dra.tracing.spans.dropped",
                "{span}",
                "Spans dropped before export because the export queue was full (the producer never waits).",
            )
            self._exported_counter = meter.create_counter(
                "otel_dra.tracing.spans.exported",
                "{span}",
                "Spans handed to the span exporter, by result (success, failure).",
            )
            meter.create_observable_gauge(
                "otel_dra.tracing.queue.spans",
                [lambda _options: [Observation(len(self._queue))]],
                "{span}",
                "Spans waiting in the export queue.",
            )

    def start(self) -> SpanSink:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="otel-dra-span-sink", daemon=True)
            self._thread.start()
        return self

    def backfill_from(self, source: Callable[[int], list[SpanData]], rate: float = BACKFILL_RATE) -> None:
        """``source(n)`` gives up to n spans of a backlog (e.g. what a first list showed); the worker
        asks it while the queue is empty, at most ``rate`` spans a second. Such spans are never
        dropped: they wait in the source until the queue has room."""
        self._backfill = source
        self._backfill_rate = rate
        self._wake.set()

    def emit(self, span: SpanData) -> None:
        """Queue a finished span; never blocks. A full queue drops it (counted)."""
        if len(self._queue) >= self._max_queue:
            self.dropped += 1
            if self._dropped_counter is not None:
                self._dropped_counter.add(1)
            if self.dropped == 1:
                log.warning("span export queue full (%d spans): dropping spans, counted in dropped", self._max_queue)
            return
        self._queue.append(span)
        if len(self._queue) >= self._batch:
            self._wake.set()

    def flush(self) -> None:
        """Export everything queued so far (tests, shutdown)."""
        while self._queue:
            self._export_batch()

    def shutdown(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self.flush()
        try:
            self._exporter.shutdown()
        except Exception:  # best effort at exit
            log.exception("span exporter shutdown failed")

    # --- the worker --------------------------------------------------------------------------
    def _run(self) -> None:
        wait = self._interval
        while not self._stop.is_set():
            self._wake.wait(wait)
            self._wake.clear()
            while self._queue and not self._stop.is_set():
                self._export_batch()
            wait = self._interval
            source = self._backfill
            if source is not None and not self._stop.is_set():
                try:
                    spans = source(self._batch)
                except Exception:  # the source's failure must not stop the worker
                    log.exception("the span backfill failed")
                    spans = []
                if spans:
                    with self._lock:
                        self._export([self._readable(data) for data in spans])
                    wait = len(spans) / self._backfill_rate  # paced; the live queue still goes first

    def _export_batch(self) -> None:
        with self._lock:
            spans: list[ReadableSpan] = []
            queue = self._queue
            while queue and len(spans) < self._batch:
                try:
                    data = queue.popleft()
                except IndexError:  # flush and the worker raced for the last one
                    break
                spans.append(self._readable(data))
            if spans:
                self._export(spans)

    def _export(self, spans: list[ReadableSpan]) -> None:
        """Hand one batch to the exporter and count the result (the caller holds the lock)."""
        try:
            result = self._exporter.export(spans)
        except Exception:  # the exporter's failure must not stop the worker
            log.exception("exporting %d spans failed", len(spans))
            result = SpanExportResult.FAILURE
        ok = result is SpanExportResult.SUCCESS
        if ok:
            self.exported += len(spans)
        else:
            self.failed += len(spans)
        if self._exported_counter is not None:
            self._exported_counter.add(len(spans), {"result": "success" if ok else "failure"})

    def _readable(self, data: SpanData) -> ReadableSpan:
        parent = (
            SpanContext(data.trace_id, data.parent_span_id, is_remote=False, trace_flags=_SAMPLED)
            if data.parent_span_id
            else None
        )
        return ReadableSpan(
            name=data.name,
            context=SpanContext(data.trace_id, data.span_id, is_remote=False, trace_flags=_SAMPLED),
            parent=parent,
            resource=self._resource,
            attributes=data.attributes,
            kind=data.kind,
            status=Status(StatusCode.ERROR, data.error) if data.error is not None else Status(StatusCode.UNSET),
            start_time=data.start_ns,
            end_time=data.end_ns,
            instrumentation_scope=self._scope,
        )
