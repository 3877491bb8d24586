"""The joined families, as data, and the values they render: a slice joined with the claims'
allocations (:class:`SliceUsage`), a resource pool (:class:`PoolState`), a claim's cost
(:class:`ClaimCost`) and a leaked claim (:class:`LeakedClaim`).

A family here reads several resources; :mod:`otel_dra.cluster.joins` keeps its values up to date,
change by change (with :mod:`otel_dra.cluster.evaluation` and :mod:`otel_dra.cluster.leaks`), and
builds only the stores of the families that ``select`` serves. Each family names the resources it
reads (``Family.reads``) and the optional slim fields it needs (``Family.fields``). See
docs/metrics.md for the semantics.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from otel_dra.cluster.deviceclass import RESOURCE as DEVICECLASSES
from otel_dra.cluster.devicetaintrule import RESOURCE as DEVICETAINTRULES
from otel_dra.cluster.families import Family, Sample, family
from otel_dra.cluster.resourceclaim import RESOURCE as RESOURCECLAIMS
from otel_dra.cluster.resourceslice import COUNTER_LABELS, DEVICE_LABELS, Amounts, Slice
from otel_dra.cluster.resourceslice import RESOURCE as RESOURCESLICES

# The resources the joined families read (Family.reads).
CLAIMS, SLICES = RESOURCECLAIMS.plural, RESOURCESLICES.plural
CLASSES, RULES = DEVICECLASSES.plural, DEVICETAINTRULES.plural
# The optional slim fields (Family.fields) that evaluating a slice reads: every family computed by
# evaluation.evaluate() keeps them all, so that its inputs are complete whichever of them is served.
EVALUATED = ("results", "capacities", "defaults", "taints", "counters", "counter_sets", "partition_type")


# --- rendered values -------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class SliceUsage:
    """A slice joined with the claims' allocations."""

    slice: Slice
    allocated: tuple[bool, ...]  # per device
    allocated_capacity: tuple[Amounts | None, ...]  # per device; None unless allowMultipleAllocations
    counters_free: tuple[tuple[str, Amounts], ...]  # per shared counter set


@dataclass(frozen=True, slots=True)
class PoolState:
    driver: str
    pool: str
    generation: int
    incomplete: bool
    invalid: bool
    # Complete, valid pools only:
    nodes: tuple[tuple[str, int, int, int], ...] = ()  # (node_name, devices, allocated, free)
    # (node_name, partition type, devices, allocated, free), for the devices that consume counters
    partitions: tuple[tuple[str, str, int, int, int], ...] = ()
    counters: tuple[tuple[str, str, str, float, float], ...] = ()  # (node_name, set, counter, capacity, free)


@dataclass(frozen=True, slots=True)
class ClaimCost:
    namespace: str
    name: str
    costs: tuple[tuple[str, float], ...]  # (device class, hourly cost of the results priced through it)
    unpriced: tuple[tuple[str, str, int], ...]  # (device class, reason, results)


@dataclass(frozen=True, slots=True)
class LeakedClaim:
    namespace: str
    name: str


# --- families ----------------------------------------------------------------------------------------
def _allocated(u: SliceUsage) -> Iterable[Sample]:
    s = u.slice
    for d, allocated in zip(s.devices, u.allocated, strict=True):
        yield (s.name, s.driver, s.pool, d.node_name, d.name), 1.0 if allocated else 0.0


def _allocated_capacity(u: SliceUsage) -> Iterable[Sample]:
    s = u.slice
    for d, amounts in zip(s.devices, u.allocated_capacity, strict=True):
        for cap, value in amounts or ():
            yield (s.name, s.driver, s.pool, d.node_name, d.name, cap), value


def _free_capacity(u: SliceUsage) -> Iterable[Sample]:
    s = u.slice
    for d, amounts in zip(s.devices, u.allocated_capacity, strict=True):
        if amounts is not None:
            for (cap, total), (_, used) in zip(d.capacities, amounts, strict=True):
                yield (s.name, s.driver, s.pool, d.node_name, d.name, cap), total - used


def _counters_free(u: SliceUsage) -> Iterable[Sample]:
    s = u.slice
    for set_name, counters in u.counters_free:
        for counter, value in counters:
            yield (s.name, s.driver, s.pool, s.node_name, set_name, counter), value


