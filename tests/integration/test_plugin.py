"""The example kubelet plugin against a real kube-apiserver, called over its real unix sockets the
way the kubelet calls it (registration, NodePrepareResources, NodeUnprepareResources)."""

from __future__ import annotations

import contextlib
import json
import shutil
import socket
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pynvml
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from otel_dra.cli.plugin import PluginApp, start_plugin
from otel_dra.kube.client import ApiError, KubeClient, load_credentials
from otel_dra.kubeletsim.nodes import ensure_node
from otel_dra.plugin.devices import simulated_devices
from otel_dra.plugin.nvml import DiscoveryError
from otel_dra.plugin.server import AlreadyRunning
from otel_dra.telemetry.traceids import root_span_id
from tests.helpers import wait_until
from tests.integration.plugin_helpers import (
    CLAIMS,
    DRIVER,
    SLICES,
    Dirs,
    Kubelet,
    ensure_namespace,
    make_claim,
    metric,
    own_slices,
    read_checkpoint,
    ref,
    result,
)
from tests.integration.test_chart import CHART, KUBE_VERSION, _helm
from tests.unit.fake_nvml import FakeGpu, FakeNvml

NS = "plugin-test"
PREPARE = "k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/NodePrepareResources"


@pytest.fixture
def dirs() -> Iterator[Dirs]:
    # Under /tmp, not pytest's tmp_path: unix socket paths are limited to 107 bytes.
    root = Path(tempfile.mkdtemp(prefix="odp-", dir="/tmp"))
    yield Dirs(root)
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def node() -> str:
    return f"node-{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="module")
def namespace(admin_client) -> str:
    ensure_namespace(admin_client, NS)
    return NS


@pytest.fixture
def start(testbed, dirs) -> Iterator[Callable[..., PluginApp]]:
    """Start in-process plugins on ``dirs``; each gets its own in-memory span exporter (``.spans``)."""
    apps: list[PluginApp] = []

    def run(node_name: str, **kwargs: Any) -> PluginApp:
        spans = InMemorySpanExporter()
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(spans))
        kwargs.setdefault("metrics_port", 0)
        kwargs.setdefault("metrics_address", "127.0.0.1")
        app = start_plugin(
            node_name=node_name,
            kubeconfig=str(testbed.kubeconfig),
            plugins_dir=dirs.plugins,
            registrar_dir=dirs.registry,
            cdi_root=dirs.cdi,
            tracer_provider=provider,
            **kwargs,
        )
        app.spans = spans  # type: ignore[attr-defined]
        apps.append(app)
        return app

    yield run
    for app in apps:
        app.stop(remove_slices=True)


@pytest.fixture
def kubelet(dirs) -> Iterator[Kubelet]:
    k = Kubelet(dirs)
    yield k
    k.close()


def _spans(app: PluginApp) -> list[ReadableSpan]:
    app.flush_spans()  # spans are made after the call (telemetry/spans.py)
    return list(app.spans.get_finished_spans())  # type: ignore[attr-defined]


def _children(spans: list[ReadableSpan], parent: ReadableSpan) -> list[ReadableSpan]:
    return [s for s in spans if s.parent is not None and s.parent.span_id == parent.context.span_id]


def _claim_spans(app: PluginApp, uid: str) -> list[ReadableSpan]:
    return [s for s in _spans(app) if s.name.endswith(" claim") and s.attributes.get("dra.claim.uid") == uid]


# --- registration, slices, health -----------------------------------------------------------------


def test_registration_slices_and_health(start, kubelet, dirs, node, admin_client):
    app = start(node, healthcheck_port=0)
    info = kubelet.get_info()
    assert (info.type, info.name, info.endpoint) == ("DRAPlugin", DRIVER, str(dirs.dra_socket))
    assert list(info.supported_versions) == [
        "v1.DRAPlugin",
        "v1beta1.DRAPlugin",
        "v1.DRAResourceHealth",
        "v1alpha1.DRAResourceHealth",
    ]
    assert not app.server.registered.is_set()
    kubelet.notify(True)
    assert app.server.registered.is_set()
    kubelet.notify(False, "version mismatch")
    assert not app.server.registered.is_set() and app.server.registration_error == "version mismatch"

    (slice_,) = wait_until(lambda: own_slices(admin_client, node), what="ResourceSlice published")
    spec = slice_["spec"]
    assert slice_["metadata"]["name"] == f"{node}-{DRIVER}-0"
    assert spec["pool"] == {"name": node, "generation": 1, "resourceSliceCount": 1}
    assert spec["driver"] == DRIVER and spec["nodeName"] == node
    assert spec["devices"] == [d.to_api() for d in simulated_devices(node, 8)]
    assert spec["devices"][0]["capacity"] == {"memory": {"value": "80Gi"}, "compute": {"value": "100"}}
    # Publishing went through the instrumented client.
    wait_until(lambda: metric(app.metrics_port, "rest_client_requests_total", code="201", method="POST") == 1)

    with grpc.insecure_channel(f"127.0.0.1:{app.health_port}") as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "liveness"):
            answer = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
            assert answer.status == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.RpcError) as exc:
            health.Check(health_pb2.HealthCheckRequest(service="other"), timeout=10)
        assert exc.value.code() == grpc.StatusCode.NOT_FOUND
        app.server.stop()  # the DRA sockets go away: no longer healthy
        answer = health.Check(health_pb2.HealthCheckRequest(service="liveness"), timeout=10)
        assert answer.status == health_pb2.HealthCheckResponse.NOT_SERVING
    assert not dirs.dra_socket.exists() and not dirs.registration_socket.exists()
    assert _spans(app) == []  # health probes (empty requests) make no traces


