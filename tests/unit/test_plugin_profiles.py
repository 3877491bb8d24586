"""Device profiles (otel_dra/plugin/profiles.py), what is left out for an API server without a
feature, how the publisher lays a pool out in slices, and how a prepare honours what was allocated
(shares, partitions, CPU sets, NICs). The slices against the real API server:
tests/integration/test_plugin_profiles.py."""

from __future__ import annotations

from typing import Any

import pytest

from otel_dra.cli import plugin as cli_plugin
from otel_dra.kube.quantity import parse_quantity
from otel_dra.plugin import devices as devices_module
from otel_dra.plugin.devices import (
    BINDING,
    CONSUMABLE,
    NODE_ALLOCATABLE,
    PARTITION_TYPE,
    PARTITIONABLE,
    simulated_devices,
    without,
)
from otel_dra.plugin.profiles import PROFILES, ProfileOptions, build
from otel_dra.plugin.slices import SlicePublisher, dropped_features, rejected_features
from otel_dra.plugin.state import ClaimError, ClaimRef, DeviceState

NODE = "node-a"
DRIVER = "gpu.example.com"


def _pool(profile: str, **options: Any) -> Any:
    return build(NODE, DRIVER, ProfileOptions(profile, **options))


def test_the_cli_knows_the_plugins_profiles_and_conditions():
    assert cli_plugin.PROFILE_CHOICES == PROFILES
    assert cli_plugin.BINDING_CONDITION == devices_module.BINDING_CONDITION
    assert cli_plugin.BINDING_FAILURE_CONDITION == devices_module.BINDING_FAILURE_CONDITION


def test_gpu_is_the_example_drivers_and_shared_gpus_carry_request_policies():
    assert list(_pool("gpu", count=3).devices) == simulated_devices(NODE, 3)
    assert _pool("gpu").features() == set()
    shared = _pool("gpu", count=2, allow_multiple=True)
    api = shared.devices[0].to_api()
    assert api["allowMultipleAllocations"] is True
    assert api["capacity"]["memory"] == {
        "value": "80Gi",
        "requestPolicy": {"default": "10240Mi", "validRange": {"min": "1Gi", "step": "1Gi"}},
    }
    assert api["capacity"]["compute"]["requestPolicy"]["default"] == "12"
    assert shared.features() == {CONSUMABLE}


def test_partitionable_gpus_consume_no_more_than_their_counter_set():
    pool = _pool("gpu-partitionable", count=2, partitions=3)
    assert [c.name for c in pool.counter_sets] == ["gpu-0-counters", "gpu-1-counters"]
    assert [d.name for d in pool.devices][:4] == ["gpu-0", "gpu-0-part-0", "gpu-0-part-1", "gpu-0-part-2"]
    assert pool.partition_type_attribute == f"{DRIVER}/profile"
    whole = {k: parse_quantity(v) for k, v in pool.counter_sets[0].counters.items()}
    parts = [d for d in pool.devices if d.partition and d.name.startswith("gpu-0-")]
    assert len(parts) == 3
    for counter in ("memory", "compute"):
        used = sum(parse_quantity(d.consumes_counters["gpu-0-counters"][counter]) for d in parts)
        assert 0 < used <= whole[counter]
    gpu0 = pool.devices[0]
    assert {k: parse_quantity(v) for k, v in gpu0.consumes_counters["gpu-0-counters"].items()} == whole
    # Devices of one partition type consume the same (what partitionTypeAttribute promises).
    costs = {d.attributes["profile"]["string"]: d.consumes_counters["gpu-0-counters"] for d in parts}
    assert list(costs) == ["1of3"]
    assert parts[0].attributes["parentUUID"] == gpu0.attributes["uuid"]
    assert parts[0].env == {"PARENT": "gpu-0", "PROFILE": "1of3", "MEMORY": "27306Mi", "COMPUTE": "33"}
    assert pool.features() == {PARTITIONABLE, PARTITION_TYPE}


