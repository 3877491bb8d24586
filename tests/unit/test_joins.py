"""The joins (otel_dra/cluster/joins.py) without an API server: semantics, incremental upkeep equal to
a fresh computation, shard union, bounded work per change, the leak clock."""

from __future__ import annotations

import random
from collections import Counter
from typing import Any

import pytest

from otel_dra.cluster import deviceclass, devicetaintrule, joins, resourceclaim, resourceslice
from otel_dra.cluster.joins import Joins
from otel_dra.cluster.sharding import Shard
from otel_dra.cluster.store import ObjectStore
from otel_dra.kube.version import parse_git_version

RV = iter(range(1, 10**9))


def _meta(name: str, namespace: str | None = None, **extra: Any) -> dict[str, Any]:
    meta = {"name": name, "uid": f"uid-{namespace}-{name}", "resourceVersion": str(next(RV)), **extra}
    if namespace:
        meta["namespace"] = namespace
    return meta


def slice_obj(name: str, driver: str, pool: str, devices: list[dict[str, Any]], **spec: Any) -> dict[str, Any]:
    spec.setdefault("nodeName", "n1")
    gen = spec.pop("generation", 1)
    count = spec.pop("count", 1)
    return {
        "metadata": _meta(name),
        "spec": {
            "driver": driver,
            "pool": {"name": pool, "generation": gen, "resourceSliceCount": count},
            "devices": devices,
            **spec,
        },
    }


def claim_obj(
    name: str,
    results: list[dict[str, Any]] | None = None,
    *,
    namespace: str = "ns",
    requests: list[dict[str, Any]] | None = None,
    reserved: bool = True,
    status_time: str | None = None,
) -> dict[str, Any]:
    meta = _meta(name, namespace)
    if status_time:
        meta["managedFields"] = [
            {"manager": "kube-scheduler", "operation": "Update", "subresource": "status", "time": status_time},
            {"manager": "kubectl", "operation": "Update", "time": "2099-01-01T00:00:00Z"},  # not a status write
        ]
    obj: dict[str, Any] = {
        "metadata": meta,
        "spec": {"devices": {"requests": requests or [{"name": "r", "exactly": {"deviceClassName": "c1"}}]}},
    }
    if results is not None:
        obj["status"] = {"allocation": {"devices": {"results": results}}}
        if reserved:
            obj["status"]["reservedFor"] = [{"resource": "pods", "name": "p", "uid": "u"}]
    return obj


def result(device: str, *, driver: str = "d", pool: str = "p", request: str = "r", **extra: Any) -> dict[str, Any]:
    return {"request": request, "driver": driver, "pool": pool, "device": device, **extra}


def class_obj(name: str, cost: str | None = None) -> dict[str, Any]:
    meta = _meta(name)
    if cost is not None:
        meta["annotations"] = {"hourly-cost": cost}
    return {"metadata": meta, "spec": {}}


class World:
    """Object stores wired to a Joins, as ClusterState wires them."""

    def __init__(
        self, shard: Shard | None = None, *, grace: float = 60.0, now: list[float] | None = None, otlp: bool = False
    ) -> None:
        shard = shard or Shard()
        self.now = now if now is not None else [1000.0]
        self.joins = Joins(shard=shard, leak_grace=grace, clock=lambda: self.now[0], segment_size=4, otlp=otlp)
        self.claims = ObjectStore(
            "resourceclaims",
            resourceclaim.parse,
            resourceclaim.STATE_FAMILIES,
            keep=shard.owns,
            listener=self.joins.claims_changed,
            otlp=otlp,
        )
        self.slices = ObjectStore(
            "resourceslices",
            resourceslice.parse,
            resourceslice.STATE_FAMILIES,
            keep=shard.owns,
            listener=self.joins.slices_changed,
            otlp=otlp,
        )
        self.classes = ObjectStore(
            "deviceclasses",
            deviceclass.parse,
            deviceclass.STATE_FAMILIES,
            keep=shard.first_only(),
            listener=self.joins.classes_changed,
            otlp=otlp,
        )
        self.rules = ObjectStore(
            "devicetaintrules",
            devicetaintrule.parse,
            devicetaintrule.STATE_FAMILIES,
            keep=shard.first_only(),
            listener=self.joins.rules_changed,
            otlp=otlp,
        )
        self.by_kind = {"claim": self.claims, "slice": self.slices, "class": self.classes, "rule": self.rules}

    def joined(self) -> dict[str, list[str]]:
        """Prometheus name -> the joined families' lines."""
        self.joins.tick()
        out: dict[str, list[str]] = {}
        for store in self.joins.stores:
            for gauge, chunks in store.blocks():
                out[gauge.prom_name] = b"".join(c.data for c in chunks).decode().splitlines()
        return out

    def samples(self, name: str) -> dict[str, float]:
        return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in self.joined()[name]}


def _value(world: World, name: str, **labels: str) -> float | None:
    for series, value in world.samples(name).items():
        if all(f'{k}="{v}"' in series for k, v in labels.items()):
            return value
    return None


# --- semantics -------------------------------------------------------------------------------------
def test_allocation_join_counters_and_free_devices():
    w = World()
    counters = [{"name": "gpu", "counters": {"mem": {"value": "80"}, "sm": {"value": "7"}}}]

    def part(name: str, mem: int, sm: int) -> dict[str, Any]:
        return {
            "name": name,
            "consumesCounters": [
                {"counterSet": "gpu", "counters": {"mem": {"value": str(mem)}, "sm": {"value": str(sm)}}}
            ],
        }

    w.slices.upsert(
        slice_obj(
            "s1",
            "d",
            "p",
            [part("whole", 80, 7), part("big", 40, 4), part("mid", 40, 3), part("small", 20, 2), {"name": "plain"}],
            sharedCounters=counters,
        )
    )
    assert _value(w, "kube_resourcepool_devices_free", pool="p") == 5
    w.claims.upsert(claim_obj("c1", [result("big")]))
    assert _value(w, "kube_resourceslice_device_allocated", device_name="big") == 1
    assert _value(w, "kube_resourceslice_device_allocated", device_name="whole") == 0
    assert _value(w, "kube_resourceslice_counter_set_free", counter="mem") == 40
    assert _value(w, "kube_resourceslice_counter_set_free", counter="sm") == 3
    # whole no longer fits; mid, small and plain do.
    assert (
        _value(w, "kube_resourcepool_devices", pool="p"),
        _value(w, "kube_resourcepool_devices_allocated", pool="p"),
    ) == (5, 1)
    assert _value(w, "kube_resourcepool_devices_free", pool="p") == 3
    w.claims.upsert(claim_obj("c2", [result("mid")]))
    assert _value(w, "kube_resourcepool_devices_free", pool="p") == 1  # only plain: small needs sm 2, 0 left
    w.claims.delete(claim_obj("c1"))
    assert _value(w, "kube_resourceslice_counter_set_free", counter="mem") == 40
    assert _value(w, "kube_resourcepool_devices_free", pool="p") == 3  # big, small, plain


