"""The free-device count against the real kube-scheduler: per node, the scheduler allocates exactly
as many more one-device claims as ``kube_resourcepool_devices_free`` says, then refuses. Since
Kubernetes 1.38 a capacity in the driver's domain may be named with or without it: the consumed
capacity the scheduler writes is joined to the device's, whichever spelling either side uses."""

from __future__ import annotations

import contextlib
from typing import Any

import pytest

from otel_dra.fixtures import create
from otel_dra.kube.client import ApiError, KubeClient, load_credentials
from otel_dra.kube.quantity import parse_quantity
from tests.helpers import (
    claim_pod,
    driver_class,
    node_slice,
    parse_samples,
    place,
    ready_node,
    scheduler_placed,
    scrape,
    shaped_for_testbed,
    wait_until,
)

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


# --- capacity names with and without the driver's domain (Kubernetes 1.38) ----------------------------
CAP = "cap.example.com"
CAP_NS = CAP_NODE = "sched-cap"
GI = 2**30


def _shared(name: str, capacity_key: str) -> dict[str, Any]:
    """A shareable device whose 8Gi memory is published as ``capacity_key``; a share that names no
    amount takes 2Gi."""
    return {
        "name": name,
        "attributes": {"nic": {"string": name}},
        "allowMultipleAllocations": True,
        "capacity": {capacity_key: {"value": "8Gi", "requestPolicy": {"default": "2Gi", "validRange": {"min": "1Gi"}}}},
    }


def _share_claim(name: str, device: str, request_key: str | None) -> dict[str, Any]:
    """A claim for a share of ``device``: 3Gi of memory named ``request_key``, or the default."""
    exactly: dict[str, Any] = {
        "deviceClassName": CAP,
        "selectors": [{"cel": {"expression": f"device.attributes['{CAP}'].nic == '{device}'"}}],
    }
    if request_key is not None:
        exactly["capacity"] = {"requests": {request_key: "3Gi"}}
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": CAP_NS},
        "spec": {"devices": {"requests": [{"name": "nic", "exactly": exactly}]}},
    }


def _share(client: KubeClient, name: str, device: str, request_key: str | None) -> bool:
    create(client, _share_claim(name, device, request_key))
    create(client, claim_pod(name, CAP_NS, name, node=CAP_NODE))
    return scheduler_placed(client, CAP_NS, name)


def _consumed_by_device(client: KubeClient) -> dict[str, float]:
    """What the scheduler wrote: the sum of every consumedCapacity value per device (one capacity
    per device here, whichever key it is written under)."""
    out: dict[str, float] = {}
    for claim in client.get_json(f"/apis/resource.k8s.io/v1/namespaces/{CAP_NS}/resourceclaims")["items"]:
        allocation = (claim.get("status") or {}).get("allocation") or {}
        for r in (allocation.get("devices") or {}).get("results") or []:
            for value in (r.get("consumedCapacity") or {}).values():
                out[r["device"]] = out.get(r["device"], 0.0) + parse_quantity(value)
    return out


def _cap_series(port: int, family: str) -> dict[tuple[str, str], float]:
    code, text = scrape(port)
    assert code == 200
    return {
        (labels["device_name"], labels.get("capacity", "")): value
        for name, labels, value in parse_samples(text)
        if name == family and labels.get("driver") == CAP
    }


@pytest.mark.kubernetes(
    min="1.38", reason="a capacity's domain prefix may be omitted when it is the driver's from 1.38"
)
def test_either_spelling_of_a_capacity_is_one_capacity_for_the_scheduler_and_the_exporter(
    testbed_sched, start_exporter_app
):
    """Two shareable devices, one publishing ``memory``, the other ``cap.example.com/memory``;
    shares requested in both spellings on both. The exporter's allocated and free capacity is what
    the scheduler wrote into consumedCapacity, labelled as the slice publishes it, and a device is
    counted free exactly while the scheduler still places a default share on it."""
    client = KubeClient(load_credentials(str(testbed_sched.kubeconfig)))
    with contextlib.suppress(ApiError):
        client.send_json("POST", "/api/v1/namespaces", {"metadata": {"name": CAP_NS}})
    ready_node(client, CAP_NODE)
    slice_ = node_slice(
        "sched-cap-slice", CAP, CAP_NODE, devices=[_shared("bare", "memory"), _shared("qualified", f"{CAP}/memory")]
    )
    create(client, slice_)
    create(client, driver_class(CAP))
    try:
        app = start_exporter_app(str(testbed_sched.kubeconfig))
        wait_until(lambda: app.state.not_synced() is None, what="sync")
        for device in ("bare", "qualified"):
            assert _share(client, f"{device}-short", device, "memory")
            assert _share(client, f"{device}-long", device, f"{CAP}/memory")
        written = _consumed_by_device(client)
        assert written == {"bare": 6.0 * GI, "qualified": 6.0 * GI}, written
        expected = {("bare", "memory"): 6.0 * GI, ("qualified", f"{CAP}/memory"): 6.0 * GI}
        wait_until(
            lambda: _cap_series(app.port, "kube_resourceslice_device_allocated_capacity") == expected,
            what="allocated capacity joined in either spelling",
        )
        assert _cap_series(app.port, "kube_resourceslice_device_free_capacity") == {k: 2.0 * GI for k in expected}
        # 6 + 2 <= 8: both devices still take a default share, then neither does.
        wait_until(lambda: _free_cap(app.port) == 2.0, what="both devices free for a default share")
        for device in ("bare", "qualified"):
            assert _share(client, f"{device}-default", device, None)
            assert not _share(client, f"{device}-refused", device, None), f"{device}: more shares than capacity"
        wait_until(lambda: _free_cap(app.port) == 0.0, what="no device free once both are full")
    finally:
        for path in (
            f"/api/v1/namespaces/{CAP_NS}/pods",
            f"/apis/resource.k8s.io/v1/namespaces/{CAP_NS}/resourceclaims",
        ):
            with contextlib.suppress(ApiError):
                client.request("DELETE", path, query={"gracePeriodSeconds": 0})
        with contextlib.suppress(ApiError):
            client.request("DELETE", "/apis/resource.k8s.io/v1/resourceslices/sched-cap-slice")
        with contextlib.suppress(ApiError):
            client.request("DELETE", f"/apis/resource.k8s.io/v1/deviceclasses/{CAP}")


def _free_cap(port: int) -> float | None:
    code, text = scrape(port)
    assert code == 200
    values = [v for n, lbl, v in parse_samples(text) if n == "kube_resourcepool_devices_free" and lbl["driver"] == CAP]
    return values[0] if values else None