def test_cpu_and_net_profiles():
    cpu = _pool("cpu", count=2)
    assert [d.name for d in cpu.devices] == ["numa-0", "numa-1"]
    assert cpu.devices[1].to_api()["nodeAllocatableResources"] == {"cpu": {"mapping": {"deviceMultiplier": "16"}}}
    assert cpu.devices[1].env == {"CPUSET": "16-31", "NUMA_NODE": "1"}
    assert cpu.features() == {NODE_ALLOCATABLE}
    net = _pool("net", count=2)
    nic = net.devices[1].to_api()
    assert nic["allowMultipleAllocations"] is True
    assert nic["capacity"]["bandwidth"]["requestPolicy"]["default"] == "10G"
    data, network = net.devices[1].status_data()
    assert network == {"interfaceName": "dranet1", "hardwareAddress": net.devices[1].env["MAC"]}
    assert data == {"pciAddress": "0000:82:00.0"}
    assert net.devices[0].env["MAC"] != net.devices[1].env["MAC"]
    assert build("node-b", DRIVER, ProfileOptions("net", count=1)).devices[0].env["MAC"] != net.devices[0].env["MAC"]


@pytest.mark.parametrize("profile", PROFILES)
def test_binding_conditions_on_every_device_of_every_profile(profile):
    pool = _pool(profile, count=1, binding_conditions=True)
    for device in pool.devices:
        api = device.to_api()
        assert api["bindingConditions"] == ["Attached"]
        assert api["bindingFailureConditions"] == ["AttachFailed"]
        assert api["bindsToNode"] is True
    assert BINDING in pool.features()
    assert not any("bindingConditions" in d.to_api() for d in without(pool, {BINDING}).devices)


def test_bad_options_are_refused_with_the_reason():
    with pytest.raises(ValueError, match="unknown device profile 'tpu'"):
        ProfileOptions("tpu")
    with pytest.raises(ValueError, match="partitions must be 1 to 8"):
        ProfileOptions("gpu-partitionable", partitions=9)
    with pytest.raises(ValueError, match="allow_multiple is for the gpu profile"):
        ProfileOptions("cpu", allow_multiple=True)
    with pytest.raises(ValueError, match="cpus_per_numa_node must be 1 to 1024"):
        ProfileOptions("cpu", cpus_per_numa_node=0)


def test_small_numa_nodes_map_as_many_cpus_as_they_have():
    [numa0, numa1] = _pool("cpu", count=2, cpus_per_numa_node=1).devices
    assert numa1.env == {"CPUSET": "1", "NUMA_NODE": "1"}
    assert numa1.to_api()["nodeAllocatableResources"] == {"cpu": {"mapping": {"deviceMultiplier": "1"}}}
    assert numa0.capacity["cpus"] == "1"


def test_without_a_feature_the_pool_is_still_right():
    pool = _pool("gpu-partitionable", count=2)
    plain = without(pool, {PARTITIONABLE})
    # Partitions beside a whole GPU that consumes nothing would be allocated twice: they go.
    assert [d.name for d in plain.devices] == ["gpu-0", "gpu-1"]
    assert plain.counter_sets == () and plain.partition_type_attribute == ""
    assert all("consumesCounters" not in d.to_api() for d in plain.devices)
    # Only the partition type: everything else stays.
    untyped = without(pool, {PARTITION_TYPE})
    assert untyped.devices == pool.devices and untyped.partition_type_attribute == ""
    whole = without(_pool("net", count=1), {CONSUMABLE}).devices[0].to_api()
    assert "allowMultipleAllocations" not in whole and "requestPolicy" not in whole["capacity"]["bandwidth"]
    assert "nodeAllocatableResources" not in without(_pool("cpu", count=1), {NODE_ALLOCATABLE}).devices[0].to_api()
    assert without(pool, {CONSUMABLE}) is pool  # nothing of it used: the same pool


def _layout(pool: Any, *, separate: bool) -> list[dict[str, Any]]:
    publisher = SlicePublisher(
        None,  # type: ignore[arg-type]  # layout needs no client once the layout is given
        driver_name=DRIVER,
        node_name=NODE,
        discover=lambda: pool,
        separate_counter_slices=separate,
    )
    return list(publisher.layout(pool, {}).values())