def test_admin_access_is_not_consumption():
    w = World()
    w.classes.upsert(class_obj("c1", "3"))
    w.slices.upsert(slice_obj("s1", "d", "p", [{"name": "x"}]))
    w.claims.upsert(claim_obj("watcher", [result("x", adminAccess=True)]))
    assert _value(w, "kube_resourceslice_device_allocated", device_name="x") == 0
    assert _value(w, "kube_resourcepool_devices_free", pool="p") == 1
    assert w.samples("kube_resourceclaim_hourly_cost") == {}
    w.claims.upsert(claim_obj("user", [result("x")]))
    assert _value(w, "kube_resourceslice_device_allocated", device_name="x") == 1
    assert list(w.samples("kube_resourceclaim_hourly_cost").values()) == [3.0]


def test_multi_allocatable_device_reports_consumed_capacity_and_default_fit():
    w = World()
    nic = {
        "name": "nic",
        "allowMultipleAllocations": True,
        "capacity": {"bw": {"value": "10", "requestPolicy": {"default": "4"}}, "queues": {"value": "8"}},
    }
    w.slices.upsert(slice_obj("s1", "d", "p", [nic]))
    assert _value(w, "kube_resourceslice_device_allocated_capacity", capacity="bw") == 0
    # A default request takes 4 bw and all 8 queues (no policy: the whole capacity).
    w.claims.upsert(claim_obj("a", [result("nic", shareID="s-a", consumedCapacity={"bw": "3", "queues": "0"})]))
    assert _value(w, "kube_resourceslice_device_allocated_capacity", capacity="bw") == 3
    assert _value(w, "kube_resourcepool_devices_free", pool="p") == 1  # 3 + 4 <= 10, 0 + 8 <= 8
    w.claims.upsert(claim_obj("b", [result("nic", shareID="s-b", consumedCapacity={"bw": "4", "queues": "1"})]))
    assert _value(w, "kube_resourceslice_device_allocated_capacity", capacity="bw") == 7
    assert _value(w, "kube_resourceslice_device_allocated_capacity", capacity="queues") == 1
    assert _value(w, "kube_resourcepool_devices_free", pool="p") == 0
    assert _value(w, "kube_resourceslice_device_allocated", device_name="nic") == 1


def test_taints_in_slices_and_evaluable_taint_rules_block_free_devices():
    w = World()
    w.slices.upsert(
        slice_obj(
            "s1",
            "d",
            "p",
            [
                {"name": "t0", "taints": [{"key": "k", "effect": "NoSchedule"}]},
                {"name": "t1", "taints": [{"key": "k", "effect": "None"}]},  # informational only
                {"name": "t2"},
                {"name": "t3"},
            ],
        )
    )
    assert _value(w, "kube_resourcepool_devices_free", pool="p") == 3
    rule = {
        "metadata": _meta("r1"),
        "spec": {"deviceSelector": {"driver": "d", "device": "t2"}, "taint": {"key": "k", "effect": "NoExecute"}},
    }
    w.rules.upsert(rule)
    assert _value(w, "kube_resourcepool_devices_free", pool="p") == 2
    # A rule that selects through CEL cannot be evaluated here: it is reported, not applied.
    cel = {
        "metadata": _meta("r2"),
        "spec": {
            "deviceSelector": {"driver": "d", "selectors": [{"cel": {"expression": "true"}}]},
            "taint": {"key": "k", "effect": "NoSchedule"},
        },
    }
    w.rules.upsert(cel)
    assert _value(w, "kube_resourcepool_devices_free", pool="p") == 2
    w.rules.delete(rule)
    assert _value(w, "kube_resourcepool_devices_free", pool="p") == 3


def test_pool_counts_newest_complete_valid_generation_only():
    w = World()
    w.slices.upsert(slice_obj("old", "d", "p", [{"name": "a"}, {"name": "b"}], generation=1))
    w.slices.upsert(slice_obj("new-1", "d", "p", [{"name": "a"}], generation=2, count=2))
    assert _value(w, "kube_resourcepool_incomplete", pool="p") == 1
    assert _value(w, "kube_resourcepool_generation", pool="p") == 2
    assert _value(w, "kube_resourcepool_devices", pool="p") is None  # no counts while incomplete
    w.slices.upsert(slice_obj("new-2", "d", "p", [{"name": "b"}, {"name": "c"}], generation=2, count=2))
    assert _value(w, "kube_resourcepool_incomplete", pool="p") == 0
    assert _value(w, "kube_resourcepool_devices", pool="p") == 3  # a, b, c -- not the old a, b
    w.claims.upsert(claim_obj("c1", [result("a")]))
    # The join is by (driver, pool, device): the lingering old slice's "a" shows allocated too.
    assert [v for s, v in w.samples("kube_resourceslice_device_allocated").items() if 'device_name="a"' in s] == [
        1.0,
        1.0,
    ]
    assert _value(w, "kube_resourcepool_devices_allocated", pool="p") == 1
    # A device named twice in the newest generation makes the pool invalid.
    w.slices.upsert(slice_obj("new-2", "d", "p", [{"name": "a"}, {"name": "c"}], generation=2, count=2))
    assert _value(w, "kube_resourcepool_invalid", pool="p") == 1
    assert _value(w, "kube_resourcepool_devices", pool="p") is None
    w.slices.delete(slice_obj("new-1", "d", "p", []))
    w.slices.delete(slice_obj("new-2", "d", "p", []))
    assert _value(w, "kube_resourcepool_generation", pool="p") == 1
    assert _value(w, "kube_resourcepool_devices", pool="p") == 2
    w.slices.delete(slice_obj("old", "d", "p", []))
    assert w.joined()["kube_resourcepool_generation"] == []


def test_per_node_counts_with_per_device_node_selection():
    w = World()
    devices = [{"name": "a", "nodeName": "n1"}, {"name": "b", "nodeName": "n2"}, {"name": "c", "allNodes": True}]
    w.slices.upsert(slice_obj("s", "d", "p", devices, perDeviceNodeSelection=True, nodeName=None))
    w.claims.upsert(claim_obj("c1", [result("b")]))
    free = w.samples("kube_resourcepool_devices_free")
    assert sorted((s.split('node_name="')[1].split('"')[0], v) for s, v in free.items()) == [
        ("", 1.0),
        ("n1", 1.0),
        ("n2", 0.0),
    ]


