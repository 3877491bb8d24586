"""The device profiles on a real node: the workloads a user writes for shared GPUs, partitions, CPU
NUMA nodes and NICs, placed by the real scheduler, prepared by the plugin the kubelet drives, the
container seeing what it was allocated, and the exporter's families reporting it.

Marked `node` (``pytest -m node``); skipped, with the reason, where the machine cannot run a node.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from otel_dra.fixtures import create
from otel_dra.kube.client import KubeClient, load_credentials
from otel_dra.kube.quantity import parse_quantity
from otel_dra.testbed import Binaries, Testbed
from otel_dra.testbed.node import Node
from tests.helpers import driver_class, parse_samples, scrape, wait_until
from tests.integration import nodes
from tests.integration.nodes import (
    NAMESPACE,
    HostPlugin,
    container_env,
    host_plugins,
    node_binaries,
    phase,
    start_plugin,
    wait_running,
)

pytestmark = [
    pytest.mark.node,
    pytest.mark.testbed,
]

GPU = "gpu.example.com"
CPU = "cpu.example.com"
NET = "net.example.com"


@pytest.fixture(scope="module")
def node_support(testbed_binaries: Binaries) -> Binaries:
    return node_binaries(testbed_binaries)


@pytest.fixture(scope="module")
def node_testbed(node_support: Binaries) -> Iterator[tuple[Testbed, Node]]:
    for testbed, node in nodes.node_testbed(node_support):
        client = KubeClient(load_credentials(str(testbed.kubeconfig)))
        create(client, driver_class(CPU))
        create(client, driver_class(NET))
        yield testbed, node


@pytest.fixture
def host_plugin(node_testbed: tuple[Testbed, Node]) -> Iterator[list[HostPlugin]]:
    yield from host_plugins()


@pytest.fixture
def client(node_testbed: tuple[Testbed, Node]) -> KubeClient:
    return KubeClient(load_credentials(str(node_testbed[0].kubeconfig)))


def _claim_pod(client: KubeClient, name: str, device_class: str, exactly: dict[str, Any] | None = None) -> None:
    """A pod with one claim (from a template) of one device of ``device_class``; ``exactly``
    adds to the request (selectors, capacity)."""
    request = {"name": "dev", "exactly": {"deviceClassName": device_class, **(exactly or {})}}
    create(
        client,
        {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaimTemplate",
            "metadata": {"name": name, "namespace": NAMESPACE},
            "spec": {"spec": {"devices": {"requests": [request]}}},
        },
    )
    pod = nodes.pod(name, [nodes.container("c", claims=("dev",))])
    pod["spec"]["resourceClaims"] = [{"name": "dev", "resourceClaimTemplateName": name}]
    create(client, pod)


def _claim_of(client: KubeClient, pod: str) -> dict[str, Any]:
    status = client.get_json(f"/api/v1/namespaces/{NAMESPACE}/pods/{pod}")["status"]
    [entry] = status["resourceClaimStatuses"]
    return client.get_json(
        f"/apis/resource.k8s.io/v1/namespaces/{NAMESPACE}/resourceclaims/{entry['resourceClaimName']}"
    )


def _result(client: KubeClient, pod: str) -> dict[str, Any]:
    [result] = _claim_of(client, pod)["status"]["allocation"]["devices"]["results"]
    return result


def _unschedulable(client: KubeClient, pod: str) -> str:
    """The scheduler's message once it has found no place for ``pod``, "" before."""
    found = client.get_json(f"/api/v1/namespaces/{NAMESPACE}/pods/{pod}")
    for condition in (found.get("status") or {}).get("conditions") or []:
        if condition.get("type") == "PodScheduled" and condition.get("status") == "False":
            return str(condition.get("message") or condition.get("reason"))
    return ""


