"""A claim's life as one trace (otel_dra/cluster/lifecycle.py), fed through a real ObjectStore."""

from __future__ import annotations

import time
import uuid
from typing import Any

from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from otel_dra.cluster import resourceclaim
from otel_dra.cluster.lifecycle import ClaimLifecycle
from otel_dra.cluster.store import ObjectStore
from otel_dra.telemetry import traceids
from otel_dra.telemetry.spansink import SpanSink
from otel_dra.telemetry.traceids import TraceIdRatio

T0 = 1_767_000_000.0


def _iso(t: float) -> str:
    import datetime

    return datetime.datetime.fromtimestamp(t, datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def claim(
    uid: str, rv: int, *, allocated: float | None = None, consumers: tuple[str, ...] = (), binding: str | None = None
) -> dict[str, Any]:
    status: dict[str, Any] = {}
    if allocated is not None:
        result = {"request": "gpu", "driver": "gpu.example.com", "pool": "n1", "device": "gpu-0"}
        if binding is not None:
            result["bindingConditions"] = ["attached"]
            result["bindingFailureConditions"] = ["failed"]
        status["allocation"] = {"devices": {"results": [result]}, "allocationTimestamp": _iso(allocated)}
        if binding is not None:
            conditions = [
                {
                    "type": "attached",
                    "status": "True" if binding == "satisfied" else "False",
                    "lastTransitionTime": _iso(allocated + 7),
                }
            ]
            if binding == "failed":
                conditions.append({"type": "failed", "status": "True", "lastTransitionTime": _iso(allocated + 9)})
            status["devices"] = [
                {"driver": "gpu.example.com", "pool": "n1", "device": "gpu-0", "conditions": conditions}
            ]
    if consumers:
        status["reservedFor"] = [{"resource": "pods", "name": name, "uid": f"uid-{name}"} for name in consumers]
    return {
        "metadata": {
            "namespace": "ns",
            "name": "c",
            "uid": uid,
            "resourceVersion": str(rv),
            "creationTimestamp": _iso(T0),
        },
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.example.com"}}]}},
        "status": status,
    }


def world(
    ratio: float = 1.0,
) -> tuple[ObjectStore[Any], InMemorySpanExporter, InMemoryMetricReader, SpanSink, list[float]]:
    exporter = InMemorySpanExporter()
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    sink = SpanSink(exporter, Resource.create({}), "test", "1")
    now = [T0 + 100]
    lifecycle = ClaimLifecycle(provider, sink, TraceIdRatio(ratio), clock=lambda: now[0])
    parse = resourceclaim.make_parser(resourceclaim.FIELDS | resourceclaim.LIFECYCLE_FIELDS)
    store: ObjectStore[Any] = ObjectStore("resourceclaims", parse, (), listener=lifecycle.claims_changed)
    return store, exporter, reader, sink, now


def in_first_list(store: ObjectStore[Any]) -> tuple[ClaimLifecycle, list[bool]]:
    """The lifecycle listening to ``store``, told that the first lists (claims and pods) are under
    way until the test sets ``listed[0]`` (ClusterState tells it from the reflectors)."""
    lifecycle = store._listener.__self__  # type: ignore[union-attr]
    listed = [False]
    lifecycle.claims_listed = lifecycle.pods_listed = lambda: listed[0]
    return lifecycle, listed


def spans(exporter: InMemorySpanExporter, sink: SpanSink) -> dict[str, Any]:
    sink.flush()
    return {s.name: s for s in exporter.get_finished_spans()}


def histogram_points(reader: InMemoryMetricReader, name: str) -> list[Any]:
    data = reader.get_metrics_data()
    return [
        p
        for rm in (data.resource_metrics if data else [])
        for sm in rm.scope_metrics
        for m in sm.metrics
        if m.name == name
        for p in m.data.data_points
    ]


def test_one_trace_from_creation_to_deletion() -> None:
    uid = str(uuid.uuid4())
    trace_id = uuid.UUID(uid).int
    root = traceids.root_span_id(trace_id)
    store, exporter, reader, sink, now = world()
    store.upsert(claim(uid, 1))
    store.upsert(claim(uid, 2, allocated=T0 + 3))
    store.upsert(claim(uid, 3, allocated=T0 + 3, consumers=("p1",)))
    now[0] = T0 + 200
    store.upsert(claim(uid, 4, allocated=T0 + 3))
    store.delete(claim(uid, 5, allocated=T0 + 3))
    got = spans(exporter, sink)
    assert set(got) == {
        "ResourceClaim ns/c",
        "allocation",
        "reserved for pod/p1",
        "consumer pod/p1",
        "deleted",
        "lifetime",
    }
    assert all(s.context.trace_id == trace_id for s in got.values())
    assert got["ResourceClaim ns/c"].context.span_id == root and got["ResourceClaim ns/c"].parent is None
    assert all(s.parent.span_id == root for n, s in got.items() if n != "ResourceClaim ns/c")
    allocation = got["allocation"]
    assert (allocation.start_time, allocation.end_time) == (int(T0 * 1e9), int((T0 + 3) * 1e9))
    assert allocation.attributes["otel_dra.span.time_source"] == "object"
    assert allocation.attributes["dra.device_class"] == "gpu.example.com"
    consumer = got["consumer pod/p1"]
    assert (consumer.start_time, consumer.end_time) == (int((T0 + 100) * 1e9), int((T0 + 200) * 1e9))
    assert consumer.attributes["otel_dra.span.time_source"] == "observed"
    # The allocation wait, with the allocation span as its exemplar.
    [point] = histogram_points(reader, "otel_dra.claim.allocation.duration")
    assert point.count == 1 and point.sum == 3.0
    assert dict(point.attributes) == {"driver": "gpu.example.com", "deviceclass_name": "gpu.example.com"}
    [exemplar] = point.exemplars
    assert (exemplar.trace_id, exemplar.span_id) == (trace_id, allocation.context.span_id)


def test_binding_conditions_satisfied_and_failed() -> None:
    for outcome, wait in (("satisfied", 7.0), ("failed", 9.0)):
        uid = str(uuid.uuid4())
        store, exporter, reader, sink, _ = world()
        store.upsert(claim(uid, 1))
        store.upsert(claim(uid, 2, allocated=T0 + 3, binding="waiting"))
        assert "binding conditions" not in spans(exporter, sink)
        store.upsert(claim(uid, 3, allocated=T0 + 3, binding=outcome))
        span = spans(exporter, sink)["binding conditions"]
        assert span.attributes["otel_dra.binding.outcome"] == outcome
        assert (span.end_time - span.start_time) / 1e9 == wait
        assert span.status.is_ok is (outcome == "satisfied")
        [point] = histogram_points(reader, "otel_dra.claim.binding.duration")
        assert point.sum == wait and point.attributes["outcome"] == outcome


def test_first_list_gives_the_phases_objects_show_by_backfill_and_measures_nothing() -> None:
    uid = str(uuid.uuid4())
    store, exporter, reader, sink, now = world()
    lifecycle, listed = in_first_list(store)
    store.replace([claim(uid, 1, allocated=T0 + 3, consumers=("p1",))])
    # Nothing is queued by the list itself, and nothing is handed out before the list is done.
    assert spans(exporter, sink) == {}
    assert lifecycle.backfill(100) == []
    listed[0] = True
    backfilled = lifecycle.backfill(100)
    assert lifecycle.backfill(100) == []  # each claim once
    # The root and the allocation (its time is in the object); the reservation's time is not, so
    # no "reserved for" instant.
    assert [s.name for s in backfilled] == ["ResourceClaim ns/c", "allocation"]
    assert backfilled[1].start_ns == int(T0 * 1e9) and backfilled[1].end_ns == int((T0 + 3) * 1e9)
    assert histogram_points(reader, "otel_dra.claim.allocation.duration") == []
    # A release seen live ends the consumer's span, from when the exporter first saw it.
    now[0] = T0 + 300
    store.upsert(claim(uid, 2, allocated=T0 + 3))
    got = spans(exporter, sink)
    assert set(got) == {"consumer pod/p1"}
    consumer = got["consumer pod/p1"]
    assert (consumer.start_time, consumer.end_time) == (int((T0 + 100) * 1e9), int((T0 + 300) * 1e9))
    assert consumer.attributes["otel_dra.span.time_source"] == "observed"


def test_a_claim_that_changes_before_its_backfill_gets_no_phase_twice() -> None:
    uid = str(uuid.uuid4())
    store, exporter, _reader, sink, _ = world()
    lifecycle, listed = in_first_list(store)
    store.replace([claim(uid, 1)])  # pending in the first list
    listed[0] = True
    store.upsert(claim(uid, 2, allocated=T0 + 3))  # allocated, seen live
    live = spans(exporter, sink)
    assert set(live) == {"allocation"}
    # The backfill gives what the list showed: the root, not the allocation again.
    assert [s.name for s in lifecycle.backfill(100)] == ["ResourceClaim ns/c"]


def test_the_sink_takes_a_backfill_while_its_queue_is_empty_and_drops_none_of_it() -> None:
    from otel_dra.telemetry.spansink import SpanData

    exporter = InMemorySpanExporter()
    sink = SpanSink(exporter, Resource.create({}), "t", "1", max_queue=4, batch=4, interval=0.05)
    backlog = [SpanData("old", 1, i + 1, 0, 0, 1, {}) for i in range(40)]
    asked: list[int] = []

    def source(limit: int) -> list[SpanData]:
        asked.append(limit)
        taken = backlog[:limit]
        del backlog[:limit]
        return taken

    sink.backfill_from(source, rate=400.0)  # 4 spans per 10 ms
    sink.emit(SpanData("live", 2, 1, 0, 0, 1, {}))
    sink.start()
    try:
        wait_for = time.monotonic() + 10
        while (backlog or len(exporter.get_finished_spans()) < 41) and time.monotonic() < wait_for:
            time.sleep(0.01)
    finally:
        sink.shutdown()
    names = [s.name for s in exporter.get_finished_spans()]
    assert names[0] == "live" and names.count("old") == 40
    assert sink.dropped == 0 and sink.exported == 41
    assert set(asked) == {4}


def test_sampled_out_claim_leaves_no_span_and_no_exemplar() -> None:
    sampler = TraceIdRatio(0.5)
    uid = next(str(u) for u in (uuid.uuid4() for _ in range(200)) if not sampler.sampled(u.int))
    store, exporter, reader, sink, _ = world(0.5)
    store.upsert(claim(uid, 1))
    store.upsert(claim(uid, 2, allocated=T0 + 3))
    assert spans(exporter, sink) == {}
    [point] = histogram_points(reader, "otel_dra.claim.allocation.duration")
    assert point.count == 1 and not point.exemplars


def test_malformed_claim_has_no_trace_and_breaks_nothing() -> None:
    store, exporter, _reader, sink, _ = world()
    bad = claim("not-a-uuid", 1)
    store.upsert(bad)
    good = str(uuid.uuid4())
    other = claim(good, 1)
    other["metadata"]["name"] = "d"
    store.upsert(other)
    assert set(spans(exporter, sink)) == {"ResourceClaim ns/d"}


def test_full_queue_drops_and_counts() -> None:
    exporter = InMemorySpanExporter()
    sink = SpanSink(exporter, Resource.create({}), "t", "1", max_queue=2)
    from otel_dra.telemetry.spansink import SpanData

    for i in range(5):
        sink.emit(SpanData("s", 1, i + 1, 0, 0, 1, {}))
    assert sink.dropped == 3
    sink.flush()
    assert len(exporter.get_finished_spans()) == 2 and sink.exported == 2


def _started_pod(name: str, claim_name: str, uid: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"namespace": "ns", "name": name, "uid": uid, "resourceVersion": "1"},
        "spec": {
            "nodeName": "n1",
            "containers": [{"name": "c", "resources": {"claims": [{"name": "gpu"}]}}],
            "resourceClaims": [{"name": "gpu", "resourceClaimName": claim_name}],
        },
        "status": {
            "conditions": [{"type": "PodScheduled", "status": "True", "lastTransitionTime": _iso(T0 + 5)}],
            "containerStatuses": [{"name": "c", "state": {"running": {"startedAt": _iso(T0 + 12)}}}],
        },
    }