def test_slices_are_owned_by_the_node_and_go_with_it(testbed_sched, dirs, node):
    """The owner reference to the Node (as upstream's: v1 Node, name, UID, controller) lets the real
    garbage collector of kube-controller-manager delete the slices with the Node. Without a Node the
    slices are published unowned, and get the owner once the Node exists."""
    admin = KubeClient(load_credentials(str(testbed_sched.kubeconfig)))
    app = start_plugin(
        node_name=node,
        kubeconfig=str(testbed_sched.kubeconfig),
        plugins_dir=dirs.plugins,
        registrar_dir=dirs.registry,
        cdi_root=dirs.cdi,
        num_devices=130,  # two slices, both owned
        resync=3600,  # only the test's triggers reconcile
    )
    try:
        wait_until(lambda: len(own_slices(admin, node)) == 2, what="slices published without a Node")
        assert all("ownerReferences" not in s["metadata"] for s in own_slices(admin, node))
        ensure_node(admin, node)
        uid = admin.get_json(f"/api/v1/nodes/{node}")["metadata"]["uid"]
        owner = {"apiVersion": "v1", "kind": "Node", "name": node, "uid": uid, "controller": True}
        app.publisher.trigger()
        wait_until(
            lambda: [s["metadata"].get("ownerReferences") for s in own_slices(admin, node)] == [[owner]] * 2,
            what="slices owned by the Node",
        )
        assert app.publisher.sync() is False  # owned and unchanged: nothing to write
        started = time.monotonic()
        admin.request("DELETE", f"/api/v1/nodes/{node}")
        wait_until(lambda: own_slices(admin, node) == [], timeout=60, what="the garbage collector to delete the slices")
        collected = time.monotonic() - started
        # The plugin runs on: its next reconcile publishes again, unowned while there is no Node.
        assert app.publisher.sync() is True
        assert all("ownerReferences" not in s["metadata"] for s in own_slices(admin, node))
        print(f"\nslices deleted by the garbage collector {collected:.1f}s after the Node")
    finally:
        app.stop(remove_slices=True)
        with contextlib.suppress(ApiError):
            admin.request("DELETE", f"/api/v1/nodes/{node}")


def test_slices_republished_on_change_and_cleaned_up(start, node, admin_client):
    def slices_with(count: int, generation: int) -> Callable[[], list[dict[str, Any]]]:
        def check() -> list[dict[str, Any]]:
            items = own_slices(admin_client, node)
            if len(items) == count and all(s["spec"]["pool"]["generation"] == generation for s in items):
                return items
            return []

        return check

    a = start(node, num_devices=3)
    (first,) = wait_until(slices_with(1, 1), what="first publish")
    assert [d["name"] for d in first["spec"]["devices"]] == ["gpu-0", "gpu-1", "gpu-2"]
    # Unchanged devices: a resync writes nothing.
    assert a.publisher.sync() is False
    assert own_slices(admin_client, node)[0]["metadata"]["resourceVersion"] == first["metadata"]["resourceVersion"]
    # Someone deletes the slice: the next resync puts it back.
    admin_client.request("DELETE", f"{SLICES}/{first['metadata']['name']}")
    assert own_slices(admin_client, node) == []
    assert a.publisher.sync() is True
    assert len(own_slices(admin_client, node)) == 1
    a.stop()

    # More devices than one slice holds: two slices, a new generation.
    b = start(node, num_devices=130)
    big = wait_until(slices_with(2, 2), what="two slices")
    assert [len(s["spec"]["devices"]) for s in big] == [128, 2]
    assert {s["spec"]["pool"]["resourceSliceCount"] for s in big} == {2}
    b.stop()
    # Fewer again: the second slice is deleted.
    c = start(node, num_devices=2)
    (small,) = wait_until(slices_with(1, 3), what="shrunk to one slice")
    assert small["spec"]["pool"]["resourceSliceCount"] == 1 and len(small["spec"]["devices"]) == 2
    c.stop(remove_slices=True)
    assert own_slices(admin_client, node) == []