# --- capacity names with and without the driver's domain (Kubernetes 1.38) ----------------------------
def _shared_gpu(capacity_key: str, other: str = "dra.example.com/bandwidth") -> dict[str, Any]:
    """A shareable device of driver gpu.example.com whose memory is published as ``capacity_key``."""
    return {
        "name": "gpu-0",
        "allowMultipleAllocations": True,
        "capacity": {
            capacity_key: {"value": "80Gi", "requestPolicy": {"default": "10Gi"}},
            other: {"value": "100", "requestPolicy": {"default": "0"}},
        },
    }


def _share(name: str, consumed: dict[str, str]) -> dict[str, Any]:
    return claim_obj(
        name, [result("gpu-0", driver=GPU, pool="node-1", shareID=f"share-{name}", consumedCapacity=consumed)]
    )


def _device_series(w: World, family: str) -> dict[str, float]:
    return {s.split('capacity="')[1].split('"')[0]: v for s, v in w.samples(family).items()}


@pytest.mark.parametrize("published", ["memory", "gpu.example.com/memory"])
@pytest.mark.parametrize("consumed_as", ["memory", "gpu.example.com/memory"])
def test_consumed_capacity_joins_either_spelling_of_the_drivers_domain(published, consumed_as):
    w = World()
    w.slices.upsert(slice_obj("s", GPU, "node-1", [_shared_gpu(published)]))
    w.claims.upsert(_share("a", {consumed_as: "50Gi", "dra.example.com/bandwidth": "10"}))
    # The device's series keep the slice's spelling; the consumption is joined to it either way.
    assert _device_series(w, "kube_resourceslice_device_allocated_capacity") == {
        published: 50.0 * GI,
        "dra.example.com/bandwidth": 10.0,
    }
    assert _device_series(w, "kube_resourceslice_device_free_capacity") == {
        published: 30.0 * GI,
        "dra.example.com/bandwidth": 90.0,
    }
    assert _value(w, "kube_resourcepool_devices_free", pool="node-1") == 1  # 50 + 10 <= 80
    # A second share in the other spelling: the same capacity, summed.
    other = f"{GPU}/memory" if consumed_as == "memory" else "memory"
    w.claims.upsert(_share("b", {other: "25Gi"}))
    assert _device_series(w, "kube_resourceslice_device_allocated_capacity")[published] == 75.0 * GI
    assert _value(w, "kube_resourcepool_devices_free", pool="node-1") == 0  # 75 + 10 > 80
    # The claims' own series name the capacity in its short form, whichever spelling they used.
    consumed = {
        (s.split('resourceclaim_name="')[1].split('"')[0], s.split('capacity="')[1].split('"')[0]): v
        for s in _claim_lines(w, "kube_resourceclaim_device_consumed_capacity")
        for v in [float(s.rsplit(" ", 1)[1])]
    }
    assert consumed == {
        ("a", "memory"): 50.0 * GI,
        ("a", "dra.example.com/bandwidth"): 10.0,
        ("b", "memory"): 25.0 * GI,
    }


def test_a_capacity_of_another_domain_is_not_the_drivers_own():
    w = World()
    w.slices.upsert(slice_obj("s", GPU, "node-1", [_shared_gpu("memory", other="bandwidth")]))
    # dra.example.com/bandwidth is not the device's bandwidth (its domain is not the driver's), nor
    # is other.example.com/memory its memory.
    w.claims.upsert(_share("a", {"dra.example.com/bandwidth": "10", "other.example.com/memory": "1Gi"}))
    assert _device_series(w, "kube_resourceslice_device_allocated_capacity") == {"memory": 0.0, "bandwidth": 0.0}


def test_both_spellings_in_one_result_are_one_capacity():
    problems: list[str] = []
    claim = resourceclaim.parse(
        _share("a", {"memory": "1Gi", f"{GPU}/memory": "2Gi", "x.example.com/memory": "3"}), problems.append
    )
    assert problems == []
    assert claim.results[0].consumed == (("memory", 3.0 * GI), ("x.example.com/memory", 3.0))


def _claim_lines(w: World, family: str) -> list[str]:
    return [
        line
        for gauge, chunks in w.claims.blocks()
        if gauge.prom_name == family
        for line in b"".join(c.data for c in chunks).decode().splitlines()
    ]


# --- PodGroup consumers (Kubernetes 1.38, gang scheduling) -------------------------------------------
POD = {"apiGroup": "", "resource": "pods", "name": "worker-0", "uid": "pod-uid-0"}
PODGROUP = {"apiGroup": "scheduling.k8s.io", "resource": "podgroups", "name": "trainers", "uid": "pg-uid"}


def reserved_claim(name: str, consumers: list[dict[str, Any]], namespace: str = "team-a") -> dict[str, Any]:
    obj = claim_obj(name, [result("x0")], namespace=namespace, reserved=False, status_time="2027-01-15T07:00:00Z")
    obj["status"]["reservedFor"] = consumers
    return obj


def test_podgroup_consumers_are_reported_with_their_kind():
    problems: list[str] = []
    job = {"apiGroup": "batch", "resource": "jobs", "name": "j", "uid": "j-uid"}
    claim = resourceclaim.parse(
        reserved_claim("c", [POD, PODGROUP, job, {"resource": "pods", "name": "p1"}]), problems.append
    )
    assert problems == []
    assert claim.consumers == (("pod", "worker-0"), ("podgroup", "trainers"), ("jobs.batch", "j"), ("pod", "p1"))
    assert claim.phase == "reserved" and claim.reserved == 4
    families = {f.prom_name: f for f in resourceclaim.FAMILIES + resourceclaim.STATE_FAMILIES}
    assert list(families["kube_resourceclaim_status_reserved_for_consumer"].samples(claim)) == [
        (("c", "team-a", "pod", "worker-0"), 1.0),
        (("c", "team-a", "podgroup", "trainers"), 1.0),
        (("c", "team-a", "jobs.batch", "j"), 1.0),
        (("c", "team-a", "pod", "p1"), 1.0),
    ]
    # The seed families stay pods only, byte for byte.
    assert list(families["kube_resourceclaim_status_reserved_for_pod"].samples(claim)) == [
        (("c", "team-a", "worker-0", "pod-uid-0"), 1.0),
        (("c", "team-a", "p1", ""), 1.0),
    ]
    assert list(families["kube_resourceclaim_status_reserved_total"].samples(claim)) == [(("c", "team-a"), 2.0)]
    # Malformed entries are consumers of no known kind; two of one kind and name are one series.
    odd = resourceclaim.parse(
        reserved_claim("d", [PODGROUP, PODGROUP, {"apiGroup": 5, "resource": "pods"}, "junk"]), print
    )
    assert list(families["kube_resourceclaim_status_reserved_for_consumer"].samples(odd)) == [
        (("d", "team-a", "podgroup", "trainers"), 2.0),
        (("d", "team-a", "", ""), 1.0),
    ]
    assert list(families["kube_resourceclaim_status_reserved_total"].samples(odd)) == [(("d", "team-a"), 0.0)]


