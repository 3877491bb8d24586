"""Spans that cost the traced call almost nothing: kept as plain data while the call runs, and made
into SDK spans by one worker thread once the call's root span has ended.

Why: the OpenTelemetry SDK's span path is cheap when warm (10-15 µs a span) but a call that comes
after a quiet spell finds its code and objects out of the CPU caches, and then the first span alone
costs about 0.2 ms (measured: docs/benchmarks-log.md, "Tracing off the call's path"). A kubelet calls
the plugin seconds apart, so every prepare paid that, five spans of it, inside the time the kubelet
waits. Here the call only reads the clock and fills dicts; the worker then starts and ends each SDK
span with the recorded times, names, kinds, attributes, events and status, so what is exported is
what the SDK would have made on the call's own thread.

Ids: a span whose context leaves the process during the call (the ``traceparent`` of an API
request) gets its trace and span id at that moment, and the worker hands them to the SDK through
the provider's id generator (a :class:`PresetIds`, given to the SDK's ``TracerProvider`` by
:func:`tracer_provider`), so the exported span has exactly the ids that were propagated. The
sampling decision for such a header is the sampler's, asked then with the same arguments the SDK
asks it later (deterministic for every sampler ``OTEL_TRACES_SAMPLER`` can name). A provider made
elsewhere (a test's, a program embedding the plugin) gets the recorder's tracer's generator
replaced instead, through the SDK's private layout (:mod:`otel_dra.telemetry.sdk_private`).

Links: a span keeps (target, attributes) pairs, given at start or added later (``add_link``), and
the worker hands them all to ``start_span(links=...)`` (the sampler, asked during the call by
``span_context``/``inject``, sees the links there were then, those to spans whose ids are reserved;
the built-in samplers do not read them). A target is a span context, or one of our spans: then its
ids are reserved on the worker, when the link is made, or before the target itself is made,
whichever comes first, so that two spans of different traces link to each other without a sampler
decision in the call. ``span_context`` reserves a span's ids as ``inject`` does. A root started with a
context whose current span is a remote span context (``traceids.parent_context``, say, or
:meth:`SpanRecorder.derived_parent` for a trace whose ids every process derives from one key) is
exported as a child of exactly that span, in its trace, the sampler asked with that parent.

Nothing here knows what is traced. A provider that is not the SDK's (tracing off) gives a recorder
whose spans are one shared object that does nothing.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
import traceback
import weakref
from collections import deque
from collections.abc import Mapping, MutableMapping, Sequence
from typing import Any

from opentelemetry import context as context_api
from opentelemetry import trace
from opentelemetry.sdk.trace import Tracer as SdkTracer
from opentelemetry.sdk.trace import TracerProvider as SdkTracerProvider
from opentelemetry.sdk.trace.id_generator import IdGenerator, RandomIdGenerator
from opentelemetry.sdk.trace.sampling import Decision, Sampler
from opentelemetry.trace import INVALID_SPAN_CONTEXT, Link, SpanContext, SpanKind, Status, StatusCode, TraceFlags

from otel_dra.telemetry import sdk_private
from otel_dra.telemetry.traceids import decides_root, parent_context, root_context

log = logging.getLogger(__name__)

# Traces waiting for the worker. Beyond this (a worker starved for minutes) the oldest are dropped
# and counted, as the SDK's batch processor drops spans when its queue is full.
MAX_PENDING_TRACES = 2048
# How long the worker lets a call finish after its root span ended (its answer still to be sent)
# before making its spans.
_SETTLE_S = 0.01
# Exports between calls (SpanRecorder._export_if_idle): at most one per interval, the spans of
# the calls meanwhile in one batch. Each export is a request of its own, whatever the batch holds,
# and a kubelet calls for each pod twice, with a device status write after each: exported after
# every call, a round of 10 pods on the real kubelet made 33 exports, the span worker's largest
# cost (docs/benchmarks-log.md, issue 29). The interval is the batch processor's own default timer
# (OTEL_BSP_SCHEDULE_DELAY, 5 s): spans reach the backend no later than the SDK alone would send
# them, in fewer requests (a round of 10 pods, start to stop: 9-10 OTLP requests, 13-14 with 2 s).
IDLE_EXPORT_INTERVAL_S = 5.0
# One slower than this pauses them that long.
_IDLE_EXPORT_TIMEOUT_MS = 5000
_SLOW_EXPORT_S = 1.0
_SLOW_EXPORT_PAUSE_S = 60.0
_EXPORTED, _BUSY, _PAUSED = "exported", "busy", "paused"  # what _export_if_idle did


class PresetIds(IdGenerator):
    """An id generator that draws from ``inner``, except that the thread holding ``lock`` can say
    which ids the next span it makes gets (``owner``, ``trace_id``, ``span_id``): other threads'
    spans (other tracers of the same provider) draw as usual meanwhile. Every span of the provider
    goes through this; without a preset it costs one attribute read more than ``inner`` alone."""

    def __init__(self, inner: IdGenerator | None = None) -> None:
        self.inner = inner if inner is not None else RandomIdGenerator()
        self.lock = threading.Lock()  # held by the recorder making a trace (one at a time)
        self.owner: int | None = None  # the thread whose presets these are
        self.trace_id: int | None = None
        self.span_id: int | None = None

    def generate_span_id(self) -> int:
        preset = self.span_id
        if preset is not None and self.owner == threading.get_ident():
            self.span_id = None
            return preset
        return self.inner.generate_span_id()

    def generate_trace_id(self) -> int:
        preset = self.trace_id
        if preset is not None and self.owner == threading.get_ident():
            self.trace_id = None
            return preset
        return self.inner.generate_trace_id()

    def is_trace_id_random(self) -> bool:
        return self.inner.is_trace_id_random()


# The providers tracer_provider made, with their id generator and sampler: what a SpanRecorder
# needs of its provider, known without reading the SDK objects' attributes.
_MADE: weakref.WeakKeyDictionary[SdkTracerProvider, tuple[PresetIds, Sampler]] = weakref.WeakKeyDictionary()


def tracer_provider(*, sampler: Sampler, id_generator: IdGenerator | None = None, **kwargs: Any) -> SdkTracerProvider:
    """The SDK's ``TracerProvider(sampler=..., id_generator=..., **kwargs)`` with a
    :class:`PresetIds` around ``id_generator`` (the SDK's random ids by default), so that the
    recorders of its tracers give exported spans the ids they propagated."""
    ids = PresetIds(id_generator)
    provider = SdkTracerProvider(sampler=sampler, id_generator=ids, **kwargs)
    _MADE[provider] = (ids, sampler)
    return provider


class RecordedSpan:
    """One span while its call runs: the SDK span's methods that the call needs, on plain data."""

    __slots__ = (
        "_recorder",
        "_root",
        "_trace",
        "attributes",
        "end_ns",
        "events",
        "flags",
        "kind",
        "linked",
        "links",
        "name",
        "parent",
        "parent_context",
        "record_exceptions",
        "span_id",
        "start_ns",
        "status",
        "trace_id",
        "trace_state",
    )

    def __init__(
        self,
        recorder: SpanRecorder,
        name: str,
        kind: SpanKind,
        attributes: dict[str, Any],
        parent: RecordedSpan | None,
        parent_context: context_api.Context | None,
        record_exceptions: bool,
        links: list[tuple[LinkTarget, dict[str, Any]]] | None = None,
    ) -> None:
        self._recorder = recorder
        self.name = name
        self.kind = kind
        self.attributes = attributes
        self.parent = parent
        self.parent_context = parent_context  # a root's (remote) parent, as extracted from the caller
        self.record_exceptions = record_exceptions
        self.events: list[tuple[str, dict[str, Any], int]] = []
        self.links: list[tuple[LinkTarget, dict[str, Any]]] = links if links is not None else []
        self.status: Status | None = None
        self.span_id: int | None = None  # reserved only when the span's context is propagated or linked to
        self.linked = False  # a link targets this span: its ids are reserved before it is made
        self.trace_id: int | None = None  # the same, for a root without a valid remote parent
        self.flags: TraceFlags | None = None  # a root's, once decided (only when propagated)
        self.trace_state: Any = None
        self.end_ns: int | None = None
        if parent is None:
            self._root = self
            self._trace: list[RecordedSpan] = [self]
        else:
            self._root = parent._root
            self._trace = parent._trace
            self._trace.append(self)
        self.start_ns = time.time_ns()

    # --- what the call uses ------------------------------------------------------------------
    def child(
        self,
        name: str,
        *,
        kind: SpanKind = SpanKind.INTERNAL,
        attributes: Mapping[str, Any] | None = None,
        record_exceptions: bool = True,
        links: Sequence[tuple[LinkTarget, Mapping[str, Any] | None]] = (),
    ) -> RecordedSpan:
        return RecordedSpan(
            self._recorder, name, kind, dict(attributes or {}), self, None, record_exceptions, _links(links)
        )

    def add_link(self, context: LinkTarget, attributes: Mapping[str, Any] | None = None) -> None:
        """A link to ``context`` (another span, of this trace or another), as the SDK's
        ``Span.add_link``; exported with the links given at start, in the order added. A recorded
        span rather than its ``span_context()`` defers reserving its ids to the worker (see
        :func:`_link`)."""
        _mark(context)
        self.links.append((context, dict(attributes or {})))

    def set_attribute(self, key: str, value: Any) -> None:
        self.attributes[key] = value

    def set_attributes(self, attributes: Mapping[str, Any]) -> None:
        self.attributes.update(attributes)

    def set_status(self, status: Status) -> None:
        self.status = status

    def record_exception(self, exception: BaseException) -> None:
        """As the SDK's ``Span.record_exception``, with the stack trace taken now: the exception's
        traceback grows while it propagates, and the SDK formats it where it is recorded."""
        module = type(exception).__module__
        qualname = type(exception).__qualname__
        attributes = {
            "exception.type": f"{module}.{qualname}" if module and module != "builtins" else qualname,
            "exception.message": str(exception),
            "exception.stacktrace": "".join(traceback.format_exception(exception)),
            "exception.escaped": "False",
        }
        self.events.append(("exception", attributes, time.time_ns()))

    def span_context(self) -> SpanContext:
        """The context this span is exported with: its trace id, span id and flags, reserved now
        (the sampler asked for the root, as for ``inject``), so that other spans can link to it or
        a measurement's exemplar can name it before it ended."""
        trace_id, span_id, flags = self._reserve()
        return SpanContext(trace_id, span_id, is_remote=False, trace_flags=flags, trace_state=self._root.trace_state)

    def inject(self, carrier: MutableMapping[str, str]) -> None:
        """Write this span's ``traceparent`` (and ``tracestate``) into ``carrier``."""
        trace_id, span_id, flags = self._reserve()
        # W3C trace context, as TraceContextTextMapPropagator.inject writes it (tests compare), without
        # the context and span objects it needs around the same four fields.
        carrier["traceparent"] = f"00-{trace_id:032x}-{span_id:016x}-{flags:02x}"
        if self._root.trace_state:
            carrier["tracestate"] = self._root.trace_state.to_header()

    def end(self) -> None:
        if self.end_ns is not None:
            return
        self.end_ns = time.time_ns()
        if self._root is self:
            recorder = self._recorder
            with recorder._calls_lock:
                recorder._calls -= 1
            recorder._submit(self._trace)

    def __enter__(self) -> RecordedSpan:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: Any) -> None:
        # As the SDK's use_span: an Exception (not a BaseException such as GeneratorExit) is recorded
        # and sets the status, unless the span was started with record_exceptions=False.
        if isinstance(exc, Exception) and self.record_exceptions:
            self.record_exception(exc)
            self.status = Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}")
        self.end()

    # --- for the recorder ---------------------------------------------------------------------
    def _reserve(self) -> tuple[int, int, TraceFlags]:
        """This span's trace id, span id and flags, the root decided and the span id drawn if they
        were not yet."""
        root = self._root
        recorder = self._recorder
        assert recorder._ids is not None  # a RecordedSpan exists only with an SDK tracer
        # The call and the worker may both reserve (a link the worker resolves to a call still
        # running): one decision, one id.
        with recorder._reserve_lock:
            if root.flags is None:
                recorder._decide(root)
            assert root.flags is not None
            if self.span_id is None:
                self.span_id = recorder._ids.inner.generate_span_id()
            trace_id = root.trace_id if root.trace_id is not None else root.remote_parent().trace_id
            return trace_id, self.span_id, root.flags

    def remote_parent(self) -> SpanContext:
        return trace.get_current_span(self.parent_context).get_span_context()