def test_nvml_devices_published_and_republished_on_change(start, node, admin_client):
    fake = FakeNvml([FakeGpu()])
    app = start(node, device_source="nvml", nvml=fake, resync=3600)
    (slice_,) = wait_until(lambda: own_slices(admin_client, node), what="NVML slice")
    (gpu,) = slice_["spec"]["devices"]
    # The API server accepted the NVIDIA-style attributes as they are.
    assert gpu["attributes"]["productName"] == {"string": "NVIDIA H200"}
    assert gpu["attributes"]["driverVersion"] == {"version": "580.159.4"}
    assert gpu["capacity"]["memory"] == {"value": "150754820096"}
    assert gpu["capacity"]["multiprocessors"] == {"value": "132"}
    # A GPU appears (MIG enabled): the next discovery republishes with a new generation.
    fake.gpus.append(
        FakeGpu(uuid="GPU-00000000-1111-2222-3333-444444444444", mig_enabled=True, mig_devices=[(1, 0, 4)])
    )
    app.publisher.trigger()

    def republished() -> list[str]:
        (s,) = own_slices(admin_client, node)
        return [d["name"] for d in s["spec"]["devices"]] if s["spec"]["pool"]["generation"] == 2 else []

    assert wait_until(republished, what="republish") == ["gpu-0", "gpu-1-mig-1-0"]
    assert app.driver.inventory.get("gpu-1-mig-1-0") is not None  # prepare can use the new device


# --- prepare / unprepare -------------------------------------------------------------------------------


def _published(app: PluginApp) -> None:
    """Wait until the first publish (a GET, then a POST) is over, so request counts stay still."""
    wait_until(lambda: metric(app.metrics_port, "rest_client_requests_total", code="201", method="POST") == 1)


def test_prepare_and_unprepare(start, kubelet, dirs, node, namespace, admin_client):
    app = start(node, resync=3600)
    port = app.metrics_port
    _published(app)
    prepared = "dra_example_driver_prepare_claims_total"
    histogram = "dra_example_driver_prepare_claim_duration_seconds_count"
    assert metric(port, prepared, result="success") == 0
    assert metric(port, prepared, result="error") == 0
    assert metric(port, histogram, result="success") is None  # histograms appear with the first observation

    claim = make_claim(admin_client, namespace, f"ok-{node}", [result(node, "gpu-1")])
    uid = claim["metadata"]["uid"]
    gets_before = metric(port, "rest_client_requests_total", code="200", method="GET") or 0
    response = kubelet.prepare([ref(claim)])
    entry = response.claims[uid]
    assert entry.error == ""
    (device,) = entry.devices
    assert list(device.request_names) == ["gpu"]
    assert (device.pool_name, device.device_name) == (node, "gpu-1")
    assert list(device.cdi_device_ids) == [f"k8s.{DRIVER}/gpu={uid}-gpu-1", f"k8s.{DRIVER}/gpu=common"]

    spec = json.loads(dirs.cdi_spec(uid).read_text())
    assert spec["kind"] == f"k8s.{DRIVER}/gpu"
    env = [
        f"GPU_DEVICE_GPU_1_RESOURCE_CLAIM={uid}",
        "DRA_ADMIN_ACCESS=false",
        "GPU_DEVICE_1=gpu-1",
        "GPU_DEVICE_1_SHARING_STRATEGY=TimeSlicing",  # upstream's default GpuConfig
        "GPU_DEVICE_1_TIMESLICE_INTERVAL=Default",
    ]
    assert spec["devices"] == [{"name": f"{uid}-gpu-1", "containerEdits": {"env": env}}]
    common = json.loads((dirs.cdi / f"k8s.{DRIVER}-gpu_common.json").read_text())
    assert f"KUBERNETES_NODE_NAME={node}" in common["devices"][0]["containerEdits"]["env"]
    assert read_checkpoint(dirs)[uid]["devices"][0]["device_name"] == "gpu-1"

    assert metric(port, prepared, result="success") == 1
    assert metric(port, prepared, result="error") == 0
    assert metric(port, histogram, result="success") == 1
    assert metric(port, "rest_client_requests_total", code="200", method="GET") == gets_before + 1

    # The traces: one SERVER span for the RPC; the claim's span in the claim's own trace (trace id =
    # its UID), a child of the claim's derived root, linked both ways with the RPC's; its three steps.
    spans = _spans(app)
    (rpc,) = [s for s in spans if s.kind == SpanKind.SERVER]
    assert rpc.name == PREPARE
    assert rpc.attributes["rpc.system.name"] == "grpc"
    assert rpc.attributes["rpc.method"] == "k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/NodePrepareResources"
    assert rpc.attributes["rpc.response.status_code"] == "OK"
    assert _children(spans, rpc) == []
    (claim_span,) = _claim_spans(app, uid)
    assert claim_span.name == "prepare claim"
    assert claim_span.context.trace_id == uuid.UUID(uid).int
    assert claim_span.parent is not None and claim_span.parent.span_id == root_span_id(uuid.UUID(uid).int)
    assert [(link.context.span_id, dict(link.attributes or {})) for link in rpc.links] == [
        (claim_span.context.span_id, {"k8s.resourceclaim.uid": uid})
    ]
    assert [link.context.span_id for link in claim_span.links] == [rpc.context.span_id]
    assert claim_span.attributes["k8s.namespace.name"] == namespace
    assert claim_span.attributes["dra.claim.name"] == f"ok-{node}"
    assert claim_span.attributes["dra.claim.uid"] == uid
    assert claim_span.attributes["dra.driver.name"] == DRIVER
    assert claim_span.attributes["dra.pool.name"] == node
    assert claim_span.attributes["dra.devices"] == ("gpu-1",)
    assert claim_span.attributes["dra.result"] == "success"
    assert claim_span.attributes["dra.claim.cached"] is False
    steps = _children(spans, claim_span)
    assert [s.name for s in steps] == [
        "GET /apis/resource.k8s.io/v1/namespaces/{namespace}/resourceclaims/{name}",
        "write CDI spec",
        "write checkpoint",
    ]
    assert steps[0].kind == SpanKind.CLIENT and steps[0].attributes["http.response.status_code"] == 200
    assert all(s.status.status_code == StatusCode.UNSET for s in spans)
    # The histogram times the driver's work after the claim was read (as upstream's, where the
    # helper reads the claim): from the end of the GET span to the end of the claim span, at least
    # the CDI and checkpoint writes. Span times and the plugin's clock differ; allow 0.5 ms.
    observed = metric(port, "dra_example_driver_prepare_claim_duration_seconds_sum", result="success")
    get, cdi, checkpoint = steps
    assert observed <= (claim_span.end_time - get.end_time) / 1e9 + 0.0005
    assert observed >= (checkpoint.end_time - cdi.start_time) / 1e9 - 0.0005

    # Idempotent: the same answer again, from the checkpoint, without reading the claim.
    again = kubelet.prepare([ref(claim)])
    assert again == response
    assert metric(port, prepared, result="success") == 2
    assert metric(port, "rest_client_requests_total", code="200", method="GET") == gets_before + 1
    assert _claim_spans(app, uid)[-1].attributes["dra.claim.cached"] is True

    # The older API version serves the same.
    assert kubelet.prepare([ref(claim)], version="v1beta1").claims[uid].devices[0].device_name == "gpu-1"

    reply = kubelet.unprepare([ref(claim)])
    assert reply.claims[uid].error == ""
    assert app.driver.settle(10)  # the spec and the checkpoint entry go just after the answer
    assert not dirs.cdi_spec(uid).exists()
    assert uid not in read_checkpoint(dirs)
    assert metric(port, "dra_example_driver_unprepare_claims_total", result="success") == 1
    assert metric(port, "dra_example_driver_unprepare_claim_duration_seconds_count", result="success") == 1
    # Unprepare is idempotent too.
    assert kubelet.unprepare([ref(claim)], version="v1beta1").claims[uid].error == ""
    assert metric(port, "dra_example_driver_unprepare_claims_total", result="success") == 2


