"""Every device profile's slices against the real API server of the testbed's release: accepted,
what the release cannot hold left out once (and the pool still right), and stable afterwards (the
next resync writes nothing). The workloads on a real kubelet: test_node_profiles.py."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from otel_dra.kube.client import KubeClient
from otel_dra.plugin.devices import NODE_ALLOCATABLE, PARTITION_TYPE, PARTITIONABLE, Device, Pool, without
from otel_dra.plugin.profiles import ProfileOptions, build
from otel_dra.plugin.slices import SLICES_PATH, SlicePublisher
from otel_dra.testbed.build import kubernetes_release, version_key

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
