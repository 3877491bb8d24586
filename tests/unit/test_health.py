"""Device health (otel_dra/plugin/health.py): the DRAResourceHealth stream through a real gRPC
channel on a unix socket, as the kubelet opens it, the simulated health directory and the taints."""

from __future__ import annotations

import shutil
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from otel_dra._generated.dra.v1 import api_pb2 as dra_v1
from otel_dra._generated.dra.v1 import api_pb2_grpc as dra_v1_grpc
from otel_dra._generated.drahealth.v1 import api_pb2 as health_v1
from otel_dra._generated.drahealth.v1 import api_pb2_grpc as health_v1_grpc
from otel_dra._generated.drahealth.v1alpha1 import api_pb2 as health_v1alpha1
from otel_dra._generated.drahealth.v1alpha1 import api_pb2_grpc as health_v1alpha1_grpc
from otel_dra._generated.pluginregistration import api_pb2 as reg_pb2
from otel_dra._generated.pluginregistration import api_pb2_grpc as reg_grpc
from otel_dra.plugin.health import (
    MAX_MESSAGE,
    DeviceTaints,
    Health,
    HealthState,
    HealthStreams,
    SimulatedHealth,
    parse_health_file,
    taint_value,
)
from otel_dra.plugin.server import PluginServer
from tests.helpers import wait_until

POOL = "node-a"
STUBS = {"v1": (health_v1, health_v1_grpc), "v1alpha1": (health_v1alpha1, health_v1alpha1_grpc)}


@pytest.fixture
def short_dir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="health-", dir="/tmp"))  # unix socket paths are short
    yield path
    shutil.rmtree(path, ignore_errors=True)


class Served:
    """A PluginServer with health streams, on real sockets; ``watch`` opens a kubelet-like stream."""

    def __init__(self, dir: Path, state: HealthState, **streams: object) -> None:
        from tests.unit.test_plugin_parts import _driver

        self.streams = HealthStreams(state, POOL, **streams)  # type: ignore[arg-type]
        self.server = PluginServer(
            _driver(dir),
            driver_name="gpu.example.com",
            plugins_dir=dir / "plugins",
            registrar_dir=dir / "registry",
            max_workers=1,
            health=self.streams,
        ).start()
        self.channel = grpc.insecure_channel(f"unix://{self.server.dra_socket}")

    def watch(self, version: str = "v1") -> grpc.Future:
        pb2, pb2_grpc = STUBS[version]
        return pb2_grpc.DRAResourceHealthStub(self.channel).NodeWatchResources(pb2.NodeWatchResourcesRequest())

    def close(self) -> None:
        self.channel.close()
        self.server.stop(grace=1)


@pytest.fixture
def served(short_dir: Path) -> Iterator[tuple[Served, HealthState]]:
    state = HealthState()
    state.set_devices(["gpu-0", "gpu-1"])
    s = Served(short_dir, state, refresh_seconds=30)
    yield s, state
    s.close()


def _health(response) -> dict[str, tuple[int, str]]:
    return {d.device.device_name: (d.health, d.message) for d in response.devices}


def _next(stream, timeout: float = 5.0):
    """The next message of a stream, or fail after ``timeout`` (a stream iterator blocks)."""
    box: list[object] = []
    thread = threading.Thread(target=lambda: box.append(next(stream, None)), daemon=True)
    thread.start()
    thread.join(timeout)
    assert box, f"no message within {timeout}s"
    return box[0]


@pytest.mark.parametrize("version", ["v1", "v1alpha1"])
def test_stream_sends_the_full_state_then_each_change(served, version):
    s, state = served
    stream = s.watch(version)
    first = _next(stream)
    assert _health(first) == {"gpu-0": (Health.HEALTHY, ""), "gpu-1": (Health.HEALTHY, "")}
    for d in first.devices:
        assert d.device.pool_name == POOL
        assert d.health_check_timeout_seconds == 30
        assert abs(d.last_updated_time - time.time()) < 5
    started = time.monotonic()
    state.report("gpu-1", Health.UNHEALTHY, "XID 79: fallen off the bus", "xid-79")
    second = _next(stream)
    assert time.monotonic() - started < 2  # a change is sent at once, not at the 10 s refresh
    assert _health(second) == {"gpu-0": (Health.HEALTHY, ""), "gpu-1": (Health.UNHEALTHY, "XID 79: fallen off the bus")}
    state.report("gpu-1", Health.HEALTHY)
    assert _health(_next(stream))["gpu-1"] == (Health.HEALTHY, "")
    stream.cancel()


