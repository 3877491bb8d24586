"""Pre-encoded OTLP requests must decode (with the official classes) to what the SDK would send."""

from __future__ import annotations

import pytest
from opentelemetry.exporter.otlp.proto.common.metrics_encoder import encode_metrics
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.resources import Resource

from otel_dra.cluster import deviceclass
from otel_dra.cluster.store import ObjectStore
from otel_dra.telemetry.otlp_encode import MetricHeader, PointEncoder, PointGroup, RequestBuilder, encode_resource
from tests.unit.sample_stores import register_sdk_gauges, sample_stores

RESOURCE = Resource.create({"service.name": "t", "k8s.cluster.name": "c"})


def _stores(segment_size=256):
    return sample_stores(otlp=True, segment_size=segment_size)


def _points(requests):
    """name -> (description, unit, {(attrs, value)}, {timestamps}); plus resource and scope seen."""
    out, resources, scopes = {}, set(), set()
    for req in requests:
        for rm in req.resource_metrics:
            resources.add(tuple(sorted((a.key, a.value.string_value) for a in rm.resource.attributes)))
            for sm in rm.scope_metrics:
                scopes.add((sm.scope.name, sm.scope.version))
                for m in sm.metrics:
                    _desc, _unit, pts, times = out.setdefault(m.name, (m.description, m.unit, set(), set()))
                    assert m.WhichOneof("data") == "gauge"
                    for p in m.gauge.data_points:
                        pts.add((tuple((a.key, a.value.string_value) for a in p.attributes), p.as_double))
                        times.add(p.time_unix_nano)
    return out, resources, scopes


def _sdk_request(stores):
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader], resource=RESOURCE)
    register_sdk_gauges(provider.get_meter("otel_dra.cluster", "1.2.3"), stores)
    request = encode_metrics(reader.get_metrics_data())
    provider.shutdown()
    return request


def test_pre_encoded_requests_equal_sdk_encoding():
    stores = _stores()
    builder = RequestBuilder(RESOURCE, "otel_dra.cluster", "1.2.3")
    metrics = [m for s in stores for m in s.otlp_metrics()]
    ours = [ExportMetricsServiceRequest.FromString(r) for r in builder.requests(metrics, 1_700_000_000_123_456_789)]
    got, resources, scopes = _points(ours)
    expected, sdk_resources, sdk_scopes = _points([_sdk_request(stores)])
    assert {k: v[:3] for k, v in got.items()} == {k: v[:3] for k, v in expected.items()}
    assert all(v[3] == {1_700_000_000_123_456_789} for v in got.values())
    assert resources == sdk_resources and scopes == sdk_scopes


@pytest.mark.parametrize(
    "attributes",
    [
        {"service.name": "t"},
        {
            "service.name": "ünïcode ☃",
            "flag": True,
            "off": False,
            "count": 3,
            "negative": -(2**63),
            "ratio": 0.25,
            "names": ("a", "b"),
            "numbers": (1, 2, 3),
            "floats": (1.5, -0.0),
            "flags": (True, False),
            "empty": "",
        },
    ],
    ids=["one string", "every type"],
)
def test_the_resource_is_encoded_as_the_sdk_encodes_it(attributes):
    """Our public-protobuf encoding of the resource against the SDK's encoder (whose
    ``_encode_resource`` we used to call), byte for byte."""
    resource = Resource(attributes)
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader], resource=resource)
    provider.get_meter("m").create_counter("c").add(1)
    (resource_metrics,) = encode_metrics(reader.get_metrics_data()).resource_metrics
    provider.shutdown()
    assert encode_resource(resource) == resource_metrics.resource.SerializeToString()


def test_requests_are_split_below_the_limit_without_losing_points():
    stores = _stores(segment_size=2)
    builder = RequestBuilder(RESOURCE, "s", "v")
    metrics = [m for s in stores for m in s.otlp_metrics()]
    whole, _, _ = _points([ExportMetricsServiceRequest.FromString(r) for r in builder.requests(metrics, 5)])
    raw = list(builder.requests(metrics, 5, limit=600))
    assert len(raw) > 5
    assert all(len(r) < 600 + 700 for r in raw)  # limit plus resource/scope/metric headers
    split, _, _ = _points([ExportMetricsServiceRequest.FromString(r) for r in raw])
    assert split == whole


def test_point_split_inside_one_oversized_chunk():
    enc = PointEncoder(("a",))
    blob = enc.encode([((f"value-{i}",), float(i)) for i in range(50)])
    from otel_dra.telemetry.otlp_encode import MetricHeader

    raw = list(
        RequestBuilder(RESOURCE, "s", "v").requests(
            [(MetricHeader("m", "d", "1"), [PointGroup.of(blob)])], 7, limit=200
        )
    )
    assert len(raw) > 3
    got, _, _ = _points([ExportMetricsServiceRequest.FromString(r) for r in raw])
    assert got["m"][2] == {((("a", f"value-{i}"),), float(i)) for i in range(50)}


def test_strange_strings_survive():
    enc = PointEncoder(("k",))
    values = ["", "ü∂", "x" * 300, "\ud800lone", '"quoted"\n']
    from otel_dra.telemetry.otlp_encode import MetricHeader

    raw = RequestBuilder(RESOURCE, "s", "v").requests(
        [(MetricHeader("m", "d", "1"), [PointGroup.of(enc.encode([((v,), 1.0) for v in values]))])], 9
    )
    got, _, _ = _points([ExportMetricsServiceRequest.FromString(r) for r in raw])
    assert {a[0][1] for a, _ in got["m"][2]} == {v.encode("utf-8", "replace").decode() for v in values}