def test_a_claim_reserved_by_a_podgroup_is_never_leaked_and_costs_in_its_namespace():
    now = [1_800_000_000.0]  # 2027-01-15T08:00:00Z: an hour after the claims' last status write
    w = World(grace=600, now=now)
    w.classes.upsert(class_obj("c1", "2.5"))
    w.slices.upsert(slice_obj("s1", "d", "p", [{"name": "x0"}]))
    # Only a PodGroup; a PodGroup and a pod that is gone (the exporter does not look pods up: the
    # reservation says in use); and, for contrast, nobody.
    w.claims.upsert(reserved_claim("gang", [PODGROUP]))
    w.claims.upsert(reserved_claim("gang-and-pod", [PODGROUP, POD], namespace="team-b"))
    w.claims.upsert(reserved_claim("nobody", []))
    now[0] += 10**6
    assert w.joined()["kube_resourceclaim_leaked"] == [
        'kube_resourceclaim_leaked{namespace="team-a",resourceclaim_name="nobody"} 1.0'
    ]
    assert w.samples("kube_resourceclaim_hourly_cost") == {
        'kube_resourceclaim_hourly_cost{deviceclass_name="c1",namespace="team-a",resourceclaim_name="gang"}': 2.5,
        'kube_resourceclaim_hourly_cost{deviceclass_name="c1",namespace="team-b",resourceclaim_name="gang-and-pod"}': 2.5,
        'kube_resourceclaim_hourly_cost{deviceclass_name="c1",namespace="team-a",resourceclaim_name="nobody"}': 2.5,
    }
    # The PodGroup lets go: now nobody reserves it, and the clock runs from that status write.
    released = reserved_claim("gang", [])
    released["metadata"]["managedFields"][0]["time"] = "2027-01-26T21:45:00Z"  # 100 s before now
    w.claims.upsert(released)
    assert 'resourceclaim_name="gang"' not in "".join(w.joined()["kube_resourceclaim_leaked"])
    now[0] += 600
    assert 'resourceclaim_name="gang"' in "".join(w.joined()["kube_resourceclaim_leaked"])
    # Reserved by a PodGroup again: not leaked any more.
    w.claims.upsert(reserved_claim("gang", [PODGROUP]))
    assert 'resourceclaim_name="gang"' not in "".join(w.joined()["kube_resourceclaim_leaked"])


# --- shared counters, pool-wide since Kubernetes 1.35 ------------------------------------------------
GI = 2**30
GPU = "gpu.example.com"


def counters_slice(name: str, driver: str, pool: str, sets: dict[str, dict[str, str]], **spec: Any) -> dict[str, Any]:
    """A counters-only slice (since 1.35 a slice holds either sharedCounters or devices)."""
    obj = slice_obj(name, driver, pool, [], **spec)
    del obj["spec"]["devices"]
    obj["spec"]["sharedCounters"] = [
        {"name": set_name, "counters": {c: {"value": v} for c, v in counters.items()}}
        for set_name, counters in sets.items()
    ]
    return obj


def partition(
    name: str, memory: str, profile: str | None = None, counter_set: str = "gpu-0-counters"
) -> dict[str, Any]:
    dev: dict[str, Any] = {
        "name": name,
        "capacity": {"memory": {"value": memory}},
        "consumesCounters": [{"counterSet": counter_set, "counters": {"memory": {"value": memory}}}],
    }
    if profile is not None:
        dev["attributes"] = {"profile": {"string": profile}}
    return dev


def node_p(generation: int = 1, memory: str = "80Gi", suffix: str = "") -> list[dict[str, Any]]:
    """The pool measured against a real 1.37 scheduler (kubernetes-current.md): a counters slice
    and a device slice; the device slice names the attribute that gives each partition's type."""
    return [
        counters_slice(
            f"node-p-counters{suffix}",
            GPU,
            "node-p",
            {"gpu-0-counters": {"memory": memory}},
            nodeName="node-p",
            count=2,
            generation=generation,
        ),
        slice_obj(
            "node-p-devices",
            GPU,
            "node-p",
            [
                partition("gpu-0-full", "80Gi", "full"),
                partition("gpu-0-half-a", "40Gi", "half"),
                partition("gpu-0-half-b", "40Gi", "half"),
            ],
            nodeName="node-p",
            count=2,
            generation=generation,
            partitionTypeAttribute=f"{GPU}/profile",
        ),
    ]


def gpu_claim(name: str, *devices: str, pool: str = "node-p") -> dict[str, Any]:
    return claim_obj(name, [result(d, driver=GPU, pool=pool) for d in devices])


def pool_view(world: World, pool: str = "node-p") -> dict[str, dict[str, float]]:
    """One pool's families: Prometheus name -> {its labels but driver and pool: value}."""
    out: dict[str, dict[str, float]] = {}
    for name, lines in world.joined().items():
        for line in lines if name.startswith("kube_resourcepool_") else ():
            series, value = line.rsplit(" ", 1)
            labels = series.split("{")[1].rstrip("}").split(",")
            if f'pool="{pool}"' in labels:
                rest = ",".join(label for label in labels if not label.startswith(("driver=", "pool=")))
                out.setdefault(name, {})[rest] = float(value)
    return out


NODE = 'node_name="node-p"'
FULL, HALF = f'{NODE},partition_type="full"', f'{NODE},partition_type="half"'
MEMORY = f'counter="memory",counter_set="gpu-0-counters",{NODE}'