def test_counter_sets_in_slices_of_their_own_since_135():
    parts = _layout(_pool("gpu-partitionable", count=20, partitions=3), separate=True)
    counters = [p for p in parts if "sharedCounters" in p]
    devices = [p for p in parts if "devices" in p]
    assert [len(p["sharedCounters"]) for p in counters] == [8, 8, 4]
    assert all("devices" not in p for p in counters)
    assert [len(p["devices"]) for p in devices] == [64, 16]  # 80 devices, 64 a slice with counters
    assert all(p["partitionTypeAttribute"] == f"{DRIVER}/profile" for p in devices)
    assert all("partitionTypeAttribute" not in p for p in counters)


def test_counter_sets_beside_their_devices_on_134():
    parts = _layout(_pool("gpu-partitionable", count=20, partitions=3), separate=False)
    for p in parts:
        names = {c["name"] for c in p["sharedCounters"]}
        assert len(names) <= 8 and len(p["devices"]) <= 64
        assert {c["counterSet"] for d in p["devices"] for c in d["consumesCounters"]} == names
    assert sum(len(p["devices"]) for p in parts) == 80


def test_plain_pools_keep_128_devices_a_slice_and_an_empty_pool_one_slice():
    assert [len(p["devices"]) for p in _layout(_pool("gpu", count=130), separate=True)] == [128, 2]
    assert _layout(_pool("gpu", count=0), separate=True) == [{"devices": []}]


def test_what_the_api_server_dropped_or_rejected():
    sent = {"devices": [_pool("net", count=1).devices[0].to_api()]}
    kept = {"spec": {"devices": [{"name": "nic-0", "capacity": {"bandwidth": {"value": "100G"}}}]}}
    assert dropped_features(sent, kept) == {CONSUMABLE}
    assert dropped_features(sent, {"spec": sent}) == set()
    partitioned = {"sharedCounters": [{"name": "x"}], "partitionTypeAttribute": "d/profile"}
    assert dropped_features(partitioned, {"spec": {"sharedCounters": [{"name": "x"}]}}) == {PARTITION_TYPE}
    message = 'ResourceSlice "n" is invalid: spec.partitionTypeAttribute: Forbidden: disabled by feature gate'
    assert rejected_features(message) == {PARTITION_TYPE}
    assert rejected_features("spec.devices[0].name: Invalid value") == set()


# --- prepare: what the container gets -------------------------------------------------------------


def _state(pool: Any, *, prefix: str = "GPU", gpu_config: bool = True) -> DeviceState:
    by_name = {d.name: d for d in pool.devices}
    return DeviceState(
        DRIVER,
        NODE,
        by_name.get,
        lambda uid, name: [f"k8s.{DRIVER}/x={uid}-{name}"],
        env_prefix=prefix,
        gpu_config=gpu_config,
    )


def _claim(*results: dict[str, Any], config: Any = None) -> dict[str, Any]:
    devices: dict[str, Any] = {"results": list(results)}
    if config is not None:
        devices["config"] = config
    return {"metadata": {"uid": "u1"}, "status": {"allocation": {"devices": devices}}}


def _result(device: str, request: str = "r", **extra: Any) -> dict[str, Any]:
    return {"request": request, "driver": DRIVER, "pool": NODE, "device": device, **extra}


REF = ClaimRef("ns", "u1", "c")
SHARE_A = "0b7e3c52-7a52-4a8e-b1a2-0c1f4f5a9d01"
SHARE_B = "9f1e3c52-7a52-4a8e-b1a2-0c1f4f5a9d02"


