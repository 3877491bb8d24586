"""What the joins compute, as pure functions of the objects they are given: one slice joined with
the allocations naming its devices (:func:`evaluate`), what a slice's allocated devices consume
from their pool's shared counters (:func:`consumption`), whether a pool generation is one the
scheduler refuses (:func:`pool_invalid`), and a claim's hourly cost (:func:`price`).

Nothing here keeps state: :class:`otel_dra.cluster.joins.Joins` keeps the indexes and calls these
for what a change touched. See docs/metrics.md for the semantics.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence

from otel_dra.cluster.deviceclass import DeviceClass
from otel_dra.cluster.fields import capacity_name
from otel_dra.cluster.joined_families import ClaimCost, SliceUsage
from otel_dra.cluster.resourceclaim import Claim
from otel_dra.cluster.resourceslice import Amounts, Device, Slice

DevKey = tuple[str, str, str]  # (driver, pool, device): how allocation results name a device
SetKey = tuple[str, str, int, str]  # (driver, pool, generation, counter set): a counter set shared pool-wide
Use = tuple[int, Amounts]  # allocation results naming a device, and their summed consumedCapacity
Sums = dict[str, dict[str, float]]  # counter set -> counter -> amount
# For a counter set name of a slice's pool and generation: the counters that a slice of it defines
# (empty when none does) and what the generation's allocated devices consume from them.
CounterLookup = Callable[[str], tuple[Amounts, Mapping[str, float]]]
# A slice's part of its pool's counts, [devices, allocated, free], by node, and for partitionable
# devices (those consuming shared counters) by (node, partition type).
Contribution = dict[str | tuple[str, str], list[int]]

# Reasons an allocation result cannot be priced (kube_resourceclaim_unpriced_devices).
CLASS_NOT_FOUND = "class_not_found"
UNRESOLVED_REQUEST = "unresolved_request"


def claim_uses(claim: Claim | None) -> dict[DevKey, Use]:
    """What an allocated claim consumes, per device (adminAccess results are not consumption)."""
    if claim is None or not claim.has_allocation:
        return {}
    counts: dict[DevKey, int] = {}
    consumed: dict[DevKey, dict[str, float]] = {}
    for r in claim.results:
        if r.admin:
            continue
        key = (r.driver, r.pool, r.device)
        counts[key] = counts.get(key, 0) + 1
        if r.consumed:
            sums = consumed.setdefault(key, {})
            for cap, value in r.consumed:
                sums[cap] = sums.get(cap, 0.0) + value
    return {key: (count, tuple(sorted(consumed.get(key, {}).items()))) for key, count in counts.items()}


def _consume(into: Sums, d: Device) -> None:
    """Add what the device consumes from shared counters."""
    for set_name, amounts in d.counters:
        sums = into.setdefault(set_name, {})
        for counter, value in amounts:
            sums[counter] = sums.get(counter, 0.0) + value


def _in_use(s: Slice, d: Device, uses: Callable[[DevKey], Iterable[Use]]) -> bool:
    return any(n for n, _ in uses((s.driver, s.pool, d.name)))


def consumption(s: Slice, uses: Callable[[DevKey], Iterable[Use]]) -> dict[SetKey, dict[str, float]]:
    """What the allocated devices of a slice consume from the counter sets of their pool (since
    Kubernetes 1.35: sets that other slices of the pool generation define); empty for 1.34's shape."""
    if s.counter_sets:
        return {}
    sums: Sums = {}
    for d in s.devices:
        if d.counters and _in_use(s, d, uses):
            _consume(sums, d)
    return {(s.driver, s.pool, s.generation, set_name): amounts for set_name, amounts in sums.items()}


def _undefined(_set_name: str) -> tuple[Amounts, Mapping[str, float]]:
    return (), {}