def _delete_pods(client: KubeClient, *pods: str) -> None:
    for pod in pods:
        client.send_json("DELETE", f"/api/v1/namespaces/{NAMESPACE}/pods/{pod}", {})
    for pod in pods:
        wait_until(lambda pod=pod: phase(client, pod) == "Gone", timeout=90, what=f"pod {pod} deleted")


def _series(port: int, name: str, **labels: str) -> list[float]:
    _, text = scrape(port)
    return [v for n, lab, v in parse_samples(text) if n == name and all(lab.get(k) == x for k, x in labels.items())]


def _env_id(device: str, share: str) -> str:
    return device.upper().replace("-", "_") + "_" + share.upper().replace("-", "_")


def test_two_pods_share_one_gpu_by_memory(
    node_testbed: tuple[Testbed, Node],
    host_plugin: list[HostPlugin],
    client: KubeClient,
    tmp_path: Path,
    start_exporter_app: Any,
) -> None:
    testbed, node = node_testbed
    start_plugin(
        testbed, node, host_plugin, tmp_path / "plugin.log", "--num-devices=1", "--gpu-allow-multiple-allocations=true"
    )
    exporter = start_exporter_app(str(testbed.kubeconfig))
    pods = ("share-a", "share-b")
    for pod in pods:  # one after the other, as for NICs below
        _claim_pod(client, pod, GPU, {"capacity": {"requests": {"memory": "20Gi"}}})
        wait_running(client, pod, node)
    a, b = (_result(client, pod) for pod in pods)
    assert a["device"] == b["device"] == "gpu-0"
    assert a["shareID"] and b["shareID"] and a["shareID"] != b["shareID"]
    for pod, result in zip(pods, (a, b), strict=True):
        assert result["consumedCapacity"]["memory"] == "20Gi"
        n = "0_" + result["shareID"].upper().replace("-", "_")
        env = container_env(node, pod, "c")
        assert {
            f"GPU_DEVICE_{n}=gpu-0",
            f"GPU_DEVICE_{n}_MEMORY=20Gi",
            f"GPU_DEVICE_{n}_SHARE_ID={result['shareID']}",
        } <= env
    # The exporter: 40Gi of gpu-0's 80Gi given out, in two shares.
    memory = {"driver": GPU, "pool": node.name, "device_name": "gpu-0", "capacity": "memory"}
    wait_until(
        lambda: _series(exporter.port, "kube_resourceslice_device_allocated_capacity", **memory) == [40 * 2**30],
        timeout=30,
        what="allocated memory of gpu-0 in the exporter",
    )
    assert _series(exporter.port, "kube_resourceslice_device_free_capacity", **memory) == [40 * 2**30]
    # Each share, by its shareID.
    for result in (a, b):
        share = {"device_name": "gpu-0", "share_id": result["shareID"], "capacity": "memory"}
        assert _series(exporter.port, "kube_resourceclaim_device_consumed_capacity", **share) == [20 * 2**30]
    _delete_pods(client, *pods)


