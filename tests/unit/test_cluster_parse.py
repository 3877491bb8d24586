from __future__ import annotations

import logging

from otel_dra.cluster import deviceclass, resourceclaim, resourceslice
from otel_dra.cluster.sharding import Shard
from otel_dra.cluster.store import ObjectStore


def _text(chunks):
    return b"".join(c.data for c in chunks)


def _samples(module, obj):
    parsed = module.parse(obj, lambda problem: None)
    return {fam.prom_name: list(fam.samples(parsed)) for fam in module.FAMILIES}


def test_node_name_resolution():
    base = {"metadata": {"name": "s"}, "spec": {"driver": "d", "pool": {"name": "p"}}}
    dev = {"name": "x", "capacity": {"memory": {"value": "1Gi"}}}
    per_device = {
        **base,
        "spec": {
            **base["spec"],
            "perDeviceNodeSelection": True,
            "nodeName": "ignored",
            "devices": [{**dev, "nodeName": "n1"}, {**dev, "name": "y", "allNodes": True}],
        },
    }
    out = _samples(resourceslice, per_device)["kube_resourceslice_device_capacity_memory_bytes"]
    assert [labels[4] for labels, _ in out] == ["n1", ""]
    plain = {**base, "spec": {**base["spec"], "nodeName": "n2", "devices": [dev]}}
    assert _samples(resourceslice, plain)["kube_resourceslice_device_capacity_memory_bytes"][0][0][4] == "n2"
    shared = {**base, "spec": {**base["spec"], "allNodes": True, "devices": [dev]}}
    # Never the pool name.
    assert _samples(resourceslice, shared)["kube_resourceslice_device_capacity_memory_bytes"][0][0][4] == ""


def test_non_string_attributes_give_empty_labels():
    obj = {
        "metadata": {"name": "s"},
        "spec": {
            "driver": "d",
            "pool": {"name": "p"},
            "nodeName": "n",
            "devices": [
                {
                    "name": "x",
                    "attributes": {"type": {"int": 3}, "productName": {"string": "P"}},
                    "capacity": {"decoders": {"value": "7"}},
                }
            ],
        },
    }
    [(labels, value)] = _samples(resourceslice, obj)["kube_resourceslice_device_capacity_decoders"]
    assert labels == ("s", "x", "d", "p", "n", "", "P", "") and value == 7.0


def test_claim_pods_only_and_duplicate_results_merge():
    obj = {
        "metadata": {"name": "c", "namespace": "ns"},
        "status": {
            "allocation": {
                "devices": {
                    "results": [
                        {"driver": "d", "pool": "p", "device": "x", "shareID": "a"},
                        {"driver": "d", "pool": "p", "device": "x", "shareID": "b"},
                        {"driver": "d", "pool": "p"},
                    ]
                }
            },
            "reservedFor": [
                {"resource": "pods", "name": "pod", "uid": "u1"},
                {"apiGroup": "batch", "resource": "jobs", "name": "job", "uid": "u2"},
                {"apiGroup": "example.com", "resource": "pods", "name": "notapod", "uid": "u3"},
            ],
        },
    }
    out = _samples(resourceclaim, obj)
    assert out["kube_resourceclaim_status_allocated_device"] == [(("c", "ns", "p", "x", "d"), 2.0)]
    assert out["kube_resourceclaim_status_reserved_for_pod"] == [(("c", "ns", "pod", "u1"), 1.0)]
    assert out["kube_resourceclaim_status_reserved_total"] == [(("c", "ns"), 1.0)]


def test_pending_claim_reports_zero_reservations():
    out = _samples(resourceclaim, {"metadata": {"name": "c", "namespace": "ns"}, "spec": {}})
    assert out["kube_resourceclaim_status_reserved_total"] == [(("c", "ns"), 0.0)]
    assert out["kube_resourceclaim_status_allocated_device"] == []