def test_registration_advertises_both_health_versions_v1_first(served):
    s, _ = served
    with grpc.insecure_channel(f"unix://{s.server.registration_socket}") as channel:
        info = reg_grpc.RegistrationStub(channel).GetInfo(reg_pb2.InfoRequest())
    assert list(info.supported_versions) == [
        "v1.DRAPlugin",
        "v1beta1.DRAPlugin",
        "v1.DRAResourceHealth",
        "v1alpha1.DRAResourceHealth",
    ]


def test_refresh_within_the_timeout_without_changes(short_dir):
    state = HealthState()
    state.set_devices(["gpu-0"])
    s = Served(short_dir, state, timeout_seconds=3)  # refresh at 1 s
    try:
        stream = s.watch()
        _next(stream)
        started = time.monotonic()
        _next(stream, timeout=3)
        _next(stream, timeout=3)
        elapsed = time.monotonic() - started
        assert 1.5 < elapsed < 3, elapsed  # two refreshes, one a second, well inside the 3 s timeout
        stream.cancel()
    finally:
        s.close()


def test_several_streams_cancel_and_a_new_one_replacing_the_oldest(short_dir):
    state = HealthState()
    state.set_devices(["gpu-0"])
    s = Served(short_dir, state, refresh_seconds=30, max_streams=2)
    try:
        a, b = s.watch(), s.watch("v1alpha1")
        _next(a), _next(b)
        assert s.streams.active == 2
        state.report("gpu-0", Health.UNKNOWN, "lost track")
        assert _health(_next(a)) == _health(_next(b)) == {"gpu-0": (Health.UNKNOWN, "lost track")}
        b.cancel()  # the kubelet's context ends (deregistration, shutdown)
        wait_until(lambda: s.streams.active == 1, timeout=5, what="the cancelled stream to end")
        c, d = s.watch(), s.watch()  # e.g. a restarted kubelet, while the old stream lingers
        _next(c), _next(d)
        assert _next(a) is None  # the oldest ended, cleanly: the kubelet reads EOF
        assert a.code() == grpc.StatusCode.OK
        assert s.streams.active == 2
        # Health streams hold their own threads: prepare/unprepare (max_workers=1) still answer.
        dra = dra_v1_grpc.DRAPluginStub(s.channel)
        started = time.monotonic()
        dra.NodePrepareResources(dra_v1.NodePrepareResourcesRequest(), timeout=5)
        assert time.monotonic() - started < 1
        c.cancel(), d.cancel()
    finally:
        s.close()


def test_stopping_the_plugin_ends_streams_cleanly(short_dir):
    state = HealthState()
    state.set_devices(["gpu-0"])
    s = Served(short_dir, state, refresh_seconds=30)
    stream = s.watch()
    _next(stream)
    started = time.monotonic()
    s.server.stop(grace=1)
    try:
        assert time.monotonic() - started < 3
        assert _next(stream) is None
        assert stream.code() == grpc.StatusCode.OK  # EOF for the kubelet, not "Error receiving"
    finally:
        s.channel.close()


def test_state_keeps_since_and_bounds_messages():
    now = [1000.0]
    state = HealthState(clock=lambda: now[0])
    state.set_devices(["gpu-0"])
    calls = []
    state.add_listener(lambda: calls.append(1))
    assert state.report("gpu-0", Health.UNHEALTHY, "x" * 5000, "xid-79")
    entry = state.get("gpu-0")
    assert entry is not None and len(entry.message) == MAX_MESSAGE and entry.since == 1000.0
    now[0] = 1010.0
    assert not state.report("gpu-0", Health.UNHEALTHY, "x" * 5000, "xid-79")  # same: no change
    assert state.get("gpu-0").checked == 1010.0 and state.get("gpu-0").since == 1000.0
    assert state.report("gpu-0", Health.UNHEALTHY, "other message", "xid-79")  # message: a change
    assert state.get("gpu-0").since == 1000.0  # still unhealthy since the first report
    assert not state.report("gpu-9", Health.UNHEALTHY)  # not a device of this node
    assert len(calls) == 2
    state.set_devices(["gpu-0", "gpu-1"])
    assert state.get("gpu-1").health == Health.HEALTHY and len(calls) == 3


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("", (Health.UNHEALTHY, "")),
        ("unhealthy: ECC storm\n", (Health.UNHEALTHY, "ECC storm")),
        ("Unknown:lost", (Health.UNKNOWN, "lost")),
        ("healthy", (Health.HEALTHY, "")),
    ],
)
def test_health_file_forms(text, expected):
    assert parse_health_file(text) == expected


