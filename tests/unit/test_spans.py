"""telemetry.spans: spans kept as data during a call and made by the SDK after it must be the
spans the SDK makes when called directly, with the ids that were propagated."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ALWAYS_ON, DEFAULT_ON, Sampler
from opentelemetry.trace import (
    INVALID_SPAN_CONTEXT,
    NoOpTracerProvider,
    SpanContext,
    SpanKind,
    Status,
    StatusCode,
    TraceFlags,
)
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from otel_dra.telemetry import sdk_private
from otel_dra.telemetry.spans import IDLE_EXPORT_INTERVAL_S, PresetIds, SpanRecorder, tracer_provider
from otel_dra.telemetry.traceids import parent_context
from tests.helpers import wait_until

PROPAGATOR = TraceContextTextMapPropagator()
PARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
CALLER = {"traceparent": PARENT, "tracestate": "vendor=abc,other=x"}


def _provider(made: bool = False, **kwargs: Any) -> tuple[TracerProvider, InMemorySpanExporter]:
    """``made``: by spans.tracer_provider (the public id_generator argument), as the plugin's
    providers are; else the SDK's own (a test's or an embedding program's: sdk_private's path)."""
    exporter = InMemorySpanExporter()
    provider = (
        tracer_provider(sampler=kwargs.pop("sampler", DEFAULT_ON), **kwargs) if made else TracerProvider(**kwargs)
    )
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider, exporter


# The tests of ids and sampling run with both kinds of provider.
both = pytest.mark.parametrize("made", [True, False], ids=["made", "foreign"])


@pytest.fixture
def recorders() -> Iterator[Callable[[TracerProvider], SpanRecorder]]:
    made: list[SpanRecorder] = []

    def make(provider: TracerProvider) -> SpanRecorder:
        made.append(SpanRecorder(provider, "t", "1"))
        return made[-1]

    yield make
    for recorder in made:
        recorder.close()


def _call_with_the_sdk(provider: TracerProvider, headers: dict[str, str]) -> None:
    """What the plugin did before: a SERVER span, a child whose context is injected, a child that
    fails with an exception, attributes set along the way."""
    tracer = provider.get_tracer("t", "1")
    parent = PROPAGATOR.extract(CALLER)
    with tracer.start_as_current_span("rpc", context=parent, kind=SpanKind.SERVER, attributes={"a": 1}) as rpc:
        with tracer.start_as_current_span("GET", kind=SpanKind.CLIENT, attributes={"url": "u"}) as get:
            PROPAGATOR.inject(headers)
            get.set_attribute("status", 200)
        with pytest.raises(OSError), tracer.start_as_current_span("write", attributes={"path": "/p"}):
            raise OSError("disk full")
        rpc.set_attributes({"devices": ["gpu-0", "gpu-1"], "ok": False})
        rpc.set_status(Status(StatusCode.ERROR, "one claim failed"))


def _call_recorded(recorder: SpanRecorder, headers: dict[str, str]) -> None:
    parent = PROPAGATOR.extract(CALLER)
    with recorder.start("rpc", context=parent, kind=SpanKind.SERVER, attributes={"a": 1}) as rpc:
        with rpc.child("GET", kind=SpanKind.CLIENT, attributes={"url": "u"}) as get:
            get.inject(headers)
            get.set_attribute("status", 200)
        with pytest.raises(OSError), rpc.child("write", attributes={"path": "/p"}):
            raise OSError("disk full")
        rpc.set_attributes({"devices": ["gpu-0", "gpu-1"], "ok": False})
        rpc.set_status(Status(StatusCode.ERROR, "one claim failed"))


def _shape(spans: tuple[ReadableSpan, ...]) -> list[tuple[Any, ...]]:
    """Everything but ids, times and the stack trace's line numbers."""
    by_id = {s.context.span_id: s.name for s in spans}
    out = []
    for s in sorted(spans, key=lambda s: s.name):
        events = [
            (e.name, {k: v for k, v in (e.attributes or {}).items() if k != "exception.stacktrace"}) for e in s.events
        ]
        parent = by_id.get(s.parent.span_id, "remote") if s.parent is not None else None
        out.append(
            (s.name, s.kind, dict(s.attributes or {}), s.status.status_code, s.status.description, events, parent)
        )
    return out