def test_partitions_of_a_gpu_and_the_whole_gpu_exclude_each_other(
    node_testbed: tuple[Testbed, Node],
    host_plugin: list[HostPlugin],
    client: KubeClient,
    tmp_path: Path,
    start_exporter_app: Any,
) -> None:
    testbed, node = node_testbed
    start_plugin(
        testbed,
        node,
        host_plugin,
        tmp_path / "plugin.log",
        "--num-devices=1",
        "--device-profile=gpu-partitionable",
        "--partitions=2",
    )
    exporter = start_exporter_app(str(testbed.kubeconfig))
    partition = {"selectors": [{"cel": {"expression": f'device.attributes["{GPU}"].type == "partition"'}}]}
    whole = {"selectors": [{"cel": {"expression": f'device.attributes["{GPU}"].type == "gpu"'}}]}
    _claim_pod(client, "part-a", GPU, partition)
    _claim_pod(client, "part-b", GPU, partition)
    for pod in ("part-a", "part-b"):
        wait_running(client, pod, node)
    devices = {_result(client, pod)["device"] for pod in ("part-a", "part-b")}
    assert devices == {"gpu-0-part-0", "gpu-0-part-1"}
    for pod in ("part-a", "part-b"):
        device = _result(client, pod)["device"]
        n = device.upper().replace("GPU-", "").replace("-", "_")
        env = container_env(node, pod, "c")
        assert {f"GPU_DEVICE_{n}={device}", f"GPU_DEVICE_{n}_PARENT=gpu-0", f"GPU_DEVICE_{n}_MEMORY=40960Mi"} <= env
    # Both halves are out: the whole GPU's counters are used up, its pod cannot be placed.
    _claim_pod(client, "whole", GPU, whole)
    message = wait_until(lambda: _unschedulable(client, "whole"), timeout=30, what="the whole-GPU pod unschedulable")
    assert phase(client, "whole") == "Pending", message
    counters = {"pool": node.name, "counter_set": "gpu-0-counters", "counter": "memory"}
    wait_until(
        lambda: _series(exporter.port, "kube_resourcepool_counter_set_free", **counters) == [0.0],
        timeout=30,
        what="gpu-0's memory counter used up in the exporter",
    )
    # Without the alpha partition type (1.37's default) every partitionable device is of type "".
    assert sum(_series(exporter.port, "kube_resourcepool_partitions_allocated", pool=node.name)) == 2
    assert sum(_series(exporter.port, "kube_resourcepool_devices_free", pool=node.name, driver=GPU)) == 0
    # One half back: still not enough for the whole GPU, which stays Pending.
    _delete_pods(client, "part-a")
    time.sleep(3)
    assert phase(client, "whole") == "Pending"
    _delete_pods(client, "part-b")
    wait_running(client, "whole", node)
    assert _result(client, "whole")["device"] == "gpu-0"
    _delete_pods(client, "whole")


def test_a_cpu_numa_node_and_its_cpu_set(
    node_testbed: tuple[Testbed, Node], host_plugin: list[HostPlugin], client: KubeClient, tmp_path: Path
) -> None:
    testbed, node = node_testbed
    start_plugin(
        testbed, node, host_plugin, tmp_path / "plugin.log", "--device-profile=cpu", f"--driver-name={CPU}", driver=CPU
    )
    _claim_pod(
        client, "numa", CPU, {"selectors": [{"cel": {"expression": f'device.attributes["{CPU}"].numaNode == 1'}}]}
    )
    wait_running(client, "numa", node)
    assert _result(client, "numa")["device"] == "numa-1"
    env = container_env(node, "numa", "c")
    assert {"CPU_DEVICE_NUMA_1=numa-1", "CPU_DEVICE_NUMA_1_CPUSET=16-31", "CPU_DEVICE_NUMA_1_NUMA_NODE=1"} <= env
    _delete_pods(client, "numa")


