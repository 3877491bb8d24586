"""One trace per ResourceClaim: the plugin's claim spans join the claim's trace (trace id = its UID,
parent = the derived root that the cluster exporter emits), linked both ways with the RPC's span;
and the allocation-to-prepared histogram, whose exemplar names the claim's span."""

from __future__ import annotations

import copy
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import HistogramDataPoint, InMemoryMetricReader
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import DEFAULT_ON, Sampler
from opentelemetry.trace import SpanKind

from otel_dra._generated.dra.v1 import api_pb2 as dra_v1
from otel_dra.kube.client import ApiError
from otel_dra.plugin.cdi import CdiWriter
from otel_dra.plugin.checkpoint import Checkpoint
from otel_dra.plugin.devices import simulated_devices
from otel_dra.plugin.driver import Driver, Inventory, allocation_time, device_classes
from otel_dra.plugin.metrics import ALLOCATION_TO_PREPARED, ALLOCATION_TO_PREPARED_BUCKETS, PluginMetrics
from otel_dra.plugin.server import _DraServicer
from otel_dra.telemetry.spans import tracer_provider
from otel_dra.telemetry.traceids import ParentBasedTraceIdRatio, TraceIdRatio, decides_root, root_span_id

DRIVER = "gpu.example.com"
# TraceIdRatio(0.5) samples a trace id whose low 56 bits are below 2^55: byte 9 of the UUID (the
# two hex digits after the variant's) below 0x80.
SAMPLED = "6f1c2a9e-0b7d-4c3e-8a41-2d5e6f708192"
UNSAMPLED = "6f1c2a9e-0b7d-4c3e-8ac1-2d5e6f708192"
SECOND = "0d3e8b42-91aa-4f0c-b215-7c6d5e4f3a21"  # sampled too
GET = "GET /apis/resource.k8s.io/v1/namespaces/{namespace}/resourceclaims/{name}"
PREPARE = "k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/NodePrepareResources"
ALLOCATED_AT = "2026-01-02T03:04:05Z"
ALLOCATED_UNIX = 1767323045.0


def _claim(uid: str, name: str, classes: tuple[str, ...] = (DRIVER,)) -> dict[str, Any]:
    requests = [{"name": f"r{i}", "exactly": {"deviceClassName": c}} for i, c in enumerate(classes)]
    results = [
        {"request": f"r{i}", "driver": DRIVER, "pool": "node-a", "device": f"gpu-{i}"} for i in range(len(classes))
    ]
    return {
        "metadata": {"namespace": "ns", "name": name, "uid": uid},
        "spec": {"devices": {"requests": requests}},
        "status": {"allocation": {"devices": {"results": results}, "allocationTimestamp": ALLOCATED_AT}},
    }


class _Api:
    """The API server: the claims by name, from the watch cache and a quorum read alike."""

    host = "https://10.0.0.1:6443"

    def __init__(self, *claims: dict[str, Any]) -> None:
        self.claims = {c["metadata"]["name"]: c for c in claims}

    def get_json(self, path, query=None, *, headers=None, timeout=None):
        name = path.rsplit("/", 1)[1]
        if name in self.claims:
            return copy.deepcopy(self.claims[name])
        raise ApiError(404, "not found")


class _Context:
    """A grpc.ServicerContext's metadata, all the servicer reads."""

    def __init__(self, traceparent: str = "") -> None:
        self.metadata = [("traceparent", traceparent)] if traceparent else []

    def invocation_metadata(self) -> list[tuple[str, str]]:
        return self.metadata


