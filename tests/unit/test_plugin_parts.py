"""Unit tests of the plugin's parts that need no API server: devices, NVML mapping, CDI specs,
checkpoint, socket lock, metrics exposition, tracing configuration, retries, flags."""

from __future__ import annotations

import json
import shutil
import subprocess
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pynvml
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from otel_dra.cli import main
from otel_dra.kube.client import ApiError, Credentials, KubeClient, RequestRecord, RetryPolicy
from otel_dra.plugin import nvml as nvml_discovery
from otel_dra.plugin.cdi import CdiWriter
from otel_dra.plugin.checkpoint import Checkpoint, CheckpointError, PreparedClaim, PreparedDevice
from otel_dra.plugin.config import DEFAULT, configs_by_request, device_env, parse_gpu_config
from otel_dra.plugin.config import ConfigError as GpuConfigError
from otel_dra.plugin.devices import Device, semver, simulated_devices
from otel_dra.plugin.metrics import PluginMetrics
from otel_dra.plugin.server import AlreadyRunning, SocketLock
from otel_dra.plugin.slices import _comparable, slice_name
from otel_dra.telemetry.exposition import assemble
from otel_dra.telemetry.otlp import ConfigError
from otel_dra.telemetry.provider import build_metrics_pipeline
from otel_dra.telemetry.tracing import build_tracing_pipeline, sampler_from_env
from tests.helpers import parse_samples, wait_until
from tests.unit.fake_nvml import FakeGpu, FakeNvml

# --- devices -----------------------------------------------------------------------------------


def test_simulated_devices_match_the_example_driver():
    devices = simulated_devices("node-a", 3)
    assert [d.name for d in devices] == ["gpu-0", "gpu-1", "gpu-2"]
    api = devices[1].to_api()
    assert api["attributes"]["index"] == {"int": 1}
    assert api["attributes"]["model"] == {"string": "LATEST-GPU-MODEL"}
    assert api["attributes"]["driverVersion"] == {"version": "1.0.0"}
    assert api["capacity"] == {"memory": {"value": "80Gi"}, "compute": {"value": "100"}}
    uuid = api["attributes"]["uuid"]["string"]
    assert uuid.startswith("gpu-") and len(uuid) == 40
    # Deterministic per node, different across nodes and indexes.
    assert simulated_devices("node-a", 3)[1].to_api() == api
    assert simulated_devices("node-b", 3)[1].to_api()["attributes"]["uuid"] != {"string": uuid}
    assert len({d.to_api()["attributes"]["uuid"]["string"] for d in devices}) == 3


def test_semver_and_device_limits():
    assert semver("580.159.04") == "580.159.4"
    assert semver("9.0") == "9.0.0"
    assert semver("13") == "13.0.0"
    for bad in ("", "1.2.3.4", "v1.0", "1.x"):
        with pytest.raises(ValueError):
            semver(bad)
    with pytest.raises(ValueError, match="longer than 64"):
        Device("d", attributes={"x": {"string": "y" * 65}})
    with pytest.raises(ValueError, match="more than 32"):
        Device("d", attributes={f"a{i}": {"int": i} for i in range(20)}, capacity={f"c{i}": "1" for i in range(13)})


# --- NVML ----------------------------------------------------------------------------------------


def test_nvml_h200_full_gpu():
    fake = FakeNvml([FakeGpu()])
    (device,) = nvml_discovery.discover(fake)
    api = device.to_api()
    assert api["name"] == "gpu-0"
    assert api["attributes"] == {
        "type": {"string": "gpu"},
        "uuid": {"string": "GPU-4f3a2b1c-9d8e-7f6a-5b4c-3d2e1f0a9b8c"},
        "index": {"int": 0},
        "productName": {"string": "NVIDIA H200"},
        "brand": {"string": "Nvidia"},
        "architecture": {"string": "Hopper"},
        "cudaComputeCapability": {"version": "9.0.0"},
        "driverVersion": {"version": "580.159.4"},
        "cudaDriverVersion": {"version": "13.0.0"},
        "pcieBusID": {"string": "00000000:19:00.0"},
    }
    # memory in bytes; SMs and decoders from the full-GPU (7-slice) profile, as NVML reports them.
    assert api["capacity"] == {
        "memory": {"value": "150754820096"},
        "multiprocessors": {"value": "132"},
        "decoders": {"value": "7"},
    }
    assert fake.calls[0] == "nvmlInit" and fake.calls[-1] == "nvmlShutdown"
    assert "nvmlDeviceGetAttributes" not in fake.calls  # NotSupported on a full GPU anyway


def test_nvml_gpu_without_mig_has_no_mig_capacities():
    fake = FakeNvml([FakeGpu(mig_capable=False, name="NVIDIA L4", architecture=pynvml.NVML_DEVICE_ARCH_ADA)])
    (device,) = nvml_discovery.discover(fake)
    assert set(device.capacity) == {"memory"}
    assert device.attributes["architecture"] == {"string": "Ada Lovelace"}


def test_nvml_mig_enabled_publishes_mig_devices():
    gpu = FakeGpu(mig_enabled=True, mig_devices=[(7, 0, 0), None, (3, 0, 1), (1, 0, 2)])
    fake = FakeNvml([FakeGpu(uuid="GPU-0000"), gpu])
    devices = nvml_discovery.discover(fake)
    assert [d.name for d in devices] == ["gpu-0", "gpu-1-mig-7-0", "gpu-1-mig-3-0", "gpu-1-mig-1-0"]
    mig = devices[1].to_api()
    assert mig["attributes"]["type"] == {"string": "mig"}
    assert mig["attributes"]["parentUUID"] == {"string": gpu.uuid}
    assert mig["attributes"]["profile"] == {"string": "1g.18gb"}
    assert mig["attributes"]["productName"] == {"string": "NVIDIA H200"}
    assert mig["attributes"]["uuid"]["string"].startswith("MIG-")
    assert mig["capacity"]["multiprocessors"] == {"value": "16"}
    assert mig["capacity"]["memory"] == {"value": str(17920 * 2**20)}
    assert set(mig["capacity"]) == {
        "multiprocessors",
        "copyEngines",
        "decoders",
        "encoders",
        "jpegEngines",
        "ofaEngines",
        "memory",
    }
    assert devices[2].attributes["profile"] == {"string": "2g.35gb"}
    assert devices[3].capacity["multiprocessors"] == "60"


def test_nvml_errors_are_clear():
    with pytest.raises(nvml_discovery.DiscoveryError, match="could not be initialised"):
        nvml_discovery.discover(FakeNvml([], init_error=pynvml.NVML_ERROR_DRIVER_NOT_LOADED))

    class Broken(FakeNvml):
        def nvmlDeviceGetUUID(self, h):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)

    fake = Broken([FakeGpu()])
    with pytest.raises(nvml_discovery.DiscoveryError, match="nvmlDeviceGetUUID"):
        nvml_discovery.discover(fake)
    assert fake.calls[-1] == "nvmlShutdown"  # shut down even after a failure


