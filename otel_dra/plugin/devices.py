"""Devices as the plugin publishes them in its ResourceSlices, and the simulated GPU profile.

A device is kept in the JSON shape of ``resource.k8s.io/v1`` (``attributes{name: {string|int|bool|
version}}``, ``capacity{name: {value}}``) so that what is published is exactly what is compared
when deciding whether to publish again. The newer per-device fields (consumed counters, several
allocations with request policies, binding conditions, node-allocatable resources) are kept the
same way; each belongs to a :data:`FEATURES` entry, so that what an API server does not take can
be left out of a whole pool (:func:`without`) instead of being published half. The other device
profiles are in :mod:`otel_dra.plugin.profiles`.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Mapping
from dataclasses import field
from typing import Any

from otel_dra.records import record, replace

# Limits of resource.k8s.io/v1 (v0.34.0) that a device source must respect.
MAX_ATTRIBUTES_AND_CAPACITIES = 32
MAX_STRING_ATTRIBUTE = 64

SIMULATED_MODEL = "LATEST-GPU-MODEL"
SIMULATED_DRIVER_VERSION = "1.0.0"
SIMULATED_MEMORY = "80Gi"
SIMULATED_COMPUTE = "100"
# Fixed namespace so that the simulated UUIDs are the same on every start for the same node.
_UUID_NAMESPACE = uuid.UUID("6f1b9c1e-3a52-4c1e-9b0e-6d1e0a7f5c21")


# The features an API server may not take, by what they add to a pool (feature gates of 1.34-1.38):
PARTITIONABLE = "partitionable"  # sharedCounters, consumesCounters (DRAPartitionableDevices)
PARTITION_TYPE = "partition-type"  # spec.partitionTypeAttribute (DRAPartitionableDevicesType, alpha 1.37)
CONSUMABLE = "consumable"  # allowMultipleAllocations, capacity requestPolicy (DRAConsumableCapacity)
BINDING = "binding"  # bindingConditions, bindingFailureConditions, bindsToNode (DRADeviceBindingConditions)
NODE_ALLOCATABLE = "node-allocatable"  # nodeAllocatableResources (DRANodeAllocatableResources, alpha 1.36)
FEATURES = {
    PARTITIONABLE: "DRAPartitionableDevices",
    PARTITION_TYPE: "DRAPartitionableDevicesType",
    CONSUMABLE: "DRAConsumableCapacity",
    BINDING: "DRADeviceBindingConditions",
    NODE_ALLOCATABLE: "DRANodeAllocatableResources",
}

# What --binding-conditions makes every device carry; otel-dra binding-controller sets them.
BINDING_CONDITION = "Attached"
BINDING_FAILURE_CONDITION = "AttachFailed"


@record(frozen=True)
class CounterSet:
    """A shared counter set of a pool (``spec.sharedCounters[]``): what partitions consume."""

    name: str
    counters: Mapping[str, str]  # name -> Kubernetes quantity

    def to_api(self) -> dict[str, Any]:
        return {"name": self.name, "counters": {k: {"value": v} for k, v in self.counters.items()}}


@record(frozen=True)
class Device:
    """One allocatable device: its name in the pool, attributes and capacity (API JSON shape), the
    newer per-device fields, and what the plugin keeps for itself (not published): the container
    environment its prepare adds and the driver data of its status in a claim."""

    name: str
    attributes: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    capacity: Mapping[str, str] = field(default_factory=dict)  # name -> Kubernetes quantity
    # capacity name -> requestPolicy (API JSON: default, validValues or validRange); CONSUMABLE.
    request_policy: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    allow_multiple_allocations: bool = False  # CONSUMABLE
    # counter set name -> counter name -> quantity (``consumesCounters``); PARTITIONABLE.
    consumes_counters: Mapping[str, Mapping[str, str]] = field(default_factory=dict)
    # Only a partition of another device: left out with PARTITIONABLE (it would be allocatable
    # beside its whole device), where a whole device only loses its consumesCounters.
    partition: bool = False
    parent: str = ""  # the device a partition is part of
    binding_conditions: tuple[str, ...] = ()  # BINDING (with the failure ones and bindsToNode)
    binding_failure_conditions: tuple[str, ...] = ()
    # resource name -> NodeAllocatableResource (API JSON); NODE_ALLOCATABLE.
    node_allocatable: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    # Not published: variables every prepare of the device adds (its CPU set, its interface), and
    # the claim status data (``data``) and network data (``networkData``) of the device.
    env: Mapping[str, str] = field(default_factory=dict)
    data: Mapping[str, Any] = field(default_factory=dict)
    network_data: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if len(self.attributes) + len(self.capacity) > MAX_ATTRIBUTES_AND_CAPACITIES:
            raise ValueError(f"device {self.name}: more than {MAX_ATTRIBUTES_AND_CAPACITIES} attributes+capacities")
        for key, value in self.attributes.items():
            text = value.get("string")
            if isinstance(text, str) and len(text) > MAX_STRING_ATTRIBUTE:
                raise ValueError(f"device {self.name}: attribute {key} is longer than {MAX_STRING_ATTRIBUTE}")

    def to_api(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name}
        if self.attributes:
            out["attributes"] = {k: dict(v) for k, v in self.attributes.items()}
        if self.capacity:
            out["capacity"] = {
                k: {"value": v, **({"requestPolicy": dict(self.request_policy[k])} if k in self.request_policy else {})}
                for k, v in self.capacity.items()
            }
        if self.consumes_counters:
            out["consumesCounters"] = [
                {"counterSet": name, "counters": {k: {"value": v} for k, v in counters.items()}}
                for name, counters in self.consumes_counters.items()
            ]
        if self.allow_multiple_allocations:
            out["allowMultipleAllocations"] = True
        if self.binding_conditions:
            out["bindsToNode"] = True
            out["bindingConditions"] = list(self.binding_conditions)
            out["bindingFailureConditions"] = list(self.binding_failure_conditions)
        if self.node_allocatable:
            out["nodeAllocatableResources"] = {k: dict(v) for k, v in self.node_allocatable.items()}
        return out

    def status_data(self) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
        """The device's ``data`` and ``networkData`` for its entry in a claim's ``status.devices``."""
        return (dict(self.data) or None, dict(self.network_data) or None)

    def features(self) -> set[str]:
        """The :data:`FEATURES` this device uses."""
        used = set()
        if self.consumes_counters:
            used.add(PARTITIONABLE)
        if self.allow_multiple_allocations or self.request_policy:
            used.add(CONSUMABLE)
        if self.binding_conditions:
            used.add(BINDING)
        if self.node_allocatable:
            used.add(NODE_ALLOCATABLE)
        return used


@record(frozen=True)
class Pool:
    """What one node publishes: its devices, the counter sets they consume, and the attribute that
    names each partitionable device's partition type (``spec.partitionTypeAttribute``, "" for none)."""

    devices: tuple[Device, ...] = ()
    counter_sets: tuple[CounterSet, ...] = ()
    partition_type_attribute: str = ""

    def features(self) -> set[str]:
        used = set().union(*(d.features() for d in self.devices))
        if self.counter_sets:
            used.add(PARTITIONABLE)
        if self.partition_type_attribute:
            used.add(PARTITION_TYPE)
        return used