def test_with_shards_each_claims_and_each_pods_spans_come_from_one_shard() -> None:
    """Two shards watch the same claims and pods: every claim's spans are emitted once, by the shard
    owning the claim, and every pod's start once, by the shard owning the pod, into its claim's
    trace even where another shard owns the claim."""
    from otel_dra.cluster import pod
    from otel_dra.cluster.sharding import Shard

    claims, pods = [], []
    for i in range(40):
        c = claim(str(uuid.uuid4()), 1, allocated=T0 + 3, consumers=(f"p{i}",))
        c["metadata"]["name"] = f"c{i}"
        claims.append(c)
        pods.append(_started_pod(f"p{i}", f"c{i}", str(uuid.uuid4())))
    exporter = InMemorySpanExporter()
    sink = SpanSink(exporter, Resource.create({}), "test", "1")
    for index in range(2):
        shard = Shard(index, 2)
        lifecycle = ClaimLifecycle(MeterProvider(), sink, TraceIdRatio(1.0), clock=lambda: T0 + 100)
        parse = resourceclaim.make_parser(resourceclaim.FIELDS | resourceclaim.LIFECYCLE_FIELDS)
        claim_store: ObjectStore[Any] = ObjectStore(
            "resourceclaims", parse, (), keep=shard.owns, listener=lifecycle.claims_changed
        )
        pod_store: ObjectStore[Any] = ObjectStore(
            "pods",
            pod.make_parser(pod.FIELDS | pod.START_FIELDS),
            (),
            keep=shard.owns,
            listener=lifecycle.pods_changed,
            listen_to_others=False,
        )
        claim_store.replace(claims)
        pod_store.replace(pods)
    sink.flush()
    got = exporter.get_finished_spans()
    owners = {c["metadata"]["name"]: Shard(0, 2).owns(c) for c in claims}
    assert 0 < sum(owners.values()) < len(claims)  # both shards own some
    for i, c in enumerate(claims):
        trace_id = uuid.UUID(c["metadata"]["uid"]).int
        in_trace = sorted(s.name for s in got if s.context.trace_id == trace_id)
        assert in_trace == sorted(
            [f"ResourceClaim ns/c{i}", "allocation", f"reserved for pod/p{i}", f"pod p{i} start"]
        ), in_trace
        [start] = [s for s in got if s.name == f"pod p{i} start"]
        assert start.parent is not None and start.parent.span_id == traceids.root_span_id(trace_id)
        assert (start.start_time, start.end_time) == (int((T0 + 5) * 1e9), int((T0 + 12) * 1e9))
    # Pods whose claim another shard owns are among them.
    assert any(Shard(0, 2).owns(p) != owners[f"c{i}"] for i, p in enumerate(pods))


def test_pods_started_before_the_first_list_are_backfilled_after_their_claims() -> None:
    from otel_dra.cluster import pod

    uid = str(uuid.uuid4())
    store, exporter, reader, sink, _ = world()
    lifecycle, listed = in_first_list(store)
    pods: ObjectStore[Any] = ObjectStore(
        "pods", pod.make_parser(pod.FIELDS | pod.START_FIELDS), (), listener=lifecycle.pods_changed
    )
    pods.replace([_started_pod("p", "c", str(uuid.uuid4()))])
    store.replace([claim(uid, 1, allocated=T0 + 3, consumers=("p",))])
    assert spans(exporter, sink) == {}
    listed[0] = True
    names = [s.name for s in lifecycle.backfill(100)]
    assert names == ["ResourceClaim ns/c", "allocation", "pod p start"]
    assert histogram_points(reader, "otel_dra.pod.startup.duration") == []
