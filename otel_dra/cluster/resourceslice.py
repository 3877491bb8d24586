"""ResourceSlices (resource.k8s.io/v1, cluster-scoped): published devices, capacity, counters, taints."""

from __future__ import annotations

import re
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass
from typing import Any

from otel_dra.cluster.families import Family, Sample, family
from otel_dra.cluster.fields import optional_time, skipped_operations
from otel_dra.kube.quantity import parse_quantity
from otel_dra.kube.reflector import ResourceType

RESOURCE = ResourceType("resourceslices", "resource.k8s.io/v1")

# The capacities the compatibility families report (the seed exporter's set).
CAPACITIES = ("memory", "multiprocessors", "decoders")

# Taint effects that keep the scheduler from allocating a device (without a toleration).
BLOCKING_EFFECTS = frozenset({"NoSchedule", "NoExecute"})

DEFAULT_DEVICE_ATTRIBUTES = "type,productName,architecture,driverVersion,uuid"
MAX_DEVICE_ATTRIBUTES = 16
# A device attribute name: an optional DNS-subdomain domain, then a C identifier (<= 32 chars).
_ATTRIBUTE_NAME = re.compile(r"(?:([a-z0-9]([-a-z0-9.]*[a-z0-9])?)/)?([A-Za-z][A-Za-z0-9_]{0,31})", re.ASCII)


def _snake(name: str) -> str:
    name = re.sub(r"([A-Z]+)([A-Z][a-z])", r"\1_\2", name)
    name = re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", name)
    return re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")


@dataclass(frozen=True)
class DeviceAttributes:
    """Which device attributes ``kube_resourceslice_device_info`` carries as labels.

    A name without a domain (``productName``) matches the attribute as published without one or
    qualified with the slice's driver (``gpu.nvidia.com/productName``), which DRA treats as the same
    attribute; a qualified name matches itself, or the bare name when the domain is the driver.
    """

    names: tuple[str, ...]
    labels: tuple[str, ...]

    @classmethod
    def parse(cls, text: str) -> DeviceAttributes:
        names = tuple(n.strip() for n in text.split(",") if n.strip())
        if len(names) > MAX_DEVICE_ATTRIBUTES:
            raise ValueError(f"at most {MAX_DEVICE_ATTRIBUTES} device attributes can become labels, got {len(names)}")
        labels = []
        for name in names:
            if not _ATTRIBUTE_NAME.fullmatch(name):
                raise ValueError(
                    f"{name!r} is not a device attribute name (an identifier such as productName, optionally "
                    "prefixed by a domain: gpu.nvidia.com/productName)"
                )
            label = "attribute_" + _snake(name.rpartition("/")[2])
            if label in labels:
                raise ValueError(f"device attributes {name!r} and another one both become the label {label}")
            labels.append(label)
        return cls(names, tuple(labels))

    def values(self, attributes: Any, driver: str) -> tuple[str, ...]:
        if not isinstance(attributes, dict) or not self.names:
            return tuple("" for _ in self.names)
        return tuple(_attribute_text(_attribute(attributes, name, driver)) for name in self.names)


def _attribute(attributes: dict[str, Any], name: str, driver: str) -> Any:
    """The attribute called ``name`` (bare or qualified: an attribute in the driver's own domain may
    be published either way), or None."""
    domain, _, ident = name.rpartition("/")
    if domain:
        value = attributes.get(name)
        if value is None and domain == driver:
            value = attributes.get(ident)
        return value
    value = attributes.get(name)
    return attributes.get(f"{driver}/{name}") if value is None else value


DEFAULT_ATTRIBUTES = DeviceAttributes.parse(DEFAULT_DEVICE_ATTRIBUTES)


