"""Shared counters are pool-wide since Kubernetes 1.35: the example measured in
kubernetes-current.md, against the real kube-scheduler. A counters slice defines one GPU's memory
(80Gi); a device slice of the same pool publishes it whole or as two halves. The exporter's free
counts must be what the scheduler can still allocate, and a pool whose device consumes a counter
set that no slice defines is invalid for both. Three shards together serve what one exporter serves.

Runs when the testbed is Kubernetes 1.35 or newer (``OTEL_DRA_KUBERNETES_VERSION=1.37``): 1.34's
API server rejects a device that consumes a counter set of another slice.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from typing import Any

import pytest

from otel_dra.cluster.sharding import Shard
from otel_dra.fixtures import create
from otel_dra.kube.client import ApiError, KubeClient, load_credentials
from otel_dra.testbed.controlplane import release_settings
from tests.helpers import driver_class, node_slice, parse_samples, place, ready_node, scrape, wait_until

pytestmark = pytest.mark.kubernetes(min="1.35", reason="counter sets are pool-wide since Kubernetes 1.35")

DRIVER = "counters.example.com"
NS = "shared-counters"
NODE, BAD_NODE = "counters-p", "counters-q"
GI = 2**30
HALF = f"device.attributes['{DRIVER}'].profile == 'half'"


def _slice(name: str, pool: str, count: int, **spec: Any) -> dict[str, Any]:
    return node_slice(name, DRIVER, pool, count, **spec)


def _partition(name: str, memory: str, profile: str, counter_set: str = "gpu-0-counters") -> dict[str, Any]:
    return {
        "name": name,
        "attributes": {"profile": {"string": profile}},
        "capacity": {"memory": {"value": memory}},
        "consumesCounters": [{"counterSet": counter_set, "counters": {"memory": {"value": memory}}}],
    }


SLICES = [
    _slice(
        f"{NODE}-counters",
        NODE,
        2,
        sharedCounters=[{"name": "gpu-0-counters", "counters": {"memory": {"value": "80Gi"}}}],
    ),
    _slice(
        f"{NODE}-devices",
        NODE,
        2,
        devices=[
            _partition("gpu-0-full", "80Gi", "full"),
            _partition("gpu-0-half-a", "40Gi", "half"),
            _partition("gpu-0-half-b", "40Gi", "half"),
        ],
    ),
    # Its device consumes a counter set that no slice of the pool defines.
    _slice(f"{BAD_NODE}-devices", BAD_NODE, 1, devices=[_partition("orphan", "40Gi", "half", "gpu-9-counters")]),
]


def _pools(port: int) -> dict[tuple[str, str], float]:
    """(family, pool) -> value of the driver's pool series (counter sets: memory only)."""
    code, text = scrape(port)
    assert code == 200
    return {
        (name, labels["pool"]): value
        for name, labels, value in parse_samples(text)
        if labels.get("driver") == DRIVER
        and name.startswith(("kube_resourcepool_", "kube_resourceslice_counter_set_free"))
        and labels.get("counter", "memory") == "memory"
    }


def _expect(port: int, **wanted: float) -> None:
    """Wait until pool NODE's series have these values (keys: Prometheus names without ``kube_``)."""
    wait_until(
        lambda: {k: _pools(port).get((f"kube_{k}", NODE)) for k in wanted} == wanted,
        timeout=30,
        what=f"the exporter to report {wanted}",
    )


def _series(port: int) -> Counter[tuple[str, tuple[tuple[str, str], ...], float]]:
    code, text = scrape(port)
    assert code == 200
    return Counter(
        (name, tuple(sorted(labels.items())), value)
        for name, labels, value in parse_samples(text)
        # The cluster-state series; the exporter's own latency histograms (otel_dra_claim_*) count
        # what each replica observed, so shards' buckets do not add up to one series each.
        if labels.get("driver") == DRIVER and not name.startswith("otel_dra_")
    )


def _allocated(client: KubeClient, name: str) -> str:
    claim = client.get_json(f"/apis/resource.k8s.io/v1/namespaces/{NS}/resourceclaims/{name}")
    (result,) = claim["status"]["allocation"]["devices"]["results"]
    return str(result["device"])


def _delete_pod_and_claim(client: KubeClient, name: str) -> None:
    for path in (
        f"/api/v1/namespaces/{NS}/pods/{name}",
        f"/apis/resource.k8s.io/v1/namespaces/{NS}/resourceclaims/{name}",
    ):
        with contextlib.suppress(ApiError):
            client.request("DELETE", path, query={"gracePeriodSeconds": 0})


