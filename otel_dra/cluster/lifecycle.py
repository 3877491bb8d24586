"""Each ResourceClaim's life as one trace, and the latency histograms of its phases.

The trace id is the claim's UID (:mod:`otel_dra.telemetry.traceids`), its root span id a hash of
it, so the plugin on the node (which gets the UID from the kubelet) adds its prepare and unprepare
spans to the same trace with nothing passed between the two processes. What the exporter sees in
its watch becomes spans, each emitted once it has ended (a span cannot be exported before):

- ``ResourceClaim <ns>/<name>``: the root, at the claim's creation (zero length: its phases are its
  children, and a claim in use for days is in Jaeger with the phases so far);
- ``allocation``: creation until the allocation (``status.allocation.allocationTimestamp``, else
  kube-scheduler's status write in managedFields, else when the exporter saw it);
- ``binding conditions``: the allocation until every device's binding conditions are satisfied,
  or one failed (the conditions' lastTransitionTime);
- ``reserved for <kind>/<name>`` (an instant, when the reservation was seen) and ``consumer
  <kind>/<name>`` (reserved until released, emitted at the release);
- ``pod <name> start``: for each pod using the claim, PodScheduled until its containers all started
  (pod status), emitted by the shard that owns the pod;
- ``deleted`` (an instant at metadata.deletionTimestamp, else when seen) and ``lifetime``
  (creation until then).

Every span says where its times come from (``otel_dra.span.time_source``: ``object`` for the
object's own timestamps, ``observed`` for when the exporter saw the change). Span ids are derived
from the trace id and the span's name (and the time that makes it unique), so a phase emitted again
(after a restart: claims that already exist get the phases their objects still show) has the same
id. Those first-list spans are not queued as the list arrives but handed to the span worker later
(:meth:`ClaimLifecycle.backfill`), paced, from the slim objects as listed. With shards, each
claim's spans come from the shard that owns the claim, each pod's from the shard that owns the pod.
The sampler decides by trace id, so a claim is traced in every process or in none.

Histograms (docs/metrics.md): allocation wait, binding-condition wait and pod start, by driver and
device class, each measurement carrying the claim's trace as its exemplar when it is sampled. Only
changes seen live are measured: the first list would measure claims allocated days ago.

Cost: per claim a small tuple (trace id, the state last seen); per pod nothing. A change costs a
few tuple comparisons, and a span is a tuple handed to :class:`~otel_dra.telemetry.spansink.SpanSink`
(a bounded queue: the watch never waits for export).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from typing import Any, NamedTuple

from opentelemetry.metrics import Histogram, MeterProvider, Observation
from opentelemetry.sdk.trace.sampling import Sampler
from opentelemetry.trace import SpanContext, TraceFlags

from otel_dra import __version__
from otel_dra.cluster.pod import Pod
from otel_dra.cluster.resourceclaim import Claim
from otel_dra.cluster.store import Change
from otel_dra.telemetry import traceids
from otel_dra.telemetry.spansink import SpanData, SpanSink

log = logging.getLogger(__name__)

SCOPE = "otel_dra.cluster.lifecycle"
# Attribute names (docs/tracing.md).
NAMESPACE = "k8s.namespace.name"
CLAIM_NAME = "k8s.resourceclaim.name"
CLAIM_UID = "k8s.resourceclaim.uid"
POD_NAME = "k8s.pod.name"
POD_UID = "k8s.pod.uid"
NODE = "k8s.node.name"
DRIVER = "dra.driver"
DEVICE_CLASS = "dra.device_class"
CONSUMER = "otel_dra.consumer"
OUTCOME = "otel_dra.binding.outcome"
TIME_SOURCE = "otel_dra.span.time_source"
OBJECT, OBSERVED = "object", "observed"

# Waits from seconds (a scheduler with free devices) to tens of minutes (a queue, an attachment).
BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0)


class _Seen(NamedTuple):
    """What the last change showed of one owned claim."""

    trace_id: int
    sampled: bool
    created: float | None
    allocated: float | None  # when allocated (object or observed time); None while pending
    binding_done: bool  # binding conditions decided (or none) for the current allocation
    consumers: tuple[tuple[str, str, float], ...]  # (kind, name, reserved at: observed)


def _ns(seconds: float) -> int:
    return int(seconds * 1e9)


def _label_values(claim: Claim) -> tuple[str, str]:
    """driver and device class of the claim's first result (or first request while pending)."""
    classes = dict(claim.request_classes)
    if claim.results:
        first = claim.results[0]
        request = first.request.split("/", 1)[0]
        return first.driver, classes.get(first.request, classes.get(request, ""))
    return "", next(iter(classes.values()), "")