def test_invalid_cost_logged_once_per_change_and_omitted(caplog):
    problems: list[str] = []
    store = ObjectStore("deviceclasses", deviceclass.parse, deviceclass.FAMILIES, on_problem=problems.append)
    obj = {"metadata": {"name": "c", "resourceVersion": "1", "annotations": {"hourly-cost": "1e3"}}}
    with caplog.at_level(logging.WARNING):
        for _ in range(3):
            store.upsert(obj)
        store.replace([obj])  # a relist of the unchanged object
    assert problems == ["deviceclasses"]
    assert sum("hourly-cost" in r.getMessage() for r in caplog.records) == 1
    assert _text(store.blocks()[0][1]) == b""
    store.upsert({"metadata": {"name": "c", "resourceVersion": "2", "annotations": {"hourly-cost": "4"}}})
    assert _text(store.blocks()[0][1]) == b'kube_deviceclass_hourly_cost{deviceclass_name="c"} 4.0\n'


def test_malformed_object_does_not_break_others():
    store = ObjectStore("resourceslices", resourceslice.parse, resourceslice.FAMILIES)
    good = {
        "metadata": {"name": "good", "resourceVersion": "1"},
        "spec": {
            "driver": "d",
            "pool": {"name": "p"},
            "nodeName": "n",
            "devices": [
                {"name": "x", "capacity": {"memory": {"value": "1Ki"}}},
                "garbage",
                {"name": "y", "capacity": {"memory": {"value": "lots"}}},
            ],
        },
    }
    bad = {"metadata": {"name": "bad", "resourceVersion": "1"}, "spec": "not-an-object"}
    store.replace([good, bad])
    assert len(store) == 2
    memory = {f.prom_name: _text(chunks) for f, chunks in store.blocks()}[
        "kube_resourceslice_device_capacity_memory_bytes"
    ]
    assert memory == (
        b'kube_resourceslice_device_capacity_memory_bytes{device_name="x",driver="d",node_name="n",'
        b'parent_uuid="",pool="p",product_name="",resourceslice_name="good",type=""} 1024.0\n'
    )


def test_store_orders_by_key_and_forgets_deleted():
    store = ObjectStore("deviceclasses", deviceclass.parse, deviceclass.FAMILIES)
    for name in ("b", "a", "c"):
        store.upsert({"metadata": {"name": name, "resourceVersion": "1", "annotations": {"hourly-cost": "1"}}})
    assert [line.split(b'"')[1] for line in _text(store.blocks()[0][1]).splitlines()] == [b"a", b"b", b"c"]
    store.delete({"metadata": {"name": "b"}})
    assert b'"b"' not in _text(store.blocks()[0][1])


def test_segments_stay_sorted_through_inserts_deletes_and_splits():
    import random

    store = ObjectStore("deviceclasses", deviceclass.parse, deviceclass.FAMILIES, segment_size=4)
    rng = random.Random(7)
    names = [f"c{i:04d}" for i in range(200)]
    rng.shuffle(names)
    present = set()
    for step in range(2000):
        name = rng.choice(names)
        rv = step + 1
        if name in present and rng.random() < 0.4:
            store.delete({"metadata": {"name": name}})
            present.discard(name)
        else:
            cost = str(rng.randint(0, 9))
            store.upsert({"metadata": {"name": name, "resourceVersion": str(rv), "annotations": {"hourly-cost": cost}}})
            present.add(name)
        if step % 97 == 0:
            shown = [line.split(b'"')[1].decode() for line in _text(store.blocks()[0][1]).splitlines()]
            assert shown == sorted(present)
    shown = [line.split(b'"')[1].decode() for line in _text(store.blocks()[0][1]).splitlines()]
    assert shown == sorted(present) and len(store) == len(present)
    # Segments stay bounded (split at 2x the size).
    assert all(0 < len(s.keys) < 8 for s in store._segments)


def test_only_dirty_segments_are_rebuilt():
    store = ObjectStore("deviceclasses", deviceclass.parse, deviceclass.FAMILIES, segment_size=2)
    objs = [
        {"metadata": {"name": f"c{i}", "resourceVersion": "1", "annotations": {"hourly-cost": "1"}}} for i in range(6)
    ]
    store.replace(objs)
    before = store.blocks()[0][1]
    store.upsert({"metadata": {"name": "c3", "resourceVersion": "2", "annotations": {"hourly-cost": "5"}}})
    after = store.blocks()[0][1]
    assert [a is b for a, b in zip(before, after, strict=True)] == [True, False, True]
    assert b'deviceclass_name="c3"} 5.0' in after[1].data