# A list-typed attribute (bools, ints, strings, versions; Kubernetes 1.36+, DRAListTypeAttributes)
# becomes one label value: its items in published order (the lists are atomic: the order is the
# driver's), joined by ",", at most LIST_ATTRIBUTE_ITEMS of them. The API allows 48 values of up to
# 64 characters per device; a label stays bounded as a scalar one (64) is, to 8 items.
LIST_ATTRIBUTE_ITEMS = 8
# The list kinds and the type of their items (an item of another type is left out).
_LIST_KINDS: tuple[tuple[str, type], ...] = (("strings", str), ("versions", str), ("bools", bool), ("ints", int))


def _item_text(value: Any, kind: type) -> str | None:
    if kind is bool:
        return ("true" if value else "false") if isinstance(value, bool) else None
    if isinstance(value, kind) and not isinstance(value, bool):
        return str(value)
    return None


def _attribute_text(value: Any) -> str:
    if not isinstance(value, dict):
        return ""
    for kind in ("string", "version"):
        if isinstance(value.get(kind), str):
            return str(value[kind])
    if isinstance(value.get("bool"), bool):
        return "true" if value["bool"] else "false"
    if isinstance(value.get("int"), int) and not isinstance(value["int"], bool):
        return str(value["int"])
    for kind, item_type in _LIST_KINDS:
        items = value.get(kind)
        if isinstance(items, list) and items:
            texts = [t for t in (_item_text(item, item_type) for item in items) if t is not None]
            shown = ",".join(texts[:LIST_ATTRIBUTE_ITEMS])
            more = len(texts) - LIST_ATTRIBUTE_ITEMS
            return f"{shown},+{more} more" if more > 0 else shown
    return ""


Amounts = tuple[tuple[str, float], ...]  # (name, value) pairs in the published order


@dataclass(frozen=True, slots=True)
class Device:
    name: str
    node_name: str
    type: str
    product_name: str
    parent_uuid: str
    capacity: tuple[float | None, ...]  # in CAPACITIES order; None when absent or invalid
    info: tuple[str, ...] = ()  # values of the configured DeviceAttributes
    capacities: Amounts = ()  # every valid capacity
    # For devices with allowMultipleAllocations: per entry of ``capacities``, what a request that
    # names no amount consumes (requestPolicy.default, else the whole capacity).
    defaults: tuple[float, ...] = ()
    taints: tuple[tuple[str, str, str], ...] = ()  # (key, value, effect)
    # Per entry of ``taints``, its timeAdded (Unix seconds; None when unset or invalid); () when no
    # taint has one.
    taints_added: tuple[float | None, ...] = ()
    counters: tuple[tuple[str, Amounts], ...] = ()  # consumesCounters: (counter set, amounts)
    multi: bool = False  # allowMultipleAllocations
    # The value of the attribute that the slice's partitionTypeAttribute names ("" when unset).
    partition_type: str = ""
    # nodeAllocatableResources (DRANodeAllocatableResources, alpha since 1.36): (resource, kind,
    # capacity key, quantity) per mapping or overhead; see NODE_ALLOCATABLE_KINDS.
    node_allocatable: tuple[tuple[str, str, str, float], ...] = ()

    @property
    def blocked(self) -> bool:
        """A taint keeps the scheduler from allocating it."""
        return any(effect in BLOCKING_EFFECTS for _, _, effect in self.taints)


@dataclass(frozen=True, slots=True)
class Slice:
    name: str
    driver: str
    pool: str
    devices: tuple[Device, ...]
    generation: int = 0
    slice_count: int = 0  # spec.pool.resourceSliceCount
    node_name: str = ""  # spec.nodeName
    counter_sets: tuple[tuple[str, Amounts], ...] = ()  # sharedCounters
    # spec.skipNodeOperations (Kubernetes 1.37, DRAOptionalNodeOperations), "*" spelled out.
    skips: tuple[str, ...] = ()

    @property
    def local_counters(self) -> bool:
        """Kubernetes 1.34's shape: the slice defines counter sets and devices, and its devices
        consume only from its own sets. Since 1.35 a slice holds either counter sets or devices,
        and devices consume from the sets of any slice of their pool (and generation)."""
        return bool(self.counter_sets) and bool(self.devices)


