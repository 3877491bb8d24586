"""Every device profile's slices against the real API server of the testbed's release: accepted,
what the release cannot hold left out once (and the pool still right), and stable afterwards (the
next resync writes nothing). The workloads on a real kubelet: test_node_profiles.py."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import pytest

from otel_dra.kube.client import KubeClient, load_credentials
from otel_dra.plugin.devices import NODE_ALLOCATABLE, PARTITION_TYPE, PARTITIONABLE, Device, Pool, without
from otel_dra.plugin.profiles import ProfileOptions, build
from otel_dra.plugin.slices import SLICES_PATH, SlicePublisher
from otel_dra.testbed import Binaries, Testbed, running
from otel_dra.testbed.build import kubernetes_release, version_key
from otel_dra.testbed.controlplane import release_settings
from tests.helpers import parse_samples, scrape, wait_until

pytestmark = pytest.mark.testbed

DRIVER = "gpu.example.com"

CASES = {
    "gpu": ProfileOptions("gpu", count=2),
    "gpu-shared": ProfileOptions("gpu", count=2, allow_multiple=True),
    "gpu-partitionable": ProfileOptions("gpu-partitionable", count=10, partitions=4),
    "cpu": ProfileOptions("cpu", count=2),
    "net": ProfileOptions("net", count=2),
    "net-binding": ProfileOptions("net", count=1, binding_conditions=True),
    "gpu-partitionable-binding": ProfileOptions("gpu-partitionable", count=1, binding_conditions=True),
}


def _expected_off(pool: Pool) -> set[str] | None:
    """What the testbed's release leaves out of ``pool``: the alpha features that are off (1.37
    on) or that it does not have (1.34); None where this test does not know (1.35, 1.36). The
    testbed turns 1.34's alpha DRA gates on (partitionable devices, consumable capacity, binding
    conditions), and 1.37+ has them on by default."""
    minor = version_key(kubernetes_release().minor)
    if minor == (1, 34) or minor >= (1, 37):
        return pool.features() & {PARTITION_TYPE, NODE_ALLOCATABLE}
    return None


def _own(client: KubeClient, node: str) -> list[dict[str, Any]]:
    items = client.get_json(SLICES_PATH, {"fieldSelector": f"spec.nodeName={node}"})["items"]
    return sorted(items, key=lambda s: s["metadata"]["name"])


@pytest.mark.parametrize("case", list(CASES))
def test_each_profile_is_published_as_the_release_can_hold_it(
    admin_client: KubeClient, case: str, caplog: pytest.LogCaptureFixture
) -> None:
    node = f"profiles-{case}"
    pool = build(node, DRIVER, CASES[case])
    seen: list[list[Device]] = []
    publisher = SlicePublisher(
        admin_client, driver_name=DRIVER, node_name=node, discover=lambda: pool, on_devices=seen.append
    )
    try:
        with caplog.at_level(logging.WARNING, logger="otel_dra.plugin.slices"):
            assert publisher.sync() is True
        expected = _expected_off(pool)
        if expected is not None:
            assert publisher.features_off == expected
        # Said once per feature, naming its gate.
        for feature in publisher.features_off:
            assert sum("does not take" in r.getMessage() and feature in _fields_named(r) for r in caplog.records) >= 1
        held = without(pool, publisher.features_off)
        # What prepare accepts is what is published.
        assert [d.name for d in seen[-1]] == [d.name for d in held.devices]
        slices = _own(admin_client, node)
        devices = [d for s in slices for d in s["spec"].get("devices") or []]
        assert [d["name"] for d in devices] == [d.name for d in held.devices]
        assert {s["spec"]["pool"]["resourceSliceCount"] for s in slices} == {len(slices)}
        if PARTITIONABLE in pool.features() and PARTITIONABLE not in publisher.features_off:
            counter_sets = [c["name"] for s in slices for c in s["spec"].get("sharedCounters") or []]
            assert sorted(counter_sets) == sorted(c.name for c in pool.counter_sets)
            if version_key(kubernetes_release().minor) >= (1, 35):
                assert all(not (s["spec"].get("sharedCounters") and s["spec"].get("devices")) for s in slices)
            consumed = {c["counterSet"] for d in devices for c in d.get("consumesCounters") or []}
            assert consumed == set(counter_sets)
        for d, api in zip(held.devices, devices, strict=True):
            assert api.get("allowMultipleAllocations") == (d.allow_multiple_allocations or None)
            assert api.get("bindingConditions") == (list(d.binding_conditions) or None)
        # Stable: the next resync compares equal and writes nothing.
        assert publisher.sync() is False
        assert publisher.sync() is False
    finally:
        publisher.delete_all()


def _fields_named(record: logging.LogRecord) -> str:
    from otel_dra.plugin.slices import FEATURE_FIELDS

    text = record.getMessage()
    return " ".join(f for f, names in FEATURE_FIELDS.items() if "/".join(names) in text)


@pytest.fixture(scope="module")
def alpha_testbed(tmp_path_factory: pytest.TempPathFactory, testbed_binaries: Binaries) -> Iterator[Testbed]:
    """A control plane with the alpha gates of the partition type and node-allocatable resources on."""
    gates = {
        **release_settings().feature_gates,
        "DRAPartitionableDevicesType": True,
        "DRAResourcePoolStatus": True,  # which DRAPartitionableDevicesType depends on
        "DRANodeAllocatableResources": True,
    }
    with running(tmp_path_factory.mktemp("alpha"), binaries=testbed_binaries, feature_gates=gates) as testbed:
        yield testbed


@pytest.mark.kubernetes(min="1.37", reason="DRAPartitionableDevicesType is new in 1.37")
def test_with_the_alpha_gates_on_nothing_is_left_out_and_the_exporter_sees_partition_types(
    alpha_testbed: Testbed, start_exporter_app: Any
) -> None:
    client = KubeClient(load_credentials(str(alpha_testbed.kubeconfig)))
    exporter = start_exporter_app(str(alpha_testbed.kubeconfig))
    for profile, node in (("gpu-partitionable", "alpha-gpu"), ("cpu", "alpha-cpu")):
        # With DRANodeAllocatableResources on, a slice whose devices map node resources must name a
        # Node that declares the feature (its kubelet does, where its gate is on).
        client.send_json("POST", "/api/v1/nodes", {"apiVersion": "v1", "kind": "Node", "metadata": {"name": node}})
        client.send_json(
            "PATCH",
            f"/api/v1/nodes/{node}/status",
            {"status": {"declaredFeatures": ["DRANodeAllocatableResources"]}},
            content_type="application/merge-patch+json",
        )
        pool = build(node, DRIVER, ProfileOptions(profile, count=2))
        publisher = SlicePublisher(client, driver_name=DRIVER, node_name=node, discover=lambda pool=pool: pool)
        assert publisher.sync() is True
        assert publisher.features_off == set()
        assert publisher.sync() is False
    slices = _own(client, "alpha-gpu")
    assert {s["spec"].get("partitionTypeAttribute") for s in slices if s["spec"].get("devices")} == {
        f"{DRIVER}/profile"
    }
    [cpu_slice] = _own(client, "alpha-cpu")
    assert cpu_slice["spec"]["devices"][0]["nodeAllocatableResources"] == {
        "cpu": {"mapping": {"deviceMultiplier": "16"}}
    }

    def partitions() -> dict[str, float]:
        _, text = scrape(exporter.port)
        return {
            lab["partition_type"]: v
            for n, lab, v in parse_samples(text)
            if n == "kube_resourcepool_partitions" and lab.get("pool") == "alpha-gpu"
        }

    # Per GPU one whole device and two halves, each shape its own partition type.
    wait_until(lambda: partitions() == {"full": 2.0, "1of2": 4.0}, timeout=30, what="partition types in the exporter")

    def mappings() -> list[tuple[str, str, str, float]]:
        _, text = scrape(exporter.port)
        return sorted(
            (lab["device_name"], lab["resource"], lab["kind"], v)
            for n, lab, v in parse_samples(text)
            if n == "kube_resourceslice_device_node_allocatable" and lab.get("pool") == "alpha-cpu"
        )

    expected = [("numa-0", "cpu", "per_device", 16.0), ("numa-1", "cpu", "per_device", 16.0)]
    wait_until(lambda: mappings() == expected, timeout=30, what="node-allocatable mappings in the exporter")


@pytest.mark.kubernetes(min="1.37", reason="DRANodeAllocatableResources (1.36) with the 1.37 gate set")
def test_a_node_without_the_node_allocatable_feature_gets_its_numa_nodes_without_mappings(
    alpha_testbed: Testbed, caplog: pytest.LogCaptureFixture
) -> None:
    """The API server's admission refuses (403) node-allocatable mappings for a Node that does not
    declare the feature (its kubelet has the gate off): the mapping is left out, said once, and the
    NUMA nodes are published without it instead of retrying forever."""
    client = KubeClient(load_credentials(str(alpha_testbed.kubeconfig)))
    node = "alpha-old-kubelet"
    client.send_json("POST", "/api/v1/nodes", {"apiVersion": "v1", "kind": "Node", "metadata": {"name": node}})
    pool = build(node, DRIVER, ProfileOptions("cpu", count=2))
    publisher = SlicePublisher(client, driver_name=DRIVER, node_name=node, discover=lambda: pool)
    with caplog.at_level(logging.WARNING, logger="otel_dra.plugin.slices"):
        assert publisher.sync() is True
    assert publisher.features_off == {NODE_ALLOCATABLE}
    assert any("does not support DRANodeAllocatableResources" in r.getMessage() for r in caplog.records)
    [held] = _own(client, node)
    assert [d["name"] for d in held["spec"]["devices"]] == ["numa-0", "numa-1"]
    assert not any("nodeAllocatableResources" in d for d in held["spec"]["devices"])
    assert publisher.sync() is False