def test_real_pynvml_without_gpu_fails_clearly():
    """On a machine without an NVIDIA driver the real library must give our clear error."""
    if shutil.which("nvidia-smi"):
        pytest.skip("this machine has an NVIDIA driver")
    with pytest.raises(nvml_discovery.DiscoveryError, match="NVML could not be initialised"):
        nvml_discovery.discover()


# --- CDI -----------------------------------------------------------------------------------------


def test_cdi_specs(tmp_path):
    cdi = CdiWriter(tmp_path / "cdi", "gpu.example.com", "node-a")
    common = cdi.write_common()
    assert common.name == "k8s.gpu.example.com-gpu_common.json"
    spec = json.loads(common.read_text())
    assert spec["kind"] == "k8s.gpu.example.com/gpu"
    assert spec["devices"] == [
        {
            "name": "common",
            "containerEdits": {"env": ["KUBERNETES_NODE_NAME=node-a", "DRA_RESOURCE_DRIVER_NAME=gpu.example.com"]},
        }
    ]
    path = cdi.write_claim(
        "uid-1", [("gpu-3", device_env("uid-1", "gpu-3", False, DEFAULT)), ("gpu-0-mig-1-0", ["A=1"])]
    )
    assert path.name == "k8s.gpu.example.com-gpu_uid-1.json"
    devices = json.loads(path.read_text())["devices"]
    assert devices == [
        {
            "name": "uid-1-gpu-3",
            "containerEdits": {
                "env": [
                    # dra-example-driver's variables, names and values exactly (its e2e tests read them)
                    "GPU_DEVICE_GPU_3_RESOURCE_CLAIM=uid-1",
                    "DRA_ADMIN_ACCESS=false",
                    "GPU_DEVICE_3=gpu-3",
                    "GPU_DEVICE_3_SHARING_STRATEGY=TimeSlicing",
                    "GPU_DEVICE_3_TIMESLICE_INTERVAL=Default",
                ]
            },
        },
        {"name": "uid-1-gpu-0-mig-1-0", "containerEdits": {"env": ["A=1"]}},
    ]
    assert cdi.device_ids("uid-1", "gpu-3") == ["k8s.gpu.example.com/gpu=uid-1-gpu-3", "k8s.gpu.example.com/gpu=common"]
    assert sorted(p.name for p in (tmp_path / "cdi").iterdir()) == [
        "k8s.gpu.example.com-gpu_common.json",
        "k8s.gpu.example.com-gpu_uid-1.json",
    ]  # no temporary files left behind
    assert cdi.remove_claim("uid-1") is True
    assert cdi.remove_claim("uid-1") is False
    assert not path.exists()


# --- opaque device configuration (GpuConfig) ------------------------------------------------------


def _gpu_config(sharing=None, **extra):
    params = {"apiVersion": "gpu.resource.example.com/v1alpha1", "kind": "GpuConfig", **extra}
    if sharing is not None:
        params["sharing"] = sharing
    return params


def _entry(params, requests=(), source="FromClaim", driver="gpu.example.com"):
    return {"source": source, "requests": list(requests), "opaque": {"driver": driver, "parameters": params}}


@pytest.mark.parametrize(
    "params, env",
    [
        (_gpu_config(), ["GPU_DEVICE_0_SHARING_STRATEGY=TimeSlicing", "GPU_DEVICE_0_TIMESLICE_INTERVAL=Default"]),
        (
            _gpu_config({"strategy": "TimeSlicing"}),
            ["GPU_DEVICE_0_SHARING_STRATEGY=TimeSlicing", "GPU_DEVICE_0_TIMESLICE_INTERVAL=Default"],
        ),
        (
            _gpu_config({"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Long"}}),
            ["GPU_DEVICE_0_SHARING_STRATEGY=TimeSlicing", "GPU_DEVICE_0_TIMESLICE_INTERVAL=Long"],
        ),
        (
            _gpu_config({"strategy": "SpacePartitioning"}),
            ["GPU_DEVICE_0_SHARING_STRATEGY=SpacePartitioning", "GPU_DEVICE_0_PARTITION_COUNT=1"],
        ),
        (
            _gpu_config({"strategy": "SpacePartitioning", "spacePartitioningConfig": {"partitionCount": 10}}),
            ["GPU_DEVICE_0_SHARING_STRATEGY=SpacePartitioning", "GPU_DEVICE_0_PARTITION_COUNT=10"],
        ),
    ],
)
def test_gpu_config_normalized_like_upstream(params, env):
    assert parse_gpu_config(params).env("gpu-0") == ["GPU_DEVICE_0=gpu-0", *env]


@pytest.mark.parametrize(
    "params, message",
    [
        ("text", "must be a JSON object"),
        ({"kind": "GpuConfig"}, "decodes only gpu.resource.example.com/v1alpha1/GpuConfig"),
        ({**_gpu_config(), "kind": "NetConfig"}, "'NetConfig'"),
        (_gpu_config(mode="x"), "unknown field(s) in GpuConfig: mode"),
        (_gpu_config({"strategy": "Sometimes"}), "unknown GPU sharing strategy: 'Sometimes'"),
        (_gpu_config({"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Eon"}}), "time-slice interval"),
        (_gpu_config({"strategy": "TimeSlicing", "timeSlicingConfig": {}}), "unknown time-slice interval: ''"),
        (
            _gpu_config({"strategy": "TimeSlicing", "spacePartitioningConfig": {"partitionCount": 2}}),
            "cannot use spacePartitioningConfig with the 'TimeSlicing' strategy",
        ),
        (
            _gpu_config({"strategy": "SpacePartitioning", "spacePartitioningConfig": {"partitionCount": -1}}),
            "invalid partition count: -1",
        ),
        (
            _gpu_config({"strategy": "SpacePartitioning", "spacePartitioningConfig": {"partitionCount": "2"}}),
            "partitionCount must be an integer",
        ),
    ],
)
def test_malformed_gpu_config_is_refused_clearly(params, message):
    with pytest.raises(GpuConfigError) as err:
        parse_gpu_config(params)
    assert message in str(err.value)


def test_configs_by_request_follow_upstream_precedence():
    long = _gpu_config({"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Long"}})
    short = _gpu_config({"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Short"}})
    parts = _gpu_config({"strategy": "SpacePartitioning"})
    entries = [
        _entry(long, requests=["a"]),  # the claim's: wins over the class's for "a"
        _entry(short, source="FromClass"),  # the class's, for every request
        _entry("not even an object", driver="other.example.com"),  # another driver's: skipped, not parsed
        _entry(parts, requests=["c"]),
    ]
    got = configs_by_request(entries, "gpu.example.com", ["a", "b", "c"])
    assert {r: (c.strategy, c.interval) for r, c in got.items() if r != "c"} == {
        "a": ("TimeSlicing", "Long"),
        "b": ("TimeSlicing", "Short"),
    }
    assert got["c"].strategy == "SpacePartitioning"
    assert configs_by_request(None, "gpu.example.com", ["a"]) == {"a": DEFAULT}
    with pytest.raises(GpuConfigError, match="only opaque parameters"):
        configs_by_request([{"source": "FromClaim", "requests": []}], "gpu.example.com", ["a"])
    with pytest.raises(GpuConfigError, match="invalid config source"):
        configs_by_request([{**_entry(long), "source": "FromElsewhere"}], "gpu.example.com", ["a"])
    with pytest.raises(GpuConfigError, match=r"config\[0\] \(FromClaim\): unknown GPU sharing strategy"):
        configs_by_request([_entry(_gpu_config({"strategy": "x"}))], "gpu.example.com", ["a"])