@both
def test_recorded_spans_are_the_spans_the_sdk_makes(recorders, made):
    live_provider, live = _provider()
    _call_with_the_sdk(live_provider, {})
    provider, exporter = _provider(made)
    recorder = recorders(provider)
    _call_recorded(recorder, {})
    recorder.flush()
    got, want = exporter.get_finished_spans(), live.get_finished_spans()
    assert _shape(got) == _shape(want)
    assert [s.name for s in got] == [s.name for s in want] == ["GET", "write", "rpc"]  # the order they ended
    assert {s.instrumentation_scope.name for s in got} == {"t"}
    assert all(s.context.trace_id == int(PARENT.split("-")[1], 16) for s in got)
    (write,) = [s for s in got if s.name == "write"]
    (event,) = write.events
    assert 'raise OSError("disk full")' in str(event.attributes["exception.stacktrace"])
    for s in got:  # the times the call took, not when the worker ran
        assert s.start_time is not None and s.end_time is not None and s.start_time <= s.end_time
    (rpc,) = [s for s in got if s.name == "rpc"]
    assert all(rpc.start_time <= s.start_time and s.end_time <= rpc.end_time for s in got)  # type: ignore[operator]


@both
def test_the_propagated_context_is_the_exported_spans(recorders, made):
    provider, exporter = _provider(made)
    recorder = recorders(provider)
    headers: dict[str, str] = {}
    _call_recorded(recorder, headers)
    recorder.flush()
    (get,) = [s for s in exporter.get_finished_spans() if s.name == "GET"]
    sent = trace.get_current_span(PROPAGATOR.extract(headers)).get_span_context()
    assert (sent.trace_id, sent.span_id) == (get.context.trace_id, get.context.span_id)
    assert sent.trace_flags == get.context.trace_flags and sent.trace_flags.sampled
    live_provider, _ = _provider()
    live: dict[str, str] = {}
    _call_with_the_sdk(live_provider, live)
    assert headers.keys() == live.keys() == {"traceparent", "tracestate"}
    assert headers["tracestate"] == live["tracestate"] == "vendor=abc,other=x"
    version, trace_id, _, flags = headers["traceparent"].split("-")
    assert [version, trace_id, flags] == [live["traceparent"].split("-")[i] for i in (0, 1, 3)]


@both
def test_a_root_of_its_own_propagates_the_trace_id_it_is_exported_with(recorders, made):
    provider, exporter = _provider(made)
    recorder = recorders(provider)
    headers: dict[str, str] = {}
    with recorder.start("claim") as claim, claim.child("GET", kind=SpanKind.CLIENT) as get:
        get.inject(headers)
    recorder.flush()
    spans = {s.name: s for s in exporter.get_finished_spans()}
    assert spans["claim"].parent is None
    sent = trace.get_current_span(PROPAGATOR.extract(headers)).get_span_context()
    assert (sent.trace_id, sent.span_id) == (spans["GET"].context.trace_id, spans["GET"].context.span_id)
    assert sent.trace_flags == spans["GET"].context.trace_flags  # sampled, and the random-trace-id flag


@both
def test_an_unsampled_trace_says_so_and_exports_nothing(recorders, made):
    provider, exporter = _provider(made, sampler=ALWAYS_OFF)
    recorder = recorders(provider)
    headers: dict[str, str] = {}
    with recorder.start("claim") as claim, claim.child("GET") as get:
        get.inject(headers)
    recorder.flush()
    assert headers["traceparent"].endswith("-00") or headers["traceparent"].endswith("-02")
    assert exporter.get_finished_spans() == ()


def test_without_an_sdk_tracer_nothing_is_recorded_or_sent():
    recorder = SpanRecorder(NoOpTracerProvider(), "t", "1")
    assert not recorder.enabled
    headers: dict[str, str] = {}
    with recorder.start("rpc") as rpc, rpc.child("GET") as get:
        get.inject(headers)
        get.set_attribute("a", 1)
    assert headers == {}
    recorder.close()