def test_counters_are_shared_pool_wide_as_measured_on_kubernetes_1_37():
    w = World()
    for obj in node_p():
        w.slices.upsert(obj)
    w.claims.upsert(gpu_claim("a", "gpu-0-half-a"))
    # The scheduler refuses the full GPU (40Gi of 80Gi are left) and gives out half-b: one free device.
    assert pool_view(w) == {
        "kube_resourcepool_generation": {"": 1.0},
        "kube_resourcepool_incomplete": {"": 0.0},
        "kube_resourcepool_invalid": {"": 0.0},
        "kube_resourcepool_devices": {NODE: 3.0},
        "kube_resourcepool_devices_allocated": {NODE: 1.0},
        "kube_resourcepool_devices_free": {NODE: 1.0},
        "kube_resourcepool_partitions": {FULL: 1.0, HALF: 2.0},
        "kube_resourcepool_partitions_allocated": {FULL: 0.0, HALF: 1.0},
        "kube_resourcepool_partitions_free": {FULL: 0.0, HALF: 1.0},
        "kube_resourcepool_counter_set_capacity": {MEMORY: 80.0 * GI},
        "kube_resourcepool_counter_set_free": {MEMORY: 40.0 * GI},
    }
    # Per slice: capacity and free where the set is defined, the counters slice.
    labels = 'counter="memory",counter_set="gpu-0-counters",driver="gpu.example.com",node_name="node-p",pool="node-p"'
    [capacity] = [b"".join(c.data for c in chunks) for g, chunks in w.slices.blocks() if "counter_set" in g.prom_name]
    assert capacity.decode() == (
        f'kube_resourceslice_counter_set_capacity{{{labels},resourceslice_name="node-p-counters"}} 8.589934592e+10\n'
    )
    assert w.samples("kube_resourceslice_counter_set_free") == {
        f'kube_resourceslice_counter_set_free{{{labels},resourceslice_name="node-p-counters"}}': 40.0 * GI
    }
    # A NoSchedule DeviceTaintRule on half-b: nothing is free.
    rule = {
        "metadata": _meta("drain-half-b"),
        "spec": {
            "deviceSelector": {"driver": GPU, "pool": "node-p", "device": "gpu-0-half-b"},
            "taint": {"key": "example.com/drain", "effect": "NoSchedule"},
        },
    }
    w.rules.upsert(rule)
    assert pool_view(w)["kube_resourcepool_devices_free"] == {NODE: 0.0}
    assert pool_view(w)["kube_resourcepool_partitions_free"] == {FULL: 0.0, HALF: 0.0}
    w.rules.delete(rule)
    assert pool_view(w)["kube_resourcepool_devices_free"] == {NODE: 1.0}
    # Both halves allocated: no memory left.
    w.claims.upsert(gpu_claim("b", "gpu-0-half-b"))
    view = pool_view(w)
    assert view["kube_resourcepool_devices_free"] == {NODE: 0.0}
    assert view["kube_resourcepool_counter_set_free"] == {MEMORY: 0.0}
    assert _value(w, "kube_resourceslice_counter_set_free", resourceslice_name="node-p-counters") == 0.0
    # Released again.
    w.claims.delete(gpu_claim("a"))
    assert pool_view(w)["kube_resourcepool_devices_free"] == {NODE: 1.0}  # half-a; the full GPU needs 80Gi
    w.claims.delete(gpu_claim("b"))
    view = pool_view(w)
    assert view["kube_resourcepool_devices_free"] == {NODE: 3.0}
    assert view["kube_resourcepool_counter_set_free"] == {MEMORY: 80.0 * GI}
    # The full GPU taken: neither half fits.
    w.claims.upsert(gpu_claim("c", "gpu-0-full"))
    assert pool_view(w)["kube_resourcepool_partitions_free"] == {FULL: 0.0, HALF: 0.0}


def test_counters_join_is_the_same_whatever_order_slices_and_claims_come_in():
    claim = gpu_claim("a", "gpu-0-half-a")
    results = []
    for order in ([0, 1, "claim"], [1, 0, "claim"], ["claim", 1, 0], [1, "claim", 0]):
        w = World()
        objs = node_p()
        for step in order:
            if step == "claim":
                w.claims.upsert(claim)
            else:
                w.slices.upsert(objs[step])  # type: ignore[index]
        results.append(w.joined())
    assert all(r == results[0] for r in results)
    # A counters slice that goes away (the pool is incomplete) and comes back.
    w = World()
    objs = node_p()
    for obj in objs:
        w.slices.upsert(obj)
    w.claims.upsert(claim)
    w.slices.delete(objs[0])
    assert pool_view(w)["kube_resourcepool_incomplete"] == {"": 1.0}
    assert "kube_resourcepool_devices_free" not in pool_view(w)
    w.slices.upsert(node_p()[0])
    assert w.joined() == results[0]


def test_pool_with_a_device_consuming_an_undefined_counter_set_is_invalid():
    w = World()
    devices = slice_obj(
        "devs", GPU, "q", [partition("x", "40Gi", counter_set="gpu-1-counters"), {"name": "plain"}], count=2
    )
    w.slices.upsert(devices)
    # Incomplete: the counters slice may not be published yet.
    assert pool_view(w, "q")["kube_resourcepool_invalid"] == {"": 0.0}
    assert pool_view(w, "q")["kube_resourcepool_incomplete"] == {"": 1.0}
    w.slices.upsert(counters_slice("ctrs", GPU, "q", {"gpu-0-counters": {"memory": "80Gi"}}, count=2))
    view = pool_view(w, "q")
    assert (view["kube_resourcepool_incomplete"], view["kube_resourcepool_invalid"]) == ({"": 0.0}, {"": 1.0})
    # An invalid pool gets no counts at all (the scheduler allocates nothing from it, "plain" included).
    assert set(view) == {"kube_resourcepool_generation", "kube_resourcepool_incomplete", "kube_resourcepool_invalid"}
    # The set exists but lacks the counter consumed.
    w.slices.upsert(counters_slice("ctrs", GPU, "q", {"gpu-1-counters": {"cores": "8"}}, count=2))
    assert pool_view(w, "q")["kube_resourcepool_invalid"] == {"": 1.0}
    w.slices.upsert(counters_slice("ctrs", GPU, "q", {"gpu-1-counters": {"memory": "80Gi", "cores": "8"}}, count=2))
    view = pool_view(w, "q")
    assert view["kube_resourcepool_invalid"] == {"": 0.0}
    assert view["kube_resourcepool_devices_free"] == {'node_name="n1"': 2.0}
    assert view["kube_resourcepool_counter_set_free"] == {
        'counter="cores",counter_set="gpu-1-counters",node_name="n1"': 8.0,
        'counter="memory",counter_set="gpu-1-counters",node_name="n1"': 80.0 * GI,
    }
    # Counter set names are unique in a pool: a second slice defining the same set is invalid.
    w.slices.upsert(slice_obj("devs", GPU, "q", devices["spec"]["devices"], count=3))
    w.slices.upsert(counters_slice("ctrs", GPU, "q", {"gpu-1-counters": {"memory": "80Gi"}}, count=3))
    w.slices.upsert(counters_slice("ctrs-2", GPU, "q", {"gpu-1-counters": {"memory": "80Gi"}}, count=3))
    assert pool_view(w, "q")["kube_resourcepool_invalid"] == {"": 1.0}
    w.slices.upsert(counters_slice("ctrs-2", GPU, "q", {"gpu-2-counters": {"memory": "80Gi"}}, count=3))
    assert pool_view(w, "q")["kube_resourcepool_invalid"] == {"": 0.0}