def _opaque(parameters: dict[str, Any], requests: list[str], source: str = "FromClaim") -> dict[str, Any]:
    return {"source": source, "requests": requests, "opaque": {"driver": DRIVER, "parameters": parameters}}


def test_prepare_honours_the_claim_device_config(start, kubelet, dirs, node, namespace, admin_client):
    """Opaque GpuConfig entries as the API server stores them in the allocation (the class's, then
    the claim's), admin access, and a malformed config that fails only its own claim."""
    app = start(node, resync=3600)
    # Admin access is allowed only in namespaces labelled for it.
    admin_ns = f"{namespace}-admin"
    ensure_namespace(admin_client, admin_ns, {"resource.kubernetes.io/admin-access": "true"})
    requests = [
        {"name": "gpu", "exactly": {"deviceClassName": DRIVER}},
        {"name": "admin", "exactly": {"deviceClassName": DRIVER, "adminAccess": True}},
    ]
    gpu = "gpu.resource.example.com/v1alpha1"
    long = {
        "apiVersion": gpu,
        "kind": "GpuConfig",
        "sharing": {"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Long"}},
    }
    parts = {
        "apiVersion": gpu,
        "kind": "GpuConfig",
        "sharing": {"strategy": "SpacePartitioning", "spacePartitioningConfig": {"partitionCount": 4}},
    }
    configured = make_claim(
        admin_client,
        admin_ns,
        f"cfg-{node}",
        [result(node, "gpu-0"), {**result(node, "gpu-1", request="admin"), "adminAccess": True}],
        config=[_opaque(long, [], source="FromClass"), _opaque(parts, ["admin"])],
        requests=requests,
    )
    broken = make_claim(
        admin_client,
        namespace,
        f"bad-{node}",
        [result(node, "gpu-2")],
        config=[_opaque({"apiVersion": gpu, "kind": "GpuConfig", "sharing": {"strategy": "Sometimes"}}, [])],
    )
    uid, bad_uid = configured["metadata"]["uid"], broken["metadata"]["uid"]
    response = kubelet.prepare([ref(configured), ref(broken)])
    assert response.claims[uid].error == ""
    assert response.claims[bad_uid].error == (
        f"prepare claim {namespace}/bad-{node} (uid {bad_uid}): ResourceClaim {namespace}/bad-{node}: "
        "config[0] (FromClaim): unknown GPU sharing strategy: 'Sometimes' (one of TimeSlicing, SpacePartitioning)"
    )
    assert not dirs.cdi_spec(bad_uid).exists() and bad_uid not in read_checkpoint(dirs)
    # Counted under its own error type (it was folded into Other).
    errors = {"operation": "prepare", "error_type": "InvalidConfig"}
    assert metric(app.metrics_port, "otel_dra_plugin_claim_errors_total", **errors) == 1
    spec = json.loads(dirs.cdi_spec(uid).read_text())
    assert {d["name"]: d["containerEdits"]["env"] for d in spec["devices"]} == {
        f"{uid}-gpu-0": [
            f"GPU_DEVICE_GPU_0_RESOURCE_CLAIM={uid}",
            "DRA_ADMIN_ACCESS=true",  # the claim's, as upstream: one of its results has admin access
            "GPU_DEVICE_0=gpu-0",
            "GPU_DEVICE_0_SHARING_STRATEGY=TimeSlicing",
            "GPU_DEVICE_0_TIMESLICE_INTERVAL=Long",
        ],
        f"{uid}-gpu-1": [
            f"GPU_DEVICE_GPU_1_RESOURCE_CLAIM={uid}",
            "DRA_ADMIN_ACCESS=true",
            "GPU_DEVICE_1=gpu-1",
            "GPU_DEVICE_1_SHARING_STRATEGY=SpacePartitioning",
            "GPU_DEVICE_1_PARTITION_COUNT=4",
        ],
    }
    assert kubelet.unprepare([ref(configured)]).claims[uid].error == ""