def without(pool: Pool, features: Iterable[str]) -> Pool:
    """``pool`` as an API server without ``features`` can hold it, and still right: without
    PARTITIONABLE the partitions go (each would be allocatable beside its whole device) and the
    whole devices consume no counters; without CONSUMABLE a device is allocated whole, once."""
    off = set(features)
    if not off & pool.features():
        return pool
    devices = []
    for d in pool.devices:
        if PARTITIONABLE in off and d.partition:
            continue
        changes: dict[str, Any] = {}
        if PARTITIONABLE in off and d.consumes_counters:
            changes["consumes_counters"] = {}
        if CONSUMABLE in off and (d.allow_multiple_allocations or d.request_policy):
            changes.update(allow_multiple_allocations=False, request_policy={})
        if BINDING in off and d.binding_conditions:
            changes.update(binding_conditions=(), binding_failure_conditions=())
        if NODE_ALLOCATABLE in off and d.node_allocatable:
            changes["node_allocatable"] = {}
        devices.append(replace(d, **changes) if changes else d)
    partitionable = PARTITIONABLE not in off
    return Pool(
        tuple(devices),
        pool.counter_sets if partitionable else (),
        pool.partition_type_attribute if partitionable and PARTITION_TYPE not in off else "",
    )


def string(value: str) -> dict[str, Any]:
    return {"string": value}


def integer(value: int) -> dict[str, Any]:
    return {"int": value}


def boolean(value: bool) -> dict[str, Any]:
    return {"bool": value}


def version(value: str) -> dict[str, Any]:
    return {"version": value}


def semver(text: str) -> str:
    """A dotted version as strict semver: ``580.159.04`` -> ``580.159.4``, ``9.0`` -> ``9.0.0``.

    The API server rejects version attributes that are not semver 2.0, and NVIDIA driver versions
    have leading zeros.
    """
    parts = [p for p in text.strip().split(".") if p != ""]
    if not parts or len(parts) > 3 or not all(p.isdigit() for p in parts):
        raise ValueError(f"not a dotted numeric version: {text!r}")
    numbers = [str(int(p)) for p in parts] + ["0"] * (3 - len(parts))
    return ".".join(numbers)


def simulated_uuid(node_name: str, index: int) -> str:
    """Deterministic per node and index, like the example driver's generated GPU UUIDs."""
    return f"gpu-{uuid.uuid5(_UUID_NAMESPACE, f'{node_name}/{index}')}"


def simulated_devices(node_name: str, count: int) -> list[Device]:
    """The dra-example-driver profile: ``gpu-<i>`` with index, uuid, model and driverVersion
    attributes and 80Gi of memory and 100 compute units each."""
    return [
        Device(
            name=f"gpu-{i}",
            attributes={
                "index": integer(i),
                "uuid": string(simulated_uuid(node_name, i)),
                "model": string(SIMULATED_MODEL),
                "driverVersion": version(SIMULATED_DRIVER_VERSION),
            },
            capacity={"memory": SIMULATED_MEMORY, "compute": SIMULATED_COMPUTE},
            data={"uuid": simulated_uuid(node_name, i)},
        )
        for i in range(count)
    ]