def test_pods_share_a_nic_by_bandwidth_until_it_is_used_up(
    node_testbed: tuple[Testbed, Node],
    host_plugin: list[HostPlugin],
    client: KubeClient,
    tmp_path: Path,
    start_exporter_app: Any,
) -> None:
    testbed, node = node_testbed
    start_plugin(
        testbed,
        node,
        host_plugin,
        tmp_path / "plugin.log",
        "--device-profile=net",
        f"--driver-name={NET}",
        "--num-devices=1",
        driver=NET,
    )
    exporter = start_exporter_app(str(testbed.kubeconfig))
    bandwidth = {"capacity": {"requests": {"bandwidth": "40G"}}}
    # One after the other: 1.34's (alpha) scheduler sometimes counts a share it is still binding
    # twice and then finds no room for a second one made at the same moment (seen 2 runs in 3).
    for pod in ("nic-a", "nic-b"):
        _claim_pod(client, pod, NET, bandwidth)
        wait_running(client, pod, node)
    for pod in ("nic-a", "nic-b"):
        result = _result(client, pod)
        n = _env_id("nic-0", result["shareID"])
        env = container_env(node, pod, "c")
        assert {f"NET_DEVICE_{n}_INTERFACE=dranet0", f"NET_DEVICE_{n}=nic-0"} <= env
        # As the API server wrote the quantity: 40G on 1.37, 39062500Ki (the same) on 1.34.
        [written] = [e.split("=", 1)[1] for e in env if e.startswith(f"NET_DEVICE_{n}_BANDWIDTH=")]
        assert written == result["consumedCapacity"]["bandwidth"]
        assert parse_quantity(written) == 40e9
    # 80G of 100G given out: a third 40G share does not fit, with no request policy default either.
    _claim_pod(client, "nic-c", NET, bandwidth)
    wait_until(lambda: _unschedulable(client, "nic-c"), timeout=30, what="the third NIC pod unschedulable")
    labels = {"driver": NET, "pool": node.name, "device_name": "nic-0", "capacity": "bandwidth"}
    wait_until(
        lambda: _series(exporter.port, "kube_resourceslice_device_free_capacity", **labels) == [20e9],
        timeout=30,
        what="free bandwidth of nic-0 in the exporter",
    )
    _delete_pods(client, "nic-a")
    wait_running(client, "nic-c", node)
    _delete_pods(client, "nic-b", "nic-c")


def test_a_pod_asks_for_a_gpu_as_an_extended_resource(
    node_testbed: tuple[Testbed, Node],
    host_plugin: list[HostPlugin],
    client: KubeClient,
    tmp_path: Path,
    start_exporter_app: Any,
) -> None:
    """The chart's DeviceClass with plugin.deviceClass.extendedResourceName: a pod asks for
    ``example.com/gpu: 1`` in its limits, no claim; the scheduler makes one and the kubelet has the
    plugin prepare it (DRAExtendedResource: the testbed turns it on in 1.34, GA in 1.37)."""
    testbed, node = node_testbed
    start_plugin(testbed, node, host_plugin, tmp_path / "plugin.log", "--num-devices=1")
    exporter = start_exporter_app(str(testbed.kubeconfig))
    device_class = driver_class(GPU)
    device_class["metadata"]["name"] = "gpu-extended"
    device_class["spec"]["extendedResourceName"] = "example.com/gpu"
    create(client, device_class)
    pod = nodes.pod("extended", [nodes.container("c")])
    pod["spec"]["containers"][0]["resources"] = {"limits": {"example.com/gpu": "1"}}
    create(client, pod)
    wait_running(client, "extended", node)
    env = container_env(node, "extended", "c")
    assert {"GPU_DEVICE_0=gpu-0", f"DRA_RESOURCE_DRIVER_NAME={GPU}"} <= env
    status = client.get_json(f"/api/v1/namespaces/{NAMESPACE}/pods/extended")["status"]
    claim_name = status.get("extendedResourceClaimStatus", {}).get("resourceClaimName")
    assert claim_name
    # The exporter tells the scheduler's claim from claims users write.
    source = {"resourceclaim_name": claim_name, "source": "extended_resource"}
    wait_until(
        lambda: _series(exporter.port, "kube_resourceclaim_source", **source) == [1.0],
        timeout=30,
        what="the extended-resource claim in the exporter",
    )
    _delete_pods(client, "extended")
    client.send_json("DELETE", "/apis/resource.k8s.io/v1/deviceclasses/gpu-extended", {})


@pytest.fixture
def binding_controllers() -> Iterator[list[Any]]:
    """In-process binding controllers a test started; stopped after it."""
    started: list[Any] = []
    yield started
    for app in started:
        app.stop()


