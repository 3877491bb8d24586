"""The device status writer's parts that need no API server: the entries and the applied object,
the API's limits, the coalescing queue, and retries against an address where nothing listens
(otel_dra/plugin/devicestatus.py; against the real API server: tests/integration/test_plugin_device_status.py)."""

from __future__ import annotations

import json
import logging
import socket
import time

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import NoOpTracerProvider, SpanKind, StatusCode

from otel_dra.kube.client import ApiError, Credentials, KubeClient
from otel_dra.kube.timestamps import format_time
from otel_dra.plugin import devicestatus as ds
from otel_dra.plugin.checkpoint import PreparedDevice
from otel_dra.plugin.metrics import PluginMetrics
from otel_dra.plugin.state import ClaimRef
from otel_dra.telemetry.traceids import trace_id_of

DRIVER = "gpu.example.com"
NODE = "node-a"
UID = "0f9a6c1e-3b1d-4c55-9a57-5a1e2f3b4c5d"
REF = ClaimRef("team-a", UID, "claim-a")


def device(name: str, share_id: str = "") -> PreparedDevice:
    return PreparedDevice(("gpu",), NODE, name, (f"k8s.{DRIVER}/gpu={name}",), share_id=share_id)


# --- the entries and the applied object ---------------------------------------------------------


def test_field_manager_is_the_driver_and_node_within_the_apis_limit():
    assert ds.field_manager(DRIVER, NODE) == "gpu.example.com/node-a"
    long_a, long_b = "n" * 252 + "a", "n" * 252 + "b"  # node names may have 253 characters
    a, b = ds.field_manager(DRIVER, long_a), ds.field_manager(DRIVER, long_b)
    assert len(a.encode()) == ds.FIELD_MANAGER_MAX and a.isprintable()
    assert a.startswith("gpu.example.com/nnn") and a != b  # cut, but still one per node
    assert ds.field_manager(DRIVER, long_a) == a  # the same after a restart
    exactly = "n" * (ds.FIELD_MANAGER_MAX - len(DRIVER) - 1)
    assert ds.field_manager(DRIVER, exactly) == f"{DRIVER}/{exactly}"


def test_entry_has_the_key_a_ready_condition_and_the_devices_data():
    entry = ds.device_entry(
        DRIVER,
        device("nic-0", share_id="7d0c5c1e-3b1d-4c55-9a57-5a1e2f3b4c5d"),
        data={"uuid": "nic-0-uuid"},
        network_data={"interfaceName": "eth1", "ips": ["192.0.2.5/24"]},
        message="prepared by gpu.example.com on node node-a",
        transition_time=format_time(1_790_000_000.7),
        generation=3,
    )
    assert entry == {
        "driver": DRIVER,
        "pool": NODE,
        "device": "nic-0",
        "shareID": "7d0c5c1e-3b1d-4c55-9a57-5a1e2f3b4c5d",
        "conditions": [
            {
                "type": "Ready",
                "status": "True",
                "reason": "Prepared",
                "message": "prepared by gpu.example.com on node node-a",
                "lastTransitionTime": "2026-09-21T14:13:20Z",
                "observedGeneration": 3,
            }
        ],
        "data": {"uuid": "nic-0-uuid"},
        "networkData": {"interfaceName": "eth1", "ips": ["192.0.2.5/24"]},
    }
    # No share, no data, no generation: those keys are absent (the API's omitempty), not empty.
    bare = ds.device_entry(
        DRIVER, device("gpu-0"), data=None, network_data=None, message="m", transition_time="t", generation=None
    )
    assert set(bare) == {"driver", "pool", "device", "conditions"}
    assert "observedGeneration" not in bare["conditions"][0]
    body = ds.apply_body(REF, [bare])
    assert body == {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": "claim-a", "namespace": "team-a", "uid": UID},
        "status": {"devices": [bare]},
    }
    assert ds.apply_body(REF, [])["status"] == {"devices": []}  # a clear: this manager wants none