def test_the_worker_makes_the_spans_without_a_flush_and_close_drains(recorders):
    provider, exporter = _provider()
    recorder = recorders(provider)
    with recorder.start("first"):
        pass
    wait_until(lambda: len(exporter.get_finished_spans()) == 1, timeout=5, what="the worker's span")
    recorder.close()
    with recorder.start("after close"):  # a call finishing during shutdown: made at once
        pass
    assert [s.name for s in exporter.get_finished_spans()] == ["first", "after close"]


def test_a_span_never_ended_is_not_exported_nor_its_children(recorders):
    provider, exporter = _provider()
    recorder = recorders(provider)
    root = recorder.start("root")
    forgotten = root.child("forgotten")
    with forgotten.child("under it"):
        pass
    with root.child("ended"):
        pass
    root.end()
    recorder.flush()
    assert sorted(s.name for s in exporter.get_finished_spans()) == ["ended", "root"]


def test_no_sdk_span_is_made_on_the_calling_thread(recorders):
    """The point of the recorder: the SDK's span work happens on its worker, not in the call."""
    threads: list[int] = []

    class Where(SpanProcessor):
        def on_start(self, span: Any, parent_context: Any = None) -> None:
            threads.append(threading.get_ident())

    provider, exporter = _provider()
    provider.add_span_processor(Where())
    recorder = recorders(provider)
    _call_recorded(recorder, {})
    wait_until(lambda: len(exporter.get_finished_spans()) == 3, timeout=5, what="the worker's spans")
    assert len(threads) == 3 and threading.get_ident() not in threads
    recorder.close()


class _Exports(SpanExporter):
    """Counts exports; ``delay`` makes each take that long (an endpoint that answers slowly)."""

    def __init__(self, delay: float = 0.0) -> None:
        self.batches: list[list[str]] = []
        self.delay = delay

    def export(self, spans: Any) -> SpanExportResult:
        time.sleep(self.delay)
        self.batches.append([s.name for s in spans])
        return SpanExportResult.SUCCESS


def _batched(exporter: SpanExporter) -> TracerProvider:
    """A batch processor whose timer does not fire within a test: only the recorder exports."""
    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=600_000))
    return provider


def test_the_batch_goes_out_between_calls_not_on_its_timer(recorders):
    exports = _Exports()
    provider = _batched(exports)
    recorder = recorders(provider)
    with recorder.start("first") as call, call.child("step"):
        pass
    wait_until(lambda: exports.batches == [["step", "first"]], timeout=5, what="the export after the call")
    running = recorder.start("long call")  # in flight: the next call's spans wait in the batch
    with recorder.start("short call"):
        pass
    time.sleep(0.3)
    assert exports.batches == [["step", "first"]]
    running.end()
    wait_until(lambda: len(exports.batches) == 2, timeout=5, what="the export once no call runs")
    assert sorted(exports.batches[1]) == ["long call", "short call"]
    provider.shutdown()


def test_calls_close_together_share_one_export(recorders):
    """Between calls, but at most one export per interval: each export is a request of its own."""
    exports = _Exports()
    provider = _batched(exports)
    recorder = recorders(provider)
    with recorder.start("first"):
        pass
    try:
        wait_until(lambda: len(exports.batches) == 1, timeout=5, what="the export after the first call")
        for name in ("second", "third"):
            with recorder.start(name):
                pass
            time.sleep(0.1)
        time.sleep(0.3)
        assert IDLE_EXPORT_INTERVAL_S > 0.6
        assert len(exports.batches) == 1  # within the interval: waiting for the next export
        wait_until(
            lambda: len(exports.batches) == 2, timeout=IDLE_EXPORT_INTERVAL_S + 5, what="one export for both calls"
        )
        assert sorted(exports.batches[1]) == ["second", "third"]
    finally:
        provider.shutdown()