class _NoSpan:
    """Every span of a recorder without an SDK tracer (tracing off): does nothing, costs a call."""

    __slots__ = ()

    def child(
        self,
        name: str,
        *,
        kind: SpanKind = SpanKind.INTERNAL,
        attributes: Mapping[str, Any] | None = None,
        record_exceptions: bool = True,
        links: Sequence[tuple[LinkTarget, Mapping[str, Any] | None]] = (),
    ) -> _NoSpan:
        return self

    def add_link(self, context: LinkTarget, attributes: Mapping[str, Any] | None = None) -> None:
        pass

    def span_context(self) -> SpanContext:
        return INVALID_SPAN_CONTEXT

    def set_attribute(self, key: str, value: Any) -> None:
        pass

    def set_attributes(self, attributes: Mapping[str, Any]) -> None:
        pass

    def set_status(self, status: Status) -> None:
        pass

    def record_exception(self, exception: BaseException) -> None:
        pass

    def inject(self, carrier: MutableMapping[str, str]) -> None:
        pass

    def end(self) -> None:
        pass

    def __enter__(self) -> _NoSpan:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: Any) -> None:
        pass


_NO_SPAN = _NoSpan()


# What traced code holds: a recorded span, or the one that does nothing.
SpanHandle = RecordedSpan | _NoSpan
# What a link points at: a span context, or a span of ours whose context is taken when the link is
# made into the SDK's (on the worker), so that linking costs the call no sampler decision nor ids.
LinkTarget = SpanContext | SpanHandle