def test_data_is_a_json_object_of_at_most_10_kib():
    assert ds.checked_data(None) is None
    assert ds.checked_data({"uuid": "x"}) == {"uuid": "x"}
    overhead = len(json.dumps({"k": ""}, separators=(",", ":")))
    assert ds.checked_data({"k": "x" * (10 * 1024 - overhead)}) is not None  # exactly 10 KiB
    with pytest.raises(ds.InvalidDeviceData, match="10241 bytes"):
        ds.checked_data({"k": "x" * (10 * 1024 - overhead + 1)})
    with pytest.raises(ds.InvalidDeviceData, match="not a JSON object"):
        ds.checked_data(["uuid"])  # type: ignore[arg-type]
    with pytest.raises(ds.InvalidDeviceData, match="not JSON"):
        ds.checked_data({"k": object()})


@pytest.mark.parametrize(
    ("network", "message"),
    [
        ({"interfaceName": "e" * 257}, "interfaceName"),
        ({"hardwareAddress": "a" * 129}, "hardwareAddress"),
        ({"ips": ["192.0.2.5"]}, "CIDR"),
        ({"ips": ["192.0.2.300/24"]}, "192.0.2.300"),
        ({"ips": ["192.0.2.5/24", "192.0.2.5/24"]}, "distinct"),
        ({"ips": [f"192.0.2.{i}/24" for i in range(17)]}, "at most 16"),
        ({"ips": "192.0.2.5/24"}, "list"),
        ({"mtu": 9000}, "unknown fields"),
        ("eth0", "not an object"),
    ],
)
def test_network_data_outside_the_apis_limits_is_refused(network, message):
    with pytest.raises(ds.InvalidDeviceData, match=message):
        ds.checked_network_data(network)


def test_network_data_within_the_limits_keeps_what_is_set():
    full = {"interfaceName": "e" * 256, "hardwareAddress": "a" * 128, "ips": ["192.0.2.5/24", "2001:db8::5/64"]}
    assert ds.checked_network_data(full) == full
    assert ds.checked_network_data({"interfaceName": "eth1", "ips": []}) == {"interfaceName": "eth1"}
    assert ds.checked_network_data({}) is None


def test_uid_conflict_is_the_api_servers_answer_to_another_uid():
    # The body kube-apiserver 1.37 sends for an apply to a re-created claim (integration test).
    body = json.dumps(
        {
            "kind": "Status",
            "code": 422,
            "reason": "Invalid",
            "message": 'ResourceClaim.resource.k8s.io "a" is invalid: metadata.uid: Invalid value: "x": field is immutable',
            "details": {"causes": [{"reason": "FieldValueInvalid", "field": "metadata.uid"}]},
        }
    )
    assert ds.uid_conflict(ApiError(422, "Unprocessable Entity", body))
    other = body.replace('"metadata.uid"', '"status.devices[0]"')
    assert not ds.uid_conflict(ApiError(422, "Unprocessable Entity", other))
    assert not ds.uid_conflict(ApiError(422, "Unprocessable Entity", "not json"))
    assert ds.uid_conflict(ApiError(409, "Conflict", json.dumps({"message": "uid mismatch: the provided ..."})))
    assert not ds.uid_conflict(ApiError(409, "Conflict", json.dumps({"message": "the object has been modified"})))
    assert not ds.uid_conflict(ApiError(404, "Not Found"))


def test_what_a_restart_compares():
    wanted = ds.device_entry(
        DRIVER, device("gpu-0"), data={"uuid": "u"}, network_data=None, message="m", transition_time="t1", generation=1
    )
    stored = json.loads(json.dumps(wanted))
    stored["conditions"][0]["lastTransitionTime"] = "t0"  # time is not compared
    stored["conditions"].append({"type": "Attached", "status": "True"})  # another writer's condition
    other = {"driver": "nic.example.com", "pool": NODE, "device": "nic-0"}
    claim = {
        "metadata": {
            "managedFields": [
                {"manager": "gpu.example.com/node-a", "operation": "Apply", "subresource": "status"},
                {"manager": "kube-scheduler", "operation": "Update", "subresource": "status"},
            ]
        },
        "status": {"devices": [other, stored]},
    }
    present = ds.current_entries(claim, [ds.device_key(wanted)])
    assert list(present) == [(DRIVER, NODE, "gpu-0", "")]
    assert ds._comparable(present[ds.device_key(wanted)]) == ds._comparable(wanted)
    assert ds.ready_since(stored) == "t0"
    assert ds.applied_by(claim, "gpu.example.com/node-a")
    assert not ds.applied_by(claim, "gpu.example.com/node-b")
    assert not ds.applied_by(claim, "kube-scheduler")  # an update, not an apply
    changed = json.loads(json.dumps(stored))
    changed["data"] = {"uuid": "v"}
    assert ds._comparable(changed) != ds._comparable(wanted)
    assert ds.ready_since({"conditions": [{"type": "Ready", "status": "False", "lastTransitionTime": "t"}]}) is None