def _thread_cpu_s(thread: threading.Thread) -> float:
    """A thread's CPU time so far, from the kernel (Linux)."""
    with open(f"/proc/self/task/{thread.native_id}/schedstat") as f:
        return int(f.read().split()[0]) / 1e9


@pytest.mark.parametrize("export_when_idle", [True, False])
def test_the_worker_sleeps_between_traces(recorders, export_when_idle):
    """Waiting for the next trace or a due export is a blocking wait, never a loop."""
    exports = _Exports()
    provider = _batched(exports)
    recorder = recorders(provider) if export_when_idle else SpanRecorder(provider, "t", "1", export_when_idle=False)
    try:
        with recorder.start("call"):
            pass
        wait_until(lambda: recorder._thread is not None, timeout=5, what="the worker")
        time.sleep(0.2)
        worker = recorder._thread
        assert worker is not None
        before = _thread_cpu_s(worker)
        time.sleep(1.0)
        assert _thread_cpu_s(worker) - before < 0.1
    finally:
        recorder.close()
        provider.shutdown()


def test_without_idle_exports_the_timer_decides():
    exports = _Exports()
    provider = _batched(exports)
    recorder = SpanRecorder(provider, "t", "1", export_when_idle=False)
    with recorder.start("call"):
        pass
    time.sleep(0.3)
    recorder.close()
    assert exports.batches == []  # made, and waiting in the batch
    provider.shutdown()
    assert exports.batches == [["call"]]


def test_a_slow_export_pauses_exports_between_calls(recorders):
    exports = _Exports(delay=1.2)
    provider = _batched(exports)
    recorder = recorders(provider)
    with recorder.start("first"):
        pass
    wait_until(lambda: len(exports.batches) == 1, timeout=5, what="the first, slow export")
    with recorder.start("second"):
        pass
    time.sleep(0.5)
    assert len(exports.batches) == 1  # paused: the batch processor's timer takes over
    provider.shutdown()
    assert exports.batches[-1] == ["second"]


def test_without_a_context_the_callers_current_span_is_the_parent(recorders):
    """As with the SDK: a root started without a context joins the span current in the caller's
    thread (not the worker's), and what it propagates is that trace."""
    provider, exporter = _provider()
    recorder = recorders(provider)
    outer = provider.get_tracer("caller").start_span("caller's span")
    headers: dict[str, str] = {}
    with trace.use_span(outer, end_on_exit=True), recorder.start("call") as call:
        call.inject(headers)
    recorder.flush()
    spans = {s.name: s for s in exporter.get_finished_spans()}
    assert spans["call"].parent is not None and spans["call"].parent.span_id == outer.get_span_context().span_id
    sent = trace.get_current_span(PROPAGATOR.extract(headers)).get_span_context()
    assert (sent.trace_id, sent.span_id) == (outer.get_span_context().trace_id, spans["call"].context.span_id)


def test_a_provider_made_here_needs_none_of_the_sdks_private_layout(recorders, monkeypatch):
    def private(*args: Any) -> None:
        raise AssertionError("sdk_private used for a provider made by spans.tracer_provider")

    for name in ("tracer_id_generator", "set_tracer_id_generator", "tracer_sampler"):
        monkeypatch.setattr(sdk_private, name, private)
    provider, exporter = _provider(made=True)
    recorder = recorders(provider)
    headers: dict[str, str] = {}
    with recorder.start("claim") as claim, claim.child("GET", kind=SpanKind.CLIENT) as get:
        get.inject(headers)
    recorder.flush()
    (sent_get,) = [s for s in exporter.get_finished_spans() if s.name == "GET"]
    assert headers["traceparent"].split("-")[2] == f"{sent_get.context.span_id:016x}"


def test_the_tracing_pipelines_provider_is_made_here():
    from otel_dra.telemetry.tracing import build_tracing_pipeline

    pipeline = build_tracing_pipeline(service_name="s", version="1", env={}, exporter=InMemorySpanExporter())
    try:
        recorder = SpanRecorder(pipeline.tracer_provider, "t", "1")
        assert recorder.enabled and recorder._ids is not None
        tracer = pipeline.tracer_provider.get_tracer("t", "1")
        assert sdk_private.tracer_id_generator(tracer) is recorder._ids  # the one given to the constructor
        recorder.close()
    finally:
        pipeline.shutdown()