def test_prepare_applies_the_claim_config_and_admin_access(tmp_path):
    """The claim's GpuConfig and adminAccess reach the CDI spec and the checkpoint; a lost spec is
    written again the same from the checkpoint; a malformed config fails that claim alone."""
    from otel_dra.plugin.state import ClaimRef

    driver = _driver(tmp_path)
    client = driver.client
    # The watch cache and a quorum read both answer this copy (the driver reads the cache first).
    client.claim = client.cached = json.loads(json.dumps(client.claim))
    devices = client.claim["status"]["allocation"]["devices"]
    devices["results"][0]["consumedCapacity"] = {"memory": "10Gi", "other": "1"}
    # Admin access is the claim's, as upstream: another driver's result with it counts too.
    devices["results"].append(
        {"request": "r", "driver": "x.example.com", "pool": "p", "device": "d", "adminAccess": True}
    )
    devices["config"] = [_entry(_gpu_config({"strategy": "SpacePartitioning"}), requests=["r"])]
    [device] = driver.prepare([ClaimRef("ns", "u1", "c")])["u1"].devices
    expected = [
        "GPU_DEVICE_GPU_0_RESOURCE_CLAIM=u1",
        "DRA_ADMIN_ACCESS=true",
        "GPU_DEVICE_0=gpu-0",
        "GPU_DEVICE_0_SHARING_STRATEGY=SpacePartitioning",
        "GPU_DEVICE_0_PARTITION_COUNT=1",
        "GPU_DEVICE_0_MEMORY=10Gi",
    ]
    spec = driver.cdi.claim_spec_path("u1")
    assert json.loads(spec.read_text())["devices"][0]["containerEdits"]["env"] == expected
    assert list(device.container_env) == expected
    spec.unlink()
    devices["config"] = []  # not read again: the checkpoint answers
    driver.prepare([ClaimRef("ns", "u1", "c")])
    assert json.loads(spec.read_text())["devices"][0]["containerEdits"]["env"] == expected

    (tmp_path / "second").mkdir()
    driver = _driver(tmp_path / "second")
    driver.client.claim = driver.client.cached = json.loads(json.dumps(client.claim))
    driver.client.claim["status"]["allocation"]["devices"]["config"] = [
        _entry(_gpu_config({"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Eon"}}))
    ]
    error = driver.prepare([ClaimRef("ns", "u1", "c")])["u1"].error
    assert error == (
        "prepare claim ns/c (uid u1): ResourceClaim ns/c: config[0] (FromClaim): unknown time-slice interval: "
        "'Eon' (one of Default, Short, Medium, Long)"
    )
    assert not driver.cdi.claim_spec_path("u1").exists() and driver.checkpoint.get("u1") is None


# --- checkpoint ----------------------------------------------------------------------------------


def _prepared(name: str = "c") -> PreparedClaim:
    return PreparedClaim("ns", name, (PreparedDevice(("gpu",), "node-a", "gpu-0", ("k/gpu=common", "k/gpu=u-gpu-0")),))


class _OneClaim:
    """The API server's side of a prepare: one claim, allocated to gpu-0 of node-a."""

    host = "https://10.0.0.1:6443"
    claim = {
        "metadata": {"namespace": "ns", "name": "c", "uid": "u1"},
        "status": {
            "allocation": {
                "devices": {
                    "results": [{"request": "r", "driver": "gpu.example.com", "pool": "node-a", "device": "gpu-0"}]
                }
            }
        },
    }

    def __init__(self) -> None:
        self.reads: list[str] = []  # "cache" or "quorum", per GET
        self.cached: dict | None = self.claim  # what the watch cache holds (None: nothing yet)

    def get_json(self, path, query=None, *, headers=None, timeout=None):
        from_cache = (query or {}).get("resourceVersion") == "0"
        self.reads.append("cache" if from_cache else "quorum")
        if path == "/apis/resource.k8s.io/v1/namespaces/ns/resourceclaims/c":
            if not from_cache:
                return self.claim
            if self.cached is not None:
                return self.cached
        raise ApiError(404, "not found")


def _driver(tmp_path, api=None, *, cleanup_delay=None, cleanup_retry=5.0, meter_provider=None):
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.trace import NoOpTracerProvider

    from otel_dra.plugin.driver import Driver, Inventory

    cdi = CdiWriter(tmp_path / "cdi", "gpu.example.com", "node-a")
    cdi.write_common()
    return Driver(
        client=api or _OneClaim(),
        driver_name="gpu.example.com",
        node_name="node-a",
        inventory=Inventory(simulated_devices("node-a", 1)),
        cdi=cdi,
        checkpoint=Checkpoint(tmp_path / "checkpoint.json"),
        metrics=PluginMetrics(meter_provider or MeterProvider(shutdown_on_exit=False)),
        tracer_provider=NoOpTracerProvider(),
        cleanup_delay=cleanup_delay,
        cleanup_retry=cleanup_retry,
    )


def test_claim_names_and_uids_with_a_trailing_newline_are_refused(tmp_path):
    """Found by tests/fuzz: the checks used re.match with ``$``, which matches before a final "\\n"."""
    from otel_dra.plugin.state import ClaimRef

    driver = _driver(tmp_path)
    for ref in (ClaimRef("ns", "u1\n", "c"), ClaimRef("ns\n", "u1", "c"), ClaimRef("ns", "u1", "c\n")):
        assert "invalid claim" in driver.prepare([ref])[ref.uid].error
        assert "invalid claim" in driver.unprepare([ref])[ref.uid].error


def test_a_prepared_uid_under_another_name_is_refused(tmp_path):
    """Found by tests/fuzz: a prepared claim is answered from the checkpoint without reading it
    again, and that answer was given for its UID under any namespace and name."""
    from otel_dra.plugin.state import ClaimRef

    driver = _driver(tmp_path)
    assert [d.device_name for d in driver.prepare([ClaimRef("ns", "u1", "c")])["u1"].devices] == ["gpu-0"]
    for ref in (ClaimRef("other", "u1", "c"), ClaimRef("ns", "u1", "d")):
        assert "was prepared as ns/c" in driver.prepare([ref])["u1"].error
    assert driver.prepare([ClaimRef("ns", "u1", "c")])["u1"].devices  # the right name still gets it