SLICE_FAMILIES: tuple[Family[SliceUsage], ...] = (
    family(
        "kube_resourceslice_device_allocated",
        "",
        "1 when a claim's allocation (adminAccess excluded) names the device, else 0.",
        DEVICE_LABELS,
        _allocated,
        stability="experimental",
        reads=(SLICES, CLAIMS),
        fields=EVALUATED,
    ),
    family(
        "kube_resourceslice_device_allocated_capacity",
        "",
        "Capacity of a multi-allocatable device consumed by the claims allocated to it (adminAccess excluded).",
        (*DEVICE_LABELS, "capacity"),
        _allocated_capacity,
        stability="experimental",
        reads=(SLICES, CLAIMS),
        fields=EVALUATED,
    ),
    family(
        "kube_resourceslice_device_free_capacity",
        "",
        "Capacity of a multi-allocatable device left for further allocations (shares).",
        (*DEVICE_LABELS, "capacity"),
        _free_capacity,
        stability="experimental",
        reads=(SLICES, CLAIMS),
        fields=EVALUATED,
    ),
    family(
        "kube_resourceslice_counter_set_free",
        "",
        "Shared counter capacity left after what the allocated devices of the slice's pool consume.",
        COUNTER_LABELS,
        _counters_free,
        stability="experimental",
        reads=(SLICES, CLAIMS),
        fields=EVALUATED,
    ),
)


def _pool_generation(p: PoolState) -> Iterable[Sample]:
    yield (p.driver, p.pool), float(p.generation)


def _pool_incomplete(p: PoolState) -> Iterable[Sample]:
    yield (p.driver, p.pool), 1.0 if p.incomplete else 0.0


def _pool_invalid(p: PoolState) -> Iterable[Sample]:
    yield (p.driver, p.pool), 1.0 if p.invalid else 0.0


def _pool_values(
    rows: Callable[[PoolState], Iterable[Sequence[Any]]], keys: int, index: int
) -> Callable[[PoolState], Iterable[Sample]]:
    """Samples from the pool's rows: the first ``keys`` fields are label values, ``index`` the value."""

    def samples(p: PoolState) -> Iterable[Sample]:
        for row in rows(p):
            yield (p.driver, p.pool, *row[:keys]), float(row[index])

    return samples


def _pool_count(index: int) -> Callable[[PoolState], Iterable[Sample]]:
    return _pool_values(lambda p: p.nodes, 1, index)


def _partition_count(index: int) -> Callable[[PoolState], Iterable[Sample]]:
    return _pool_values(lambda p: p.partitions, 2, index)


def _pool_counter(index: int) -> Callable[[PoolState], Iterable[Sample]]:
    return _pool_values(lambda p: p.counters, 3, index)


POOL_NODE_LABELS = ("driver", "pool", "node_name")
PARTITION_LABELS = (*POOL_NODE_LABELS, "partition_type")
POOL_COUNTER_LABELS = (*POOL_NODE_LABELS, "counter_set", "counter")


POOL_STATE_FAMILIES: tuple[Family[PoolState], ...] = (
    family(
        "kube_resourcepool_generation",
        "",
        "The newest generation among the pool's ResourceSlices.",
        ("driver", "pool"),
        _pool_generation,
        stability="experimental",
        reads=(SLICES,),
    ),
    family(
        "kube_resourcepool_incomplete",
        "",
        "1 while fewer or more slices of the pool's newest generation exist than resourceSliceCount says.",
        ("driver", "pool"),
        _pool_incomplete,
        stability="experimental",
        reads=(SLICES,),
    ),
    family(
        "kube_resourcepool_invalid",
        "",
        "1 when the pool's newest generation names a device or a counter set twice, or a device consumes a counter "
        "that no slice of it defines (nothing is allocated from it).",
        ("driver", "pool"),
        _pool_invalid,
        stability="experimental",
        reads=(SLICES,),
        # An undefined counter set or counter makes a pool invalid.
        fields=("counters", "counter_sets"),
    ),
)