def test_blocks_hand_over_the_same_lists_until_a_family_changes():
    """What lets a scrape reuse a family's buffers (telemetry.exposition.Assembler): blocks() gives
    the same list object per family until one of that family's chunks changed; a changed family
    gets a new list, and the list served before is left as it was."""
    store = ObjectStore("deviceclasses", deviceclass.parse, deviceclass.FAMILIES + deviceclass.STATE_FAMILIES)
    objs = [
        {"metadata": {"name": f"c{i}", "resourceVersion": "1", "annotations": {"hourly-cost": "1"}}} for i in range(6)
    ]
    store.replace(objs)
    first = [chunks for _, chunks in store.blocks()]
    assert all(a is b for a, b in zip(first, [c for _, c in store.blocks()], strict=True))
    cost = [g.prom_name for g, _ in store.blocks()].index("kube_deviceclass_hourly_cost")
    served = _text(first[cost])
    store.upsert({"metadata": {"name": "c3", "resourceVersion": "2", "annotations": {"hourly-cost": "5"}}})
    second = [chunks for _, chunks in store.blocks()]
    assert [a is b for a, b in zip(first, second, strict=True)] == [i != cost for i in range(len(first))]
    assert _text(first[cost]) == served and b'"c3"} 5.0' in _text(second[cost])
    # A relist with the same objects (a resourceVersion unchanged) renders nothing new.
    store.replace(
        [
            *objs[:3],
            {"metadata": {"name": "c3", "resourceVersion": "2", "annotations": {"hourly-cost": "5"}}},
            *objs[4:],
        ]
    )
    assert all(a is b for a, b in zip(second, [c for _, c in store.blocks()], strict=True))
    store.delete(objs[5])
    assert all(b'"c5"' not in _text(chunks) for _, chunks in store.blocks())


def test_metadata_that_is_not_an_object_drops_only_that_object():
    """Found by tests/fuzz: ``metadata: "0"`` raised in object_key (outside the parsers' error
    handling), so one such object broke the whole list or watch instead of being dropped."""
    problems: list[str] = []
    store = ObjectStore("deviceclasses", deviceclass.parse, deviceclass.FAMILIES, on_problem=problems.append)
    good = {"metadata": {"name": "good", "resourceVersion": "1", "annotations": {"hourly-cost": "2"}}}
    store.replace([good, {"metadata": "0"}])
    store.upsert({"metadata": ["x"], "spec": {}})
    store.delete({"metadata": 7})
    assert _text(store.blocks()[0][1]) == b'kube_deviceclass_hourly_cost{deviceclass_name="good"} 2.0\n'
    assert problems == ["deviceclasses", "deviceclasses"]  # counted, each time it changed
    sharded = ObjectStore("deviceclasses", deviceclass.parse, deviceclass.FAMILIES, keep=Shard(0, 2).owns)
    sharded.replace([good, {"metadata": "0"}])


def test_shard_filter():
    store = ObjectStore(
        "deviceclasses", deviceclass.parse, deviceclass.FAMILIES, keep=lambda o: o["metadata"]["name"] != "skip"
    )
    store.replace(
        [{"metadata": {"name": "skip", "resourceVersion": "1"}}, {"metadata": {"name": "keep", "resourceVersion": "1"}}]
    )
    store.upsert({"metadata": {"name": "skip", "resourceVersion": "2"}})
    assert len(store) == 1


def test_gc_is_paused_during_concurrent_relists_and_restored_after():
    import gc
    import threading

    from otel_dra.cluster import store as store_module

    assert gc.isenabled()
    inside = threading.Event()
    release = threading.Event()
    seen = []

    def slow_objects():
        inside.set()
        release.wait(5)
        yield {"metadata": {"name": "a", "resourceVersion": "1"}}

    first = ObjectStore("deviceclasses", deviceclass.parse, deviceclass.FAMILIES)
    t = threading.Thread(target=first.replace, args=(slow_objects(),))
    t.start()
    assert inside.wait(5)
    seen.append(gc.isenabled())  # paused while the first relist runs
    with store_module._gc_paused():  # a second, overlapping relist
        seen.append(gc.isenabled())
    seen.append(gc.isenabled())  # still paused: the first has not finished
    release.set()
    t.join(5)
    assert seen == [False, False, False]
    assert gc.isenabled() and len(first) == 1