class ClaimLifecycle:
    """Turns claim and pod changes (the stores' listener calls) into spans and histograms.

    ``sink``/``sampler``: None for no spans (the histograms are still recorded). ``listed``: the
    claims' and pods' reflectors say whether their first list is done (changes before it are not
    measured)."""

    def __init__(
        self,
        meter_provider: MeterProvider,
        sink: SpanSink | None = None,
        sampler: Sampler | None = None,
        *,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._sink = sink
        self._sampler = sampler
        self._clock = clock
        self._seen: dict[str, _Seen] = {}  # owned claims, by namespace/name
        self._uids: dict[str, tuple[int, bool, dict[str, str]]] = {}  # every claim: trace id, sampled, labels
        self._label_sets: dict[tuple[str, str], dict[str, str]] = {}
        # Claims first seen in the first list whose spans wait for backfill(): the slim object as
        # listed (shared with the store until it changes) and its trace id.
        self._backfill: deque[tuple[Claim, int]] = deque()
        self._pod_backfill: deque[Pod] = deque()  # pods found started in the first list
        self.claims_listed: Callable[[], bool] = lambda: True
        self.pods_listed: Callable[[], bool] = lambda: True
        meter = meter_provider.get_meter(SCOPE, __version__)

        def histogram(name: str, description: str) -> Histogram:
            return meter.create_histogram(name, "s", description, explicit_bucket_boundaries_advisory=BUCKETS)

        self._allocation_wait = histogram(
            "otel_dra.claim.allocation.duration",
            "Seconds from a ResourceClaim's creation to its allocation, by driver and device class.",
        )
        self._binding_wait = histogram(
            "otel_dra.claim.binding.duration",
            "Seconds from an allocation to its devices' binding conditions all satisfied, or one failed "
            "(outcome), by driver and device class.",
        )
        if sink is not None:
            meter.create_observable_gauge(
                "otel_dra.tracing.backfill.objects",
                [lambda _options: [Observation(len(self._backfill) + len(self._pod_backfill))]],
                "{object}",
                "Claims and pods of the first lists whose spans (a claim's root and the phases its object "
                "shows, a pod's start) wait to be exported; the span worker takes them at a paced rate "
                "while it has nothing newer.",
            )
        self._pod_start = histogram(
            "otel_dra.pod.startup.duration",
            "Seconds from a pod with ResourceClaims being scheduled to its containers all started, by the "
            "driver and device class of its first claim.",
        )

    def _labels(self, claim: Claim) -> dict[str, str]:
        """The claim's histogram labels, one shared (never mutated) dict per driver and class:
        every claim is remembered with its labels, and 10^5 copies of a few distinct dicts would
        cost ~20 MB."""
        values = _label_values(claim)
        labels = self._label_sets.get(values)
        if labels is None:
            labels = self._label_sets[values] = {"driver": values[0], "deviceclass_name": values[1]}
        return labels

    @property
    def tracing(self) -> bool:
        return self._sink is not None

    def __len__(self) -> int:
        return len(self._seen)

    # --- claims ----------------------------------------------------------------------------------
    def claims_changed(self, changes: list[Change[Claim]]) -> None:
        live = self.claims_listed()
        for key, _old, new, owned in changes:
            try:
                if new is None:
                    self._uids.pop(key, None)
                    seen = self._seen.pop(key, None)
                    if seen is not None and _old is not None:
                        self._deleted(_old, seen, _old.deleting)
                    continue
                trace_id = traceids.trace_id_of(new.uid)
                if trace_id is None:
                    continue  # no UID (a malformed object): no trace to add to
                known = self._uids.get(key)
                if known is None or known[0] != trace_id:
                    sampled = self._sampler is not None and traceids.decides_root(self._sampler, trace_id, "claim")
                else:
                    sampled = known[1]
                self._uids[key] = (trace_id, sampled, self._labels(new))
                if owned:
                    self._claim(key, new, trace_id, sampled, live)
                else:
                    self._seen.pop(key, None)
            except Exception:  # one claim's trace must never break the watch or the others
                log.exception("tracing claim %s failed", key)

    def _claim(self, key: str, claim: Claim, trace_id: int, sampled: bool, live: bool) -> None:
        seen = self._seen.get(key)
        if seen is not None and seen.trace_id != trace_id:  # the name was reused by a new claim
            seen = None
        if seen is None and not live:
            # First seen in the first list: what the object shows is emitted later, by backfill(),
            # at the span worker's spare pace (at 10^5 claims, a root and an allocation each would
            # overflow the queue and compete with the list for the GIL).
            self._seen[key] = self._advance(claim, None, trace_id, sampled, live, None)
            if sampled and self._sink is not None:
                self._backfill.append((claim, trace_id))
            return
        spans: list[SpanData] = []
        self._seen[key] = self._advance(claim, seen, trace_id, sampled, live, spans)
        self._send(spans)

    def backfill(self, limit: int) -> list[SpanData]:
        """Up to ``limit`` spans of claims first seen in the first list (their root and the phases
        their objects showed then), once that list is done: the span worker asks for them while it
        has nothing else to export (``SpanSink.backfill``)."""
        if not self.claims_listed():
            return []
        out: list[SpanData] = []
        while self._backfill and len(out) < limit:
            claim, trace_id = self._backfill.popleft()
            try:
                self._advance(claim, None, trace_id, True, False, out)
            except Exception:
                log.exception("tracing claim %s failed", claim.key)
        # Pods after claims: a pod's span goes into its claim's trace, known once claims are listed.
        while self._pod_backfill and len(out) < limit and self.pods_listed():
            pod = self._pod_backfill.popleft()
            try:
                self._pod_started(pod, False, out)
            except Exception:
                log.exception("tracing pod %s/%s failed", pod.namespace, pod.name)
        return out

    def _advance(
        self, claim: Claim, seen: _Seen | None, trace_id: int, sampled: bool, live: bool, spans: list[SpanData] | None
    ) -> _Seen:
        """What ``claim`` shows beyond ``seen`` (None: first sight): the state to remember, the
        spans of the phases that ended into ``spans`` (None: make none), and, when ``live``, the
        waits into the histograms."""
        now = self._clock()
        labels = self._labels(claim)
        attrs = {NAMESPACE: claim.namespace, CLAIM_NAME: claim.name, CLAIM_UID: claim.uid, **_span_labels(labels)}
        root = traceids.root_span_id(trace_id)
        out = spans if sampled and self._sink is not None else None
        created = claim.created
        if seen is None:
            if created is not None:
                _add(
                    out,
                    f"ResourceClaim {claim.key}",
                    trace_id,
                    root,
                    0,
                    created,
                    created,
                    {**attrs, TIME_SOURCE: OBJECT},
                )
            seen = _Seen(trace_id, sampled, created, None, False, ())
            # Reserved before the first list: when is unknown, so no "reserved for" instant (the
            # consumer's span starts when the exporter first saw it, marked observed).
            announce = live
        else:
            announce = True
        allocated, binding_done, consumers = seen.allocated, seen.binding_done, seen.consumers
        # Allocation.
        if claim.has_allocation and allocated is None:
            at, source = _allocation_time(claim)
            if at is None and not live:
                # Allocated before the exporter started, at a time the object does not show: no span.
                allocated = now
            else:
                at, source = (at, source) if at is not None else (now, OBSERVED)
                allocated = at
                start = created if created is not None else at
                _add(
                    out,
                    "allocation",
                    trace_id,
                    traceids.named_span_id(trace_id, f"allocation@{at}"),
                    root,
                    start,
                    at,
                    {**attrs, TIME_SOURCE: source},
                )
                if live and created is not None:
                    self._record(self._allocation_wait, at - created, labels, trace_id, sampled, "allocation", at)
        elif not claim.has_allocation and allocated is not None:
            allocated, binding_done = None, False  # deallocated (a failed binding): a new allocation follows
        # Binding conditions of the current allocation.
        if allocated is not None and not binding_done:
            binding_done = self._binding(claim, attrs, labels, trace_id, sampled, allocated, live, out)
        # Consumers.
        consumers = self._consumers(claim, consumers, attrs, trace_id, now, announce, out)
        return _Seen(trace_id, sampled, created, allocated, binding_done, consumers)

    def _binding(
        self,
        claim: Claim,
        attrs: dict[str, Any],
        labels: dict[str, str],
        trace_id: int,
        sampled: bool,
        allocated: float,
        live: bool,
        out: list[SpanData] | None,
    ) -> bool:
        if not claim.binding:
            return True
        states = [b.state for b in claim.binding]
        if "failed" in states:
            outcome = "failed"
        elif all(s == "satisfied" for s in states):
            outcome = "satisfied"
        else:
            return False
        times = [b.since for b in claim.binding if b.state == outcome and b.since is not None]
        end, source = (max(times), OBJECT) if times else (self._clock(), OBSERVED)
        _add(
            out,
            "binding conditions",
            trace_id,
            traceids.named_span_id(trace_id, f"binding@{allocated}"),
            traceids.root_span_id(trace_id),
            allocated,
            end,
            {**attrs, OUTCOME: outcome, TIME_SOURCE: source},
            error=f"binding condition failed on {len(claim.binding)} device(s)" if outcome == "failed" else None,
        )
        if live:
            self._record(
                self._binding_wait,
                end - allocated,
                {**labels, "outcome": outcome},
                trace_id,
                sampled,
                "binding",
                allocated,
            )
        return True

    def _consumers(
        self,
        claim: Claim,
        before: tuple[tuple[str, str, float], ...],
        attrs: dict[str, Any],
        trace_id: int,
        now: float,
        announce: bool,
        out: list[SpanData] | None,
    ) -> tuple[tuple[str, str, float], ...]:
        current = set(claim.consumers)
        if current == {(k, n) for k, n, _ in before}:
            return before
        root = traceids.root_span_id(trace_id)
        kept: list[tuple[str, str, float]] = []
        for kind, name, since in before:
            if (kind, name) in current:
                kept.append((kind, name, since))
                continue
            _consumer_ended(out, trace_id, root, attrs, kind, name, since, now)
        had = {(k, n) for k, n, _ in before}
        for kind, name in claim.consumers:
            if (kind, name) in had:
                continue
            if announce:
                _add(
                    out,
                    f"reserved for {kind}/{name}",
                    trace_id,
                    traceids.named_span_id(trace_id, f"reserved {kind}/{name}@{now}"),
                    root,
                    now,
                    now,
                    {**attrs, CONSUMER: f"{kind}/{name}", TIME_SOURCE: OBSERVED},
                )
            kept.append((kind, name, now))
        return tuple(kept)

    def _deleted(self, claim: Claim, seen: _Seen, deleting: float | None) -> None:
        now = self._clock()
        at, source = (deleting, OBJECT) if deleting is not None else (now, OBSERVED)
        attrs = {NAMESPACE: claim.namespace, CLAIM_NAME: claim.name, CLAIM_UID: claim.uid}
        root = traceids.root_span_id(seen.trace_id)
        out: list[SpanData] | None = [] if seen.sampled and self._sink is not None else None
        # Reservations still open end with the claim.
        for kind, name, since in seen.consumers:
            _consumer_ended(out, seen.trace_id, root, attrs, kind, name, since, now)
        deleted = traceids.named_span_id(seen.trace_id, "deleted")
        _add(out, "deleted", seen.trace_id, deleted, root, at, at, {**attrs, TIME_SOURCE: source})
        if seen.created is not None:
            _add(
                out,
                "lifetime",
                seen.trace_id,
                traceids.named_span_id(seen.trace_id, "lifetime"),
                root,
                seen.created,
                max(at, seen.created),
                {**attrs, TIME_SOURCE: source},
            )
        self._send(out or [])

    # --- pods ------------------------------------------------------------------------------------
    def pods_changed(self, changes: list[Change[Pod]]) -> None:
        live = self.pods_listed()
        for key, old, new, owned in changes:
            if new is None or not owned or not new.claims or new.started_at is None or new.scheduled_at is None:
                continue
            if old is not None and old.started_at is not None:
                continue  # its start was seen already
            if not live:
                # Started before the exporter: its span waits for backfill() (see _claim).
                if self._sink is not None:
                    self._pod_backfill.append(new)
                continue
            try:
                spans: list[SpanData] = []
                self._pod_started(new, True, spans)
                self._send(spans)
            except Exception:
                log.exception("tracing pod %s failed", key)

    def _pod_started(self, pod: Pod, live: bool, out: list[SpanData]) -> None:
        """The pod's start span into ``out`` (in each sampled claim's trace), and when ``live`` its
        start into the histogram."""
        assert pod.scheduled_at is not None and pod.started_at is not None
        recorded = False
        for ref in pod.claims:
            if not ref.resourceclaim:
                continue
            known = self._uids.get(f"{pod.namespace}/{ref.resourceclaim}")
            if known is None:
                continue
            trace_id, sampled, labels = known
            span_name = f"pod {pod.name} start"
            _add(
                out if sampled and self._sink is not None else None,
                span_name,
                trace_id,
                traceids.named_span_id(trace_id, f"{span_name} {pod.uid}"),
                traceids.root_span_id(trace_id),
                pod.scheduled_at,
                max(pod.started_at, pod.scheduled_at),
                {
                    NAMESPACE: pod.namespace,
                    POD_NAME: pod.name,
                    POD_UID: pod.uid,
                    NODE: pod.node,
                    CLAIM_NAME: ref.resourceclaim,
                    TIME_SOURCE: OBJECT,
                    **_span_labels(labels),
                },
            )
            if live and not recorded:
                recorded = True
                self._record(
                    self._pod_start,
                    pod.started_at - pod.scheduled_at,
                    labels,
                    trace_id,
                    sampled,
                    f"{span_name} {pod.uid}",
                    None,
                )

    # --- output ----------------------------------------------------------------------------------
    def _send(self, spans: list[SpanData]) -> None:
        """Hand finished spans to the sink (made only for sampled claims, with a sink)."""
        if self._sink is not None:
            for span in spans:
                self._sink.emit(span)

    def _record(
        self,
        histogram: Histogram,
        seconds: float,
        labels: dict[str, str],
        trace_id: int,
        sampled: bool,
        span_name: str,
        at: float | None,
    ) -> None:
        if seconds < 0:
            return  # clocks of different machines: no negative waits
        context = None
        if sampled and self._sink is not None:
            name = f"{span_name}@{at}" if at is not None else span_name
            span = SpanContext(
                trace_id,
                traceids.named_span_id(trace_id, name),
                is_remote=False,
                trace_flags=TraceFlags(TraceFlags.SAMPLED),
            )
            context = traceids.parent_context(span)
        histogram.record(seconds, labels, context=context)


def _add(
    out: list[SpanData] | None,
    name: str,
    trace_id: int,
    span_id: int,
    parent: int,
    start: float,
    end: float,
    attributes: dict[str, Any],
    error: str | None = None,
) -> None:
    """A finished span into ``out`` (None: spans are not wanted)."""
    if out is not None:
        out.append(SpanData(name, trace_id, span_id, parent, _ns(start), _ns(max(end, start)), attributes, error=error))


def _consumer_ended(
    out: list[SpanData] | None,
    trace_id: int,
    root: int,
    attrs: dict[str, Any],
    kind: str,
    name: str,
    since: float,
    now: float,
) -> None:
    """The span of a consumer's reservation, from when it was seen until its release (or the
    claim's deletion)."""
    _add(
        out,
        f"consumer {kind}/{name}",
        trace_id,
        traceids.named_span_id(trace_id, f"consumer {kind}/{name}@{since}"),
        root,
        since,
        now,
        {**attrs, CONSUMER: f"{kind}/{name}", TIME_SOURCE: OBSERVED},
    )


def _allocation_time(claim: Claim) -> tuple[float | None, str]:
    if claim.allocation_time is not None:
        return claim.allocation_time, OBJECT
    if claim.scheduler_write is not None:
        return claim.scheduler_write, OBJECT
    return None, OBSERVED


def _span_labels(labels: dict[str, str]) -> dict[str, str]:
    return {
        key: value for key, value in ((DRIVER, labels["driver"]), (DEVICE_CLASS, labels["deviceclass_name"])) if value
    }


def listeners(*hooks: Callable[[list[Any]], None] | None) -> Callable[[list[Any]], None] | None:
    """One store listener calling each hook in turn (None: no hook at all)."""
    present = [hook for hook in hooks if hook is not None]
    if not present:
        return None
    if len(present) == 1:
        return present[0]

    def both(changes: list[Any]) -> None:
        for hook in present:
            hook(changes)

    return both