class _Plugin:
    def __init__(self, root: Path, api: _Api, sampler: Sampler, now: float) -> None:
        self.spans = InMemorySpanExporter()
        self.provider = tracer_provider(sampler=sampler)
        self.provider.add_span_processor(SimpleSpanProcessor(self.spans))
        self.reader = InMemoryMetricReader()
        self.meters = MeterProvider(metric_readers=[self.reader], shutdown_on_exit=False)
        cdi = CdiWriter(root / "cdi", DRIVER, "node-a")
        cdi.write_common()
        self.driver = Driver(
            client=api,  # type: ignore[arg-type]
            driver_name=DRIVER,
            node_name="node-a",
            inventory=Inventory(simulated_devices("node-a", 4)),
            cdi=cdi,
            checkpoint=Checkpoint(root / "checkpoint.json"),
            metrics=PluginMetrics(self.meters),
            tracer_provider=self.provider,
            wall_clock=lambda: now,
        )
        self.servicer = _DraServicer(dra_v1, self.driver)

    def prepare(self, *claims: tuple[str, str], traceparent: str = "") -> Any:
        request = dra_v1.NodePrepareResourcesRequest(
            claims=[dra_v1.Claim(namespace="ns", uid=uid, name=name) for uid, name in claims]
        )
        return self.servicer.NodePrepareResources(request, _Context(traceparent))

    def unprepare(self, *claims: tuple[str, str]) -> Any:
        request = dra_v1.NodeUnprepareResourcesRequest(
            claims=[dra_v1.Claim(namespace="ns", uid=uid, name=name) for uid, name in claims]
        )
        return self.servicer.NodeUnprepareResources(request, _Context())

    def finished(self) -> list[ReadableSpan]:
        self.driver.spans.flush()
        return list(self.spans.get_finished_spans())

    def histogram(self) -> list[HistogramDataPoint]:
        data = self.reader.get_metrics_data()
        return [
            p
            for rm in (data.resource_metrics if data else [])
            for sm in rm.scope_metrics
            for m in sm.metrics
            if m.name == ALLOCATION_TO_PREPARED.name
            for p in m.data.data_points
        ]

    def close(self) -> None:
        self.driver.spans.close()
        self.provider.shutdown()
        self.meters.shutdown()


@pytest.fixture
def plugin(tmp_path) -> Iterator[Any]:
    made: list[_Plugin] = []

    def make(*claims: dict[str, Any], sampler: Sampler = DEFAULT_ON, now: float = ALLOCATED_UNIX + 7.0) -> _Plugin:
        path = tmp_path / str(len(made))
        path.mkdir()
        made.append(_Plugin(path, _Api(*claims), sampler, now))
        return made[-1]

    yield make
    for p in made:
        p.close()


def _tid(uid: str) -> int:
    return uuid.UUID(uid).int


def _by_name(spans: list[ReadableSpan], name: str) -> list[ReadableSpan]:
    return [s for s in spans if s.name == name]


def _children(spans: list[ReadableSpan], parent: ReadableSpan) -> list[str]:
    return [s.name for s in spans if s.parent is not None and s.parent.span_id == parent.context.span_id]


# --- the layout -------------------------------------------------------------------------------------


@pytest.mark.parametrize("traceparent", ["", "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"])
def test_each_claim_span_is_a_child_of_its_claims_root_linked_with_the_rpc(plugin, traceparent):
    p = plugin(_claim(SAMPLED, "a"), _claim(SECOND, "b"))
    response = p.prepare((SAMPLED, "a"), (SECOND, "b"), traceparent=traceparent)
    assert response.claims[SAMPLED].error == "" and response.claims[SECOND].error == ""
    spans = p.finished()
    (rpc,) = _by_name(spans, PREPARE)
    assert rpc.kind == SpanKind.SERVER
    if traceparent:  # the call keeps its caller's parent
        assert rpc.parent is not None and rpc.parent.span_id == 0xB7AD6B7169203331
        assert rpc.context.trace_id == 0x0AF7651916CD43DD8448EB211C80319C
    else:
        assert rpc.parent is None
    claims = {s.attributes["dra.claim.uid"]: s for s in _by_name(spans, "prepare claim")}
    assert set(claims) == {SAMPLED, SECOND}
    for uid, claim in claims.items():
        assert claim.context.trace_id == _tid(uid)
        assert claim.parent is not None and claim.parent.is_remote
        assert (claim.parent.trace_id, claim.parent.span_id) == (_tid(uid), root_span_id(_tid(uid)))
        assert dict(claim.attributes)["dra.result"] == "success" and claim.attributes["dra.claim.cached"] is False
        # Its steps stay its children, in its trace.
        assert _children(spans, claim) == [GET, "write CDI spec", "write checkpoint"]
        assert all(
            s.context.trace_id == _tid(uid) for s in spans if s.parent and s.parent.span_id == claim.context.span_id
        )
        (back,) = claim.links
        assert (back.context.trace_id, back.context.span_id) == (rpc.context.trace_id, rpc.context.span_id)
    # The RPC: one link per claim, in request order, naming it.
    assert [(link.context.trace_id, link.context.span_id, dict(link.attributes or {})) for link in rpc.links] == [
        (_tid(uid), claims[uid].context.span_id, {"k8s.resourceclaim.uid": uid}) for uid in (SAMPLED, SECOND)
    ]
    assert _children(spans, rpc) == []