# The per-node counts and the pool's counter sets: they need each slice evaluated (the allocated and
# free ones, the claims too; the free devices, the taint rules too).
POOL_COUNT_FAMILIES: tuple[Family[PoolState], ...] = (
    family(
        "kube_resourcepool_devices",
        "{device}",
        "Devices in the pool's newest generation, per node (complete, valid pools only).",
        POOL_NODE_LABELS,
        _pool_count(1),
        stability="experimental",
        reads=(SLICES,),
        fields=EVALUATED,
    ),
    family(
        "kube_resourcepool_devices_allocated",
        "{device}",
        "Allocated devices in the pool's newest generation, per node (adminAccess excluded).",
        POOL_NODE_LABELS,
        _pool_count(2),
        stability="experimental",
        reads=(SLICES, CLAIMS),
        fields=EVALUATED,
    ),
    family(
        "kube_resourcepool_devices_free",
        "{device}",
        "Devices a new request could get now, per node: unallocated, shared counters left, not tainted.",
        POOL_NODE_LABELS,
        _pool_count(3),
        stability="experimental",
        reads=(SLICES, CLAIMS, RULES),
        fields=EVALUATED,
    ),
    # Partitionable devices (those consuming shared counters), per node and partition type.
    *(
        family(
            name,
            "{device}",
            description,
            PARTITION_LABELS,
            _partition_count(index),
            "experimental",
            reads=reads,
            fields=EVALUATED,
        )
        for name, index, reads, description in (
            (
                "kube_resourcepool_partitions",
                2,
                (SLICES,),
                "Devices of the pool's newest generation that consume shared counters, per node and partition type.",
            ),
            (
                "kube_resourcepool_partitions_allocated",
                3,
                (SLICES, CLAIMS),
                "Of those, the allocated ones (adminAccess excluded).",
            ),
            (
                "kube_resourcepool_partitions_free",
                4,
                (SLICES, CLAIMS, RULES),
                "Of those, the ones a new request could get now: unallocated, shared counters left, not tainted.",
            ),
        )
    ),
    # The counter sets of the pool's newest generation, wherever they are defined.
    *(
        family(
            name,
            "",
            description,
            POOL_COUNTER_LABELS,
            _pool_counter(index),
            "experimental",
            reads=reads,
            fields=EVALUATED,
        )
        for name, index, reads, description in (
            (
                "kube_resourcepool_counter_set_capacity",
                3,
                (SLICES,),
                "Counters of the shared counter sets of the pool's newest generation, as numbers.",
            ),
            (
                "kube_resourcepool_counter_set_free",
                4,
                (SLICES, CLAIMS),
                "Counter capacity left after what the allocated devices of the pool's newest generation consume.",
            ),
        )
    ),
)

POOL_FAMILIES = POOL_STATE_FAMILIES + POOL_COUNT_FAMILIES


def _cost(c: ClaimCost) -> Iterable[Sample]:
    for deviceclass, cost in c.costs:
        yield (c.name, c.namespace, deviceclass), cost


def _unpriced(c: ClaimCost) -> Iterable[Sample]:
    for deviceclass, reason, count in c.unpriced:
        yield (c.name, c.namespace, deviceclass, reason), float(count)


COST_FAMILIES: tuple[Family[ClaimCost], ...] = (
    family(
        "kube_resourceclaim_hourly_cost",
        "{cost}",
        "Hourly cost of the devices allocated to the ResourceClaim, per DeviceClass they were requested through.",
        ("resourceclaim_name", "namespace", "deviceclass_name"),
        _cost,
        stability="experimental",
        reads=(CLAIMS, CLASSES),
        fields=("results", "request_classes"),
    ),
    family(
        "kube_resourceclaim_unpriced_devices",
        "{device}",
        "Devices allocated to the ResourceClaim that could not be priced, by DeviceClass and reason.",
        ("resourceclaim_name", "namespace", "deviceclass_name", "reason"),
        _unpriced,
        stability="experimental",
        reads=(CLAIMS, CLASSES),
        fields=("results", "request_classes"),
    ),
)


def _leaked(c: LeakedClaim) -> Iterable[Sample]:
    yield (c.name, c.namespace), 1.0


LEAK_FAMILIES: tuple[Family[LeakedClaim], ...] = (
    family(
        "kube_resourceclaim_leaked",
        "",
        "Present (1) for claims allocated and reserved by nobody for longer than the leak grace period.",
        ("resourceclaim_name", "namespace"),
        _leaked,
        stability="experimental",
        reads=(CLAIMS,),
        fields=("status_time",),
    ),
)

ALL_FAMILIES: tuple[Family[Any], ...] = (*SLICE_FAMILIES, *POOL_FAMILIES, *COST_FAMILIES, *LEAK_FAMILIES)