def test_pool_wide_counters_match_what_the_scheduler_allocates(testbed_sched, start_exporter_app):
    client = KubeClient(load_credentials(str(testbed_sched.kubeconfig)))
    with contextlib.suppress(ApiError):
        client.send_json("POST", "/api/v1/namespaces", {"metadata": {"name": NS}})
    for node in (NODE, BAD_NODE):
        ready_node(client, node)
    for obj in SLICES:
        create(client, obj)
    device_class = driver_class(DRIVER)
    create(client, device_class)
    rule_api = release_settings().served_taint_rule_api
    rule_path = f"/apis/{rule_api}/devicetaintrules/{NS}"
    try:
        app = start_exporter_app(str(testbed_sched.kubeconfig))
        wait_until(lambda: app.state.not_synced() is None, what="sync")
        _expect(app.port, resourcepool_devices_free=3, resourcepool_counter_set_free=80 * GI, resourcepool_invalid=0)
        assert wait_until(lambda: _pools(app.port).get(("kube_resourcepool_invalid", BAD_NODE)) == 1.0)

        # One half taken: the scheduler refuses the full GPU, so one device (the other half) is free.
        assert place(client, NS, "first-half", NODE, DRIVER, HALF)
        other = {"gpu-0-half-a": "gpu-0-half-b", "gpu-0-half-b": "gpu-0-half-a"}[_allocated(client, "first-half")]
        _expect(
            app.port,
            resourcepool_devices_free=1,
            resourcepool_counter_set_free=40 * GI,
            resourcepool_counter_set_capacity=80 * GI,
            resourceslice_counter_set_free=40 * GI,
        )

        # A NoSchedule DeviceTaintRule on the other half: nothing is free, and the scheduler agrees.
        rule = {
            "apiVersion": rule_api,
            "kind": "DeviceTaintRule",
            "metadata": {"name": NS},
            "spec": {
                "deviceSelector": {"driver": DRIVER, "pool": NODE, "device": other},
                "taint": {"key": "example.com/drain", "effect": "NoSchedule"},
            },
        }
        create(client, rule)
        _expect(app.port, resourcepool_devices_free=0)
        assert not place(client, NS, "while-tainted", NODE, DRIVER)
        _delete_pod_and_claim(client, "while-tainted")  # or it would take the half once the rule goes
        client.request("DELETE", rule_path)
        _expect(app.port, resourcepool_devices_free=1)

        # As many more as the exporter says, then both halves are taken and no memory is left.
        placed = 0
        while place(client, NS, f"more-{placed}", NODE, DRIVER):
            placed += 1
            assert placed <= 1, "the scheduler placed more than the one free device"
        assert placed == 1
        _expect(
            app.port,
            resourcepool_devices_free=0,
            resourcepool_devices_allocated=2,
            resourcepool_counter_set_free=0,
            resourceslice_counter_set_free=0,
        )

        # The scheduler allocates nothing from the invalid pool.
        assert not place(client, NS, "from-invalid-pool", BAD_NODE, DRIVER)
        assert _pools(app.port)[("kube_resourcepool_invalid", BAD_NODE)] == 1.0

        # Three shards serve together what one exporter serves, counter sets joined across slices
        # that different shards own.
        shards = [start_exporter_app(str(testbed_sched.kubeconfig), shard=Shard(i, 3)) for i in range(3)]
        for shard in shards:
            wait_until(lambda shard=shard: shard.state.not_synced() is None, what="sync")
        wait_until(
            lambda: sum((_series(shard.port) for shard in shards), Counter()) == _series(app.port),
            what="the union of the shards' series to equal the unsharded exporter's",
        )
    finally:
        for path in (f"/api/v1/namespaces/{NS}/pods", f"/apis/resource.k8s.io/v1/namespaces/{NS}/resourceclaims"):
            with contextlib.suppress(ApiError):
                client.request("DELETE", path, query={"gracePeriodSeconds": 0})
        for path in (
            rule_path,
            *(f"/apis/resource.k8s.io/v1/resourceslices/{obj['metadata']['name']}" for obj in SLICES),
            f"/apis/resource.k8s.io/v1/deviceclasses/{DRIVER}",
        ):
            with contextlib.suppress(ApiError):
                client.request("DELETE", path)