def test_unprepare_claims_join_their_traces_too(plugin):
    p = plugin(_claim(SAMPLED, "a"))
    p.prepare((SAMPLED, "a"))
    p.finished()  # the prepare's spans made, then forgotten
    p.spans.clear()
    assert p.unprepare((SAMPLED, "a")).claims[SAMPLED].error == ""
    spans = p.finished()
    (claim,) = _by_name(spans, "unprepare claim")
    assert claim.context.trace_id == _tid(SAMPLED) and claim.parent.span_id == root_span_id(_tid(SAMPLED))
    assert _children(spans, claim) == ["remove CDI spec", "write checkpoint"]
    (rpc,) = [s for s in spans if s.kind == SpanKind.SERVER]
    assert [link.context.span_id for link in rpc.links] == [claim.context.span_id]


def test_a_uid_that_is_no_uuid_keeps_the_claim_under_the_rpc(plugin):
    p = plugin(_claim("u1", "a"))
    assert p.prepare(("u1", "a"), ("", "bad")).claims["u1"].error == ""
    spans = p.finished()
    (rpc,) = _by_name(spans, PREPARE)
    claims = _by_name(spans, "prepare claim")
    assert len(claims) == 2
    for claim in claims:
        assert claim.parent is not None and claim.parent.span_id == rpc.context.span_id
        assert claim.context.trace_id == rpc.context.trace_id and claim.links == ()
    assert rpc.links == ()
    (good,) = [c for c in claims if c.attributes["dra.claim.uid"] == "u1"]
    assert _children(spans, good) == [GET, "write CDI spec", "write checkpoint"]


# --- sampling -----------------------------------------------------------------------------------------


def test_the_ratio_sampler_decides_claims_by_their_uid_and_the_rpc_by_its_own_trace(plugin):
    ratio = TraceIdRatio(0.5)
    assert ratio.sampled(_tid(SAMPLED)) and not ratio.sampled(_tid(UNSAMPLED))
    # The RPC's trace id sampled out, one claim's in: the claim span is there, the RPC's is not.
    rpc_out = f"{0x5A << 56 | 0x80 << 48:032x}"
    assert not ratio.sampled(int(rpc_out, 16))
    p = plugin(_claim(SAMPLED, "in"), _claim(UNSAMPLED, "out"), sampler=ratio)
    response = p.prepare((SAMPLED, "in"), (UNSAMPLED, "out"), traceparent=f"00-{rpc_out}-b7ad6b7169203331-01")
    assert response.claims[UNSAMPLED].error == ""  # sampled out: prepared all the same
    spans = p.finished()
    assert {s.context.trace_id for s in spans} == {_tid(SAMPLED)}  # no span of the other claim's, none of the RPC's
    (claim,) = _by_name(spans, "prepare claim")
    assert claim.attributes["dra.claim.uid"] == SAMPLED and claim.context.trace_flags.sampled
    assert len(_children(spans, claim)) == 3
    # The RPC's trace id sampled in: its span is there, still with a link to each claim.
    p.spans.clear()  # (flushed above)
    rpc_in = f"{0x5A << 56 | 0x10 << 48:032x}"
    p.prepare((UNSAMPLED, "out"), traceparent=f"00-{rpc_in}-b7ad6b7169203331-01")
    spans = p.finished()
    (rpc,) = spans
    assert rpc.name == PREPARE and rpc.context.trace_id == int(rpc_in, 16)
    (link,) = rpc.links
    assert link.context.trace_id == _tid(UNSAMPLED) and not link.context.trace_flags.sampled


@pytest.mark.parametrize("sampler", [TraceIdRatio(0.5), ParentBasedTraceIdRatio(0.5)], ids=["ratio", "parentbased"])
def test_a_claim_is_sampled_alike_in_every_process(plugin, sampler):
    """The exporter decides its root by decides_root with its sampler; the plugin's claim span, with
    either default-family sampler, agrees, whatever the RPC's decision."""
    p = plugin(_claim(SAMPLED, "in"), _claim(UNSAMPLED, "out"), sampler=sampler)
    p.prepare((SAMPLED, "in"), (UNSAMPLED, "out"))
    exported = {s.attributes["dra.claim.uid"] for s in _by_name(p.finished(), "prepare claim")}
    for uid in (SAMPLED, UNSAMPLED):
        assert (uid in exported) is decides_root(TraceIdRatio(0.5), _tid(uid), "claim root")