def test_what_a_list_built_is_frozen_before_the_collector_resumes():
    """Otherwise the first collection after the pause traverses every container the list made."""
    import gc

    gc.unfreeze()
    store = ObjectStore("deviceclasses", deviceclass.parse, deviceclass.FAMILIES)
    store.replace({"metadata": {"name": f"c{i}", "resourceVersion": "1"}} for i in range(100))
    try:
        assert gc.isenabled() and gc.get_freeze_count() > 0
        assert gc.get_count()[0] < 100  # the list's allocations are not waiting in generation 0
    finally:
        gc.unfreeze()


def test_lines_are_held_once_and_survive_rejoins_splits_and_relists():
    """After a join an entry's lines live only in its segment's chunks; re-joins after changes,
    segment splits and full relists must still produce exactly what a fresh store produces."""
    import random

    rng = random.Random(3)

    def obj(name, rv, cost):
        return {"metadata": {"name": name, "resourceVersion": str(rv), "annotations": {"hourly-cost": str(cost)}}}

    live = ObjectStore(
        "deviceclasses", deviceclass.parse, deviceclass.FAMILIES + deviceclass.STATE_FAMILIES, segment_size=3
    )
    current: dict[str, dict] = {}
    rv = 0
    for step in range(600):
        rv += 1
        name = f"c{rng.randrange(40):02d}"
        action = rng.random()
        if action < 0.25 and name in current:
            live.delete(current.pop(name))
        elif action < 0.28:
            # A relist: some objects unchanged (reused), some changed, some gone.
            keep = {k: v for k, v in current.items() if rng.random() < 0.8}
            for k in list(keep):
                if rng.random() < 0.3:
                    rv += 1
                    keep[k] = obj(k, rv, rng.randrange(9))
            current = keep
            live.replace(list(current.values()))
        else:
            current[name] = obj(name, rv, rng.randrange(9))
            live.upsert(current[name])
        if rng.random() < 0.3:
            fresh = ObjectStore("deviceclasses", deviceclass.parse, deviceclass.FAMILIES + deviceclass.STATE_FAMILIES)
            fresh.replace(list(current.values()))
            got = [(g.prom_name, _text(c)) for g, c in live.blocks()]
            assert got == [(g.prom_name, _text(c)) for g, c in fresh.blocks()], step
            # Joined entries gave their own copy of the lines to the segment.
            assert all(e.lines is None for e in live._entries.values())


def test_initial_list_is_joined_as_it_streams_in_key_order_or_not():
    """Into an empty store, a list in key order is segmented and joined while it is read; a list
    out of order falls back to segmenting at the end. Both serve the same bytes."""
    objs = [
        {"metadata": {"name": f"c{i:03d}", "resourceVersion": "1", "annotations": {"hourly-cost": str(i % 7)}}}
        for i in range(50)
    ]
    families = deviceclass.FAMILIES + deviceclass.STATE_FAMILIES
    ordered = ObjectStore("deviceclasses", deviceclass.parse, families, segment_size=4, otlp=True)
    ordered.replace(iter(objs))
    shuffled = ObjectStore("deviceclasses", deviceclass.parse, families, segment_size=4, otlp=True)
    mixed = objs[:30] + objs[40:] + objs[30:40]  # in order for 30 objects (7 segments), then not
    shuffled.replace(iter(mixed))
    assert [len(s.keys) for s in ordered._segments] == [4] * 12 + [2]
    assert not any(s.lines.stale for s in ordered._segments)
    for store in (ordered, shuffled):
        assert all(e.lines is None and e.points is None for e in store._entries.values())
        assert [k for s in store._segments for k in s.keys] == sorted(o["metadata"]["name"] for o in objs)
    assert [(g.prom_name, _text(c)) for g, c in ordered.blocks()] == [
        (g.prom_name, _text(c)) for g, c in shuffled.blocks()
    ]

    def points(store):
        return [(h.name, b"".join(b for g in gs for b in g.raw())) for h, gs in store.otlp_metrics()]

    assert points(ordered) == points(shuffled) and any(data for _, data in points(ordered))