def test_health_file_with_a_bad_word_is_refused():
    with pytest.raises(ValueError, match="'sick', not one of healthy, unhealthy, unknown"):
        parse_health_file("sick: very")


def test_simulated_health_directory(tmp_path, caplog):
    state = HealthState()
    state.set_devices(["gpu-0", "gpu-1"])
    source = SimulatedHealth(state, tmp_path / "health", poll_seconds=3600)
    source.start()
    try:
        (source.directory / "gpu-1").write_text("unhealthy: fan failure\n")
        (source.directory / "gpu-7").write_text("")
        source.poll()
        assert state.get("gpu-1").health == Health.UNHEALTHY
        assert state.get("gpu-1").message == "fan failure" and state.get("gpu-1").reason == "simulated"
        assert "no device gpu-7 on this node" in caplog.text
        (source.directory / "gpu-0").write_text("")
        (source.directory / "gpu-1").write_text("sick")
        source.poll()
        assert state.get("gpu-0").message == f"marked unhealthy in {source.directory / 'gpu-0'}"
        assert state.get("gpu-1").message == "fan failure"  # a bad file changes nothing ...
        assert "'sick', not one of healthy" in caplog.text  # ... and says why
        (source.directory / "gpu-0").unlink()
        (source.directory / "gpu-1").unlink()
        source.poll()
        assert {e.device: e.health for e in state.snapshot()} == {"gpu-0": Health.HEALTHY, "gpu-1": Health.HEALTHY}
    finally:
        source.stop()


def test_a_poll_that_finds_nothing_new_refreshes_every_devices_checked_time(tmp_path):
    """The stream's last_updated_time: every device's checked time moves with each poll, sick or
    not, without the poll rewriting each device's entry."""
    now = [1000.0]
    state = HealthState(clock=lambda: now[0])
    state.set_devices(["gpu-0", "gpu-1", "gpu-2"])
    source = SimulatedHealth(state, tmp_path / "health", poll_seconds=3600)
    source.directory.mkdir()
    (source.directory / "gpu-2").write_text("unknown: no answer\n")
    now[0] = 1005.0
    source.poll()
    now[0] = 1010.0
    source.poll()
    assert {e.device: (e.health, e.checked) for e in state.snapshot()} == {
        "gpu-0": (Health.HEALTHY, 1010.0),
        "gpu-1": (Health.HEALTHY, 1010.0),
        "gpu-2": (Health.UNKNOWN, 1010.0),
    }
    assert state.get("gpu-2").since == 1005.0 and state.get("gpu-0").checked == 1010.0
    (source.directory / "gpu-2").unlink()
    now[0] = 1020.0
    source.poll()
    assert state.get("gpu-2").health == Health.HEALTHY and state.get("gpu-2").since == 1020.0
    streams = HealthStreams(state, "node-a")
    assert {d.last_updated_time for d in streams.response(health_v1).devices} == {1020}


def test_taints_of_unhealthy_devices_only():
    state = HealthState(clock=lambda: 1767225600.0)  # 2026-01-01T00:00:00Z
    state.set_devices(["gpu-0", "gpu-1", "gpu-2"])
    state.report("gpu-1", Health.UNHEALTHY, "XID 79", "xid-79")
    state.report("gpu-2", Health.UNKNOWN, "no answer")
    assert DeviceTaints(state, "gpu.example.com")() == {
        "gpu-1": [
            {
                "key": "gpu.example.com/unhealthy",
                "value": "xid-79",
                "effect": "NoSchedule",
                "timeAdded": "2026-01-01T00:00:00Z",
            }
        ]
    }
    assert DeviceTaints(state, "gpu.example.com", "NoExecute")()["gpu-1"][0]["effect"] == "NoExecute"
    with pytest.raises(ValueError, match="NoSchedule, NoExecute"):
        DeviceTaints(state, "gpu.example.com", "None")
    assert taint_value("double bit ECC!") == "double-bit-ECC"
    assert len(taint_value("x" * 100)) == 63
    assert taint_value("") == "unhealthy"


# --- NVML events (tests/unit/fake_nvml.py) -------------------------------------------------------


def _nvml_health(gpus):
    from otel_dra.plugin import nvml as nvml_discovery
    from otel_dra.plugin.nvml_health import NvmlHealth
    from tests.unit.fake_nvml import FakeNvml

    fake = FakeNvml(gpus)
    state = HealthState()
    state.set_devices([d.name for d in nvml_discovery.discover(fake)])
    return fake, state, NvmlHealth(state, fake, wait_ms=50)