def test_pool_wide_counters_are_joined_per_generation():
    w = World()
    for obj in node_p(generation=1):
        w.slices.upsert(obj)
    w.claims.upsert(gpu_claim("a", "gpu-0-half-a"))
    # The driver republishes the pool as generation 2 with more memory and a quarter partition;
    # generation 1 lingers. Slices of one generation never consume from another's sets.
    new_counters = node_p(generation=2, memory="96Gi", suffix="-2")[0]
    w.slices.upsert(new_counters)
    view = pool_view(w)
    assert (view["kube_resourcepool_generation"], view["kube_resourcepool_incomplete"]) == ({"": 2.0}, {"": 1.0})
    assert "kube_resourcepool_counter_set_free" not in view  # no counts while incomplete
    new_devices = slice_obj(
        "node-p-devices-2",
        GPU,
        "node-p",
        [
            partition("gpu-0-full", "96Gi"),
            partition("gpu-0-half-a", "48Gi"),
            partition("gpu-0-half-b", "48Gi"),
            partition("gpu-0-quarter", "24Gi"),
        ],
        nodeName="node-p",
        count=2,
        generation=2,
    )
    w.slices.upsert(new_devices)
    w.claims.upsert(gpu_claim("q", "gpu-0-quarter"))
    view = pool_view(w)
    # Generation 2: half-a (48Gi, joined by device name) and the quarter (24Gi) take 72Gi of 96Gi.
    assert view["kube_resourcepool_counter_set_capacity"] == {MEMORY: 96.0 * GI}
    assert view["kube_resourcepool_counter_set_free"] == {MEMORY: 24.0 * GI}
    assert view["kube_resourcepool_devices"] == {NODE: 4.0}
    assert view["kube_resourcepool_devices_free"] == {NODE: 0.0}  # half-b needs 48Gi
    # No partitionTypeAttribute in generation 2: its partitions have no type.
    assert view["kube_resourcepool_partitions_free"] == {f'{NODE},partition_type=""': 0.0}
    # Generation 1's counters slice keeps its own free: only half-a (40Gi); it has no quarter.
    assert _value(w, "kube_resourceslice_counter_set_free", resourceslice_name="node-p-counters") == 40.0 * GI
    assert _value(w, "kube_resourceslice_counter_set_free", resourceslice_name="node-p-counters-2") == 24.0 * GI
    # Generation 2 goes away: back to generation 1.
    w.slices.delete(new_counters)
    w.slices.delete(new_devices)
    view = pool_view(w)
    assert view["kube_resourcepool_counter_set_free"] == {MEMORY: 40.0 * GI}
    assert view["kube_resourcepool_devices_free"] == {NODE: 1.0}


def test_kubernetes_1_34_slices_with_their_own_counters():
    """1.34: a slice defines counter sets and devices, and its devices consume from its own sets
    only; two slices of a pool may each define a set of the same name."""
    w = World()
    for node in ("n1", "n2"):
        w.slices.upsert(
            slice_obj(
                f"gpu-{node}",
                GPU,
                "shared",
                [partition(f"{node}-full", "80Gi", "full"), partition(f"{node}-half", "40Gi", "half")],
                nodeName=node,
                count=2,
                sharedCounters=[{"name": "gpu-0-counters", "counters": {"memory": {"value": "80Gi"}}}],
                partitionTypeAttribute=f"{GPU}/profile",
            )
        )
    w.claims.upsert(gpu_claim("a", "n1-half", pool="shared"))
    view = pool_view(w, "shared")
    assert view["kube_resourcepool_invalid"] == {"": 0.0}
    assert view["kube_resourcepool_devices_free"] == {'node_name="n1"': 0.0, 'node_name="n2"': 2.0}
    assert view["kube_resourcepool_counter_set_free"] == {
        'counter="memory",counter_set="gpu-0-counters",node_name="n1"': 40.0 * GI,
        'counter="memory",counter_set="gpu-0-counters",node_name="n2"': 80.0 * GI,
    }
    assert view["kube_resourcepool_partitions_allocated"] == {
        'node_name="n1",partition_type="full"': 0.0,
        'node_name="n1",partition_type="half"': 1.0,
        'node_name="n2",partition_type="full"': 0.0,
        'node_name="n2",partition_type="half"': 0.0,
    }
    assert _value(w, "kube_resourceslice_counter_set_free", resourceslice_name="gpu-n1") == 40.0 * GI
    assert _value(w, "kube_resourceslice_counter_set_free", resourceslice_name="gpu-n2") == 80.0 * GI
    # Two slices on one node with a set of the same name: one series, their sums.
    w.slices.upsert(
        slice_obj(
            "gpu-n2",
            GPU,
            "shared",
            [partition("n2-full", "80Gi")],
            nodeName="n1",
            count=2,
            sharedCounters=[{"name": "gpu-0-counters", "counters": {"memory": {"value": "80Gi"}}}],
        )
    )
    assert pool_view(w, "shared")["kube_resourcepool_counter_set_free"] == {
        'counter="memory",counter_set="gpu-0-counters",node_name="n1"': 120.0 * GI
    }


def test_cost_resolution_and_unpriced_devices():
    w = World()
    for name, cost in (("big", "9.5"), ("small", "1.25"), ("nocost", None), ("bad", "1,5")):
        w.classes.upsert(class_obj(name, cost))
    requests = [
        {
            "name": "accel",
            "firstAvailable": [{"name": "b", "deviceClassName": "big"}, {"name": "s", "deviceClassName": "small"}],
        },
        {"name": "x", "exactly": {"deviceClassName": "nocost"}},
        {"name": "y", "exactly": {"deviceClassName": "bad"}},
        {"name": "z", "exactly": {"deviceClassName": "missing"}},
    ]
    results = [
        result("d0", request="accel/s"),
        result("d1", request="accel/s"),
        result("d2", request="x"),
        result("d3", request="y"),
        result("d4", request="z"),
        result("d5", request="nosuchrequest"),
        result("d6", request="accel/s", adminAccess=True),
    ]
    w.claims.upsert(claim_obj("c", results, requests=requests))
    assert w.samples("kube_resourceclaim_hourly_cost") == {
        'kube_resourceclaim_hourly_cost{deviceclass_name="small",namespace="ns",resourceclaim_name="c"}': 2.5
    }
    unpriced = {s.split("{")[1]: v for s, v in w.samples("kube_resourceclaim_unpriced_devices").items()}
    assert unpriced == {
        'deviceclass_name="",namespace="ns",reason="unresolved_request",resourceclaim_name="c"}': 1.0,
        'deviceclass_name="bad",namespace="ns",reason="invalid_cost",resourceclaim_name="c"}': 1.0,
        'deviceclass_name="missing",namespace="ns",reason="class_not_found",resourceclaim_name="c"}': 1.0,
        'deviceclass_name="nocost",namespace="ns",reason="no_cost",resourceclaim_name="c"}': 1.0,
    }
    # Classes appearing, changing and going away re-price the claim.
    w.classes.upsert(class_obj("missing", "2"))
    w.classes.upsert(class_obj("small", "1"))
    w.classes.delete(class_obj("nocost"))
    costs = {
        s.split('deviceclass_name="')[1].split('"')[0]: v
        for s, v in w.samples("kube_resourceclaim_hourly_cost").items()
    }
    assert costs == {"missing": 2.0, "small": 2.0}
    assert 'deviceclass_name="nocost",namespace="ns",reason="class_not_found"' in "".join(
        w.joined()["kube_resourceclaim_unpriced_devices"]
    )
    # Deallocated: no cost at all.
    w.claims.upsert(claim_obj("c", None, requests=requests))
    assert (
        w.joined()["kube_resourceclaim_hourly_cost"] == [] and w.joined()["kube_resourceclaim_unpriced_devices"] == []
    )


