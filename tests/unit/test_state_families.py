"""The families beyond the seed, rendered by us, against the OTel SDK (Prometheus reader and OTLP
encoder) fed the same samples through real observable gauges; and their parsing edge cases."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml
from opentelemetry.exporter.prometheus import PrometheusMetricReader
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
from opentelemetry.sdk.metrics import MeterProvider
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.openmetrics.exposition import generate_latest as generate_openmetrics

from otel_dra.cluster import deviceclass, devicetaintrule, joined_families, resourceclaim, resourceslice
from otel_dra.cluster.resourceslice import DeviceAttributes
from otel_dra.telemetry.exposition import assemble
from otel_dra.telemetry.otlp_encode import RequestBuilder
from tests.unit.sample_stores import register_sdk_gauges
from tests.unit.test_joins import World
from tests.unit.test_otlp_encode import RESOURCE, _points, _sdk_request

OBJECTS = Path(__file__).parents[1] / "golden" / "state_objects.yaml"

# Copied by the scheduler from the slice's devices (tests/golden/state_objects.yaml, case bind).
BINDING = {"bindingConditions": ["Attached"], "bindingFailureConditions": ["AttachFailed"]}
EXTENDED_CLAIM = "ext-pod-extended-resources-x7k2p"

# What the scheduler allocated in the golden test (tests/integration/test_golden_state.py).
ALLOCATIONS: dict[str, list[dict[str, Any]]] = {
    "part-4g": [{"request": "gpu", "driver": "part.example.com", "pool": "gold-part", "device": "mig-4g-0"}],
    "share-4g": [
        {
            "request": "nic",
            "driver": "share.example.com",
            "pool": "gold-part",
            "device": "nic-0",
            "shareID": "0b9e2f0c-0000-4000-8000-000000000001",
            "consumedCapacity": {"bandwidth": "4G"},
        }
    ],
    "share-2g": [
        {
            "request": "nic",
            "driver": "share.example.com",
            "pool": "gold-part",
            "device": "nic-0",
            "shareID": "0b9e2f0c-0000-4000-8000-000000000002",
            "consumedCapacity": {"bandwidth": "2G"},
        }
    ],
    "bind-wait": [{"request": "dev", "driver": "bind.example.com", "pool": "gold-bind", "device": "b0", **BINDING}],
    "bind-done": [{"request": "dev", "driver": "bind.example.com", "pool": "gold-bind", "device": "b1", **BINDING}],
    # What kube-scheduler makes for ext-pod's extended-resource request (the claim is not in the
    # objects file: the scheduler creates it), with 1.37's skipNodeOperations copied from the slice.
    EXTENDED_CLAIM: [
        {
            "request": "container-0-request-0",
            "driver": "ext.example.com",
            "pool": "gold-ext",
            "device": "e0",
            "skipNodeOperations": ["*"],
        }
    ],
    "gen-d2": [{"request": "dev", "driver": "gen.example.com", "pool": "gen-pool", "device": "d2"}],
    "flexible": [{"request": "accel/small", "driver": "cost.example.com", "pool": "gold-cost", "device": "s0"}],
    "mixed": [
        {"request": "a", "driver": "cost.example.com", "pool": "gold-cost", "device": "p0"},
        {"request": "b", "driver": "cost.example.com", "pool": "gold-cost", "device": "p1"},
    ],
    "orphan": [{"request": "dev", "driver": "cost.example.com", "pool": "gold-cost", "device": "p2"}],
    "user": [{"request": "dev", "driver": "admin.example.com", "pool": "gold-admin", "device": "a0"}],
    "monitor": [
        {"request": "dev", "driver": "admin.example.com", "pool": "gold-admin", "device": "a0", "adminAccess": True}
    ],
    "health": [{"request": "dev", "driver": "taint.example.com", "pool": "gold-taint", "device": "t2"}],
    "busy": [{"request": "dev", "driver": "leak.example.com", "pool": "gold-leak", "device": "l1"}],
}


def _world(otlp: bool = False) -> World:
    w = World(now=[1_800_000_000.0], otlp=otlp)
    load_golden(
        {"ResourceClaim": w.claims, "ResourceSlice": w.slices, "DeviceClass": w.classes, "DeviceTaintRule": w.rules}
    )
    return w


def load_golden(kinds: dict[str, Any]) -> None:
    """Upsert the golden objects, allocated as the scheduler allocated them, into the store of their
    kind (a kind missing or mapped to None is skipped)."""
    for i, doc in enumerate(yaml.safe_load_all(OBJECTS.read_text())):
        if not doc or kinds.get("ResourceClaim" if doc["kind"] == "Pod" else doc["kind"]) is None:
            continue
        obj = copy.deepcopy(doc)
        meta = obj["metadata"]
        meta.update(resourceVersion=str(i + 1), uid=f"uid-{i}", creationTimestamp="2026-11-30T01:02:03Z")
        name = meta["name"]
        condition_fields = {"reason": "R", "message": "", "lastTransitionTime": "2026-11-30T01:02:05Z"}
        if doc["kind"] == "Pod" and name == "ext-pod":
            # The claim kube-scheduler makes for the pod's extended-resource request, instead of the pod.
            doc = {"kind": "ResourceClaim"}
            obj = {
                "apiVersion": "resource.k8s.io/v1",
                "kind": "ResourceClaim",
                "metadata": {
                    **meta,
                    "name": EXTENDED_CLAIM,
                    "annotations": {"resource.kubernetes.io/extended-resource-claim": "true"},
                },
                "spec": {
                    "devices": {
                        "requests": [
                            {
                                "name": "container-0-request-0",
                                "exactly": {
                                    "deviceClassName": "ext.example.com",
                                    "allocationMode": "ExactCount",
                                    "count": 1,
                                },
                            }
                        ]
                    }
                },
            }
            meta, name = obj["metadata"], EXTENDED_CLAIM
        if doc["kind"] == "ResourceSlice" and name == "gold-ext":
            obj["spec"]["skipNodeOperations"] = ["*"]  # Kubernetes 1.37 (DRAOptionalNodeOperations)
            # Kubernetes 1.36+ (DRANodeAllocatableResources, and a Node declaring the feature).
            obj["spec"]["devices"][0]["nodeAllocatableResources"] = {"memory": {"overhead": {"perPod": "1Gi"}}}
        if name in ALLOCATIONS:
            obj["status"] = {
                "allocation": {
                    "devices": {"results": ALLOCATIONS[name]},
                    "allocationTimestamp": "2026-11-30T01:02:04Z",
                },
                "reservedFor": [{"resource": "pods", "name": f"{name}-pod", "uid": f"pod-{i}"}],
            }
        if name == "bind-done":
            obj["status"]["devices"] = [
                {
                    "driver": "bind.example.com",
                    "pool": "gold-bind",
                    "device": "b1",
                    "conditions": [{"type": "Attached", "status": "True", **condition_fields}],
                }
            ]
        if name == "health":
            condition = {"reason": "R", "message": "", "lastTransitionTime": "2026-11-30T01:02:05Z"}
            obj["status"]["devices"] = [
                {
                    "driver": "taint.example.com",
                    "pool": "gold-taint",
                    "device": "t2",
                    "conditions": [
                        {"type": "Ready", "status": "True", **condition},
                        {"type": "Healthy", "status": "False", **condition},
                        {"type": 'Odd "quoted" \\ type', "status": "Maybe", **condition},
                    ],
                }
            ]
        if doc["kind"] == "DeviceTaintRule":
            # As kube-controller-manager's device-taint-eviction controller (1.35+) writes it for a
            # rule that does not evict.
            obj["status"] = {
                "conditions": [
                    {
                        "type": "EvictionInProgress",
                        "status": "False",
                        "reason": "OtherEffect",
                        "message": "Eviction only happens for the NoExecute effect.",
                        "observedGeneration": 1,
                        "lastTransitionTime": "2026-11-30T01:02:05Z",
                    }
                ]
            }
        kinds[doc["kind"]].upsert(obj)


def _stores(world: World) -> list[Any]:
    return [world.claims, world.slices, world.classes, world.rules, *world.joins.stores]


def _lines(text: bytes) -> list[str]:
    return sorted(line for line in text.decode().splitlines() if line and line != "# EOF")


def _sdk_lines(stores: list[Any], openmetrics: bool) -> list[str]:
    registry = CollectorRegistry()
    reader = PrometheusMetricReader(disable_target_info=True, scope_info_enabled=False, registry=registry)
    provider = MeterProvider(metric_readers=[reader])
    register_sdk_gauges(provider.get_meter("test"), stores)
    try:
        return _lines(generate_openmetrics(registry) if openmetrics else generate_latest(registry))
    finally:
        provider.shutdown()


def test_every_new_family_has_samples_in_the_world():
    w = _world()
    w.joins.tick()
    empty = [gauge.prom_name for s in _stores(w) for gauge, chunks in s.blocks() if not any(c.data for c in chunks)]
    # Seed families are not in these stores; leaks need time to pass (see test_joins).
    assert empty == ["kube_resourceclaim_leaked"] or empty == []


def test_prometheus_exposition_equals_the_sdk_reader():
    w = _world()
    w.now[0] += 10**6  # the stuck claim is past its grace period
    w.joins.tick()
    stores = _stores(w)
    blocks = [b for s in stores for b in s.blocks()]
    for openmetrics in (False, True):
        ours = b"".join(assemble(CollectorRegistry(), blocks, openmetrics))
        assert _lines(ours) == _sdk_lines(stores, openmetrics)


def test_otlp_points_equal_the_sdk_encoding():
    world = _world(otlp=True)
    world.now[0] += 10**6
    world.joins.tick()
    stores = _stores(world)
    builder = RequestBuilder(RESOURCE, "otel_dra.cluster", "1.2.3")
    metrics = [m for s in stores for m in s.otlp_metrics()]
    ours = [ExportMetricsServiceRequest.FromString(r) for r in builder.requests(metrics, 1_700_000_000_000_000_000)]
    got, _, _ = _points(ours)
    expected, _, _ = _points([_sdk_request(stores)])
    assert {k: v[:3] for k, v in got.items()} == {k: v[:3] for k, v in expected.items()}
    # Every family beyond the seed has points in this world, so the comparisons above cover all of
    # them: a family added to a resource module or to the joins must get an object in
    # tests/golden/state_objects.yaml (or an allocation above) that gives it a sample.
    assert sorted(got) == sorted(family.gauge.name for family in _families_beyond_the_seed())


def _families_beyond_the_seed() -> list[Any]:
    """What the exporter serves besides the seven seed families (`FAMILIES`, which the seed's own
    golden test covers): each resource module's STATE_FAMILIES and the joins' families."""
    modules = (resourceclaim, resourceslice, deviceclass, devicetaintrule)
    return [family for module in modules for family in module.STATE_FAMILIES] + list(joined_families.ALL_FAMILIES)


# --- parsing edge cases ------------------------------------------------------------------------------
def test_device_attributes_option():
    attrs = DeviceAttributes.parse("productName, gpu.nvidia.com/parentUUID,cudaComputeCapability,index")
    assert attrs.labels == (
        "attribute_product_name",
        "attribute_parent_uuid",
        "attribute_cuda_compute_capability",
        "attribute_index",
    )
    published = {
        "gpu.nvidia.com/productName": {"string": "H200"},  # qualified with the driver: same attribute
        "parentUUID": {"string": "GPU-1"},  # bare, the driver's domain: same attribute
        "cudaComputeCapability": {"version": "9.0.0"},
        "index": {"int": 3},
    }
    assert attrs.values(published, "gpu.nvidia.com") == ("H200", "GPU-1", "9.0.0", "3")
    assert attrs.values(published, "other.example.com") == ("", "", "9.0.0", "3")
    for bad in ("a b", "x/", "1abc", ",".join(f"a{i}" for i in range(17)), "productName,gpu.nvidia.com/productName"):
        try:
            DeviceAttributes.parse(bad)
        except ValueError as exc:
            assert str(exc)
        else:
            raise AssertionError(f"{bad!r} accepted")


def test_claim_parse_times_phases_and_bad_values():
    problems: list[str] = []
    obj = {
        "metadata": {
            "name": "c",
            "namespace": "ns",
            "creationTimestamp": "yesterday",
            "managedFields": [
                {"subresource": "status", "time": "2026-11-30T01:00:00Z"},
                {"subresource": "status", "time": "2026-11-30T02:00:00Z"},
                {"subresource": "status", "time": "garbage"},
            ],
        },
        "status": {
            "allocation": {
                "allocationTimestamp": "2026-11-30T00:30:00+01:00",
                "devices": {
                    "results": [
                        {"request": "r", "driver": "d", "pool": "p", "device": "x", "consumedCapacity": {"bw": "lots"}}
                    ]
                },
            }
        },
    }
    claim = resourceclaim.parse(obj, problems.append)
    assert claim.created is None and claim.phase == "allocated"
    assert claim.allocation_time == 1_795_995_000.0  # 2026-11-29T23:30:00Z
    assert claim.status_time == 1_796_004_000.0  # the newest status write, 02:00Z
    assert claim.results[0].consumed == ()
    assert len(problems) == 2 and "consumedCapacity" in problems[0] and "creationTimestamp" in problems[1]
    obj["status"]["reservedFor"] = [{"apiGroup": "batch", "resource": "jobs", "name": "j", "uid": "u"}]
    reserved = resourceclaim.parse(obj, problems.append)
    assert reserved.phase == "reserved" and reserved.status_time is None  # only needed while unreserved


def test_slice_parse_keeps_going_past_bad_counters_and_capacities():
    problems: list[str] = []
    obj = {
        "metadata": {"name": "s"},
        "spec": {
            "driver": "d",
            "pool": {"name": "p", "generation": "7", "resourceSliceCount": 2},
            "nodeName": "n",
            "sharedCounters": [
                {"name": "cs", "counters": {"m": {"value": "8Gi"}, "bad": {"value": "x"}}},
                {"counters": {}},
            ],
            "devices": [
                {
                    "name": "a",
                    "capacity": {"memory": {"value": "1Gi"}, "weird": {"value": []}},
                    "consumesCounters": [{"counterSet": "cs", "counters": {"m": {"value": "1Gi"}}}],
                    "taints": [{"key": "k", "effect": "NoSchedule"}, "junk"],
                }
            ],
        },
    }
    s = resourceslice.parse(obj, problems.append)
    assert (s.generation, s.slice_count) == (7, 2)
    assert s.counter_sets == (("cs", (("m", 8 * 2**30),)),)
    [d] = s.devices
    assert d.capacities == (("memory", 2**30),) and d.capacity == (2**30, None, None)
    assert d.counters == (("cs", (("m", 2**30),)),) and d.blocked
    assert len(problems) == 3


def test_slice_parse_partition_type():
    """partitionTypeAttribute (Kubernetes 1.37, alpha) names a device attribute by its fully
    qualified name; a device of the driver's own domain may publish it bare."""
    obj = {
        "metadata": {"name": "s"},
        "spec": {
            "driver": "gpu.example.com",
            "pool": {"name": "p", "generation": 1, "resourceSliceCount": 1},
            "nodeName": "n",
            "partitionTypeAttribute": "gpu.example.com/profile",
            "devices": [
                {"name": "bare", "attributes": {"profile": {"string": "1g.10gb"}}},
                {"name": "qualified", "attributes": {"gpu.example.com/profile": {"string": "3g.40gb"}}},
                {"name": "other-domain", "attributes": {"other.example.com/profile": {"string": "x"}}},
                {"name": "none"},
                {"name": "junk", "attributes": ["not", "a", "map"]},
            ],
        },
    }
    problems: list[str] = []
    s = resourceslice.parse(obj, problems.append)
    assert [d.partition_type for d in s.devices] == ["1g.10gb", "3g.40gb", "", "", ""]
    del obj["spec"]["partitionTypeAttribute"]
    assert {d.partition_type for d in resourceslice.parse(obj, problems.append).devices} == {""}
    assert problems == []