def test_unchanged_segments_reuse_their_point_groups():
    store = ObjectStore("deviceclasses", deviceclass.parse, deviceclass.FAMILIES, otlp=True, segment_size=2)
    objs = [
        {"metadata": {"name": f"c{i}", "resourceVersion": "1", "annotations": {"hourly-cost": "1"}}} for i in range(6)
    ]
    store.replace(objs)
    first = store.otlp_metrics()[0][1]
    store.upsert({"metadata": {"name": "c3", "resourceVersion": "2", "annotations": {"hourly-cost": "5"}}})
    second = store.otlp_metrics()[0][1]
    assert [a is b for a, b in zip(first, second, strict=True)] == [True, False, True]
    assert second[1].size == sum(map(len, second[1].raw())) > 0
    # Stored compressed, unpacked for a push.
    assert second[1].packed and sum(map(len, second[1].buffers)) < second[1].size


@pytest.mark.parametrize("first_push", [0, 250])
def test_points_survive_rejoins_splits_and_relists(first_push):
    """OTLP points are held once (in the segments' joined buffers), like the Prometheus lines:
    after changes, splits and relists a push still carries exactly a fresh store's points. Points
    are deferred until the first push: with ``first_push`` 250, half the steps (relists and
    splits included) happen before any point is encoded."""
    import random

    rng = random.Random(5)

    def obj(name, rv, cost):
        return {"metadata": {"name": name, "resourceVersion": str(rv), "annotations": {"hourly-cost": str(cost)}}}

    families = deviceclass.FAMILIES + deviceclass.STATE_FAMILIES
    live = ObjectStore("deviceclasses", deviceclass.parse, families, otlp=True, segment_size=3)
    current: dict[str, dict] = {}
    builder = RequestBuilder(RESOURCE, "s", "v")
    for step in range(500):
        name = f"c{rng.randrange(30):02d}"
        if rng.random() < 0.25 and name in current:
            live.delete(current.pop(name))
        elif rng.random() < 0.04:
            current = {k: v for k, v in current.items() if rng.random() < 0.8}
            live.replace(list(current.values()))
        else:
            current[name] = obj(name, 1000 + step, rng.randrange(9))
            live.upsert(current[name])
        if rng.random() < 0.3:
            live.blocks()  # joins the lines at other moments than the points
        if step < first_push:
            assert all(e.points is None for e in live._entries.values())  # deferred
        elif rng.random() < 0.3:
            fresh = ObjectStore("deviceclasses", deviceclass.parse, families, otlp=True)
            fresh.replace(list(current.values()))
            got, _, _ = _points(
                [ExportMetricsServiceRequest.FromString(r) for r in builder.requests(live.otlp_metrics(), 1)]
            )
            want, _, _ = _points(
                [ExportMetricsServiceRequest.FromString(r) for r in builder.requests(fresh.otlp_metrics(), 1)]
            )
            assert got == want, step
            assert all(e.points is None for e in live._entries.values())


def test_first_push_survives_changes_between_its_segments():
    """The first push encodes the deferred points one segment at a time, releasing the store's
    lock in between; the watch thread may relist or store a change (rendered before the push
    began, so without points) in those gaps. The push must carry exactly the state it ends with."""

    def obj(name, rv, cost):
        return {"metadata": {"name": name, "resourceVersion": str(rv), "annotations": {"hourly-cost": str(cost)}}}

    families = deviceclass.FAMILIES + deviceclass.STATE_FAMILIES
    live = ObjectStore("deviceclasses", deviceclass.parse, families, otlp=True, segment_size=2)
    live.replace([obj(f"c{i}", 1, i) for i in range(6)])
    later = [obj(f"d{i}", 2, i) for i in range(5)]
    early = live._build("d3", obj("d3", 3, 8))  # rendered now: before the first push, no points
    assert early.points is None

    class Interleave:
        """The store's lock, with the watch thread's work slipped in before given acquisitions."""

        def __init__(self, lock):
            self.lock, self.count = lock, 0

        def __enter__(self):
            self.count += 1
            if self.count == 2:  # the first deferred segment: a relist retires every segment
                live.replace(later)
            elif self.count == 5:  # a later one: the early-rendered change is stored
                with self.lock:
                    live._store("d3", early)
            return self.lock.__enter__()

        def __exit__(self, *exc):
            return self.lock.__exit__(*exc)

    live._lock = Interleave(live._lock)
    builder = RequestBuilder(RESOURCE, "s", "v")
    got, _, _ = _points([ExportMetricsServiceRequest.FromString(r) for r in builder.requests(live.otlp_metrics(), 1)])
    assert live._lock.count > 5
    fresh = ObjectStore("deviceclasses", deviceclass.parse, families, otlp=True)
    fresh.replace([*later[:3], obj("d3", 3, 8), *later[4:]])
    want, _, _ = _points([ExportMetricsServiceRequest.FromString(r) for r in builder.requests(fresh.otlp_metrics(), 1)])
    assert got == want


def test_counted_requests_say_how_many_points_each_carries():
    metrics = [
        (
            MetricHeader(f"m{i}", "d", "1"),
            [PointGroup.of(PointEncoder(("k",)).encode([((f"v{j}",), float(j)) for j in range(40)]))],
        )
        for i in range(5)
    ]
    builder = RequestBuilder(RESOURCE, "s", "v")
    counted = list(builder.counted(metrics, 7, limit=600))
    assert len(counted) > 1
    for raw, points in counted:
        decoded = ExportMetricsServiceRequest.FromString(raw)
        assert points == sum(
            len(m.gauge.data_points) for rm in decoded.resource_metrics for sm in rm.scope_metrics for m in sm.metrics
        )
    assert sum(p for _, p in counted) == 200
    assert [r for r, _ in counted] == list(builder.requests(metrics, 7, limit=600))