# --- allocation to prepared ---------------------------------------------------------------------------


def test_allocation_to_prepared_once_per_claim_with_the_claim_span_as_exemplar(plugin):
    p = plugin(_claim(SAMPLED, "a"), now=ALLOCATED_UNIX + 7.25)
    p.prepare((SAMPLED, "a"))
    p.prepare((SAMPLED, "a"))  # answered from the checkpoint: not observed again
    (point,) = p.histogram()
    assert dict(point.attributes) == {"driver": DRIVER, "deviceclass_name": DRIVER}
    assert (point.count, point.sum) == (1, 7.25)
    assert tuple(point.explicit_bounds) == ALLOCATION_TO_PREPARED_BUCKETS
    (claim, _) = _by_name(p.finished(), "prepare claim")
    (exemplar,) = point.exemplars
    assert exemplar.trace_id == _tid(SAMPLED) and exemplar.span_id == claim.context.span_id
    assert exemplar.value == 7.25


def test_allocation_to_prepared_per_device_class_and_without_exemplar_when_sampled_out(plugin):
    p = plugin(
        _claim(UNSAMPLED, "two", classes=("gpu.example.com", "mig.example.com", "gpu.example.com")),
        sampler=TraceIdRatio(0.5),
    )
    assert p.prepare((UNSAMPLED, "two")).claims[UNSAMPLED].error == ""
    points = {p_.attributes["deviceclass_name"]: p_ for p_ in p.histogram()}
    assert set(points) == {"gpu.example.com", "mig.example.com"}
    assert all(pt.count == 1 and pt.sum == 7.0 and list(pt.exemplars) == [] for pt in points.values())


def test_allocation_to_prepared_is_not_recorded_for_a_failed_prepare_or_without_a_time(plugin):
    no_time = _claim(SAMPLED, "a")
    del no_time["status"]["allocation"]["allocationTimestamp"]
    failing = _claim(SECOND, "b")
    failing["status"]["allocation"]["devices"]["results"][0]["device"] = "gpu-9"  # not published
    p = plugin(no_time, failing)
    response = p.prepare((SAMPLED, "a"), (SECOND, "b"))
    assert response.claims[SAMPLED].error == "" and "not published" in response.claims[SECOND].error
    assert p.histogram() == []


def test_allocation_time_from_the_timestamp_else_the_schedulers_status_write():
    claim = _claim(SAMPLED, "a")
    claim["metadata"]["managedFields"] = [
        {"manager": "kube-scheduler", "subresource": "status", "time": "2026-01-02T03:05:00Z"},
    ]
    assert allocation_time(claim) == ALLOCATED_UNIX
    del claim["status"]["allocation"]["allocationTimestamp"]
    claim["metadata"]["managedFields"] += [
        {"manager": "kube-scheduler", "subresource": "status", "time": "2026-01-02T03:04:30Z"},
        {"manager": "kube-scheduler", "time": "2026-01-02T03:09:00Z"},  # the spec: not the allocation
        {"manager": "kubelet", "subresource": "status", "time": "2026-01-02T03:08:00Z"},
        {"manager": "kube-scheduler", "subresource": "status", "time": "yesterday"},
    ]
    assert allocation_time(claim) == ALLOCATED_UNIX + 55
    claim["metadata"]["managedFields"] = [{"manager": "kubelet", "subresource": "status", "time": ALLOCATED_AT}]
    assert allocation_time(claim) is None
    assert allocation_time({}) is None


def test_device_classes_of_this_drivers_results():
    claim = _claim(SAMPLED, "a", classes=("c1", "c2"))
    claim["spec"]["devices"]["requests"].append(
        {"name": "pick", "firstAvailable": [{"name": "big", "deviceClassName": "c3"}, {"name": "small"}]}
    )
    results = claim["status"]["allocation"]["devices"]["results"]
    results += [
        {"request": "pick/big", "driver": DRIVER, "pool": "node-a", "device": "gpu-3"},
        {"request": "r0", "driver": "other.example.com", "pool": "p", "device": "x"},
        {"request": "unknown", "driver": DRIVER, "pool": "node-a", "device": "gpu-2"},
    ]
    assert device_classes(claim, DRIVER) == ["c1", "c2", "c3", ""]
    assert device_classes(claim, "other.example.com") == ["c1"]
    assert device_classes({}, DRIVER) == []
