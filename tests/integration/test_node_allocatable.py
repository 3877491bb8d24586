"""The cpu profile's node-allocatable mappings on a real node with DRANodeAllocatableResources on
(alpha since 1.36): the kubelet declares the feature on its Node, the API server then takes the
plugin's mappings, kube-scheduler counts each allocated NUMA node against the node's allocatable
cpu, and the exporter reports the mappings. A node of its own: the gate is the whole cluster's.

Marked `node`; skipped, with the reason, where the machine cannot run a node.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from otel_dra.fixtures import create
from otel_dra.kube.client import KubeClient, load_credentials
from otel_dra.testbed import Binaries, Testbed
from otel_dra.testbed.controlplane import release_settings
from otel_dra.testbed.node import Node
from tests.helpers import driver_class, parse_samples, scrape, wait_until
from tests.integration import nodes
from tests.integration.nodes import NAMESPACE, HostPlugin, container_env, host_plugins, node_binaries, start_plugin

pytestmark = [
    pytest.mark.node,
    pytest.mark.testbed,
    pytest.mark.kubernetes(min="1.37", reason="DRANodeAllocatableResources with the gates of 1.37 and later"),
]

CPU = "cpu.example.com"


@pytest.fixture(scope="module")
def node_support(testbed_binaries: Binaries) -> Binaries:
    return node_binaries(testbed_binaries)


@pytest.fixture(scope="module")
def node_testbed(node_support: Binaries) -> Iterator[tuple[Testbed, Node]]:
    gates = {**release_settings().feature_gates, "DRANodeAllocatableResources": True}
    for testbed, node in nodes.node_testbed(node_support, feature_gates=gates):
        create(KubeClient(load_credentials(str(testbed.kubeconfig))), driver_class(CPU))
        yield testbed, node


@pytest.fixture
def host_plugin(node_testbed: tuple[Testbed, Node]) -> Iterator[list[HostPlugin]]:
    yield from host_plugins()


def _numa_pod(client: KubeClient, name: str, numa_node: int) -> None:
    selector = {"cel": {"expression": f'device.attributes["{CPU}"].numaNode == {numa_node}'}}
    request = {"name": "cpu", "exactly": {"deviceClassName": CPU, "selectors": [selector]}}
    claim = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": NAMESPACE},
        "spec": {"devices": {"requests": [request]}},
    }
    create(client, claim)
    pod = nodes.pod(name, [nodes.container("c", claims=("cpu",))])
    pod["spec"]["resourceClaims"] = [{"name": "cpu", "resourceClaimName": name}]
    create(client, pod)


def test_numa_nodes_count_against_the_nodes_allocatable_cpu(
    node_testbed: tuple[Testbed, Node], host_plugin: list[HostPlugin], tmp_path: Path, start_exporter_app: Any
) -> None:
    testbed, node = node_testbed
    client = KubeClient(load_credentials(str(testbed.kubeconfig)))
    found = client.get_json(f"/api/v1/nodes/{node.name}")
    assert "DRANodeAllocatableResources" in (found["status"].get("declaredFeatures") or [])
    allocatable = float(found["status"]["allocatable"]["cpu"])
    # NUMA nodes of 1 CPU fit this machine; one of more CPUs than the node has cannot be placed.
    big = int(allocatable) + 1
    start_plugin(
        testbed,
        node,
        host_plugin,
        tmp_path / "plugin.log",
        "--device-profile=cpu",
        f"--driver-name={CPU}",
        "--cpus-per-numa-node=1",
        driver=CPU,
    )
    [held] = nodes.node_slices(client, node, CPU)
    mapping = {"cpu": {"mapping": {"deviceMultiplier": "1"}}}
    assert [d.get("nodeAllocatableResources") for d in held["spec"]["devices"]] == [mapping, mapping]
    exporter = start_exporter_app(str(testbed.kubeconfig))
    _numa_pod(client, "numa-fits", 1)
    nodes.wait_running(client, "numa-fits", node)
    assert "CPU_DEVICE_NUMA_1_CPUSET=1" in container_env(node, "numa-fits", "c")

    def mappings() -> list[float]:
        _, text = scrape(exporter.port)
        return [
            v
            for n, lab, v in parse_samples(text)
            if n == "kube_resourceslice_device_node_allocatable" and lab.get("pool") == node.name
        ]

    wait_until(lambda: mappings() == [1.0, 1.0], timeout=30, what="the mappings in the exporter")
    client.send_json("DELETE", f"/api/v1/namespaces/{NAMESPACE}/pods/numa-fits", {})
    wait_until(lambda: nodes.phase(client, "numa-fits") == "Gone", timeout=90, what="pod deleted")
    client.send_json("DELETE", f"/apis/resource.k8s.io/v1/namespaces/{NAMESPACE}/resourceclaims/numa-fits", {})

    # The plugin again with NUMA nodes bigger than the node: the scheduler refuses for lack of cpu.
    host_plugin.pop().kill()
    start_plugin(
        testbed,
        node,
        host_plugin,
        tmp_path / "plugin-big.log",
        "--device-profile=cpu",
        f"--driver-name={CPU}",
        f"--cpus-per-numa-node={big}",
        driver=CPU,
    )
    wait_until(
        lambda: (
            [
                d.get("nodeAllocatableResources")
                for s in nodes.node_slices(client, node, CPU)
                for d in s["spec"]["devices"]
            ][:1]
            == [{"cpu": {"mapping": {"deviceMultiplier": str(big)}}}]
        ),
        timeout=30,
        what="the bigger NUMA nodes published",
    )
    _numa_pod(client, "numa-too-big", 0)

    def unschedulable() -> str:
        pod = client.get_json(f"/api/v1/namespaces/{NAMESPACE}/pods/numa-too-big")
        for condition in (pod.get("status") or {}).get("conditions") or []:
            if condition.get("type") == "PodScheduled" and condition.get("status") == "False":
                return str(condition.get("message"))
        return ""

    message = wait_until(unschedulable, timeout=30, what="the too-big NUMA pod unschedulable")
    assert "cpu" in message.lower(), message
    client.send_json("DELETE", f"/api/v1/namespaces/{NAMESPACE}/pods/numa-too-big", {})
    wait_until(lambda: nodes.phase(client, "numa-too-big") == "Gone", timeout=90, what="pod deleted")