def test_nvml_critical_xid_and_double_bit_ecc_make_a_gpu_unhealthy():
    import pynvml

    from tests.unit.fake_nvml import FakeGpu

    a, b = FakeGpu(uuid="GPU-aaaa"), FakeGpu(uuid="GPU-bbbb")
    fake, state, monitor = _nvml_health([a, b])
    monitor.start()
    try:
        assert fake.registered == {id(a): 0xA, id(b): 0xA}  # XID critical | double-bit ECC
        fake.inject(a, pynvml.nvmlEventTypeXidCriticalError, 13)  # an application's fault: ignored
        fake.inject(b, pynvml.nvmlEventTypeXidCriticalError, 79)  # fallen off the bus
        wait_until(lambda: state.get("gpu-1").health == Health.UNHEALTHY, timeout=5, what="gpu-1 unhealthy")
        assert state.get("gpu-1").message == "critical XID 79 reported by NVML on GPU GPU-bbbb"
        assert state.get("gpu-1").reason == "xid-79"
        assert state.get("gpu-0").health == Health.HEALTHY
        fake.inject(a, pynvml.nvmlEventTypeDoubleBitEccError)
        wait_until(lambda: state.get("gpu-0").health == Health.UNHEALTHY, timeout=5, what="gpu-0 unhealthy")
        assert state.get("gpu-0").reason == "ecc-double-bit"
    finally:
        monitor.stop()
    assert fake.init_count == 0  # every nvmlInit has its nvmlShutdown


def test_nvml_lost_gpu_and_a_gpu_without_events():
    from tests.unit.fake_nvml import FakeGpu

    a, b = FakeGpu(uuid="GPU-aaaa", supported_events=0), FakeGpu(uuid="GPU-bbbb")
    fake, state, monitor = _nvml_health([a, b])
    monitor.start()
    try:
        assert id(a) not in fake.registered  # NotSupported: only the probe watches it
        a.lost = True
        wait_until(lambda: state.get("gpu-0").health == Health.UNHEALTHY, timeout=5, what="gpu-0 lost")
        assert state.get("gpu-0").reason == "gpu-lost" and "GPU GPU-aaaa is lost" in state.get("gpu-0").message
        assert state.get("gpu-1").health == Health.HEALTHY
    finally:
        monitor.stop()


def test_nvml_mig_events_name_their_mig_device_or_all_of_the_gpu():
    import pynvml

    from tests.unit.fake_nvml import FakeGpu

    gpu = FakeGpu(mig_enabled=True, mig_devices=[(1, 0, 0), (2, 0, 0)])
    fake, state, monitor = _nvml_health([gpu])
    names = sorted(e.device for e in state.snapshot())
    assert names == ["gpu-0-mig-1-0", "gpu-0-mig-2-0"]
    monitor.start()
    try:
        fake.inject(gpu, pynvml.nvmlEventTypeXidCriticalError, 94, gi=2, ci=0)  # contained ECC error in one MIG
        wait_until(lambda: state.get("gpu-0-mig-2-0").health == Health.UNHEALTHY, timeout=5, what="one MIG device")
        assert state.get("gpu-0-mig-1-0").health == Health.HEALTHY
        fake.inject(gpu, pynvml.nvmlEventTypeXidCriticalError, 79)  # the whole GPU
        wait_until(lambda: state.get("gpu-0-mig-1-0").health == Health.UNHEALTHY, timeout=5, what="all MIG devices")
    finally:
        monitor.stop()


def test_nvml_health_check_command_output():
    """What `python -m otel_dra.plugin.nvml_health` prints on a GPU machine, here on the fake."""
    import io
    import json

    from otel_dra.plugin.nvml_health import check
    from tests.unit.fake_nvml import FakeGpu, FakeNvml

    fake = FakeNvml([FakeGpu(uuid="GPU-aaaa"), FakeGpu(uuid="GPU-bbbb")])
    out = io.StringIO()
    assert check(fake, 0.1, out) == 0
    report = json.loads(out.getvalue())
    assert [d["name"] for d in report["devices"]] == ["gpu-0", "gpu-1"]
    assert report["supported_event_types"] == {"GPU-aaaa": "0xb", "GPU-bbbb": "0xb"}
    assert report["health"]["gpu-1"] == {"health": "HEALTHY", "message": "", "reason": ""}
    assert fake.init_count == 0