# --- the queue ----------------------------------------------------------------------------------


def _closed_port() -> int:
    """A loopback port where nothing listens: every request fails with "connection refused"."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _writer(
    reader: InMemoryMetricReader,
    tracer_provider=None,
    device_data=lambda name: ({"uuid": f"{name}-uuid"}, None),
    backoff=(0.01, 0.05),
) -> ds.DeviceStatusWriter:
    creds = Credentials(
        host=f"http://127.0.0.1:{_closed_port()}",
        source="test",
        ca_file=None,
        cert_file=None,
        key_file=None,
        verify=True,
        tls_server_name=None,
        auth_headers=dict,
    )
    return ds.DeviceStatusWriter(
        KubeClient(creds),
        driver_name=DRIVER,
        node_name=NODE,
        device_data=device_data,
        metrics=PluginMetrics(MeterProvider(metric_readers=[reader])),
        tracer_provider=tracer_provider or NoOpTracerProvider(),
        api_timeout=(1.0, 1.0),
        backoff=backoff,
    )


def _writes(reader: InMemoryMetricReader) -> dict[tuple[str, str], float]:
    data = reader.get_metrics_data()
    out: dict[tuple[str, str], float] = {}
    for rm in data.resource_metrics if data else ():
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                if m.name == "otel_dra_plugin_device_status_writes":
                    for p in m.data.data_points:
                        out[(p.attributes["operation"], p.attributes["result"])] = p.value
    return out


def test_one_pending_state_per_claim_the_newest():
    w = _writer(InMemoryMetricReader())  # not started: what waits is all there is
    other = ClaimRef("team-a", "1b2c3d4e-0000-4000-8000-000000000000", "claim-b")
    for i in range(500):
        w.prepared(REF, [device(f"gpu-{i % 4}")], generation=i)
        w.prepared(other, [device("gpu-7")])
    assert w.pending == 2  # bounded by the claims, not by the calls
    assert w._pending[REF.uid].devices == (device("gpu-3"),)
    assert w._pending[REF.uid].generation == 499
    w.prepared(REF, [device("gpu-3")])  # a repeat without a generation keeps the one known
    assert w._pending[REF.uid].generation == 499
    w.unprepared(REF)  # a clear replaces the apply that was not written yet
    assert w.pending == 2 and w._pending[REF.uid].devices is None
    assert list(w._pending) == [other.uid, REF.uid]  # oldest first
    w.stop()


def test_a_state_written_since_the_start_is_not_queued_again():
    w = _writer(InMemoryMetricReader())
    w._written[REF.uid] = ds._Want(REF, (device("gpu-0"),), None, 0.0, False).fingerprint()
    w.prepared(REF, [device("gpu-0")])  # the kubelet's repeated prepare
    assert w.pending == 0
    w.prepared(REF, [device("gpu-1")])  # another state is written
    assert w.pending == 1
    w.unprepared(REF)
    assert w.pending == 1
    w.stop()


def test_failures_are_retried_with_backoff_logged_once_and_counted(caplog):
    reader = InMemoryMetricReader()
    spans = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(spans))
    w = _writer(reader, provider).start()
    assert _writes(reader) == {(op, r): 0 for op in ("apply", "clear") for r in ("success", "error")}
    with caplog.at_level(logging.DEBUG, logger="otel_dra.plugin.devicestatus"):
        started = time.monotonic()
        w.prepared(REF, [device("gpu-0")], generation=2)
        assert time.monotonic() - started < 0.01  # the caller never waits for the API server
        deadline = time.monotonic() + 10
        while _writes(reader).get(("apply", "error"), 0) < 4 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert _writes(reader)[("apply", "error")] >= 4
        assert w.pending == 1  # kept until written or replaced: nothing is lost
        w.prepared(REF, [device("gpu-1")])  # replaced while failing: still one
        assert w.pending == 1
        w.stop(timeout=2)
    assert not w._thread.is_alive()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len([m for m in warnings if "retrying with backoff" in m]) == 1, warnings
    assert "claim team-a/claim-a" in warnings[0] and "Connection refused" in warnings[0]
    assert any("not written" in m and UID in m for m in warnings)  # the stop says what is left
    # Each attempt is a CLIENT span in the claim's trace; the retries say which resend they are.
    made = [s for s in spans.get_finished_spans() if s.name.startswith("PATCH ")]
    assert len(made) >= 4
    assert {s.context.trace_id for s in made} == {trace_id_of(UID)}
    first = made[0]
    assert first.name == "PATCH /apis/resource.k8s.io/v1/namespaces/{namespace}/resourceclaims/{name}/status"
    assert first.kind is SpanKind.CLIENT and first.status.status_code is StatusCode.ERROR
    assert first.attributes["http.request.method"] == "PATCH"
    assert first.attributes["url.full"].endswith(
        "/namespaces/team-a/resourceclaims/claim-a/status?fieldManager=gpu.example.com%2Fnode-a&force=true"
    )
    assert first.attributes["error.type"] == "NewConnectionError"  # no answer: the transport error
    assert first.attributes["dra.device_status.operation"] == "apply"
    assert first.attributes["dra.devices"] == ("gpu-0",)
    assert "http.request.resend_count" not in first.attributes
    assert made[1].attributes["http.request.resend_count"] == 1
    provider.shutdown()


def test_backoff_grows_to_its_longest_and_honours_retry_after():
    w = _writer(InMemoryMetricReader(), backoff=(0.5, 60.0))
    assert 0.25 <= w._delay(1) <= 0.5
    assert 2.0 <= w._delay(4) <= 4.0
    assert 30.0 <= w._delay(20) <= 60.0
    assert w._delay(1, retry_after=7.0) == 7.0
    assert w._delay(1, retry_after=600.0) == 60.0
    w.stop()


def test_device_data_the_api_would_refuse_is_left_out_once(caplog):
    def data(name: str):
        if name == "bad":
            return {"k": "x" * 20_000}, {"ips": ["not-an-ip"]}
        if name == "broken":
            raise RuntimeError("no such device handle")
        return {"uuid": "ok"}, None

    w = _writer(InMemoryMetricReader(), device_data=data)
    want = ds._Want(REF, (device("bad"), device("broken"), device("good")), 4, 1_790_000_000.0, False)
    with caplog.at_level(logging.WARNING, logger="otel_dra.plugin.devicestatus"):
        for _ in range(3):
            entries = w._entries(want, 4, None)
    bad, broken, good = entries
    assert "data" not in bad and "networkData" not in bad and bad["conditions"][0]["status"] == "True"
    assert "data" not in broken
    assert good["data"] == {"uuid": "ok"}
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 3, messages  # data, networkData, the failing lookup: each said once
    assert any("device bad: data is 20008 bytes" in m for m in messages)
    w.stop()


def test_no_write_starts_while_a_call_runs(monkeypatch):
    monkeypatch.setattr(ds, "MAX_DEFER_S", 0.3)
    reader = InMemoryMetricReader()
    w = _writer(reader, backoff=(5.0, 5.0)).start()  # one attempt per claim within the test

    def attempts() -> float:
        return sum(v for (_, result), v in _writes(reader).items() if result == "error")

    with w.call():
        w.prepared(REF, [device("gpu-0")])
        time.sleep(0.1)
        assert attempts() == 0  # held back while the kubelet waits for the call
    deadline = time.monotonic() + 5
    while attempts() < 1 and time.monotonic() < deadline:
        time.sleep(0.005)
    assert attempts() == 1  # after the call, SETTLE_S later
    # A node whose calls never pause: a write waits at most MAX_DEFER_S.
    other = ClaimRef("team-a", "1b2c3d4e-0000-4000-8000-000000000000", "claim-b")
    with w.call():
        started = time.monotonic()
        w.prepared(other, [device("gpu-1")])
        while attempts() < 2 and time.monotonic() < deadline:
            time.sleep(0.005)
        assert attempts() == 2 and 0.25 <= time.monotonic() - started < 2.0
    w.stop(timeout=0.5)