def _string_attribute(attributes: Any, name: str) -> str:
    value = attributes.get(name) if isinstance(attributes, dict) else None
    if isinstance(value, dict) and isinstance(value.get("string"), str):
        return str(value["string"])
    return ""


def _int(value: Any) -> int:
    if isinstance(value, bool):
        return 0
    if isinstance(value, int):
        return value
    if isinstance(value, str) and value.isdigit():
        return int(value)
    return 0


def _amounts(raw: Any, what: str, report: Callable[[str], None]) -> Amounts:
    """``{name: {value: <quantity>}}`` as (name, number) pairs; invalid entries are reported and skipped."""
    if not isinstance(raw, dict):
        if raw is not None:
            report(f"{what} is not an object")
        return ()
    out = []
    for name, entry in raw.items():
        try:
            value = entry.get("value") if isinstance(entry, dict) else entry
            out.append((str(name), parse_quantity(value)))
        except ValueError as exc:
            report(f"{what} {name}: {exc}; series omitted")
    return tuple(out)


# The fields of Slice and Device that only some families read (Family.fields); a parser made for a
# set of them leaves the others at their defaults (memory: a family that is off keeps nothing).
FIELDS = frozenset(
    {"capacity", "type", "product_name", "parent_uuid", "info", "capacities", "defaults", "taints", "counters"}
    | {"taints_added", "partition_type", "counter_sets", "skips", "node_allocatable"}
)

# How a device adds to a node-allocatable resource: per allocated device (mapping.deviceMultiplier),
# per unit of a consumed capacity (mapping.capacityKey x capacityMultiplier), or as overhead per pod
# or per container that references the claim.
NODE_ALLOCATABLE_KINDS = {
    ("mapping", "deviceMultiplier"): "per_device",
    ("mapping", "capacityMultiplier"): "per_capacity",
    ("overhead", "perPod"): "overhead_per_pod",
    ("overhead", "perContainer"): "overhead_per_container",
}


def make_parser(
    attributes: DeviceAttributes = DEFAULT_ATTRIBUTES,
    keep: Collection[str] = FIELDS,
) -> Callable[[dict[str, Any], Callable[[str], None]], Slice]:
    """A parser that fills only the optional fields in ``keep`` (names of other types ignored)."""
    wanted = FIELDS.intersection(keep)

    def parse(obj: dict[str, Any], report: Callable[[str], None]) -> Slice:
        meta = obj.get("metadata") or {}
        spec = obj.get("spec")
        if not isinstance(spec, dict):
            raise ValueError("spec is missing or not an object")
        driver = str(spec.get("driver", ""))
        pool = spec.get("pool") or {}
        if not isinstance(pool, dict):
            pool = {}
        per_device = spec.get("perDeviceNodeSelection") is True
        slice_node = spec["nodeName"] if isinstance(spec.get("nodeName"), str) else ""
        partition_attribute = spec.get("partitionTypeAttribute")
        if not isinstance(partition_attribute, str):
            partition_attribute = ""
        raw_devices = spec.get("devices") or []
        if not isinstance(raw_devices, list):
            report("spec.devices is not a list")
            raw_devices = []
        devices: list[Device] = []
        # The API server refuses a slice with two devices of one name; one that holds them anyway
        # (a fake, a future validation gap) must not give a scrape two identical series.
        device_names: set[str] = set()
        for i, dev in enumerate(raw_devices):
            if not isinstance(dev, dict) or not isinstance(dev.get("name"), str):
                report(f"spec.devices[{i}] has no name; skipped")
                continue
            if dev["name"] in device_names:
                report(f"spec.devices[{i}]: a second device named {dev['name']!r}; skipped")
                continue
            device_names.add(dev["name"])
            devices.append(
                _device(dev, per_device, slice_node, driver, attributes, partition_attribute, wanted, report)
            )
        counter_sets: list[tuple[str, Amounts]] = []
        raw_sets = (spec.get("sharedCounters") or []) if "counter_sets" in wanted else []
        for i, counter_set in enumerate(raw_sets if isinstance(raw_sets, list) else []):
            if not isinstance(counter_set, dict) or not isinstance(counter_set.get("name"), str):
                report(f"spec.sharedCounters[{i}] has no name; skipped")
                continue
            name = counter_set["name"]
            if any(name == known for known, _ in counter_sets):
                report(f"spec.sharedCounters[{i}]: a second counter set named {name!r}; skipped")
                continue
            counter_sets.append((name, _amounts(counter_set.get("counters"), f"counter set {name}: counter", report)))
        return Slice(
            name=str(meta.get("name", "")),
            driver=driver,
            pool=str(pool.get("name", "")),
            devices=tuple(devices),
            generation=_int(pool.get("generation")),
            slice_count=_int(pool.get("resourceSliceCount")),
            node_name=slice_node,
            counter_sets=tuple(counter_sets),
            skips=skipped_operations(spec.get("skipNodeOperations")) if "skips" in wanted else (),
        )

    return parse


