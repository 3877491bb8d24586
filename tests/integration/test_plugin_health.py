"""Device health of the in-process plugin against the real API server: NVML events (fake NVML)
and the simulated health directory become taints of the published ResourceSlice, with the
configured effect, and go again on recovery; the DRAResourceHealth stream says the same."""

from __future__ import annotations

import time

import grpc
import pynvml
import pytest

from otel_dra._generated.drahealth.v1 import api_pb2 as health_v1
from otel_dra._generated.drahealth.v1 import api_pb2_grpc as health_v1_grpc
from tests.helpers import wait_until
from tests.integration import test_plugin
from tests.integration.plugin_helpers import CLAIMS, DRIVER, make_claim, metric, own_slices, ref, result
from tests.unit.fake_nvml import FakeGpu, FakeNvml

pytestmark = pytest.mark.testbed

# test_plugin's fixtures: in-process plugins on short directories, a fresh node name.
dirs = test_plugin.dirs
node = test_plugin.node
start = test_plugin.start
KEY = f"{DRIVER}/unhealthy"


def _taints(admin_client, node: str) -> dict[str, list[tuple[str, str, str]]]:
    out = {}
    for s in own_slices(admin_client, node):
        for d in s["spec"]["devices"]:
            if d.get("taints"):
                out[d["name"]] = [(t["key"], t["value"], t["effect"]) for t in d["taints"]]
                assert all(t["timeAdded"].endswith("Z") for t in d["taints"])
    return out


def test_nvml_xid_taints_the_gpu_with_the_chosen_effect(start, node, admin_client):
    a, b = FakeGpu(uuid="GPU-aaaa"), FakeGpu(uuid="GPU-bbbb")
    fake = FakeNvml([a, b])
    app = start(node, device_source="nvml", nvml=fake, resync=3600, unhealthy_device_taint="NoExecute")
    wait_until(lambda: own_slices(admin_client, node), what="the slice")
    generation = own_slices(admin_client, node)[0]["spec"]["pool"]["generation"]
    fake.inject(b, pynvml.nvmlEventTypeXidCriticalError, 79)
    wait_until(lambda: _taints(admin_client, node) == {"gpu-1": [(KEY, "xid-79", "NoExecute")]}, what="gpu-1 tainted")
    assert own_slices(admin_client, node)[0]["spec"]["pool"]["generation"] == generation + 1
    entry = app.device_health.get("gpu-1")
    assert entry.message == "critical XID 79 reported by NVML on GPU GPU-bbbb"


def test_a_lost_gpu_is_tainted_and_the_plugin_carries_on(start, node, admin_client):
    """NVML_ERROR_GPU_IS_LOST: the monitor's probe taints the GPU, and the rediscovery that now
    fails on it keeps the devices instead of stopping the plugin (other discovery errors do)."""
    a, b = FakeGpu(uuid="GPU-aaaa"), FakeGpu(uuid="GPU-bbbb")
    fake = FakeNvml([a, b])
    app = start(node, device_source="nvml", nvml=fake, resync=3600)
    wait_until(lambda: own_slices(admin_client, node), what="the slice")
    b.lost = True
    # The publisher counts a write once the API server has answered it, so the taint can be seen
    # there a moment before it is counted: wait for both (the first publish, then the taint's).
    wait_until(
        lambda: (
            _taints(admin_client, node) == {"gpu-1": [(KEY, "gpu-lost", "NoSchedule")]} and app.publisher.publishes == 2
        ),
        timeout=20,
        what="gpu-1 tainted and the write counted",
    )
    publishes = app.publisher.publishes
    app.publisher.trigger()  # rediscovery: nvmlDeviceGetMemoryInfo of gpu-1 fails
    time.sleep(1.5)
    assert app.fatal is None
    assert app.publisher.publishes == publishes  # same devices, same taint: nothing to write
    assert [d["name"] for d in own_slices(admin_client, node)[0]["spec"]["devices"]] == ["gpu-0", "gpu-1"]