# --- leak clock ----------------------------------------------------------------------------------
def test_leak_clock():
    now = [1_800_000_000.0]  # 2027-01-15T08:00:00Z
    w = World(grace=600, now=now)
    written = "2027-01-15T07:55:00Z"  # 300 s ago
    w.claims.upsert(claim_obj("idle", [result("x")], reserved=False, status_time=written))
    w.claims.upsert(claim_obj("busy", [result("y")]))
    w.claims.upsert(claim_obj("pending"))
    assert w.joined()["kube_resourceclaim_leaked"] == []
    now[0] += 299
    assert w.joined()["kube_resourceclaim_leaked"] == []
    now[0] += 2
    assert w.joined()["kube_resourceclaim_leaked"] == [
        'kube_resourceclaim_leaked{namespace="ns",resourceclaim_name="idle"} 1.0'
    ]
    # A later status write restarts the clock; a reservation ends it.
    w.claims.upsert(claim_obj("idle", [result("x")], reserved=False, status_time="2027-01-15T08:05:00Z"))
    assert w.joined()["kube_resourceclaim_leaked"] == []
    now[0] += 600
    assert len(w.joined()["kube_resourceclaim_leaked"]) == 1
    w.claims.upsert(claim_obj("idle", [result("x")]))
    assert w.joined()["kube_resourceclaim_leaked"] == []
    # Without managed fields the clock starts when the exporter first sees the claim unreserved,
    # and keeps running through unrelated updates.
    w.claims.upsert(claim_obj("nofields", [result("z")], reserved=False))
    now[0] += 400
    w.claims.upsert(claim_obj("nofields", [result("z")], reserved=False))
    now[0] += 201
    assert w.joined()["kube_resourceclaim_leaked"] == [
        'kube_resourceclaim_leaked{namespace="ns",resourceclaim_name="nofields"} 1.0'
    ]
    w.claims.delete(claim_obj("nofields"))
    assert w.joined()["kube_resourceclaim_leaked"] == []
    assert len(w.joins.leaks) == 0


# --- incremental upkeep ------------------------------------------------------------------------------
def _random_world_ops(rng: random.Random, steps: int) -> list[tuple[str, str, dict[str, Any] | None]]:
    """Random changes over a small universe: (kind, key, object or None for a delete)."""
    ops: list[tuple[str, str, dict[str, Any] | None]] = []
    drivers = ("d1", "d2")
    for _ in range(steps):
        kind = rng.choice(("slice", "slice", "claim", "claim", "claim", "class", "rule", "version"))
        if kind == "version":  # an upgrade or downgrade across v1.37.1 (rules without a selector)
            ops.append(("version", rng.choice(("v1.36.6", "v1.37.0", "v1.37.2", "v1.38.0-beta.0")), None))
        elif kind == "slice":
            name = f"s{rng.randrange(8)}"
            driver = drivers[int(name[1:]) % 2]
            pool = f"p{rng.randrange(3)}"
            devices = []
            for i in range(rng.randrange(1, 5)):
                dev: dict[str, Any] = {"name": f"x{rng.randrange(6)}", "nodeName": f"n{i % 2}"}
                if rng.random() < 0.4:
                    counters = {"m": {"value": str(rng.randrange(1, 5))}}
                    if rng.random() < 0.2:
                        counters["k"] = {"value": "1"}
                    dev["consumesCounters"] = [{"counterSet": rng.choice(("cs", "cs", "cs2")), "counters": counters}]
                    if rng.random() < 0.7:
                        dev["attributes"] = {"profile": {"string": rng.choice(("small", "big"))}}
                if rng.random() < 0.2:
                    dev["allowMultipleAllocations"] = True
                    dev["capacity"] = {"bw": {"value": "10", "requestPolicy": {"default": "3"}}}
                if rng.random() < 0.15:
                    dev["taints"] = [{"key": "k", "effect": rng.choice(("NoSchedule", "NoExecute", "None"))}]
                devices.append(dev)
            spec: dict[str, Any] = {"perDeviceNodeSelection": True, "nodeName": None}
            shape = rng.random()
            if shape < 0.3:  # 1.34: counters and devices in one slice
                spec["sharedCounters"] = [{"name": "cs", "counters": {"m": {"value": "6"}}}]
            elif shape < 0.55:  # 1.35+: a counters-only slice of the pool
                spec = {"nodeName": rng.choice(("n0", "n1")), "sharedCounters": []}
                for set_name in rng.sample(("cs", "cs2"), rng.randrange(1, 3)):
                    counters = {"m": {"value": str(rng.randrange(3, 9))}}
                    if rng.random() < 0.5:
                        counters["k"] = {"value": "2"}
                    spec["sharedCounters"].append({"name": set_name, "counters": counters})
                devices = []
            if devices and rng.random() < 0.5:
                spec["partitionTypeAttribute"] = f"{driver}/profile"
            obj = slice_obj(
                name, driver, pool, devices, generation=rng.randrange(1, 3), count=rng.randrange(1, 4), **spec
            )
            if not devices:
                del obj["spec"]["devices"]
            ops.append(("slice", name, None if rng.random() < 0.15 else obj))
        elif kind == "claim":
            name = f"c{rng.randrange(12)}"
            results = None
            if rng.random() < 0.7:
                results = []
                for _ in range(rng.randrange(1, 3)):
                    extra: dict[str, Any] = {}
                    if rng.random() < 0.2:
                        extra["adminAccess"] = True
                    if rng.random() < 0.3:
                        extra["consumedCapacity"] = {"bw": str(rng.randrange(0, 5))}
                    request = rng.choice(("r", "fa/a", "fa/b", "bogus"))
                    results.append(
                        result(
                            f"x{rng.randrange(6)}",
                            driver=rng.choice(drivers),
                            pool=f"p{rng.randrange(3)}",
                            request=request,
                            **extra,
                        )
                    )
            requests = [
                {"name": "r", "exactly": {"deviceClassName": f"k{rng.randrange(3)}"}},
                {
                    "name": "fa",
                    "firstAvailable": [{"name": "a", "deviceClassName": "k0"}, {"name": "b", "deviceClassName": "k3"}],
                },
            ]
            obj = claim_obj(
                name, results, namespace=rng.choice(("a", "b")), requests=requests, reserved=rng.random() < 0.5
            )
            ops.append(("claim", f"{obj['metadata']['namespace']}/{name}", None if rng.random() < 0.15 else obj))
        elif kind == "class":
            name = f"k{rng.randrange(4)}"
            obj = class_obj(name, rng.choice((None, "1", "2.5", "bad")))
            ops.append(("class", name, None if rng.random() < 0.2 else obj))
        else:
            name = f"r{rng.randrange(2)}"
            selector = {"driver": rng.choice(drivers)}
            if rng.random() < 0.5:
                selector["device"] = f"x{rng.randrange(6)}"
            rule_spec: dict[str, Any] = {"deviceSelector": selector, "taint": {"key": "k", "effect": "NoSchedule"}}
            shape = rng.random()
            if shape < 0.2:
                del rule_spec["deviceSelector"]  # every device before v1.37.1, none since
            elif shape < 0.3:
                rule_spec["deviceSelector"] = {}  # every device
            obj = {"metadata": _meta(name), "spec": rule_spec}
            ops.append(("rule", name, None if rng.random() < 0.3 else obj))
    return ops