def test_claim_spans_name_the_profile_the_partitions_parent_and_the_share(
    start, kubelet, dirs, node, namespace, admin_client
):
    app = start(node, resync=3600, profile="gpu-partitionable", num_devices=1)
    part = make_claim(admin_client, namespace, f"part-{node}", [result(node, "gpu-0-part-1")])
    share_id = "5d0f3c1e-3a52-4c1e-9b0e-6d1e0a7f5c21"
    shared = make_claim(admin_client, namespace, f"share-{node}", [{**result(node, "gpu-0"), "shareID": share_id}])
    response = kubelet.prepare([ref(part), ref(shared)])
    assert {uid: c.error for uid, c in response.claims.items()} == {
        part["metadata"]["uid"]: "",
        shared["metadata"]["uid"]: "",
    }
    (part_span,) = _claim_spans(app, part["metadata"]["uid"])
    assert part_span.attributes["dra.device.profile"] == "gpu-partitionable"
    assert list(part_span.attributes["dra.devices.parents"]) == ["gpu-0"]
    assert "dra.devices.share_ids" not in part_span.attributes
    (shared_span,) = _claim_spans(app, shared["metadata"]["uid"])
    assert list(shared_span.attributes["dra.devices.share_ids"]) == [share_id]
    assert "dra.devices.parents" not in shared_span.attributes
    # The partition's CDI spec: its parent and its part of the counters.
    spec = json.loads(dirs.cdi_spec(part["metadata"]["uid"]).read_text())
    [device] = spec["devices"]
    assert {"GPU_DEVICE_0_PART_1_PARENT=gpu-0", "GPU_DEVICE_0_PART_1_PROFILE=1of2"} <= set(
        device["containerEdits"]["env"]
    )
    assert kubelet.unprepare([ref(part), ref(shared)]).claims[part["metadata"]["uid"]].error == ""
    # The plugin's own gauges of what it publishes: a whole GPU and its two partitions; the alpha
    # partition type (off on every release the testbed runs by default) left out, said by its gate.
    port = app.metrics_port
    left_out = {"feature": "partition-type", "feature_gate": "DRAPartitionableDevicesType"}
    wait_until(lambda: metric(port, "otel_dra_plugin_features_left_out", **left_out) == 1, what="the first publish")
    assert metric(port, "otel_dra_plugin_published_devices", profile="gpu-partitionable", partition="false") == 1
    assert metric(port, "otel_dra_plugin_published_devices", profile="gpu-partitionable", partition="true") == 2


def _assert_error_span(app: PluginApp, uid: str, error_type: str) -> None:
    (span,) = _claim_spans(app, uid)
    assert span.status.status_code == StatusCode.ERROR, span.name
    assert span.attributes["error.type"] == error_type
    assert span.attributes["dra.result"] == "error"
    assert any(e.name == "exception" for e in span.events)