def test_simulated_health_file_taints_and_recovers(start, node, dirs, admin_client):
    app = start(node, num_devices=2, resync=3600, health_poll=0.2)
    wait_until(lambda: own_slices(admin_client, node), what="the slice")
    health_dir = dirs.plugins / DRIVER / "health"
    channel = grpc.insecure_channel(f"unix://{dirs.dra_socket}")
    try:
        stream = health_v1_grpc.DRAResourceHealthStub(channel).NodeWatchResources(health_v1.NodeWatchResourcesRequest())
        first = next(stream)
        assert {d.device.device_name: d.health for d in first.devices} == {"gpu-0": 1, "gpu-1": 1}
        (health_dir / "gpu-0").write_text("unhealthy: fan failure")
        wait_until(lambda: _taints(admin_client, node) == {"gpu-0": [(KEY, "simulated", "NoSchedule")]}, what="tainted")
        sick = next(stream)
        assert {d.device.device_name: (d.health, d.message) for d in sick.devices}["gpu-0"] == (2, "fan failure")
        port = app.metrics_port
        assert metric(port, "otel_dra_plugin_device_health", device_name="gpu-0", health="Unhealthy") == 1
        assert metric(port, "otel_dra_plugin_device_health", device_name="gpu-0", health="Healthy") == 0
        assert metric(port, "otel_dra_plugin_device_health", device_name="gpu-1", health="Healthy") == 1
        assert metric(port, "otel_dra_plugin_health_streams") == 1
        assert metric(port, "otel_dra_plugin_prepared_devices") == 0
        (health_dir / "gpu-0").unlink()
        wait_until(lambda: _taints(admin_client, node) == {}, what="taint removed")
        assert {d.device.device_name: d.health for d in next(stream).devices} == {"gpu-0": 1, "gpu-1": 1}
        stream.cancel()
        wait_until(lambda: metric(app.metrics_port, "otel_dra_plugin_health_streams") == 0, what="stream closed")
    finally:
        channel.close()
    assert app.server.health.opened == 1


def test_no_taints_when_switched_off(start, node, dirs, admin_client):
    app = start(node, num_devices=1, resync=3600, health_poll=0.2, unhealthy_device_taint="none")
    wait_until(lambda: own_slices(admin_client, node), what="the slice")
    (dirs.plugins / DRIVER / "health" / "gpu-0").write_text("")
    wait_until(lambda: app.device_health.get("gpu-0").health == 2, what="gpu-0 unhealthy")
    publishes = app.publisher.publishes
    time.sleep(1.5)  # the health change triggered a reconcile: it must find nothing to write
    assert app.publisher.publishes == publishes
    assert _taints(admin_client, node) == {}


# --- spans: RPC semantic conventions, the claim's pods ---------------------------------------------

kubelet = test_plugin.kubelet
namespace = test_plugin.namespace


def _reserved_claim(admin_client, namespace: str, name: str, node: str, pods: list[tuple[str, str]]):
    claim = make_claim(admin_client, namespace, name, [result(node, "gpu-0")])
    claim["status"]["reservedFor"] = [{"resource": "pods", "name": n, "uid": u} for n, u in pods]
    return admin_client.send_json("PUT", f"{CLAIMS.format(ns=namespace)}/{name}/status", claim)


@pytest.mark.parametrize("opt_in", ["", "http,rpc/dup"])
def test_rpc_span_semconv_and_the_claims_pods(start, kubelet, node, namespace, admin_client, monkeypatch, opt_in):
    from opentelemetry.trace import SpanKind

    monkeypatch.setenv("OTEL_SEMCONV_STABILITY_OPT_IN", opt_in)
    app = start(node, num_devices=1, resync=3600)
    one = _reserved_claim(admin_client, namespace, f"one-{node}", node, [("web-0", "uid-web-0")])
    two = _reserved_claim(admin_client, namespace, f"two-{node}", node, [("a", "uid-a"), ("b", "uid-b")])
    response = kubelet.prepare([ref(one), ref(two)])
    assert all(c.error == "" for c in response.claims.values())
    app.flush_spans()
    spans = list(app.spans.get_finished_spans())
    (rpc,) = [s for s in spans if s.kind == SpanKind.SERVER]
    expected = {
        "rpc.system.name": "grpc",
        "rpc.method": "k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/NodePrepareResources",
        "rpc.response.status_code": "OK",
        "dra.claim.count": 2,
        "dra.claim.errors": 0,
    }
    if opt_in:  # rpc/dup: the v1.37.0 attributes too
        expected |= {
            "rpc.system": "grpc",
            "rpc.service": "k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin",
            "rpc.grpc.status_code": 0,
            "network.transport": "unix",
        }
    assert dict(rpc.attributes) == expected
    claims = {s.attributes["dra.claim.name"]: s.attributes for s in spans if s.name == "prepare claim"}
    single = claims[f"one-{node}"]
    assert (single["k8s.pod.name"], single["k8s.pod.uid"]) == ("web-0", "uid-web-0")
    assert single["k8s.namespace.name"] == namespace
    shared = claims[f"two-{node}"]
    assert "k8s.pod.name" not in shared  # two consumers: only the arrays
    assert (shared["dra.claim.pod.names"], shared["dra.claim.pod.uids"]) == (("a", "b"), ("uid-a", "uid-b"))