def test_presets_are_the_setting_threads_only():
    ids = PresetIds()
    with ids.lock:
        ids.owner, ids.span_id, ids.trace_id = threading.get_ident(), 7, 9
        other: list[tuple[int, int]] = []
        thread = threading.Thread(target=lambda: other.append((ids.generate_span_id(), ids.generate_trace_id())))
        thread.start()
        thread.join()
        assert other[0] != (7, 9)  # another thread's span draws its own ids meanwhile
        assert (ids.generate_span_id(), ids.generate_trace_id()) == (7, 9)
        assert ids.generate_span_id() != 7  # taken once


def test_recorders_sharing_a_foreign_tracer_share_one_generator(recorders):
    provider, exporter = _provider()
    first, second = recorders(provider), recorders(provider)
    assert first._ids is second._ids and first._lock is second._lock  # the tracer (one per scope) is wrapped once
    headers: list[dict[str, str]] = [{}, {}]
    for recorder, carrier in zip((first, second), headers, strict=True):
        with recorder.start("claim") as claim, claim.child("GET") as get:
            get.inject(carrier)
    first.flush()
    second.flush()
    got = sorted(f"{s.context.span_id:016x}" for s in exporter.get_finished_spans() if s.name == "GET")
    assert got == sorted(h["traceparent"].split("-")[2] for h in headers)


# --- links, reserved contexts, roots under a remote parent ------------------------------------------


def _ctx(span: ReadableSpan) -> tuple[int, int, int]:
    assert span.context is not None
    return span.context.trace_id, span.context.span_id, int(span.context.trace_flags)


@both
def test_spans_of_two_traces_link_to_each_other_before_either_ended(recorders, made):
    provider, exporter = _provider(made)
    recorder = recorders(provider)
    first = recorder.start("first")
    second = recorder.start("second", links=[(first.span_context(), {"why": "started by"})])
    first.add_link(second.span_context(), {"uid": "u"})
    first.add_link(second.span_context())  # no attributes: an empty set
    with second.child("step") as step:
        step_context = step.span_context()
    second.end()
    first.end()
    recorder.flush()
    spans = {s.name: s for s in exporter.get_finished_spans()}
    assert spans["first"].context.trace_id != spans["second"].context.trace_id
    (back,) = spans["second"].links
    assert (back.context.trace_id, back.context.span_id) == _ctx(spans["first"])[:2]
    assert dict(back.attributes or {}) == {"why": "started by"}
    assert [(link.context.span_id, dict(link.attributes or {})) for link in spans["first"].links] == [
        (spans["second"].context.span_id, {"uid": "u"}),
        (spans["second"].context.span_id, {}),
    ]
    # What span_context reserved is what was exported: ids and flags, a child's too.
    assert (first.span_context().trace_id, first.span_context().span_id) == _ctx(spans["first"])[:2]
    assert int(first.span_context().trace_flags) == _ctx(spans["first"])[2]
    assert (step_context.trace_id, step_context.span_id, int(step_context.trace_flags)) == _ctx(spans["step"])
    assert spans["step"].links == ()


@both
def test_links_to_spans_are_resolved_on_the_worker_with_the_ids_exported(recorders, made):
    """Linking to a span (not its context) asks the sampler nothing during the call; the worker
    resolves the links, in either order of the two traces, to the ids each span is exported with."""
    sampler = _Asked()
    provider, exporter = _provider(made, sampler=sampler)
    recorder = recorders(provider)
    rpc = recorder.start("rpc")
    claims = []
    for uid in ("a", "b"):
        claim = recorder.start(f"claim {uid}", links=[(rpc, None)])
        rpc.add_link(claim, {"uid": uid})
        claims.append(claim)
    assert sampler.asked == []  # nothing decided in the call
    for claim in claims:
        claim.end()  # the claims' traces are queued before the rpc's
    rpc.end()
    recorder.flush()
    spans = {s.name: s for s in exporter.get_finished_spans()}
    assert [(link.context.span_id, dict(link.attributes or {})) for link in spans["rpc"].links] == [
        (spans["claim a"].context.span_id, {"uid": "a"}),
        (spans["claim b"].context.span_id, {"uid": "b"}),
    ]
    for uid in ("a", "b"):
        (back,) = spans[f"claim {uid}"].links
        assert _ctx(spans["rpc"])[:2] == (back.context.trace_id, back.context.span_id)
        assert spans[f"claim {uid}"].context.trace_id != spans["rpc"].context.trace_id