def test_prepare_error_paths(start, kubelet, node, namespace, admin_client):
    app = start(node)
    port = app.metrics_port
    good = make_claim(admin_client, namespace, f"good-{node}", [result(node, "gpu-0")])
    other_driver = make_claim(
        admin_client, namespace, f"other-{node}", [result(node, "x-0", driver="other.example.com")]
    )
    unallocated = make_claim(admin_client, namespace, f"unalloc-{node}")
    wrong_pool = make_claim(admin_client, namespace, f"pool-{node}", [result("another-node", "gpu-0")])
    ns, good_uid, good_name = ref(good)
    missing_uid = str(uuid.uuid4())
    mismatch_uid = str(uuid.uuid4())
    cases = {
        missing_uid: ((ns, missing_uid, f"missing-{node}"), "NotFound", "not found"),
        mismatch_uid: ((ns, mismatch_uid, good_name), "UIDMismatch", f"has UID {good_uid}"),
        ref(other_driver)[1]: (ref(other_driver), "NoResultsForDriver", f"no allocation results for driver {DRIVER}"),
        ref(unallocated)[1]: (ref(unallocated), "NotAllocated", "is not allocated"),
        ref(wrong_pool)[1]: (ref(wrong_pool), "WrongPool", "not in this node's pool"),
        "": ((ns, "", "x"), "InvalidRequest", "invalid claim UID ''"),
        "no-name": ((ns, "no-name", ""), "InvalidRequest", "invalid claim name ''"),
        "..": ((ns, "..", "x"), "InvalidRequest", "invalid claim UID '..'"),
    }
    response = kubelet.prepare([ref(good)] + [c[0] for c in cases.values()])
    assert response.claims[good_uid].error == ""  # the RPC and the good claim succeed
    assert set(response.claims) == {good_uid, *cases}
    for uid, (_ref, error_type, text) in cases.items():
        error = response.claims[uid].error
        assert text in error, (error_type, error)
        assert list(response.claims[uid].devices) == []
        _assert_error_span(app, uid, error_type)
    assert metric(port, "dra_example_driver_prepare_claims_total", result="error") == len(cases)
    assert metric(port, "dra_example_driver_prepare_claims_total", result="success") == 1
    assert metric(port, "dra_example_driver_prepare_claim_duration_seconds_count", result="error") == len(cases)
    not_found_get = [
        s for s in _spans(app) if s.name.startswith("GET") and s.attributes.get("http.response.status_code") == 404
    ]
    # A claim in neither the watch cache nor etcd: the cache miss is no error of its own (a cache
    # may lag); the quorum read that decides is.
    cache_miss, quorum = not_found_get
    assert cache_miss.attributes["url.full"].endswith("?resourceVersion=0")
    assert cache_miss.status.status_code == StatusCode.UNSET and "error.type" not in cache_miss.attributes
    assert not quorum.attributes["url.full"].endswith("?resourceVersion=0")
    assert quorum.status.status_code == StatusCode.ERROR
    (rpc,) = [s for s in _spans(app) if s.kind == SpanKind.SERVER]
    assert rpc.attributes["dra.claim.count"] == len(cases) + 1 and rpc.attributes["dra.claim.errors"] == len(cases)
    # Unprepare of a malformed claim is an error as well; of an unknown claim, a no-op.
    reply = kubelet.unprepare([(ns, "", "x"), (ns, missing_uid, "missing")])
    assert "invalid claim UID" in reply.claims[""].error and reply.claims[missing_uid].error == ""
    assert metric(port, "dra_example_driver_unprepare_claims_total", result="error") == 1


def test_prepare_while_api_server_is_down(testbed, start, kubelet, node, namespace, admin_client):
    app = start(node, resync=3600)
    port = app.metrics_port
    _published(app)
    claim = make_claim(admin_client, namespace, f"outage-{node}", [result(node, "gpu-2")])
    uid = claim["metadata"]["uid"]
    testbed.stop_apiserver()
    try:
        response = kubelet.prepare([ref(claim)])
        assert "cannot reach the API server" in response.claims[uid].error
        _assert_error_span(app, uid, "APIUnavailable")
        assert metric(port, "dra_example_driver_prepare_claims_total", result="error") == 1
        # The client retried (bounded) before giving up; every attempt is counted.
        retries = metric(port, "rest_client_request_retries_total", code="<error>", verb="GET")
        assert retries is not None and retries >= 3
        assert metric(port, "rest_client_requests_total", code="<error>", method="GET") >= 4
    finally:
        testbed.start_apiserver()
    # The kubelet retries; now it works.
    assert kubelet.prepare([ref(claim)]).claims[uid].error == ""
    assert metric(port, "dra_example_driver_prepare_claims_total", result="success") == 1


# --- restart, second instance --------------------------------------------------------------------------


def test_restart_between_prepare_and_unprepare(start, kubelet, dirs, node, namespace, admin_client):
    first = start(node)
    claim = make_claim(admin_client, namespace, f"restart-{node}", [result(node, "gpu-3")])
    uid = claim["metadata"]["uid"]
    before = kubelet.prepare([ref(claim)])
    assert before.claims[uid].error == ""
    first.stop()
    # The pod still runs, so its claim stays allocated: only the checkpoint knows what was prepared
    # (a claim gone or allocated anew while the plugin was down is dropped from the checkpoint at
    # start: test_plugin_device_status.py).
    second = start(node)
    kubelet = Kubelet(dirs)  # a new connection, as a restarted plugin gets
    try:
        after = kubelet.prepare([ref(claim)])  # the kubelet re-prepares running pods after a restart
        assert after == before
        (span,) = _claim_spans(second, uid)
        assert span.attributes["dra.claim.cached"] is True
        assert kubelet.unprepare([ref(claim)]).claims[uid].error == ""
    finally:
        kubelet.close()
    assert second.driver.settle(10)
    assert not dirs.cdi_spec(uid).exists()
    assert read_checkpoint(dirs) == {}


def test_second_instance_is_refused(testbed, start, kubelet, dirs, node):
    first = start(node)
    with pytest.raises(AlreadyRunning, match="another plugin instance"):
        start(node)
    assert kubelet.get_info().name == DRIVER  # the first one still serves its sockets
    # Same registry but another plugins directory: no shared lock, but the live registration
    # socket is not taken over either.
    with pytest.raises(AlreadyRunning, match="served by another process"):
        start_plugin(
            node_name=node,
            kubeconfig=str(testbed.kubeconfig),
            plugins_dir=dirs.root / "plugins2",
            registrar_dir=dirs.registry,
            cdi_root=dirs.cdi,
        )
    assert kubelet.get_info().name == DRIVER
    first.stop()