def _device(
    dev: dict[str, Any],
    per_device: bool,
    slice_node: str,
    driver: str,
    attributes: DeviceAttributes,
    partition_attribute: str,
    keep: frozenset[str],
    report: Callable[[str], None],
) -> Device:
    name = dev["name"]
    # node_name is the node the device is bound to -- never the pool name. With per-device
    # node selection each device says; otherwise the slice does (empty for shared devices).
    node = dev.get("nodeName") if per_device else slice_node
    attrs = dev.get("attributes")
    if not isinstance(attrs, dict):
        attrs = {}
    raw_capacity = dev.get("capacity") or {}
    capacities: Amounts = ()
    if not keep.isdisjoint(("capacity", "capacities", "defaults")):
        capacities = _amounts(raw_capacity, f"device {name}: capacity", report)
    by_name = dict(capacities)
    multi = dev.get("allowMultipleAllocations") is True
    defaults: list[float] = []
    if multi and "defaults" in keep:
        for cap, value in capacities:
            policy = (raw_capacity.get(cap) or {}).get("requestPolicy")
            default = value
            if isinstance(policy, dict) and policy.get("default") is not None:
                try:
                    default = parse_quantity(policy["default"])
                except ValueError as exc:
                    report(f"device {name}: capacity {cap}: requestPolicy.default: {exc}")
            defaults.append(default)
    taints = []
    added: list[float | None] = []
    raw_taints = (dev.get("taints") or []) if "taints" in keep else []
    want_added = "taints_added" in keep
    for taint in raw_taints if isinstance(raw_taints, list) else []:
        if isinstance(taint, dict) and isinstance(taint.get("key"), str):
            taints.append((taint["key"], str(taint.get("value") or ""), str(taint.get("effect") or "")))
            if want_added:
                what = f"device {name}: taint {taint['key']}: timeAdded"
                added.append(optional_time(taint.get("timeAdded"), what, report))
    counters = []
    raw_counters = (dev.get("consumesCounters") or []) if "counters" in keep else []
    for consumption in raw_counters if isinstance(raw_counters, list) else []:
        if isinstance(consumption, dict) and isinstance(consumption.get("counterSet"), str):
            set_name = consumption["counterSet"]
            counters.append(
                (
                    set_name,
                    _amounts(consumption.get("counters"), f"device {name}: counter set {set_name}: counter", report),
                )
            )
    node_allocatable = (
        _node_allocatable(dev.get("nodeAllocatableResources"), name, report) if "node_allocatable" in keep else ()
    )
    return Device(
        name=name,
        node_name=node if isinstance(node, str) else "",
        type=_string_attribute(attrs, "type") if "type" in keep else "",
        product_name=_string_attribute(attrs, "productName") if "product_name" in keep else "",
        parent_uuid=_string_attribute(attrs, "parentUUID") if "parent_uuid" in keep else "",
        capacity=tuple(by_name.get(cap) for cap in CAPACITIES) if "capacity" in keep else (None,) * len(CAPACITIES),
        info=attributes.values(attrs, driver) if "info" in keep else (),
        capacities=capacities if "capacities" in keep else (),
        defaults=tuple(defaults),
        taints=tuple(taints),
        taints_added=tuple(added) if any(t is not None for t in added) else (),
        counters=tuple(counters),
        multi=multi,
        partition_type=_attribute_text(_attribute(attrs, partition_attribute, driver))
        if partition_attribute and "partition_type" in keep
        else "",
        node_allocatable=node_allocatable,
    )