def test_claim_source_from_the_annotations_kubernetes_sets():
    def source(annotations):
        meta = {"name": "c", "namespace": "ns", **({"annotations": annotations} if annotations is not None else {})}
        claim = resourceclaim.parse({"metadata": meta, "spec": {}}, lambda problem: None)
        [(labels, value)] = resourceclaim.STATE_FAMILIES[0].samples(claim)
        assert value == 1.0
        return tuple(labels)

    assert source(None) == ("c", "ns", "direct")
    assert source({"resource.kubernetes.io/pod-claim-name": "gpu"}) == ("c", "ns", "template")
    assert source({"resource.kubernetes.io/extended-resource-claim": "true"}) == ("c", "ns", "extended_resource")
    # Only "true" is valid for the scheduler's annotation; anything else is not its claim.
    assert source({"resource.kubernetes.io/extended-resource-claim": "yes"}) == ("c", "ns", "direct")
    assert source("not-a-map") == ("c", "ns", "direct")


def _family(module_families, prom_name):
    [fam] = [f for f in module_families if f.prom_name == prom_name]
    return fam


def _claim(results, devices=None, allocated_at="2026-11-30T01:00:00Z"):
    allocation = {"devices": {"results": results}}
    if allocated_at is not None:
        allocation["allocationTimestamp"] = allocated_at
    status = {"allocation": allocation, **({"devices": devices} if devices is not None else {})}
    problems: list[str] = []
    claim = resourceclaim.parse({"metadata": {"name": "c", "namespace": "ns"}, "status": status}, problems.append)
    return claim, problems


def _binding(claim):
    state = _family(resourceclaim.STATE_FAMILIES, "kube_resourceclaim_device_binding_state")
    since = _family(resourceclaim.STATE_FAMILIES, "kube_resourceclaim_device_binding_state_timestamp_seconds")
    states = {labels[2:6]: labels[6] for labels, value in state.samples(claim) if value == 1.0}
    return states, {labels[2:6]: value for labels, value in since.samples(claim)}


def test_binding_state_is_decided_as_the_scheduler_decides_it():
    binding = {"bindingConditions": ["Attached", "Ready"], "bindingFailureConditions": ["Failed"]}

    def result(device, share=None, **extra):
        return {
            "request": "r",
            "driver": "d",
            "pool": "p",
            "device": device,
            **binding,
            **extra,
            **({"shareID": share} if share else {}),
        }

    def entry(device, conditions, share=None):
        return {
            "driver": "d",
            "pool": "p",
            "device": device,
            **({"shareID": share} if share else {}),
            "conditions": [
                {"type": t, "status": s, "reason": "R", "message": "", "lastTransitionTime": f"2026-11-30T01:0{m}:00Z"}
                for t, s, m in conditions
            ],
        }

    claim, problems = _claim(
        [
            result("none"),  # no status.devices entry yet
            result("half"),  # one of two conditions true
            result("done"),
            result("bad"),  # a failure condition wins over true binding conditions
            result("shared", share="s-1"),  # matched by shareID too: s-2's entry is not its own
            {"request": "r", "driver": "d", "pool": "p", "device": "plain"},  # no binding conditions: no series
        ],
        devices=[
            entry("half", [("Attached", "True", 1), ("Ready", "False", 2)]),
            entry("done", [("Attached", "True", 1), ("Ready", "True", 3)]),
            entry("bad", [("Attached", "True", 1), ("Ready", "True", 2), ("Failed", "True", 4)]),
            entry("shared", [("Attached", "True", 1), ("Ready", "True", 2)], share="s-2"),
        ],
    )
    assert problems == []
    states, since = _binding(claim)
    t = resourceclaim.parse_time
    assert states == {
        ("d", "p", "none", ""): "waiting",
        ("d", "p", "half", ""): "waiting",
        ("d", "p", "done", ""): "satisfied",
        ("d", "p", "bad", ""): "failed",
        ("d", "p", "shared", "s-1"): "waiting",
    }
    # waiting: since the allocation; satisfied: since the last condition became true; failed: since the failure.
    assert since == {
        ("d", "p", "none", ""): t("2026-11-30T01:00:00Z"),
        ("d", "p", "half", ""): t("2026-11-30T01:00:00Z"),
        ("d", "p", "done", ""): t("2026-11-30T01:03:00Z"),
        ("d", "p", "bad", ""): t("2026-11-30T01:04:00Z"),
        ("d", "p", "shared", "s-1"): t("2026-11-30T01:00:00Z"),
    }
    # The state set has all three states per device, one of them 1.
    state = _family(resourceclaim.STATE_FAMILIES, "kube_resourceclaim_device_binding_state")
    assert len(list(state.samples(claim))) == 5 * 3
    # Without an allocation time (or with a bad one) the state is there, its time is not.
    claim, problems = _claim([result("none")], allocated_at="yesterday")
    assert _binding(claim) == ({("d", "p", "none", ""): "waiting"}, {})
    assert problems == ["allocationTimestamp: not a timestamp: 'yesterday'; series omitted"]
    # Malformed binding lists and status entries are not an error: no conditions, so waiting.
    claim, _ = _claim(
        [
            {
                "request": "r",
                "driver": "d",
                "pool": "p",
                "device": "x",
                "bindingConditions": ["A", 3],
                "bindingFailureConditions": "F",
            }
        ],
        devices=[{"driver": "d", "pool": "p", "device": "x", "conditions": [{"type": "A"}, "junk"]}, "junk"],
    )
    assert _binding(claim)[0] == {("d", "p", "x", ""): "waiting"}