def _links(links: Sequence[tuple[LinkTarget, Mapping[str, Any] | None]]) -> list[tuple[LinkTarget, dict[str, Any]]]:
    for target, _ in links:
        _mark(target)
    return [(context, dict(attributes or {})) for context, attributes in links]


def _mark(target: LinkTarget) -> None:
    if isinstance(target, RecordedSpan):
        target.linked = True


def _link(target: LinkTarget, attributes: dict[str, Any], reserve: bool) -> Link | None:
    """The SDK's link to ``target``; None for a span that does nothing (no context to link to),
    and, unless ``reserve``, for a span whose ids are not reserved yet (a sampler's view of the
    links: asking for them there could come back to the span being decided)."""
    if isinstance(target, SpanContext):
        return Link(target, attributes)
    if isinstance(target, RecordedSpan) and not reserve and (target._root.flags is None or target.span_id is None):
        return None
    context = target.span_context()
    return Link(context, attributes) if context.is_valid else None


def _sdk_links(links: Sequence[tuple[LinkTarget, dict[str, Any]]], *, reserve: bool = True) -> list[Link]:
    return [link for target, attributes in links if (link := _link(target, attributes, reserve)) is not None]


class SpanRecorder:
    """Starts root spans for calls; their SDK spans are made on a worker thread (see module doc).

    ``flush`` makes the spans of every trace ended so far (tests, before reading an exporter);
    ``close`` does that and stops the worker, and must come before the provider's shutdown."""

    def __init__(
        self, tracer_provider: trace.TracerProvider, scope: str, version: str, *, export_when_idle: bool = True
    ) -> None:
        """``export_when_idle``: after making a call's spans, have the provider export its batch
        when no call is running (see ``_export_if_idle``)."""
        tracer = tracer_provider.get_tracer(scope, version)
        self.enabled = isinstance(tracer, SdkTracer)
        self._tracer = tracer
        self._ids: PresetIds | None = None
        self._sampler: Sampler | None = None
        if isinstance(tracer, SdkTracer):
            made = _MADE.get(tracer_provider) if isinstance(tracer_provider, SdkTracerProvider) else None
            if made is not None:
                self._ids, self._sampler = made
            else:  # a provider made elsewhere: its tracer's generator is replaced (see sdk_private)
                current = sdk_private.tracer_id_generator(tracer)
                self._ids = current if isinstance(current, PresetIds) else PresetIds(current)
                if self._ids is not current:
                    sdk_private.set_tracer_id_generator(tracer, self._ids)
                self._sampler = sdk_private.tracer_sampler(tracer)
        self._queue: deque[list[RecordedSpan]] = deque()
        # One trace made at a time, in the order they ended; the recorders sharing an id generator
        # share its lock, since its presets are one slot.
        self._lock = self._ids.lock if self._ids is not None else threading.Lock()
        # The worker's wake-up: SimpleQueue's put and get are C, where an Event's set is Python code
        # that a cold call pays for (several puts before a get only mean an empty flush).
        self._wake: queue.SimpleQueue[None] = queue.SimpleQueue()
        self._start_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._closed = False
        self.dropped = 0  # traces dropped because the worker fell MAX_PENDING_TRACES behind
        self._provider = (
            tracer_provider if export_when_idle and isinstance(tracer_provider, SdkTracerProvider) else None
        )
        self._calls = 0  # roots started and not ended: the calls running now
        self._calls_lock = threading.Lock()
        # RecordedSpan._reserve; reentrant: a decision looks at the links' spans.
        self._reserve_lock = threading.RLock()
        self._idle_export_paused_until = 0.0

    def start(
        self,
        name: str,
        *,
        kind: SpanKind = SpanKind.INTERNAL,
        attributes: Mapping[str, Any] | None = None,
        context: context_api.Context | None = None,
        record_exceptions: bool = True,
        links: Sequence[tuple[LinkTarget, Mapping[str, Any] | None]] = (),
    ) -> SpanHandle:
        """A root span; ``context``: the caller's, with its remote parent if it sent one (or
        :meth:`derived_parent`'s); ``links``: (span context, attributes) pairs."""
        if not self.enabled:
            return _NO_SPAN
        if context is None:
            # As Tracer.start_span: no context means the caller's current one. Taken now, since the
            # worker's own (empty) context is not the caller's.
            context = context_api.get_current()
        with self._calls_lock:
            self._calls += 1
        return RecordedSpan(self, name, kind, dict(attributes or {}), None, context, record_exceptions, _links(links))

    def derived_parent(self, trace_id: int, name: str) -> context_api.Context:
        """The context that makes a root started with it (``start(name, context=...)``) a child of
        the root of the derived trace ``trace_id`` (:mod:`otel_dra.telemetry.traceids`), whose span
        another process emits: flagged sampled when this recorder's sampler samples a root of that
        trace named ``name``, so that a parent-based sampler agrees with the root's own process."""
        sampled = self._sampler is not None and decides_root(self._sampler, trace_id, name)
        return parent_context(root_context(trace_id, sampled))

    def flush(self) -> None:
        while True:
            with self._lock:
                if not self._queue:
                    return
                self._make(self._queue.popleft())

    def close(self) -> None:
        self._closed = True
        self._wake.put(None)
        if self._thread is not None:
            # Short: the worker may be in an export to an endpoint that does not answer; what it
            # has not made yet, flush makes here (it waits only for a trace being made).
            self._thread.join(timeout=2)
        self.flush()

    # --- the worker ------------------------------------------------------------------------------
    def _submit(self, spans: list[RecordedSpan]) -> None:
        if self._closed:
            with self._lock:
                self._make(spans)  # after close (a call still finishing at shutdown): made at once
            return
        if len(self._queue) >= MAX_PENDING_TRACES:
            with contextlib.suppress(IndexError):  # the worker took it meanwhile
                self._queue.popleft()
            self.dropped += 1
            if self.dropped == 1:
                log.warning(
                    "span worker %d traces behind: dropping the oldest (counted in dropped)", MAX_PENDING_TRACES
                )
        self._queue.append(spans)
        if self._thread is None:
            with self._start_lock:  # two calls ending at once start one worker
                if self._thread is None:
                    # Started by the first trace, not at start-up: a plugin nobody calls pays nothing.
                    self._thread = threading.Thread(target=self._work, name="otel-dra-spans", daemon=True)
                    self._thread.start()
        self._wake.put(None)

    def _work(self) -> None:
        unexported = False  # spans made since the last export between calls
        due = 0.0  # monotonic time from which the next export between calls may go
        busy = False  # a call was running at the last try: the next trace to end wakes us
        while not self._closed:
            # Asleep until a trace ends, or until an export is due for spans made before.
            wait = max(0.0, due - time.monotonic()) if unexported and not busy else None
            try:
                self._wake.get(timeout=wait)
            except queue.Empty:
                pass
            else:
                # The root ends inside the handler: its thread still builds and sends the answer,
                # Python code that would wait for the GIL behind this worker (1 ms switch interval).
                time.sleep(_SETTLE_S)
                self.flush()
                # Only where this recorder exports between calls; else the batch processor does.
                unexported, busy = self._provider is not None, False
            if self._provider is None or not unexported or time.monotonic() < due:
                continue  # unexported with an export due later: the wait above ends then
            outcome = self._export_if_idle(self._provider)
            busy = outcome == _BUSY
            if not busy:  # exported, or paused (the batch processor's timer exports meanwhile)
                unexported = False
                due = time.monotonic() + IDLE_EXPORT_INTERVAL_S

    def _export_if_idle(self, provider: SdkTracerProvider) -> str:
        """Export what the SDK's batch holds now, while no call runs.

        The batch processor exports on a timer, and an export (encoding and sending, about 10 ms
        of Python for a few dozen spans) that overlaps a call delays it: measured at +7% on the
        kubelet-observed prepare mean against the same spans never exported (docs/benchmarks-log.md,
        "Tracing off the call's path"). Right after a call's spans are made is the gap where the
        next call is least likely, so the batch goes out then (at most once per
        ``IDLE_EXPORT_INTERVAL_S``: the calls of that time share one export); under a steady stream of calls
        (always one in flight) the processor's own timer and batch size decide as before. An
        export that takes long (an endpoint that does not answer: the exporter retries up to its
        timeout) turns this off for a while, so the worker keeps making spans."""
        if time.monotonic() < self._idle_export_paused_until:
            return _PAUSED
        if self._calls or self._queue:
            return _BUSY
        started = time.monotonic()
        try:
            provider.force_flush(_IDLE_EXPORT_TIMEOUT_MS)
        except Exception:  # the exporter's errors are the SDK's to log; ours must not stop the worker
            log.exception("exporting spans between calls failed")
        if time.monotonic() - started > _SLOW_EXPORT_S:
            self._idle_export_paused_until = time.monotonic() + _SLOW_EXPORT_PAUSE_S
        return _EXPORTED

    def _decide(self, root: RecordedSpan) -> None:
        """A root's trace id and flags as ``Tracer.start_span`` will make them: its sampler asked
        with the same arguments; the random-trace-id flag from the id generator or the parent."""
        assert self._ids is not None and self._sampler is not None
        parent = root.remote_parent()
        if parent.is_valid:
            trace_id, random_id = parent.trace_id, parent.trace_flags.random_trace_id
        else:
            trace_id = root.trace_id = self._ids.inner.generate_trace_id()
            random_id = self._ids.inner.is_trace_id_random()
        links = _sdk_links(root.links, reserve=False)
        result = self._sampler.should_sample(
            root.parent_context, trace_id, root.name, root.kind, root.attributes, links
        )
        flags = TraceFlags.SAMPLED if result.decision is Decision.RECORD_AND_SAMPLE else TraceFlags.DEFAULT
        root.flags = TraceFlags(flags | TraceFlags.RANDOM_TRACE_ID if random_id else flags)
        root.trace_state = result.trace_state

    def _make(self, spans: list[RecordedSpan]) -> None:
        """Start and end the SDK span of each recorded one (caller holds ``_lock``)."""
        ids = self._ids
        assert ids is not None  # traces are submitted only by spans of an SDK tracer
        ids.owner = threading.get_ident()  # the presets below are this thread's
        made: dict[RecordedSpan, trace.Span] = {}
        try:
            for s in spans:
                if s.end_ns is None:
                    continue  # never ended: as with the SDK, not exported (nor its children)
                # A span that a link targets gets its ids before the SDK span is made: the linking
                # span, perhaps of a trace made later (links resolve on this thread, see _link),
                # must find the ids this one was exported with. Others are left to the SDK.
                if s.linked:
                    s._reserve()
                if s.parent is None:
                    context = s.parent_context
                    ids.trace_id = s.trace_id
                else:
                    parent = made.get(s.parent)
                    if parent is None:
                        continue
                    context = trace.set_span_in_context(parent)
                ids.span_id = s.span_id
                try:
                    span = self._tracer.start_span(
                        s.name,
                        context=context,
                        kind=s.kind,
                        attributes=s.attributes,
                        links=_sdk_links(s.links),
                        start_time=s.start_ns,
                        record_exception=False,
                        set_status_on_exception=False,
                    )
                finally:  # a preset not taken (a span with a parent takes no trace id) must not stay
                    ids.trace_id = ids.span_id = None
                for name, attributes, timestamp in s.events:
                    span.add_event(name, attributes, timestamp)
                if s.status is not None:
                    span.set_status(s.status)
                made[s] = span
            # In the order they ended in the call (a child before its parent when the clock ties).
            ends = sorted(enumerate(made.items()), key=lambda e: (e[1][0].end_ns, -e[0]))
            for _, (s, span) in ends:
                span.end(end_time=s.end_ns)
        except Exception:  # a bug here must not stop the worker: the next traces still go out
            log.exception("could not make the spans of a trace")