@pytest.mark.kubernetes(
    min="1.35", reason="binding conditions are alpha (the testbed turns them on) in 1.34; tried from 1.35"
)
def test_a_pod_waits_for_its_device_to_attach_then_runs_and_the_claim_says_so(
    node_testbed: tuple[Testbed, Node],
    host_plugin: list[HostPlugin],
    client: KubeClient,
    tmp_path: Path,
    start_exporter_app: Any,
    binding_controllers: list[Any],
) -> None:
    from otel_dra.cli.binding_controller import start_binding_controller

    testbed, node = node_testbed
    start_plugin(testbed, node, host_plugin, tmp_path / "plugin.log", "--num-devices=1", "--binding-conditions=true")
    exporter = start_exporter_app(str(testbed.kubeconfig))
    binding_controllers.append(start_binding_controller(kubeconfig=str(testbed.kubeconfig), attach_delay=3.0))
    created = time.monotonic()
    _claim_pod(client, "attached", GPU)
    seconds = wait_running(client, "attached", node)
    # Not bound before the attachment: the scheduler held it in PreBind for the delay.
    assert time.monotonic() - created >= 3.0
    claim = _claim_of(client, "attached")
    [result] = claim["status"]["allocation"]["devices"]["results"]
    assert result["bindingConditions"] == ["Attached"]

    def entry() -> dict[str, Any] | None:
        found = _claim_of(client, "attached")
        devices = (found.get("status") or {}).get("devices") or []
        return (
            devices[0] if devices and {"Attached", "Ready"} <= {c["type"] for c in devices[0]["conditions"]} else None
        )

    # The controller's Attached and the plugin's Ready (and data) live in one entry.
    device_status = wait_until(entry, timeout=30, what="Attached and Ready in the claim's status.devices")
    assert {(c["type"], c["status"]) for c in device_status["conditions"]} >= {("Attached", "True"), ("Ready", "True")}
    assert device_status["data"]["uuid"].startswith("gpu-")
    name = claim["metadata"]["name"]
    wait_until(
        lambda: (
            _series(
                exporter.port, "kube_resourceclaim_device_binding_state", resourceclaim_name=name, state="satisfied"
            )
            == [1.0]
        ),
        timeout=30,
        what="the binding state in the exporter",
    )
    ready = {"resourceclaim_name": name, "condition": "Ready", "status": "true"}
    assert _series(exporter.port, "kube_resourceclaim_status_device_condition", **ready) == [1.0]
    print(f"\npod with binding conditions Running {seconds:.1f}s after creation (attach delay 3s)")
    _delete_pods(client, "attached")


@pytest.mark.kubernetes(
    min="1.35", reason="binding conditions are alpha (the testbed turns them on) in 1.34; tried from 1.35"
)
def test_a_failed_attachment_sends_the_pod_back_to_the_scheduler(
    node_testbed: tuple[Testbed, Node],
    host_plugin: list[HostPlugin],
    client: KubeClient,
    tmp_path: Path,
    binding_controllers: list[Any],
) -> None:
    from otel_dra.cli.binding_controller import start_binding_controller

    testbed, node = node_testbed
    start_plugin(testbed, node, host_plugin, tmp_path / "plugin.log", "--num-devices=1", "--binding-conditions=true")
    binding_controllers.append(
        start_binding_controller(kubeconfig=str(testbed.kubeconfig), attach_delay=1.0, failure_fraction=1.0)
    )
    _claim_pod(client, "never-attached", GPU)

    def failed_binding_seen() -> bool:
        events = client.get_json(f"/api/v1/namespaces/{NAMESPACE}/events")["items"]
        return any(
            e["involvedObject"].get("name") == "never-attached" and "binding" in (e.get("message") or "").lower()
            for e in events
            if e.get("reason") == "FailedScheduling"
        )

    wait_until(failed_binding_seen, timeout=60, what="the scheduler giving the failed allocation up")
    found = client.get_json(f"/api/v1/namespaces/{NAMESPACE}/pods/never-attached")
    assert not found["spec"].get("nodeName") and phase(client, "never-attached") == "Pending"
    _delete_pods(client, "never-attached")