@pytest.mark.parametrize(
    ("cached", "reads"),
    [
        (_OneClaim.claim, ["cache"]),  # the usual case: the watch cache has it, one cheap read
        (None, ["cache", "quorum"]),  # not in the cache yet
        ({**_OneClaim.claim, "status": {}}, ["cache", "quorum"]),  # cached before the allocation
        ({**_OneClaim.claim, "metadata": {**_OneClaim.claim["metadata"], "uid": "old"}}, ["cache", "quorum"]),
    ],
)
def test_the_claim_is_read_from_the_watch_cache_unless_it_lags(tmp_path, cached, reads):
    from otel_dra.plugin.state import ClaimRef

    api = _OneClaim()
    api.cached = cached
    driver = _driver(tmp_path, api)
    result = driver.prepare([ClaimRef("ns", "u1", "c")])["u1"]
    assert result.error == ""
    assert [d.device_name for d in result.devices] == ["gpu-0"]
    assert api.reads == reads


def test_a_claim_gone_from_cache_and_etcd_is_not_found(tmp_path):
    from otel_dra.plugin.state import ClaimRef

    api = _OneClaim()
    result = _driver(tmp_path, api).prepare([ClaimRef("ns", "u2", "gone")])["u2"]
    assert "not found" in result.error
    assert api.reads == ["cache", "quorum"]


def test_checkpoint_roundtrip_and_atomicity(tmp_path):
    path = tmp_path / "checkpoint.json"
    cp = Checkpoint(path)
    assert cp.get("u") is None
    cp.put("u", _prepared())
    cp.put("v", _prepared("d"))
    again = Checkpoint(path)  # what a restarted plugin reads
    assert again.get("u") == _prepared()
    assert again.uids() == ["u", "v"]
    assert again.remove("u") is True and again.remove("u") is False
    assert Checkpoint(path).uids() == ["v"]
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoint.json"]
    assert path.stat().st_mode & 0o777 == 0o600


def test_checkpoint_write_failure_changes_nothing(tmp_path):
    directory = tmp_path / "d"
    directory.mkdir()
    cp = Checkpoint(directory / "checkpoint.json")
    cp.put("u", _prepared())
    shutil.rmtree(directory)  # the disk lets us down (works as root too, unlike permissions)
    with pytest.raises(OSError):
        cp.put("v", _prepared())
    assert cp.uids() == ["u"]
    assert cp.get("v") is None


@pytest.mark.parametrize(
    "content",
    [b"{not json", b"[]", b'{"version": 99, "claims": {}}', b'{"version": 1, "claims": {"u": {"devices": 3}}}'],
)
def test_corrupt_checkpoint_is_refused_with_its_path(tmp_path, content):
    """Loading does not raise (the plugin must not exit into a crash loop); every use does, with
    the path and the way out, and the file is left as it was."""
    path = tmp_path / "checkpoint.json"
    path.write_bytes(content)
    cp = Checkpoint(path)
    assert cp.broken is not None and str(path) in str(cp.broken)
    for use in (lambda: cp.get("u"), lambda: cp.put("u", _prepared()), lambda: cp.remove("u")):
        with pytest.raises(CheckpointError, match=str(path)) as exc:
            use()
        assert f"mv {path} {path}.broken" in str(exc.value)
    assert path.read_bytes() == content  # nothing lost: the operator decides