def _node_allocatable(raw: Any, device: str, report: Callable[[str], None]) -> tuple[tuple[str, str, str, float], ...]:
    """``nodeAllocatableResources`` as (resource, kind, capacity key, quantity); a malformed entry
    is reported and left out, the device's other entries kept."""
    if raw is None:
        return ()
    if not isinstance(raw, dict):
        report(f"device {device}: nodeAllocatableResources is not an object; series omitted")
        return ()
    out = []
    for resource, entry in raw.items():
        if not isinstance(entry, dict):
            report(f"device {device}: nodeAllocatableResources.{resource} is not an object; series omitted")
            continue
        for (part, field), kind in NODE_ALLOCATABLE_KINDS.items():
            section = entry.get(part)
            if not isinstance(section, dict) or section.get(field) is None:
                continue
            value = section[field]
            key = section.get("capacityKey") if kind == "per_capacity" else ""
            try:
                out.append((str(resource), kind, str(key or ""), parse_quantity(value)))
            except ValueError as exc:
                report(f"device {device}: nodeAllocatableResources.{resource}.{part}.{field}: {exc}; series omitted")
    return tuple(out)


parse = make_parser()


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


SEED_FIELDS = ("capacity", "type", "product_name", "parent_uuid")

# The seed's compatibility families: names, labels and values kept byte for byte.
FAMILIES: tuple[Family[Slice], ...] = (
    family(
        "kube_resourceslice_device_capacity_memory",
        "By",
        "Device memory capacity in bytes, from the device's capacity.memory.",
        LABELS,
        _capacity(0),
        fields=SEED_FIELDS,
    ),
    family(
        "kube_resourceslice_device_capacity_multiprocessors",
        "{multiprocessor}",
        "Device streaming-multiprocessor count, from the device's capacity.multiprocessors.",
        LABELS,
        _capacity(1),
        fields=SEED_FIELDS,
    ),
    family(
        "kube_resourceslice_device_capacity_decoders",
        "{decoder}",
        "Device video-decoder count, from the device's capacity.decoders.",
        LABELS,
        _capacity(2),
        fields=SEED_FIELDS,
    ),
)

DEVICE_LABELS = ("resourceslice_name", "driver", "pool", "node_name", "device_name")
COUNTER_LABELS = ("resourceslice_name", "driver", "pool", "node_name", "counter_set", "counter")


def _info(s: Slice) -> Iterable[Sample]:
    for d in s.devices:
        yield (s.name, s.driver, s.pool, d.node_name, d.name, *d.info), 1.0


def _all_capacities(s: Slice) -> Iterable[Sample]:
    for d in s.devices:
        for cap, value in d.capacities:
            yield (s.name, s.driver, s.pool, d.node_name, d.name, cap), value


def _taints(s: Slice) -> Iterable[Sample]:
    for d in s.devices:
        # The API allows the same key with different effects; identical entries become one series.
        for key, value, effect in dict.fromkeys(d.taints):
            yield (s.name, s.driver, s.pool, d.node_name, d.name, key, value, effect), 1.0