def test_two_shares_of_one_gpu_are_two_cdi_devices_with_their_share_and_capacity():
    state = _state(_pool("gpu", count=1, allow_multiple=True))
    claim = _claim(
        _result("gpu-0", "a", shareID=SHARE_A, consumedCapacity={"memory": "10Gi", "compute": "10"}),
        # 1.38 may qualify a capacity with the driver's own domain.
        _result("gpu-0", "b", shareID=SHARE_B, consumedCapacity={f"{DRIVER}/memory": "20Gi"}),
    )
    prepared = state.prepare(REF, claim)
    assert [name for name, _ in prepared.edits] == [f"gpu-0-{SHARE_A}", f"gpu-0-{SHARE_B}"]
    assert [d.share_id for d in prepared.devices] == [SHARE_A, SHARE_B]
    assert prepared.devices[1].cdi_device_ids == (f"k8s.{DRIVER}/x=u1-gpu-0-{SHARE_B}",)
    a = "0_" + SHARE_A.replace("-", "_").upper()
    assert list(prepared.edits[0][1]) == [
        f"GPU_DEVICE_GPU_{a}_RESOURCE_CLAIM=u1",
        "DRA_ADMIN_ACCESS=false",
        f"GPU_DEVICE_{a}=gpu-0",
        f"GPU_DEVICE_{a}_SHARING_STRATEGY=TimeSlicing",
        f"GPU_DEVICE_{a}_TIMESLICE_INTERVAL=Default",
        f"GPU_DEVICE_{a}_MEMORY=10Gi",
        f"GPU_DEVICE_{a}_COMPUTE=10",
        f"GPU_DEVICE_{a}_SHARE_ID={SHARE_A}",
    ]
    assert f"GPU_DEVICE_0_{SHARE_B.replace('-', '_').upper()}_MEMORY=20Gi" in prepared.edits[1][1]


def test_a_partition_names_its_parent_and_its_part():
    state = _state(_pool("gpu-partitionable", count=1))
    env = state.prepare(REF, _claim(_result("gpu-0-part-1"))).edits[0][1]
    assert "GPU_DEVICE_0_PART_1=gpu-0-part-1" in env
    assert {"GPU_DEVICE_0_PART_1_PARENT=gpu-0", "GPU_DEVICE_0_PART_1_MEMORY=40960Mi"} <= set(env)


def test_cpu_and_nic_variables_and_no_opaque_config_for_them():
    cpu = _state(_pool("cpu", count=2), prefix="CPU", gpu_config=False)
    env = cpu.prepare(REF, _claim(_result("numa-1"))).edits[0][1]
    assert list(env) == [
        "CPU_DEVICE_NUMA_1_RESOURCE_CLAIM=u1",
        "DRA_ADMIN_ACCESS=false",
        "CPU_DEVICE_NUMA_1=numa-1",
        "CPU_DEVICE_NUMA_1_CPUSET=16-31",
        "CPU_DEVICE_NUMA_1_NUMA_NODE=1",
    ]
    config = [{"source": "FromClaim", "opaque": {"driver": DRIVER, "parameters": {}}}]
    with pytest.raises(ClaimError, match="takes no opaque parameters") as info:
        cpu.prepare(REF, _claim(_result("numa-0"), config=config))
    assert info.value.kind == "InvalidConfig"
    other = [{"source": "FromClaim", "opaque": {"driver": "other.example.com", "parameters": {}}}]
    assert cpu.prepare(REF, _claim(_result("numa-0"), config=other)).devices
    net = _state(_pool("net", count=1), prefix="NET", gpu_config=False)
    env = net.prepare(REF, _claim(_result("nic-0", shareID=SHARE_A, consumedCapacity={"bandwidth": "5G"}))).edits[0][1]
    n = "NIC_0_" + SHARE_A.replace("-", "_").upper()
    assert f"NET_DEVICE_{n}_BANDWIDTH=5G" in env
    assert f"NET_DEVICE_{n}_INTERFACE=dranet0" in env
    assert f"NET_DEVICE_{n}_SHARE_ID={SHARE_A}" in env


def test_a_malformed_share_id_fails_that_claim():
    state = _state(_pool("gpu", count=1, allow_multiple=True))
    with pytest.raises(ClaimError) as info:
        state.prepare(REF, _claim(_result("gpu-0", shareID=7)))
    assert info.value.kind == "InvalidClaim"