@pytest.mark.parametrize("fix", ["move away", "repair"])
def test_a_broken_checkpoint_is_read_again_once_the_operator_acts(tmp_path, fix):
    path = tmp_path / "checkpoint.json"
    good = Checkpoint(path)
    good.put("u", _prepared())
    intact = path.read_bytes()
    path.write_bytes(intact[: len(intact) // 2])  # truncated
    cp = Checkpoint(path)
    with pytest.raises(CheckpointError, match="unreadable"):
        cp.get("u")
    if fix == "move away":
        path.rename(path.with_name("checkpoint.json.broken"))
        assert cp.get("u") is None  # empty, and usable
        cp.put("v", _prepared())
        assert Checkpoint(path).uids() == ["v"]
    else:
        path.write_bytes(intact)
        assert cp.get("u") == _prepared()
    assert cp.broken is None


def test_driver_reports_a_broken_checkpoint_per_claim_and_recovers(tmp_path):
    from otel_dra.plugin.state import ClaimRef

    (tmp_path / "checkpoint.json").write_bytes(b'{"version": 1, "claims": {"u1": ')  # truncated
    driver = _driver(tmp_path)
    ref = ClaimRef("ns", "u1", "c")
    for result in (driver.prepare([ref])["u1"], driver.unprepare([ref])["u1"]):
        assert "checkpoint" in result.error and "unreadable" in result.error and ".broken" in result.error
    assert not driver.cdi.claim_spec_path("u1").exists()  # nothing acted on a state it cannot know
    (tmp_path / "checkpoint.json").rename(tmp_path / "checkpoint.json.broken")
    assert driver.prepare([ref])["u1"].ok  # the kubelet's retry
    assert driver.unprepare([ref])["u1"].ok


# --- the unprepare's files, after the answer (plugin/cleanup.py) ----------------------------------


def _on_disk(tmp_path) -> list[str]:
    return sorted(json.loads((tmp_path / "checkpoint.json").read_text())["claims"])


def test_an_unprepare_answers_first_and_its_files_follow(tmp_path):
    from otel_dra.plugin.state import ClaimRef

    driver = _driver(tmp_path, cleanup_delay=3600)  # nothing runs until settle()
    try:
        ref = ClaimRef("ns", "u1", "c")
        assert driver.prepare([ref])["u1"].ok
        spec = driver.cdi.claim_spec_path("u1")
        assert [d.device_name for d in driver.unprepare([ref])["u1"].devices] == ["gpu-0"]
        # Answered: the claim is unprepared for everything that asks, the files not touched yet.
        assert driver.checkpoint.get("u1") is None and driver.checkpoint.uids() == []
        assert spec.exists() and _on_disk(tmp_path) == ["u1"]
        assert driver.settle(5)
        assert not spec.exists() and _on_disk(tmp_path) == []
        assert driver.unprepare([ref])["u1"].ok  # again: nothing to do
        assert driver.settle(5)
    finally:
        driver.close()


def test_a_prepare_before_the_files_went_keeps_its_own(tmp_path):
    from otel_dra.plugin.state import ClaimRef

    driver = _driver(tmp_path, cleanup_delay=3600)
    try:
        ref = ClaimRef("ns", "u1", "c")
        assert driver.prepare([ref])["u1"].ok
        assert driver.unprepare([ref])["u1"].ok
        assert driver.prepare([ref])["u1"].ok  # read from the API server again, not from the checkpoint
        assert driver.client.reads == ["cache", "cache"]
        assert driver.settle(5)
        assert driver.cdi.claim_spec_path("u1").exists()  # the removal left the new prepare's spec
        assert _on_disk(tmp_path) == ["u1"]
        assert Checkpoint(tmp_path / "checkpoint.json").get("u1") == driver.checkpoint.get("u1")
    finally:
        driver.close()


def test_the_unprepares_of_a_moment_share_one_checkpoint_write(tmp_path, monkeypatch):
    from otel_dra.plugin import checkpoint as checkpoint_module
    from otel_dra.plugin.state import ClaimRef

    driver = _driver(tmp_path, cleanup_delay=3600)
    try:
        for uid in ("u1", "u2", "u3"):
            driver.checkpoint.put(uid, _prepared(f"c-{uid}"))
        writes = []
        real = checkpoint_module.write_atomic
        monkeypatch.setattr(checkpoint_module, "write_atomic", lambda *a, **k: (writes.append(a[0]), real(*a, **k)))
        for uid in ("u1", "u2", "u3"):
            assert driver.unprepare([ClaimRef("ns", uid, f"c-{uid}")])[uid].ok
        assert writes == []
        assert driver.settle(5)
        assert len(writes) == 1 and _on_disk(tmp_path) == []
    finally:
        driver.close()


def test_a_failed_removal_is_counted_and_tried_again(tmp_path, monkeypatch):
    import errno

    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    from otel_dra.plugin.state import ClaimRef

    reader = InMemoryMetricReader()
    driver = _driver(
        tmp_path, cleanup_delay=0.01, cleanup_retry=0.05, meter_provider=MeterProvider([reader], shutdown_on_exit=False)
    )
    try:
        ref = ClaimRef("ns", "u1", "c")
        assert driver.prepare([ref])["u1"].ok
        spec = driver.cdi.claim_spec_path("u1")
        tries = []

        def read_only(uid):
            tries.append(uid)
            raise OSError(errno.EROFS, "Read-only file system")

        real = driver.cdi.remove_claim
        monkeypatch.setattr(driver.cdi, "remove_claim", read_only)
        assert driver.unprepare([ref])["u1"].ok  # the kubelet's answer does not wait for the disk
        assert not driver.settle(5)  # the first try failed: known at once
        wait_until(lambda: len(tries) >= 2, 5, 0.01, what="a second try")
        assert spec.exists()
        assert not driver.settle(5)
        errors = {
            (dict(p.attributes)["operation"], dict(p.attributes)["error_type"]): p.value
            for m in reader.get_metrics_data().resource_metrics[0].scope_metrics[0].metrics
            if m.name == "otel_dra_plugin_claim_errors"
            for p in m.data.data_points
        }
        assert errors[("unprepare", "CDIRemoveFailed")] >= 2
        monkeypatch.setattr(driver.cdi, "remove_claim", real)  # writable again
        # A retry already running with the read-only removal may fail once more; the next succeeds.
        assert driver.settle(5) or driver.settle(5)
        assert not spec.exists() and _on_disk(tmp_path) == []
    finally:
        driver.close()


def test_a_stop_removes_the_files_of_the_unprepares_answered(tmp_path):
    from otel_dra.plugin.state import ClaimRef

    driver = _driver(tmp_path, cleanup_delay=3600)
    ref = ClaimRef("ns", "u1", "c")
    assert driver.prepare([ref])["u1"].ok
    assert driver.unprepare([ref])["u1"].ok
    driver.close()
    assert not driver.cdi.claim_spec_path("u1").exists() and _on_disk(tmp_path) == []
    assert not [t for t in threading.enumerate() if t.name == "unprepare-cleanup"]
    assert driver.prepare([ref])["u1"].ok and driver.unprepare([ref])["u1"].ok  # a call finishing at stop
    assert not driver.cdi.claim_spec_path("u1").exists() and _on_disk(tmp_path) == []


def test_deferred_batches_retries_and_survives_a_bug():
    from otel_dra.plugin.cleanup import Deferred

    calls: list[list[str]] = []
    fail = {"b"}

    def work(keys):
        calls.append(keys)
        if "boom" in keys:
            raise RuntimeError("a bug")
        return [k for k in keys if k in fail]

    deferred = Deferred(work, delay=3600, retry=0.01, name="t")
    try:
        assert deferred.flush(1)  # nothing yet, no thread
        for key in ("a", "b", "a"):
            assert deferred.submit(key)
        assert deferred.pending() == 2
        assert not deferred.flush(5)  # b failed
        wait_until(lambda: len(calls) >= 3, 5, 0.01, what="two retries of b")
        assert calls[0] == ["a", "b"] and all(c == ["b"] for c in calls[1:]) and len(calls) >= 3  # again and again
        fail.clear()
        # A retry of b already running may fail once more; the next succeeds.
        assert (deferred.flush(5) or deferred.flush(5)) and deferred.pending() == 0
        calls.clear()
        deferred.submit("boom")
        assert not deferred.flush(5)  # logged, kept
        assert calls and all(c == ["boom"] for c in calls)
    finally:
        deferred.close()
    assert deferred.pending() == 0  # tried once more at close, then left (logged)
    assert not deferred.submit("c")  # after close the caller does the work itself
    assert calls[-1] == ["boom"]


def test_deferred_backs_off_a_key_that_keeps_failing_and_not_a_new_one():
    from otel_dra.plugin.cleanup import Deferred

    assert [Deferred(list, retry=5, max_retry=300).retry_wait(n) for n in (1, 2, 3, 6, 7, 100)] == [
        5,
        10,
        20,
        160,
        300,
        300,
    ]
    times: dict[str, list[float]] = {"old": [], "new": []}

    def work(keys):
        for key in keys:
            times[key].append(time.monotonic())
        return [k for k in keys if k == "old"]

    deferred = Deferred(work, delay=0, retry=0.1, max_retry=10)
    try:
        deferred.submit("old")
        wait_until(lambda: len(times["old"]) >= 3, 10, 0.01, what="three tries of the old key")
        first, second, third = times["old"][:3]
        assert second - first >= 0.1 and third - second >= 0.2  # doubled (never shorter than asked)
        # A key submitted now is not held back by the old one's next wait, 0.4 s.
        submitted = time.monotonic()
        deferred.submit("new")
        wait_until(lambda: times["new"], 10, 0.005, what="the new key's try")
        assert times["new"][0] - submitted < 0.3
    finally:
        deferred.close()


# --- sockets -------------------------------------------------------------------------------------


def test_socket_lock_is_exclusive(tmp_path):
    first = SocketLock(tmp_path / "plugin.lock")
    first.acquire()
    second = SocketLock(tmp_path / "plugin.lock")
    with pytest.raises(AlreadyRunning, match=r"pid \d+"):
        second.acquire()
    first.release()
    second.acquire()  # free again once the holder lets go
    second.release()


# --- slices --------------------------------------------------------------------------------------


def test_slice_names_are_valid_and_bounded():
    assert slice_name("node-a", "gpu.example.com", 0) == "node-a-gpu.example.com-0"
    long = slice_name("n" * 253, "gpu.example.com", 1)
    assert len(long) <= 253 and long.endswith("-1")
    assert long != slice_name("n" * 253, "gpu.example.com", 2)
    assert slice_name("n" * 253, "other.example.com", 1) != long


def test_slice_comparison_ignores_quantity_spelling():
    ours = [Device("gpu-0", {"index": {"int": 0}}, {"memory": "80Gi"}).to_api()]
    served = [{"name": "gpu-0", "attributes": {"index": {"int": 0}}, "capacity": {"memory": {"value": "85899345920"}}}]
    assert _comparable(ours) == _comparable(served)
    served[0]["attributes"]["index"] = {"int": 1}
    assert _comparable(ours) != _comparable(served)


class _SliceApi:
    """An API server's ResourceSlices and Nodes in memory, recording every request."""

    host = "https://10.0.0.1:6443"

    def __init__(self) -> None:
        self.slices: dict[str, dict] = {}
        self.nodes: dict[str, dict] = {}
        self.requests: list[tuple[str, str]] = []
        self.version = 0

    def get_json(self, path, query=None, headers=None, **_):
        metadata_only = "PartialObjectMetadataList" in (headers or {}).get("Accept", "")
        self.requests.append(("GET metadata" if metadata_only else "GET", path))
        if path.startswith("/api/v1/nodes/"):
            node = self.nodes.get(path.rsplit("/", 1)[1])
            if node is None:
                raise ApiError(404, "not found")
            return node
        if metadata_only:
            return {"items": [{"metadata": dict(s["metadata"])} for s in self.slices.values()]}
        return {"items": [json.loads(json.dumps(s)) for s in self.slices.values()]}

    def send_json(self, method, path, body, *args):
        self.requests.append((method, path))
        body = json.loads(json.dumps(body))
        self.version += 1
        body["metadata"]["resourceVersion"] = str(self.version)
        self.slices[body["metadata"]["name"]] = body
        return body

    def request(self, method, path, **_):
        self.requests.append((method, path))
        self.slices.pop(path.rsplit("/", 1)[1], None)


def test_slices_owned_by_the_node_and_the_lookup_only_when_writing(caplog):
    from otel_dra.plugin.slices import SlicePublisher

    api = _SliceApi()
    publisher = SlicePublisher(
        api, driver_name="gpu.example.com", node_name="node-a", discover=lambda: simulated_devices("node-a", 2)
    )
    # No Node: published unowned, one warning, the lookup repeated at each reconcile.
    assert publisher.sync() is True
    assert [s["metadata"].get("ownerReferences") for s in api.slices.values()] == [None]
    assert publisher.sync() is False
    assert publisher.sync() is False
    assert api.requests.count(("GET", "/api/v1/nodes/node-a")) == 4  # 2 at the write, 1 per unchanged sync
    assert sum("Node node-a does not exist" in r.getMessage() for r in caplog.records) == 1
    # The Node appears: the slices are rewritten owned by it.
    api.nodes["node-a"] = {"metadata": {"name": "node-a", "uid": "uid-1"}}
    assert publisher.sync() is True
    owner = {"apiVersion": "v1", "kind": "Node", "name": "node-a", "uid": "uid-1", "controller": True}
    assert [s["metadata"]["ownerReferences"] for s in api.slices.values()] == [[owner]]
    # Unchanged resyncs cost one metadata-only LIST and no Node lookup.
    api.requests.clear()
    assert publisher.sync() is False
    assert api.requests == [("GET metadata", "/apis/resource.k8s.io/v1/resourceslices")]
    # Re-created Node (a new UID) after the collector deleted the slices: the new owner.
    api.slices.clear()
    api.nodes["node-a"] = {"metadata": {"name": "node-a", "uid": "uid-2"}}
    assert publisher.sync() is True
    assert [s["metadata"]["ownerReferences"][0]["uid"] for s in api.slices.values()] == ["uid-2"]


def test_slices_unchanged_resync_reads_metadata_only_and_any_change_takes_the_full_path():
    from otel_dra.plugin.slices import SlicePublisher

    api = _SliceApi()
    api.nodes["node-a"] = {"metadata": {"name": "node-a", "uid": "uid-1"}}
    devices = {"n": 2}
    publisher = SlicePublisher(
        api,
        driver_name="gpu.example.com",
        node_name="node-a",
        discover=lambda: simulated_devices("node-a", devices["n"]),
    )
    assert publisher.sync() is True
    assert (publisher.publishes, publisher.full_checks) == (1, 1)
    # Nothing changed: the names and versions say so, the devices are not read.
    api.requests.clear()
    assert publisher.sync() is False
    assert api.requests == [("GET metadata", "/apis/resource.k8s.io/v1/resourceslices")]
    assert publisher.full_checks == 1
    (name,) = api.slices
    # Someone else writes the slice without changing what it publishes (a label): compared in full,
    # nothing written, and the new version is the known one from then on.
    api.version += 1
    api.slices[name]["metadata"]["labels"]["team"] = "x"
    api.slices[name]["metadata"]["resourceVersion"] = str(api.version)
    assert publisher.sync() is False
    assert (publisher.publishes, publisher.full_checks) == (1, 2)
    assert publisher.sync() is False
    assert publisher.full_checks == 2
    # Someone else changes a device: rewritten.
    api.version += 1
    api.slices[name]["spec"]["devices"][0]["attributes"]["index"] = {"int": 99}
    api.slices[name]["metadata"]["resourceVersion"] = str(api.version)
    assert publisher.sync() is True
    assert publisher.publishes == 2
    assert publisher.sync() is False
    # Deleted (the kubelet's wipe at registration): published again.
    api.slices.clear()
    assert publisher.sync() is True
    assert publisher.publishes == 3
    # Our own devices change: the full path, a new generation.
    devices["n"] = 3
    assert publisher.sync() is True
    assert [len(s["spec"]["devices"]) for s in api.slices.values()] == [3]
    assert publisher.publishes == 4
    # A write that fails half-way leaves nothing known: the next sync compares in full.
    checks = publisher.full_checks
    devices["n"] = 4
    send = api.send_json
    api.send_json = lambda *a: (_ for _ in ()).throw(ApiError(500, "boom"))
    with pytest.raises(ApiError):
        publisher.sync()
    api.send_json = send
    devices["n"] = 3
    assert publisher.sync() is False  # what is there is what is wanted again, found by reading it
    assert publisher.full_checks == checks + 2


# --- metrics -------------------------------------------------------------------------------------


def _exposition(pipeline) -> str:
    return b"".join(assemble(pipeline.registry, [], False)).decode()


def test_metrics_exposition_matches_upstream_names():
    pipeline = build_metrics_pipeline(service_name="t", version="0", target_info=False)
    metrics = PluginMetrics(pipeline.meter_provider)
    text = _exposition(pipeline)
    # Before any work: the counters at 0 for both results, no histograms yet (as upstream).
    assert (
        "# HELP dra_example_driver_prepare_claims_total [BETA] Total number of resource claim prepare "
        "operations handled by the driver.\n# TYPE dra_example_driver_prepare_claims_total counter\n"
    ) in text
    samples = {(n, tuple(sorted(lab.items()))): v for n, lab, v in parse_samples(text)}
    for op in ("prepare", "unprepare"):
        for result in ("success", "error"):
            assert samples[(f"dra_example_driver_{op}_claims_total", (("result", result),))] == 0
    assert samples[("dra_example_driver_fatal_background_errors_total", ())] == 0
    assert "duration" not in text and "rest_client" not in text
    for op in ("prepare", "unprepare"):  # ours, next to upstream's: in flight at 0 from the start
        assert samples[("otel_dra_plugin_requests_in_flight", (("operation", op),))] == 0

    metrics.prepared(True, 0.0042)
    metrics.prepared(False, 0.3)
    metrics.unprepared(True, 0.001)
    metrics.fatal_error()
    metrics.observe_request(RequestRecord("GET", "10.0.0.1:6443", "/apis/x", 200, 0.003, False))
    metrics.observe_request(RequestRecord("GET", "10.0.0.1:6443", "/apis/x", 503, 0.01, True))
    metrics.observe_request(RequestRecord("PUT", "10.0.0.1:6443", "/apis/x", 0, 5.0, False))
    text = _exposition(pipeline)
    samples = {(n, tuple(sorted(lab.items()))): v for n, lab, v in parse_samples(text)}
    assert samples[("dra_example_driver_prepare_claims_total", (("result", "success"),))] == 1
    assert samples[("dra_example_driver_prepare_claims_total", (("result", "error"),))] == 1
    assert samples[("dra_example_driver_fatal_background_errors_total", ())] == 1
    h = "dra_example_driver_prepare_claim_duration_seconds"
    les = [lab["le"] for n, lab, _ in parse_samples(text) if n == h + "_bucket" and lab["result"] == "success"]
    # Upstream's buckets, then 30, 60 and 120 s (a reset or a passthrough can take a minute).
    assert les == [
        *("0.005", "0.01", "0.025", "0.05", "0.1", "0.25", "0.5", "1.0", "2.5", "5.0", "10.0"),
        *("30.0", "60.0", "120.0", "+Inf"),
    ]
    assert samples[(h + "_bucket", (("le", "0.005"), ("result", "success")))] == 1
    assert samples[(h + "_bucket", (("le", "0.25"), ("result", "error")))] == 0
    assert samples[(h + "_count", (("result", "error"),))] == 1
    host = ("host", "10.0.0.1:6443")
    assert samples[("rest_client_requests_total", (("code", "200"), host, ("method", "GET")))] == 1
    assert samples[("rest_client_requests_total", (("code", "503"), host, ("method", "GET")))] == 1
    assert samples[("rest_client_requests_total", (("code", "<error>"), host, ("method", "PUT")))] == 1
    assert samples[("rest_client_request_retries_total", (("code", "503"), host, ("verb", "GET")))] == 1
    assert samples[("rest_client_request_duration_seconds_count", (host, ("verb", "GET")))] == 2
    assert all("otel_scope" not in line for line in text.splitlines())
    for line in text.splitlines():
        if line.startswith("# HELP ") and not line.startswith("# HELP process_"):
            _, _, name, help_text = line.split(" ", 3)
            # Upstream's stability levels: the driver's families BETA, client-go's rest_client ALPHA
            # (process_* are registered raw there, without a level: tests/unit/test_process_metrics.py).
            if name.startswith("otel_dra_plugin_"):
                continue  # ours
            assert help_text.startswith("[ALPHA] " if name.startswith("rest_client_") else "[BETA] "), line
    assert (
        "# HELP dra_example_driver_prepare_claim_duration_seconds [BETA] Latency in seconds of resource claim "
        "prepare operations handled by the driver."
    ) in text
    if shutil.which("promtool"):
        check = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True)
        assert check.returncode == 0, check.stdout + check.stderr
    pipeline.shutdown()


# --- tracing configuration -------------------------------------------------------------------------


def test_sampler_from_env():
    assert sampler_from_env({}).get_description() == "TraceIdRatio56{1.0}"
    assert sampler_from_env({"OTEL_TRACES_SAMPLER_ARG": "0.5"}).get_description() == "TraceIdRatio56{0.5}"
    parent = sampler_from_env({"OTEL_TRACES_SAMPLER": "parentbased_always_on"})
    assert parent.get_description().startswith("ParentBased{root:AlwaysOnSampler")
    assert sampler_from_env({"OTEL_TRACES_SAMPLER": "always_off"}).get_description() == "AlwaysOffSampler"
    ratio = sampler_from_env({"OTEL_TRACES_SAMPLER": "traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0.25"})
    assert ratio.get_description() == "TraceIdRatio56{0.25}"
    with pytest.raises(ConfigError, match="OTEL_TRACES_SAMPLER='sometimes'"):
        sampler_from_env({"OTEL_TRACES_SAMPLER": "sometimes"})
    with pytest.raises(ConfigError, match="OTEL_TRACES_SAMPLER_ARG"):
        sampler_from_env({"OTEL_TRACES_SAMPLER": "parentbased_traceidratio", "OTEL_TRACES_SAMPLER_ARG": "2"})


def test_tracing_pipeline_from_env():
    off = build_tracing_pipeline(service_name="s", version="1", env={})
    assert not off.enabled
    on = build_tracing_pipeline(
        service_name="s",
        version="1",
        env={"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://127.0.0.1:9", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"},
    )
    assert on.enabled and on.otlp is not None and on.otlp.protocol == "grpc"
    on.shutdown()
    none = build_tracing_pipeline(
        service_name="s",
        version="1",
        env={"OTEL_EXPORTER_OTLP_ENDPOINT": "http://x:4318", "OTEL_TRACES_EXPORTER": "none"},
    )
    assert not none.enabled
    with pytest.raises(ConfigError, match="OTEL_TRACES_EXPORTER='zipkin'"):
        build_tracing_pipeline(service_name="s", version="1", env={"OTEL_TRACES_EXPORTER": "zipkin"})


# --- KubeClient retries ----------------------------------------------------------------------------


class _Flaky(BaseHTTPRequestHandler):
    """Answers each path's first ``fail`` requests with ``status``, then 200."""

    plan: dict[str, tuple[int, int]] = {}
    seen: dict[str, int] = {}
    lock = threading.Lock()

    def log_message(self, *args):
        pass

    def _answer(self):
        with self.lock:
            n = self.seen.get(self.path, 0)
            self.seen[self.path] = n + 1
        fail, status = self.plan.get(self.path.split("?")[0], (0, 200))
        code = status if n < fail else 200
        body = b'{"kind": "Status", "message": "try later"}' if code != 200 else b'{"ok": true}'
        self.send_response(code)
        if code == 429:
            self.send_header("Retry-After", "0")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = do_PUT = _answer


@pytest.fixture
def flaky_server():
    _Flaky.plan, _Flaky.seen = {}, {}
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Flaky)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server
    server.shutdown()
    server.server_close()


def _client(port: int, records: list[RequestRecord], retry: RetryPolicy | None) -> KubeClient:
    creds = Credentials(
        host=f"http://127.0.0.1:{port}",
        source="test",
        ca_file=None,
        cert_file=None,
        key_file=None,
        verify=True,
        tls_server_name=None,
        auth_headers=dict,
    )
    return KubeClient(creds, observer=records.append, retry=retry)


def test_retries_idempotent_requests_on_5xx_and_429(flaky_server):
    port = flaky_server.server_address[1]
    _Flaky.plan = {"/a": (2, 503), "/b": (1, 429), "/c": (5, 500), "/p": (1, 503)}
    records: list[RequestRecord] = []
    client = _client(port, records, RetryPolicy(max_retries=3, base_delay=0.01))
    assert client.get_json("/a") == {"ok": True}
    assert [(r.status, r.retried) for r in records] == [(503, True), (503, True), (200, False)]
    assert records[0].host == f"127.0.0.1:{port}" and records[0].method == "GET"
    records.clear()
    assert client.get_json("/b") == {"ok": True}
    assert [(r.status, r.retried) for r in records] == [(429, True), (200, False)]
    records.clear()
    with pytest.raises(ApiError) as exc:
        client.get_json("/c")  # bounded: 1 + 3 attempts, then the error
    assert exc.value.status == 500 and exc.value.message == "try later"
    assert [(r.status, r.retried) for r in records] == [(500, True)] * 3 + [(500, False)]
    records.clear()
    with pytest.raises(ApiError):
        client.send_json("POST", "/p", {})  # not idempotent: never repeated
    assert [(r.status, r.retried) for r in records] == [(503, False)]


def test_api_error_carries_the_retry_after_of_the_answer(flaky_server):
    """Without a retry policy (the exporter's client) a 429 is an ApiError that says how long the
    server asked to wait, for the reflector to honour."""
    port = flaky_server.server_address[1]
    _Flaky.plan = {"/t": (5, 429), "/u": (5, 503)}
    client = _client(port, [], None)
    with pytest.raises(ApiError) as exc:
        client.get_json("/t")
    assert (exc.value.status, exc.value.retry_after) == (429, 0.0)
    with pytest.raises(ApiError) as exc:
        client.get_json("/u")
    assert (exc.value.status, exc.value.retry_after) == (503, None)


@pytest.mark.parametrize(
    ("header", "seconds"),
    [
        (None, None),
        ("", None),
        ("3", 3.0),
        (" 1.5 ", 1.5),
        ("-1", None),
        ("nan", None),
        ("Wed, 21 Oct 2015 07:28:00 GMT", None),
    ],
)
def test_retry_after_seconds(header, seconds):
    from otel_dra.kube.client import retry_after_seconds

    assert retry_after_seconds(header) == seconds


def test_retries_connection_errors_then_fails(flaky_server):
    port = flaky_server.server_address[1]
    flaky_server.shutdown()
    flaky_server.server_close()
    records: list[RequestRecord] = []
    client = _client(port, records, RetryPolicy(max_retries=2, base_delay=0.01))
    start = time.monotonic()
    with pytest.raises(ApiError) as exc:
        client.get_json("/a")
    assert exc.value.status == 0
    assert [(r.status, r.retried) for r in records] == [(0, True), (0, True), (0, False)]
    assert time.monotonic() - start < 5
    records.clear()
    plain = _client(port, records, None)  # without a policy: one attempt, as before
    with pytest.raises(ApiError):
        plain.get_json("/a")
    assert len(records) == 1


def test_retry_delay_is_bounded():
    policy = RetryPolicy(base_delay=0.1, max_delay=1.0)
    assert 0.05 <= policy.delay(1) <= 0.1
    assert 0.5 <= policy.delay(10) <= 1.0
    assert policy.delay(1, "0.3") == 0.3
    assert policy.delay(1, "3600") == 1.0
    assert 0.05 <= policy.delay(1, "Wed, 21 Oct 2015 07:28:00 GMT") <= 0.1


# --- flags -----------------------------------------------------------------------------------------


def test_plugin_flags_and_env_fail_clearly(monkeypatch, capsys):
    for name in ("NODE_NAME", "DRIVER_NAME", "NUM_DEVICES", "METRICS_PORT", "HEALTHCHECK_PORT", "DEVICE_SOURCE"):
        monkeypatch.delenv(name, raising=False)
    assert main(["plugin"]) == 2
    assert "--node-name (or NODE_NAME) is required" in capsys.readouterr().err
    cases = [
        ("NODE_NAME", "Node_A"),
        ("DRIVER_NAME", "x" * 64),
        ("NUM_DEVICES", "-1"),
        ("METRICS_PORT", "-2"),
        ("HEALTHCHECK_PORT", "70000"),
        ("DEVICE_SOURCE", "cuda"),
    ]
    for name, value in cases:
        monkeypatch.setenv(name, value)
        assert main(["plugin", "--node-name", "n1"]) == 2, name
        assert f"environment variable {name}" in capsys.readouterr().err
        monkeypatch.delenv(name)
    # The plugin's generic variable names do not break the other subcommands.
    monkeypatch.setenv("METRICS_PORT", "nope")
    with pytest.raises(SystemExit) as exc:
        main(["exporter", "--help"])
    assert exc.value.code == 0
    monkeypatch.delenv("METRICS_PORT")
    for argv in (["--num-devices", "many"], ["--metrics-port", "65536"], ["--device-source", "gpu"]):
        with pytest.raises(SystemExit) as exc:
            main(["plugin", "--node-name", "n1", *argv])
        assert exc.value.code == 2
        assert argv[0] in capsys.readouterr().err


def test_plugin_bad_otel_env_and_credentials(monkeypatch, tmp_path, capsys):
    assert main(["plugin", "--node-name", "n1", "--kubeconfig", str(tmp_path / "missing")]) == 2
    assert "does not exist" in capsys.readouterr().err
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: c\n"
        "clusters: [{name: c, cluster: {server: 'https://127.0.0.1:1'}}]\n"
        "users: [{name: u, user: {token: t}}]\n"
        "contexts: [{name: c, context: {cluster: c, user: u}}]\n"
    )
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "sometimes")
    argv = ["plugin", "--node-name", "n1", "--kubeconfig", str(kubeconfig), "--cdi-root", str(tmp_path / "cdi")]
    assert main(argv) == 2
    assert "OTEL_TRACES_SAMPLER='sometimes'" in capsys.readouterr().err
    assert not (tmp_path / "cdi").exists()  # failed before touching anything


_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=12,
)
_keys = st.sampled_from(
    ["source", "requests", "opaque", "driver", "parameters", "apiVersion", "kind", "sharing", "strategy",
     "timeSlicingConfig", "spacePartitioningConfig", "interval", "partitionCount"]
)  # fmt: skip
_shaped = st.recursive(
    _json | st.sampled_from(["FromClass", "FromClaim", "gpu.example.com", "TimeSlicing", "SpacePartitioning", "Long"]),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_keys, inner, max_size=4),
    max_leaves=16,
)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(config=_shaped)
def test_any_allocation_config_gives_configs_or_a_clear_error(config):
    """Whatever the config entries hold, the answer is a config per request or a ConfigError (which
    fails the claim with its message), never another exception (which would be an Internal error)."""
    try:
        got = configs_by_request(config, "gpu.example.com", ["a", "b"])
    except GpuConfigError as exc:
        assert str(exc)
    else:
        assert set(got) == {"a", "b"}
        for c in got.values():
            c.env("gpu-0")