def test_stale_sockets_are_replaced(start, kubelet, dirs, node):
    for path in (dirs.dra_socket, dirs.registration_socket):
        path.parent.mkdir(parents=True, exist_ok=True)
        s = socket.socket(socket.AF_UNIX)
        s.bind(str(path))
        s.close()  # a socket file nobody listens on, as a crashed plugin leaves it
    start(node)
    assert kubelet.get_info().name == DRIVER


def test_fatal_background_error_is_counted_and_reported(start, node, admin_client):
    fake = FakeNvml([FakeGpu()])
    fatal = threading.Event()
    app = start(node, device_source="nvml", nvml=fake, resync=3600, on_fatal=lambda exc: fatal.set())
    wait_until(lambda: own_slices(admin_client, node), what="NVML slice")
    assert metric(app.metrics_port, "dra_example_driver_fatal_background_errors_total") == 0
    fake.init_error = pynvml.NVML_ERROR_DRIVER_NOT_LOADED  # the driver goes away under the plugin
    app.publisher.trigger()
    assert fatal.wait(10)
    assert isinstance(app.fatal, DiscoveryError)
    assert metric(app.metrics_port, "dra_example_driver_fatal_background_errors_total") == 1


def chart_plugin_rules(helm: Path) -> list[dict[str, Any]]:
    """The rules of the Helm chart's plugin ClusterRole: the test below runs the plugin with exactly
    what the chart grants, so chart and code cannot drift apart."""
    rendered = _helm(
        helm, "template", "rel", str(CHART), "--kube-version", KUBE_VERSION, "--set", "plugin.enabled=true"
    ).stdout
    (role,) = [
        d
        for d in yaml.safe_load_all(rendered)
        if d and d["kind"] == "ClusterRole" and d["metadata"]["name"] == "rel-otel-dra-kubeletplugin"
    ]
    rules: list[dict[str, Any]] = role["rules"]
    return rules


def plugin_rbac(rules: list[dict[str, Any]]) -> str:
    role = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole"}
    return yaml.safe_dump_all(
        [
            {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "plugin-rbac"}},
            {
                "apiVersion": "v1",
                "kind": "ServiceAccount",
                "metadata": {"name": "dra-plugin", "namespace": "plugin-rbac"},
            },
            {**role, "metadata": {"name": "otel-dra-plugin-test"}, "rules": rules},
            {
                "apiVersion": "rbac.authorization.k8s.io/v1",
                "kind": "ClusterRoleBinding",
                "metadata": {"name": "otel-dra-plugin-test"},
                "roleRef": {
                    "apiGroup": "rbac.authorization.k8s.io",
                    "kind": "ClusterRole",
                    "name": "otel-dra-plugin-test",
                },
                "subjects": [{"kind": "ServiceAccount", "name": "dra-plugin", "namespace": "plugin-rbac"}],
            },
        ]
    )


def test_chart_role_is_enough(testbed, helm, dirs, kubelet, node, namespace, admin_client):
    rules = chart_plugin_rules(helm)
    # Least privilege: nothing but what the plugin's code paths use.
    assert {(r["resources"][0], v) for r in rules for v in r["verbs"]} == {
        ("resourceclaims", "get"),
        ("resourceclaims/status", "patch"),  # the devices' status (plugin/devicestatus.py) ...
        ("resourceclaims/driver", "associated-node:patch"),  # ... of its driver, on its node
        ("resourceslices", "list"),
        ("resourceslices", "create"),
        ("resourceslices", "update"),
        ("resourceslices", "delete"),
        ("nodes", "get"),
    }
    testbed.kubectl("apply", "-f", "-", input=plugin_rbac(rules))
    ensure_node(admin_client, node)  # so that the owner lookup (get nodes) is exercised too
    # The token of a plugin pod on that node, as the DaemonSet's: bound to the pod, it names the
    # node, which the API server compares with the claim's (the associated-node verb).
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": f"plugin-{node}", "namespace": "plugin-rbac"},
        "spec": {
            "nodeName": node,
            "serviceAccountName": "dra-plugin",
            "automountServiceAccountToken": False,
            "containers": [{"name": "plugin", "image": "example.invalid/plugin:0"}],
        },
    }
    admin_client.send_json("POST", "/api/v1/namespaces/plugin-rbac/pods", pod)
    token = testbed.kubectl(
        "create",
        "token",
        "dra-plugin",
        "-n",
        "plugin-rbac",
        "--bound-object-kind=Pod",
        f"--bound-object-name=plugin-{node}",
    ).stdout.strip()
    kubeconfig = testbed.write_kubeconfig(testbed.dir / "dra-plugin.kubeconfig", token)
    app = start_plugin(
        node_name=node,
        kubeconfig=str(kubeconfig),
        plugins_dir=dirs.plugins,
        registrar_dir=dirs.registry,
        cdi_root=dirs.cdi,
        num_devices=130,  # two slices: create, and below delete
        metrics_port=0,
        metrics_address="127.0.0.1",
    )
    try:
        wait_until(lambda: len(own_slices(admin_client, node)) == 2, what="slices published with least privilege")
        node_uid = admin_client.get_json(f"/api/v1/nodes/{node}")["metadata"]["uid"]
        assert {s["metadata"]["ownerReferences"][0]["uid"] for s in own_slices(admin_client, node)} == {node_uid}
        assert app.publisher.sync() is False  # list works; nothing to write
        claim = make_claim(admin_client, namespace, f"rbac-{node}", [result(node, "gpu-129")], node=node)
        uid = claim["metadata"]["uid"]
        assert kubelet.prepare([ref(claim)]).claims[uid].error == ""
        path = f"{CLAIMS.format(ns=namespace)}/rbac-{node}"
        wait_until(lambda: admin_client.get_json(path).get("status", {}).get("devices"), what="device status written")
        assert kubelet.unprepare([ref(claim)]).claims[uid].error == ""
        # Allocated to this node alone: the entries go with the allocation (the API server drops
        # them), so the unprepare patches nothing.
        assert app.driver.device_status.flush(20)
        assert admin_client.get_json(path)["status"]["devices"]
        assert metric(app.metrics_port, "rest_client_requests_total", code="200", method="PATCH") == 1
        for method in ("GET", "PATCH"):
            assert metric(app.metrics_port, "rest_client_requests_total", code="403", method=method) is None
        assert metric(app.metrics_port, "rest_client_requests_total", code="422", method="PATCH") is None
    finally:
        app.stop(remove_slices=True)
        admin_client.request("DELETE", f"/api/v1/namespaces/plugin-rbac/pods/plugin-{node}")
        admin_client.request("DELETE", f"/api/v1/nodes/{node}")
    assert own_slices(admin_client, node) == []