def _apply(
    world: World, ops: list[tuple[str, str, dict[str, Any] | None]], current: dict[tuple[str, str], dict[str, Any]]
) -> None:
    for kind, key, obj in ops:
        if kind == "version":
            world.joins.set_server_version(parse_git_version(key))
            current[("version", "")] = {"gitVersion": key}
            continue
        store = world.by_kind[kind]
        if obj is None:
            gone = current.pop((kind, key), None)
            if gone is not None:
                store.delete(gone)
        else:
            # A claim may move namespace under the same name: that is another object.
            current[(kind, key)] = obj
            store.upsert(obj)


@pytest.mark.parametrize("seed", range(6))
def test_incremental_upkeep_equals_a_fresh_computation(seed):
    rng = random.Random(seed)
    live = World(now=[5000.0])
    current: dict[tuple[str, str], dict[str, Any]] = {}
    for _round in range(8):
        _apply(live, _random_world_ops(rng, 40), current)
        fresh = World(now=[5000.0])
        version = current.get(("version", ""))
        if version is not None:
            fresh.joins.set_server_version(parse_git_version(version["gitVersion"]))
        for kind in ("class", "rule", "slice", "claim"):  # any order must give the same result
            fresh.by_kind[kind].replace([o for (k, _), o in current.items() if k == kind])
        assert live.joined() == fresh.joined()
        # A relist of the same objects changes nothing either.
        for kind in ("claim", "slice", "class", "rule"):
            live.by_kind[kind].replace([o for (k, _), o in current.items() if k == kind])
        assert live.joined() == fresh.joined()


def test_union_of_shards_equals_unsharded():
    rng = random.Random(42)
    ops = _random_world_ops(rng, 300)
    whole = World()
    shards = [World(Shard(i, 3)) for i in range(3)]
    for world in (whole, *shards):
        _apply(world, ops, {})
    expected = Counter(line for lines in whole.joined().values() for line in lines)
    union: Counter[str] = Counter()
    for world in shards:
        union.update(line for lines in world.joined().values() for line in lines)
    assert union == expected
    assert all(sum(1 for lines in w.joined().values() for _ in lines) < sum(expected.values()) for w in shards)


@pytest.fixture
def evaluated(monkeypatch) -> list[str]:
    """The names of the slices evaluated (clear it before the change under test)."""
    names: list[str] = []
    real = joins.evaluate

    def counting(s, *args):
        names.append(s.name)
        return real(s, *args)

    monkeypatch.setattr(joins, "evaluate", counting)
    return names


def test_work_per_claim_change_is_bounded_by_the_slices_it_touches(evaluated):
    w = World()
    for i in range(200):
        w.slices.upsert(slice_obj(f"s{i:03d}", "d", f"p{i:03d}", [{"name": f"x{j}"} for j in range(8)]))
    for i in range(200):
        w.claims.upsert(claim_obj(f"c{i:03d}", [result("x0", pool=f"p{i:03d}")]))
    evaluated.clear()
    # Move one claim from one device to another of a different pool: two slices, nothing else.
    w.claims.upsert(claim_obj("c007", [result("x1", pool="p123")]))
    assert sorted(evaluated) == ["s007", "s123"]
    evaluated.clear()
    w.claims.upsert(claim_obj("c008", [result("x0", pool="p008")], reserved=False))  # same devices
    assert evaluated == []
    # A class change re-prices only its claims (no slice work).
    w.classes.upsert(class_obj("c1", "2"))
    assert evaluated == []


def test_work_per_claim_change_in_a_partitionable_pool_is_bounded_by_the_counter_set(evaluated):
    w = World()
    gpus = {f"gpu-{g}-counters": {"memory": "80Gi"} for g in range(4)}
    w.slices.upsert(counters_slice("counters", GPU, "big", gpus, count=5))
    for g in range(4):
        devices = [partition(f"gpu-{g}-half-{h}", "40Gi", counter_set=f"gpu-{g}-counters") for h in "ab"]
        w.slices.upsert(slice_obj(f"devices-{g}", GPU, "big", devices, count=5))
    evaluated.clear()
    # A claim takes a half of GPU 1: its slice and the slice defining its counter set, no other.
    w.claims.upsert(gpu_claim("c", "gpu-1-half-a", pool="big"))
    assert sorted(evaluated) == ["counters", "devices-1"]
    assert pool_view(w, "big")["kube_resourcepool_devices_free"] == {'node_name="n1"': 7.0}
    evaluated.clear()
    # A status write that changes nothing the join uses costs nothing.
    w.claims.upsert(claim_obj("c", [result("gpu-1-half-a", driver=GPU, pool="big")], reserved=False))
    assert evaluated == []