class _Asked(Sampler):
    """ALWAYS_ON that keeps the parent span context and the trace id of every question."""

    def __init__(self) -> None:
        self.asked: list[tuple[SpanContext, int, int]] = []

    def should_sample(self, parent_context, trace_id, name, kind=None, attributes=None, links=None, trace_state=None):
        parent = trace.get_current_span(parent_context).get_span_context()
        self.asked.append((parent, trace_id, len(links or ())))
        return ALWAYS_ON.should_sample(parent_context, trace_id, name, kind, attributes, links, trace_state)

    def get_description(self) -> str:
        return "asked"


def test_a_root_under_a_remote_parent_is_its_child_in_its_trace(recorders):
    sampler = _Asked()
    provider, exporter = _provider(made=True, sampler=sampler)
    recorder = recorders(provider)
    remote = SpanContext(0x1234, 0x5678, is_remote=True, trace_flags=TraceFlags(TraceFlags.SAMPLED))
    link = SpanContext(0x99, 0x98, is_remote=False, trace_flags=TraceFlags(TraceFlags.SAMPLED))
    with recorder.start("joined", context=parent_context(remote), links=[(link, None)]) as joined:
        reserved = joined.span_context()  # the sampler asked now, during the call
        with joined.child("step"):
            pass
    recorder.flush()
    spans = {s.name: s for s in exporter.get_finished_spans()}
    exported = spans["joined"]
    assert exported.parent is not None and exported.parent.is_remote
    assert (exported.parent.trace_id, exported.parent.span_id) == (0x1234, 0x5678)
    assert exported.context.trace_id == 0x1234 and spans["step"].context.trace_id == 0x1234
    assert (reserved.trace_id, reserved.span_id) == (0x1234, exported.context.span_id)
    # Asked twice about the root (here, then by the SDK on the worker), both times with that parent
    # and the link; the child is asked with the root as its parent.
    root_questions = [a for a in sampler.asked if a[0].span_id == 0x5678]
    assert len(root_questions) == 2 and all(a[0] == remote and a[1] == 0x1234 and a[2] == 1 for a in root_questions)


def test_derived_parent_is_the_derived_root_flagged_as_the_sampler_decides(recorders):
    from otel_dra.telemetry.traceids import TraceIdRatio, root_span_id

    provider, _ = _provider(made=True, sampler=TraceIdRatio(0.5))
    recorder = recorders(provider)
    for trace_id, sampled in ((0x7 << 100 | 1, True), (0x7 << 100 | (1 << 55) | 1, False)):
        parent = trace.get_current_span(recorder.derived_parent(trace_id, "x")).get_span_context()
        assert (parent.trace_id, parent.span_id, parent.is_remote) == (trace_id, root_span_id(trace_id), True)
        assert parent.trace_flags.sampled is sampled


def test_without_an_sdk_tracer_links_and_contexts_cost_nothing():
    recorder = SpanRecorder(NoOpTracerProvider(), "t", "1")
    span = recorder.start("rpc", links=[(INVALID_SPAN_CONTEXT, None)])
    span.add_link(INVALID_SPAN_CONTEXT, {"a": 1})
    assert span.span_context() is INVALID_SPAN_CONTEXT and span.child("c").span_context() is INVALID_SPAN_CONTEXT
    assert not trace.get_current_span(recorder.derived_parent(1, "x")).get_span_context().trace_flags.sampled
    span.end()
    recorder.close()