def test_unchanged_resync_lists_metadata_only_on_the_real_api_server(start, node, admin_client):
    # The publisher's cheap re-check: a metadata-only list (PartialObjectMetadataList, the field
    # selector applied by the API server) says whether anything changed since it last looked.
    from otel_dra.plugin.slices import METADATA_LIST, SLICES_PATH

    app = start(node, resync=3600)
    wait_until(lambda: own_slices(admin_client, node), what="first publish")
    wait_until(lambda: app.publisher.sync() is False, what="a quiet sync")
    # What the publisher asks for is what the API server answers: metadata alone, selected.
    listed = admin_client.get_json(
        SLICES_PATH, {"fieldSelector": f"spec.nodeName={node}"}, headers={"Accept": METADATA_LIST}
    )
    assert listed["kind"] == "PartialObjectMetadataList"
    assert sorted(i["metadata"]["name"] for i in listed["items"]) == sorted(
        s["metadata"]["name"] for s in own_slices(admin_client, node)
    )
    assert all(set(i) <= {"apiVersion", "kind", "metadata"} for i in listed["items"])
    checks, publishes = app.publisher.full_checks, app.publisher.publishes
    assert app.publisher.sync() is False
    assert (app.publisher.full_checks, app.publisher.publishes) == (checks, publishes)  # names and versions only
    # Another writer's change that leaves the devices alone: read in full once, not written.
    (first, *_) = own_slices(admin_client, node)
    first["metadata"].setdefault("labels", {})["team"] = "gpu"
    admin_client.send_json("PUT", f"/apis/resource.k8s.io/v1/resourceslices/{first['metadata']['name']}", first)
    assert app.publisher.sync() is False
    assert (app.publisher.full_checks, app.publisher.publishes) == (checks + 1, publishes)
    assert app.publisher.sync() is False
    assert app.publisher.full_checks == checks + 1
    # A device changed by someone else: put back.
    (first, *_) = own_slices(admin_client, node)
    wanted = first["spec"]["devices"][0]["attributes"]
    first["spec"]["devices"][0]["attributes"] = {**wanted, "otel-dra.test/extra": {"string": "x"}}
    admin_client.send_json("PUT", f"/apis/resource.k8s.io/v1/resourceslices/{first['metadata']['name']}", first)
    assert app.publisher.sync() is True
    assert app.publisher.publishes == publishes + 1
    name = first["metadata"]["name"]
    (again,) = [s for s in own_slices(admin_client, node) if s["metadata"]["name"] == name]
    assert again["spec"]["devices"][0]["attributes"] == wanted


def test_slices_deleted_around_a_registration_come_back_before_the_resync(start, node, admin_client):
    # A starting kubelet deletes its node's slices near the moment it registers the plugin; the
    # plugin then checks again at once and a few times after (recheck_soon), not only at the resync.
    app = start(node, resync=3600)
    wait_until(lambda: own_slices(admin_client, node), what="first publish")
    publishes = app.publisher.publishes
    app.publisher.recheck_soon((0.0, 1.0, 2.0))
    time.sleep(0.3)  # after the immediate check: only the later ones can bring them back
    for s in own_slices(admin_client, node):
        admin_client.request("DELETE", f"/apis/resource.k8s.io/v1/resourceslices/{s['metadata']['name']}")
    assert own_slices(admin_client, node) == []
    started = time.monotonic()
    wait_until(lambda: own_slices(admin_client, node), timeout=10, what="slices republished")
    assert time.monotonic() - started < 3.0
    assert app.publisher.publishes == publishes + 1
