"""ResourceSlices (resource.k8s.io/v1, cluster-scoped): published devices and their capacity."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from otel_dra.cluster.families import Family, Sample, family
from otel_dra.kube.quantity import parse_quantity
from otel_dra.kube.reflector import ResourceType

RESOURCE = ResourceType("resourceslices", "resource.k8s.io/v1")

# The capacities the compatibility families report (the seed exporter's set).
CAPACITIES = ("memory", "multiprocessors", "decoders")


@dataclass(frozen=True, slots=True)
class Device:
    name: str
    node_name: str
    type: str
    product_name: str
    parent_uuid: str
    capacity: tuple[float | None, ...]  # in CAPACITIES order; None when absent or invalid


@dataclass(frozen=True, slots=True)
class Slice:
    name: str
    driver: str
    pool: str
    devices: tuple[Device, ...]


def _string_attribute(attributes: Any, name: str) -> str:
    value = attributes.get(name) if isinstance(attributes, dict) else None
    if isinstance(value, dict) and isinstance(value.get("string"), str):
        return str(value["string"])
    return ""


def parse(obj: dict[str, Any], report: Callable[[str], None]) -> Slice:
    meta = obj.get("metadata") or {}
    spec = obj.get("spec")
    if not isinstance(spec, dict):
        raise ValueError("spec is missing or not an object")
    pool = spec.get("pool") or {}
    per_device = spec.get("perDeviceNodeSelection") is True
    slice_node = spec.get("nodeName") if isinstance(spec.get("nodeName"), str) else ""
    raw_devices = spec.get("devices") or []
    if not isinstance(raw_devices, list):
        report("spec.devices is not a list")
        raw_devices = []
    devices: list[Device] = []
    for i, dev in enumerate(raw_devices):
        if not isinstance(dev, dict) or not isinstance(dev.get("name"), str):
            report(f"spec.devices[{i}] has no name; skipped")
            continue
        # node_name is the node the device is bound to -- never the pool name. With per-device
        # node selection each device says; otherwise the slice does (empty for shared devices).
        node = dev.get("nodeName") if per_device else slice_node
        attributes = dev.get("attributes") or {}
        capacity_in = dev.get("capacity") or {}
        values: list[float | None] = []
        for cap in CAPACITIES:
            entry = capacity_in.get(cap) if isinstance(capacity_in, dict) else None
            if entry is None:
                values.append(None)
                continue
            try:
                raw = entry.get("value") if isinstance(entry, dict) else entry
                values.append(parse_quantity(raw))
            except ValueError as exc:
                report(f"device {dev['name']}: capacity {cap}: {exc}; series omitted")
                values.append(None)
        devices.append(
            Device(
                name=dev["name"],
                node_name=node if isinstance(node, str) else "",
                type=_string_attribute(attributes, "type"),
                product_name=_string_attribute(attributes, "productName"),
                parent_uuid=_string_attribute(attributes, "parentUUID"),
                capacity=tuple(values),
            )
        )
    return Slice(
        name=str(meta.get("name", "")),
        driver=str(spec.get("driver", "")),
        pool=str(pool.get("name", "")) if isinstance(pool, dict) else "",
        devices=tuple(devices),
    )


LABELS = (
    "resourceslice_name",
    "device_name",
    "driver",
    "pool",
    "node_name",
    "type",
    "product_name",
    "parent_uuid",
)


def _capacity(index: int) -> Callable[[Slice], Iterable[Sample]]:
    def samples(s: Slice) -> Iterable[Sample]:
        for d in s.devices:
            value = d.capacity[index]
            if value is not None:
                yield (
                    (s.name, d.name, s.driver, s.pool, d.node_name, d.type, d.product_name, d.parent_uuid),
                    value,
                )

    return samples


FAMILIES: tuple[Family[Slice], ...] = (
    family(
        "kube_resourceslice_device_capacity_memory",
        "By",
        "Device memory capacity in bytes, from the device's capacity.memory.",
        LABELS,
        _capacity(0),
    ),
    family(
        "kube_resourceslice_device_capacity_multiprocessors",
        "{multiprocessor}",
        "Device streaming-multiprocessor count, from the device's capacity.multiprocessors.",
        LABELS,
        _capacity(1),
    ),
    family(
        "kube_resourceslice_device_capacity_decoders",
        "{decoder}",
        "Device video-decoder count, from the device's capacity.decoders.",
        LABELS,
        _capacity(2),
    ),
)