def evaluate(
    s: Slice,
    uses: Callable[[DevKey], Iterable[Use]],
    rules: Sequence[tuple[str, str]] = (),
    counters: CounterLookup = _undefined,
) -> tuple[SliceUsage, Contribution]:
    """The slice joined with the allocations naming its devices, and its contribution to its pool's
    per-node counts (see Contribution). ``rules``: (pool,
    device) selectors of the blocking DeviceTaintRules for the slice's driver ("" matches any).
    ``counters``: the counter sets of the slice's pool generation (not used for 1.34's shape, where
    a slice's devices consume from the slice's own sets)."""
    allocated: list[bool] = []
    capacity: list[Amounts | None] = []
    counter_use: Sums = {}
    for d in s.devices:
        count = 0
        sums: dict[str, float] = {}
        for n, amounts in uses((s.driver, s.pool, d.name)):
            count += n
            for cap, value in amounts:
                sums[cap] = sums.get(cap, 0.0) + value
        allocated.append(count > 0)
        # Claims name consumed capacity as capacity_name spells it (the driver's domain dropped);
        # the device keeps its own spelling, which its series show.
        capacity.append(
            tuple((cap, sums.get(capacity_name(cap, s.driver), 0.0)) for cap, _ in d.capacities) if d.multi else None
        )
        if count:
            _consume(counter_use, d)
    left: dict[tuple[str, str], float] = {}
    own_use: Mapping[str, Mapping[str, float]] = counter_use
    if not s.local_counters:
        # A devices-only slice: its devices consume from sets that other slices of the pool define.
        for set_name in {set_name for d in s.devices for set_name, _ in d.counters}:
            defined, used = counters(set_name)
            left.update(((set_name, c), v - used.get(c, 0.0)) for c, v in defined)
        # A counters-only slice: its sets are consumed by the devices of other slices.
        own_use = {set_name: counters(set_name)[1] for set_name, _ in s.counter_sets}
    for set_name, amounts in s.counter_sets:
        used = own_use.get(set_name, {})
        left.update(((set_name, c), v - used.get(c, 0.0)) for c, v in amounts)
    contribution: Contribution = {}
    for d, is_allocated, used_capacity in zip(s.devices, allocated, capacity, strict=True):
        if d.multi:
            # Shareable: free while a request that names no amount (the default) still fits.
            taken = dict(used_capacity or ())
            free = all(
                taken.get(cap, 0.0) + default <= value
                for (cap, value), default in zip(d.capacities, d.defaults, strict=True)
            )
        else:
            free = not is_allocated
        if free and not is_allocated:
            # Its partitions' shared counters must still have room for it (counters that no slice
            # defines make the pool invalid: no counts are reported for it).
            free = all(left.get((set_name, c), v) >= v for set_name, amounts in d.counters for c, v in amounts)
        if free and (d.blocked or any(p in ("", s.pool) and dev in ("", d.name) for p, dev in rules)):
            free = False
        counts = contribution.setdefault((d.node_name, d.partition_type) if d.counters else d.node_name, [0, 0, 0])
        counts[0] += 1
        counts[1] += is_allocated
        counts[2] += free
    usage = SliceUsage(
        slice=s,
        allocated=tuple(allocated),
        allocated_capacity=tuple(capacity),
        counters_free=tuple(
            (set_name, tuple((counter, left[(set_name, counter)]) for counter, _ in amounts))
            for set_name, amounts in s.counter_sets
        ),
    )
    return usage, contribution


def pool_invalid(slices: Sequence[Slice], *, complete: bool) -> bool:
    """What makes the scheduler refuse a pool generation: a device name or a pool-wide counter set
    name defined twice, or, once the pool is complete (a counters-only slice may come after the
    devices that consume from it), a device consuming a counter set or counter that is not defined
    (in its own slice for 1.34's shape, in a counters-only slice of the generation since 1.35)."""
    names: set[str] = set()
    devices = 0
    pool_sets: dict[str, set[str]] = {}
    for s in slices:
        devices += len(s.devices)
        names.update(d.name for d in s.devices)
        for set_name, amounts in () if s.devices else s.counter_sets:
            if set_name in pool_sets:
                return True
            pool_sets[set_name] = {counter for counter, _ in amounts}
    if len(names) != devices:
        return True
    if not complete:
        return False
    for s in slices:
        sets = {n: {c for c, _ in amounts} for n, amounts in s.counter_sets} if s.local_counters else pool_sets
        for d in s.devices:
            for set_name, amounts in d.counters:
                defined = sets.get(set_name)
                if defined is None or any(counter not in defined for counter, _ in amounts):
                    return True
    return False


def price(claim: Claim, classes: Mapping[str, DeviceClass]) -> ClaimCost:
    """The hourly cost of an allocated claim's devices, per DeviceClass they were requested through
    (``classes``: by name), and the results that cannot be priced, by class and reason."""
    requests = dict(claim.request_classes)
    costs: dict[str, float] = {}
    unpriced: dict[tuple[str, str], int] = {}
    for r in claim.results:
        if r.admin:
            continue
        deviceclass = requests.get(r.request)
        reason = None
        if deviceclass is None:
            deviceclass, reason = "", UNRESOLVED_REQUEST
        else:
            found = classes.get(deviceclass)
            if found is None:
                reason = CLASS_NOT_FOUND
            elif found.hourly_cost is None:
                reason = found.cost_problem or CLASS_NOT_FOUND
            else:
                costs[deviceclass] = costs.get(deviceclass, 0.0) + found.hourly_cost
        if reason is not None:
            unpriced[(deviceclass, reason)] = unpriced.get((deviceclass, reason), 0) + 1
    return ClaimCost(
        claim.namespace,
        claim.name,
        tuple(sorted(costs.items())),
        tuple((c, reason, n) for (c, reason), n in sorted(unpriced.items())),
    )


def classes_of(claim: Claim) -> Sequence[str]:
    """The DeviceClasses a claim's allocation is priced through (a changed class re-prices it)."""
    requests = dict(claim.request_classes)
    return sorted({requests[r.request] for r in claim.results if r.request in requests})
