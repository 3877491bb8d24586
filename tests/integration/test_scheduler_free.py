"""The free-device count against the real kube-scheduler: per node, the scheduler allocates exactly
as many more one-device claims as ``kube_resourcepool_devices_free`` says, then refuses."""

from __future__ import annotations

import contextlib
from typing import Any

from otel_dra.fixtures import create
from otel_dra.kube.client import ApiError, KubeClient, load_credentials
from tests.helpers import driver_class, parse_samples, place, ready_node, scrape, shaped_for_testbed, wait_until

DRIVER = "free.example.com"
NS = "sched-free"


def _slice(node: str, devices: list[dict[str, Any]], counters: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "driver": DRIVER,
        "nodeName": node,
        "pool": {"name": node, "generation": 1, "resourceSliceCount": 1},
        "devices": devices,
    }
    if counters:
        spec["sharedCounters"] = counters
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": f"{node}-free"},
        "spec": spec,
    }


def _half(name: str) -> dict[str, Any]:
    return {
        "name": name,
        "attributes": {"kind": {"string": "half"}},
        "consumesCounters": [{"counterSet": "gpu", "counters": {"memory": {"value": "40Gi"}}}],
    }


# Node -> its slice. free-a: four devices, one tainted, one taken below; free-b: three plain
# devices; free-c: one GPU that is either whole or two halves (shared counters), one half taken below.
SLICES = {
    "sched-free-a": _slice(
        "sched-free-a",
        [
            {"name": "f0"},
            {"name": "f1"},
            {"name": "f2"},
            {"name": "f3", "taints": [{"key": "example.com/broken", "effect": "NoSchedule"}]},
        ],
    ),
    "sched-free-b": _slice("sched-free-b", [{"name": "g0"}, {"name": "g1"}, {"name": "g2"}]),
    "sched-free-c": _slice(
        "sched-free-c",
        [
            {
                "name": "whole",
                "attributes": {"kind": {"string": "whole"}},
                "consumesCounters": [{"counterSet": "gpu", "counters": {"memory": {"value": "80Gi"}}}],
            },
            _half("half-0"),
            _half("half-1"),
        ],
        counters=[{"name": "gpu", "counters": {"memory": {"value": "80Gi"}}}],
    ),
}
# What the exporter should say once the two pre-allocations are in, by hand.
EXPECTED_FREE = {"sched-free-a": 2, "sched-free-b": 3, "sched-free-c": 1}


def _free(port: int) -> dict[str, float]:
    code, text = scrape(port)
    assert code == 200
    return {
        labels["node_name"]: value
        for name, labels, value in parse_samples(text)
        if name == "kube_resourcepool_devices_free" and labels["driver"] == DRIVER
    }


def test_free_count_matches_what_the_scheduler_can_still_allocate(testbed_sched, start_exporter_app):
    client = KubeClient(load_credentials(str(testbed_sched.kubeconfig)))
    with contextlib.suppress(ApiError):
        client.send_json("POST", "/api/v1/namespaces", {"metadata": {"name": NS}})
    for node, slice_ in SLICES.items():
        ready_node(client, node)
        for shaped in shaped_for_testbed(slice_):  # 1.35+: free-c's counters in a slice of their own
            create(client, shaped)
    create(client, driver_class(DRIVER))
    try:
        app = start_exporter_app(str(testbed_sched.kubeconfig))
        wait_until(lambda: app.state.not_synced() is None, what="sync")
        assert wait_until(lambda: _free(app.port) == {"sched-free-a": 3, "sched-free-b": 3, "sched-free-c": 3})
        # Take one device on free-a, and one half of the GPU on free-c.
        assert place(client, NS, "pre-a", "sched-free-a", DRIVER)
        assert place(client, NS, "pre-c", "sched-free-c", DRIVER, f"device.attributes['{DRIVER}'].kind == 'half'")
        free = wait_until(
            lambda: (f := _free(app.port)) == EXPECTED_FREE and f, what="free counts after two allocations"
        )

        for node, count in free.items():
            placed = 0
            while place(client, NS, f"more-{node}-{placed}", node, DRIVER):
                placed += 1
                assert placed <= count, f"the scheduler placed more on {node} than the {count} free devices"
            assert placed == count, f"{node}: exporter said {count} free, the scheduler allocated {placed}"
        assert wait_until(lambda: set(_free(app.port).values()) == {0.0}, what="no free devices left")
    finally:
        for path in (
            f"/api/v1/namespaces/{NS}/pods",
            f"/apis/resource.k8s.io/v1/namespaces/{NS}/resourceclaims",
        ):
            with contextlib.suppress(ApiError):
                client.request("DELETE", path, query={"gracePeriodSeconds": 0})
        for slice_ in SLICES.values():
            for shaped in shaped_for_testbed(slice_):
                with contextlib.suppress(ApiError):
                    client.request("DELETE", f"/apis/resource.k8s.io/v1/resourceslices/{shaped['metadata']['name']}")
        with contextlib.suppress(ApiError):
            client.request("DELETE", f"/apis/resource.k8s.io/v1/deviceclasses/{DRIVER}")