def test_consumed_capacity_per_share_and_skipped_node_operations():
    claim, problems = _claim(
        [
            {
                "request": "a",
                "driver": "d",
                "pool": "p",
                "device": "nic",
                "shareID": "s-1",
                "consumedCapacity": {"bw": "4G"},
            },
            {
                "request": "b",
                "driver": "d",
                "pool": "p",
                "device": "nic",
                "shareID": "s-2",
                "consumedCapacity": {"bw": "2G", "q": "x"},
            },
            {
                "request": "m",
                "driver": "d",
                "pool": "p",
                "device": "nic",
                "adminAccess": True,
                "consumedCapacity": {"bw": "1G"},
            },
            {
                "request": "c",
                "driver": "d",
                "pool": "p",
                "device": "gpu",
                "skipNodeOperations": ["*", "NodePrepareResources"],
            },
            {
                "request": "e",
                "driver": "d",
                "pool": "p",
                "device": "fpga",
                "skipNodeOperations": ["NodeUnprepareResources", "Future", 7],
            },
        ]
    )
    assert problems == ["consumedCapacity q: not a quantity: 'x'; ignored"]
    consumed = _family(resourceclaim.STATE_FAMILIES, "kube_resourceclaim_device_consumed_capacity")
    assert list(consumed.samples(claim)) == [
        (("c", "ns", "d", "p", "nic", "s-1", "bw"), 4e9),
        (("c", "ns", "d", "p", "nic", "s-2", "bw"), 2e9),
    ]
    skipped = _family(resourceclaim.STATE_FAMILIES, "kube_resourceclaim_device_skip_node_operation")
    assert [labels[4:] for labels, value in skipped.samples(claim) if value == 1.0] == [
        ("gpu", "NodePrepareResources"),
        ("gpu", "NodeUnprepareResources"),
        ("fpga", "NodeUnprepareResources"),
        ("fpga", "Future"),
    ]
    spec = {
        "driver": "d",
        "pool": {"name": "p"},
        "nodeName": "n",
        "skipNodeOperations": ["*"],
        "devices": [{"name": "x"}],
    }
    sl = resourceslice.parse({"metadata": {"name": "s"}, "spec": spec}, lambda problem: None)
    slice_skips = _family(resourceslice.STATE_FAMILIES, "kube_resourceslice_skip_node_operation")
    assert list(slice_skips.samples(sl)) == [
        (("s", "d", "p", "n", "NodePrepareResources"), 1.0),
        (("s", "d", "p", "n", "NodeUnprepareResources"), 1.0),
    ]
    # A slice that skips nothing (every minor before 1.37) has no series.
    del spec["skipNodeOperations"]
    assert list(slice_skips.samples(resourceslice.parse({"metadata": {"name": "s"}, "spec": spec}, print))) == []