def _taints_added(s: Slice) -> Iterable[Sample]:
    for d in s.devices:
        # As for _taints, identical entries are one series: the earliest time.
        first: dict[tuple[str, str, str], float] = {}
        for taint, added in zip(d.taints, d.taints_added, strict=False):
            if added is not None:
                first[taint] = min(added, first.get(taint, added))
        for (key, value, effect), added in first.items():
            yield (s.name, s.driver, s.pool, d.node_name, d.name, key, value, effect), added


def _node_allocatable_samples(s: Slice) -> Iterable[Sample]:
    for d in s.devices:
        for resource, kind, capacity, value in d.node_allocatable:
            yield (s.name, s.driver, s.pool, d.node_name, d.name, resource, kind, capacity), value


def _counter_capacity(s: Slice) -> Iterable[Sample]:
    for set_name, counters in s.counter_sets:
        for counter, value in counters:
            yield (s.name, s.driver, s.pool, s.node_name, set_name, counter), value


def _skipped(s: Slice) -> Iterable[Sample]:
    for operation in s.skips:
        yield (s.name, s.driver, s.pool, s.node_name, operation), 1.0


def _generation(s: Slice) -> Iterable[Sample]:
    yield (s.name, s.driver, s.pool), float(s.generation)


def state_families(attributes: DeviceAttributes = DEFAULT_ATTRIBUTES) -> tuple[Family[Slice], ...]:
    """The per-slice families beyond the seed (``kube_resourceslice_device_info``'s labels depend
    on the configured attributes)."""
    return (
        family(
            "kube_resourceslice_device_info",
            "",
            "Devices published in ResourceSlices (1 per device), with chosen device attributes as labels.",
            (*DEVICE_LABELS, *attributes.labels),
            _info,
            stability="experimental",
            fields=("info",),
        ),
        family(
            "kube_resourceslice_device_capacity",
            "",
            "Every capacity of every device, as a number (capacity label: the capacity's name).",
            (*DEVICE_LABELS, "capacity"),
            _all_capacities,
            stability="experimental",
            fields=("capacities",),
        ),
        family(
            "kube_resourceslice_device_taint",
            "",
            "Taints of devices in ResourceSlices: 1 per (key, value, effect).",
            (*DEVICE_LABELS, "key", "value", "effect"),
            _taints,
            stability="experimental",
            fields=("taints",),
        ),
        family(
            "kube_resourceslice_device_taint_added_timestamp",
            "s",
            "Unix time each taint of a device in a ResourceSlice was added (its timeAdded).",
            (*DEVICE_LABELS, "key", "value", "effect"),
            _taints_added,
            stability="experimental",
            kubernetes="1.34",
            fields=("taints", "taints_added"),
        ),
        family(
            "kube_resourceslice_device_node_allocatable",
            "",
            "What an allocation of the device adds to a node-allocatable resource (nodeAllocatableResources).",
            (*DEVICE_LABELS, "resource", "kind", "capacity"),
            _node_allocatable_samples,
            stability="experimental",
            kubernetes="1.36",
            fields=("node_allocatable",),
        ),
        family(
            "kube_resourceslice_counter_set_capacity",
            "",
            "Counters of the slice's shared counter sets, as numbers.",
            COUNTER_LABELS,
            _counter_capacity,
            stability="experimental",
            fields=("counter_sets",),
        ),
        family(
            "kube_resourceslice_skip_node_operation",
            "",
            "Node operations (kubelet gRPC calls to the driver) that the slice's devices skip.",
            ("resourceslice_name", "driver", "pool", "node_name", "operation"),
            _skipped,
            stability="experimental",
            kubernetes="1.37",
            fields=("skips",),
        ),
        family(
            "kube_resourceslice_pool_generation",
            "",
            "The slice's spec.pool.generation.",
            ("resourceslice_name", "driver", "pool"),
            _generation,
            stability="experimental",
        ),
    )


STATE_FAMILIES = state_families()