def test_node_allocatable_mappings_and_overheads_per_device():
    problems: list[str] = []
    devices = [
        # The plugin's cpu profile: each NUMA node is 16 of the node's cpu.
        {"name": "numa-0", "nodeAllocatableResources": {"cpu": {"mapping": {"deviceMultiplier": "16"}}}},
        {
            "name": "mem",
            "nodeAllocatableResources": {
                "memory": {
                    "mapping": {"capacityKey": "d/memory", "capacityMultiplier": "1"},
                    "overhead": {"perPod": "64Mi", "perContainer": "1Mi"},
                },
                "hugepages-2Mi": {"mapping": {"deviceMultiplier": "not a quantity"}},
                "cpu": "not an object",
            },
        },
        {"name": "plain"},
    ]
    spec = {"driver": "d", "pool": {"name": "p"}, "nodeName": "n", "devices": devices}
    sl = resourceslice.parse({"metadata": {"name": "s"}, "spec": spec}, problems.append)
    fam = _family(resourceslice.STATE_FAMILIES, "kube_resourceslice_device_node_allocatable")
    assert list(fam.samples(sl)) == [
        (("s", "d", "p", "n", "numa-0", "cpu", "per_device", ""), 16.0),
        (("s", "d", "p", "n", "mem", "memory", "per_capacity", "d/memory"), 1.0),
        (("s", "d", "p", "n", "mem", "memory", "overhead_per_pod", ""), 64 * 2**20),
        (("s", "d", "p", "n", "mem", "memory", "overhead_per_container", ""), 2**20),
    ]
    # The malformed entries are said and left out; the device's others stay.
    assert len(problems) == 2
    assert "hugepages-2Mi.mapping.deviceMultiplier" in problems[0]
    assert "nodeAllocatableResources.cpu is not an object" in problems[1]


def test_list_typed_attributes_render_bounded_and_in_published_order():
    attributes = resourceslice.DeviceAttributes.parse("numa,pcieRoots,flags,versions,many,empty,mixed")
    many = [f"v{i}" for i in range(11)]
    device = {
        "name": "x",
        "attributes": {
            "numa": {"ints": [1, 0]},
            "pcieRoots": {"strings": ["pci0000:00", "pci0000:80"]},
            "flags": {"bools": [True, False]},
            "versions": {"versions": ["1.2.3", "2.0.0"]},
            "many": {"strings": many},
            "empty": {"strings": []},
            "mixed": {"ints": [1, "two", None, 3]},
        },
    }
    spec = {"driver": "d", "pool": {"name": "p"}, "nodeName": "n", "devices": [device]}
    parse = resourceslice.make_parser(attributes)
    sl = parse({"metadata": {"name": "s"}, "spec": spec}, lambda problem: None)
    assert sl.devices[0].info == (
        "1,0",
        "pci0000:00,pci0000:80",
        "true,false",
        "1.2.3,2.0.0",
        "v0,v1,v2,v3,v4,v5,v6,v7,+3 more",
        "",
        "1,3",  # items of another type are left out
    )


def test_a_slice_with_two_devices_or_counter_sets_of_one_name_keeps_the_first():
    """The API server refuses such a slice; one that gets through must not give a scrape two
    identical series (the OpenMetrics parser merges them; found by tests/fuzz)."""
    problems: list[str] = []
    spec = {
        "driver": "d.example.com",
        "nodeName": "n",
        "pool": {"name": "p", "generation": 1, "resourceSliceCount": 1},
        "devices": [{"name": "a0"}, {"name": "a0", "attributes": {"x": {"int": 1}}}, {"name": "a1"}],
        "sharedCounters": [{"name": "c", "counters": {"m": {"value": "1"}}}, {"name": "c", "counters": {}}],
    }
    sl = resourceslice.parse({"metadata": {"name": "s"}, "spec": spec}, problems.append)
    assert [d.name for d in sl.devices] == ["a0", "a1"]
    assert [name for name, _ in sl.counter_sets] == ["c"]
    assert problems == [
        "spec.devices[1]: a second device named 'a0'; skipped",
        "spec.sharedCounters[1]: a second counter set named 'c'; skipped",
    ]
