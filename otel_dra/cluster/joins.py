"""Joins across resources, kept up to date change by change: device allocation, pool and node
utilization, shared counters, claim cost and leaked claims.

The three object stores tell :class:`Joins` about every change (old and new slim object). Joins
keeps indexes over *all* objects (every shard needs them: a claim and the slice holding its device
may belong to different shards) and re-renders, into its own :class:`SeriesStore`s, only what a
change touches:

- a claim change re-evaluates the slices holding the devices its allocation names (before and
  after), and their pools; re-prices the claim; moves it on or off the leak clock;
- a slice change re-evaluates the slice and its pool;
- a DeviceClass change re-prices the claims allocated through it;
- a DeviceTaintRule change re-evaluates the slices of the driver (and pool) it selects (rules are
  few and change rarely).

So the work per change is bounded by the objects it touches (a slice has at most 128 devices), not
by the size of the cluster. Changes of one full relist are applied as one batch, and each touched
slice and pool is evaluated once per batch. See docs/metrics.md for the semantics.

Only what the served families need is built (``select``, see :mod:`otel_dra.cluster.selection`):
a store whose families are all off does not exist, and neither does the work and the indexes that
only it needs (slice evaluation and the device index, pool sums, pricing, the leak clock). Each
family names the resources it reads (``Family.reads``); :attr:`Joins.reads` is their union, the
resources the exporter must watch for the joins.
"""

from __future__ import annotations

import heapq
import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from otel_dra.cluster.deviceclass import RESOURCE as DEVICECLASSES
from otel_dra.cluster.deviceclass import DeviceClass
from otel_dra.cluster.devicetaintrule import RESOURCE as DEVICETAINTRULES
from otel_dra.cluster.devicetaintrule import DeviceTaintRule
from otel_dra.cluster.families import Family, Sample, family
from otel_dra.cluster.resourceclaim import RESOURCE as RESOURCECLAIMS
from otel_dra.cluster.resourceclaim import Claim
from otel_dra.cluster.resourceslice import BLOCKING_EFFECTS, COUNTER_LABELS, DEVICE_LABELS, Amounts, Slice
from otel_dra.cluster.resourceslice import RESOURCE as RESOURCESLICES
from otel_dra.cluster.selection import EVERYTHING, FamilySelection
from otel_dra.cluster.sharding import Shard
from otel_dra.cluster.store import SEGMENT, Change, SeriesStore

log = logging.getLogger(__name__)

DevKey = tuple[str, str, str]  # (driver, pool, device): how allocation results name a device
PoolKey = tuple[str, str]  # (driver, pool)
Use = tuple[int, Amounts]  # allocation results naming a device, and their summed consumedCapacity

# The resources the joined families read (Family.reads).
CLAIMS, SLICES = RESOURCECLAIMS.plural, RESOURCESLICES.plural
CLASSES, RULES = DEVICECLASSES.plural, DEVICETAINTRULES.plural
# The optional slim fields (Family.fields) that evaluating a slice reads: every family computed by
# evaluate() keeps them all, so that its inputs are complete whichever of them is served.
EVALUATED = ("results", "capacities", "defaults", "taints", "counters", "counter_sets")

# Reasons an allocation result cannot be priced (kube_resourceclaim_unpriced_devices).
CLASS_NOT_FOUND = "class_not_found"
UNRESOLVED_REQUEST = "unresolved_request"


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
    nodes: tuple[tuple[str, int, int, int], ...]  # (node_name, devices, allocated, free); complete, valid pools


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
        "kube_resourceslice_counter_set_free",
        "",
        "Shared counter capacity left after what the slice's allocated devices consume.",
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


def _pool_count(index: int) -> Callable[[PoolState], Iterable[Sample]]:
    def samples(p: PoolState) -> Iterable[Sample]:
        for node in p.nodes:
            yield (p.driver, p.pool, node[0]), float(node[index])

    return samples


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
        "1 when the pool's newest generation names a device twice (nothing is allocated from it).",
        ("driver", "pool"),
        _pool_invalid,
        stability="experimental",
        reads=(SLICES,),
    ),
)

# The per-node counts: they need each slice evaluated (the allocated and free ones, the claims too).
POOL_COUNT_FAMILIES: tuple[Family[PoolState], ...] = (
    family(
        "kube_resourcepool_devices",
        "{device}",
        "Devices in the pool's newest generation, per node (complete, valid pools only).",
        ("driver", "pool", "node_name"),
        _pool_count(1),
        stability="experimental",
        reads=(SLICES,),
        fields=EVALUATED,
    ),
    family(
        "kube_resourcepool_devices_allocated",
        "{device}",
        "Allocated devices in the pool's newest generation, per node (adminAccess excluded).",
        ("driver", "pool", "node_name"),
        _pool_count(2),
        stability="experimental",
        reads=(SLICES, CLAIMS),
        fields=EVALUATED,
    ),
    family(
        "kube_resourcepool_devices_free",
        "{device}",
        "Devices a new request could get now, per node: unallocated, shared counters left, not tainted.",
        ("driver", "pool", "node_name"),
        _pool_count(3),
        stability="experimental",
        reads=(SLICES, CLAIMS, RULES),
        fields=EVALUATED,
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


# --- evaluation of one slice ----------------------------------------------------------------------
def _claim_uses(claim: Claim | None) -> dict[DevKey, Use]:
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


def evaluate(
    s: Slice,
    uses: Callable[[DevKey], Iterable[Use]],
    rules: Sequence[tuple[str, str]] = (),
) -> tuple[SliceUsage, dict[str, list[int]]]:
    """The slice joined with the allocations naming its devices, and its contribution to its pool's
    per-node counts: node -> [devices, allocated, free]. ``rules``: (pool, device) selectors of the
    blocking DeviceTaintRules for the slice's driver ("" matches any)."""
    allocated: list[bool] = []
    capacity: list[Amounts | None] = []
    counter_use: dict[tuple[str, str], float] = {}
    for d in s.devices:
        count = 0
        sums: dict[str, float] = {}
        for n, amounts in uses((s.driver, s.pool, d.name)):
            count += n
            for cap, value in amounts:
                sums[cap] = sums.get(cap, 0.0) + value
        allocated.append(count > 0)
        capacity.append(tuple((cap, sums.get(cap, 0.0)) for cap, _ in d.capacities) if d.multi else None)
        if count:
            for set_name, amounts in d.counters:
                for counter, value in amounts:
                    counter_use[(set_name, counter)] = counter_use.get((set_name, counter), 0.0) + value
    left = {
        (set_name, counter): value - counter_use.get((set_name, counter), 0.0)
        for set_name, amounts in s.counter_sets
        for counter, value in amounts
    }
    contribution: dict[str, list[int]] = {}
    for d, is_allocated, used in zip(s.devices, allocated, capacity, strict=True):
        if d.multi:
            # Shareable: free while a request that names no amount (the default) still fits.
            taken = dict(used or ())
            free = all(
                taken.get(cap, 0.0) + default <= value
                for (cap, value), default in zip(d.capacities, d.defaults, strict=True)
            )
        else:
            free = not is_allocated
        if free and not is_allocated:
            # Its partitions' shared counters must still have room for it (counters the slice does
            # not define are ignored, as the scheduler does).
            free = all(left.get((set_name, c), v) >= v for set_name, amounts in d.counters for c, v in amounts)
        if free and (d.blocked or any(p in ("", s.pool) and dev in ("", d.name) for p, dev in rules)):
            free = False
        counts = contribution.setdefault(d.node_name, [0, 0, 0])
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


# --- leak clock ----------------------------------------------------------------------------------
class LeakClock:
    """Claims allocated and reserved by nobody, and when their grace period ends.

    Deadlines sit in a heap; :meth:`tick` (at each scrape or push) renders only the claims whose
    deadline passed since the last tick. Stale heap entries (a claim that changed) are skipped.
    """

    def __init__(self, store: SeriesStore[LeakedClaim], grace: float, clock: Callable[[], float]) -> None:
        self.store = store
        self.grace = grace
        self._clock = clock
        self._lock = threading.Lock()
        self._heap: list[tuple[float, str]] = []
        self._deadlines: dict[str, tuple[float, LeakedClaim]] = {}
        self._seen: dict[str, float] = {}  # first seen unreserved, when the claim gives no time

    def watch(self, key: str, claim: Claim) -> None:
        now = self._clock()
        since = claim.status_time
        if since is None:
            since = self._seen.setdefault(key, now)
        deadline = since + self.grace
        leaked = LeakedClaim(claim.namespace, claim.name)
        with self._lock:
            if self._deadlines.get(key) == (deadline, leaked):
                return
            self._deadlines[key] = (deadline, leaked)
            if deadline <= now:
                self.store.put(key, leaked)
            else:
                heapq.heappush(self._heap, (deadline, key))
                self.store.remove(key)  # a later status write restarts the clock

    def forget(self, key: str) -> None:
        self._seen.pop(key, None)
        with self._lock:
            if self._deadlines.pop(key, None) is not None:
                self.store.remove(key)

    def tick(self) -> None:
        now = self._clock()
        with self._lock:
            due = []
            while self._heap and self._heap[0][0] <= now:
                deadline, key = heapq.heappop(self._heap)
                current = self._deadlines.get(key)
                if current is not None and current[0] == deadline:
                    due.append((key, current[1]))
            if due:
                self.store.update(due)

    def __len__(self) -> int:
        return len(self._deadlines)


# --- the joins -----------------------------------------------------------------------------------
class Joins:
    """Indexes over all claims, slices and classes, and the stores of the joined families that
    ``select`` serves (a store none of whose families is served is None)."""

    def __init__(
        self,
        *,
        shard: Shard | None = None,
        leak_grace: float = 600.0,
        otlp: bool = False,
        segment_size: int = SEGMENT,
        clock: Callable[[], float] = time.time,
        select: FamilySelection = EVERYTHING,
    ) -> None:
        self.shard = shard or Shard()
        common: dict[str, Any] = {"otlp": otlp, "segment_size": segment_size}
        slice_families = select.select(SLICE_FAMILIES)
        pool_families = select.select(POOL_FAMILIES)
        cost_families = select.select(COST_FAMILIES)
        leak_families = select.select(LEAK_FAMILIES)
        self.slice_usage: SeriesStore[SliceUsage] | None = (
            SeriesStore("slice usage", slice_families, **common) if slice_families else None
        )
        self.pools: SeriesStore[PoolState] | None = (
            SeriesStore("resource pools", pool_families, **common) if pool_families else None
        )
        self.costs: SeriesStore[ClaimCost] | None = (
            SeriesStore("claim costs", cost_families, **common) if cost_families else None
        )
        self.leaked: SeriesStore[LeakedClaim] | None = (
            SeriesStore("leaked claims", leak_families, **common) if leak_families else None
        )
        self.stores: list[SeriesStore[Any]] = [
            s for s in (self.slice_usage, self.pools, self.costs, self.leaked) if s is not None
        ]
        self.leaks = LeakClock(self.leaked, leak_grace, clock) if self.leaked is not None else None
        self.families: tuple[Family[Any], ...] = (*slice_families, *pool_families, *cost_families, *leak_families)
        self.reads: frozenset[str] = frozenset(r for f in self.families for r in f.reads)
        # What the served families need: slices evaluated against the claims' allocations (and
        # the taint rules, for free devices), and each slice's per-node counts for the pool sums.
        evaluated: tuple[Family[Any], ...] = (*slice_families, *(f for f in pool_families if f in POOL_COUNT_FAMILIES))
        self._evaluate = bool(evaluated)
        self._allocations = any(CLAIMS in f.reads for f in evaluated)
        self._tainting = any(RULES in f.reads for f in evaluated)
        self._counting = any(f in POOL_COUNT_FAMILIES for f in pool_families)
        self._lock = threading.Lock()
        # Every object, whichever shard renders it.
        self._slices: dict[str, Slice] = {}
        self._slices_of_driver: dict[str, set[str]] = {}
        self._owned_slices: set[str] = set()
        self._device_slices: dict[DevKey, tuple[str, ...]] = {}
        self._pools: dict[PoolKey, dict[int, set[str]]] = {}  # pool -> generation -> slice keys
        self._invalid: dict[PoolKey, bool] = {}
        self._contribution: dict[str, dict[str, list[int]]] = {}  # slice key -> node -> counts
        self._uses: dict[DevKey, dict[str, Use]] = {}  # device -> claim key -> use
        self._classes: dict[str, DeviceClass] = {}
        self._rules: dict[str, DeviceTaintRule] = {}  # blocking, evaluable DeviceTaintRules
        # Owned, allocated claims, for re-pricing when a class changes.
        self._priced: dict[str, Claim] = {}
        self._claims_of_class: dict[str, set[str]] = {}
        # Work of the current batch.
        self._dirty_slices: set[str] = set()
        self._dirty_pools: set[PoolKey] = set()
        self._restructured: set[PoolKey] = set()
        self._cost_updates: list[tuple[str, ClaimCost | None]] = []

    # --- listeners (one reflector thread each; a listener is only wired when its resource is in
    # ``reads``, and does only the work of the stores that exist) -----------------------------------
    def claims_changed(self, changes: list[Change[Claim]]) -> None:
        with self._lock:
            for key, old, new, owned in changes:
                if self._allocations:
                    self._claim_uses(key, old, new)
                if self.costs is not None:
                    self._claim_cost(key, new, owned)
                if self.leaks is not None:
                    self._claim_leak(key, new, owned)
            self._flush()

    def slices_changed(self, changes: list[Change[Slice]]) -> None:
        with self._lock:
            for key, old, new, owned in changes:
                self._slice(key, old, new, owned)
            self._flush()

    def classes_changed(self, changes: list[Change[DeviceClass]]) -> None:
        if self.costs is None:
            return
        with self._lock:
            repriced: set[str] = set()
            for key, old, new, _owned in changes:
                if new is None:
                    self._classes.pop(key, None)
                else:
                    self._classes[key] = new
                before = (old.hourly_cost, old.cost_problem) if old else None
                after = (new.hourly_cost, new.cost_problem) if new else None
                if before != after:
                    repriced |= self._claims_of_class.get(key, set())
            self.costs.update((k, self._price(self._priced[k])) for k in sorted(repriced) if k in self._priced)

    def rules_changed(self, changes: list[Change[DeviceTaintRule]]) -> None:
        if not self._tainting:
            return
        with self._lock:
            for key, old, new, _owned in changes:
                if new is not None and new.evaluable and new.effect in BLOCKING_EFFECTS:
                    self._rules[key] = new
                else:
                    self._rules.pop(key, None)
                # The slices the rule may select (before and after the change) are re-evaluated.
                for rule in (old, new):
                    if rule is None:
                        continue
                    drivers = [rule.driver] if rule.driver else list(self._slices_of_driver)
                    for driver in drivers:
                        self._dirty_slices.update(
                            k for k in self._slices_of_driver.get(driver, ()) if rule.pool in ("", self._slices[k].pool)
                        )
            self._flush()

    def _rules_for(self, s: Slice) -> list[tuple[str, str]]:
        return [(r.pool, r.device) for r in self._rules.values() if r.driver in ("", s.driver)]

    def tick(self) -> None:
        """Bring time-based series up to date (called before each scrape and push)."""
        if self.leaks is not None:
            self.leaks.tick()

    # --- claims ---------------------------------------------------------------------------------------
    def _claim_uses(self, key: str, old: Claim | None, new: Claim | None) -> None:
        before, after = _claim_uses(old), _claim_uses(new)
        if before == after:
            return
        for dev in before.keys() | after.keys():
            use = after.get(dev)
            if before.get(dev) == use:
                continue
            claims = self._uses.get(dev)
            if use is None:
                if claims is not None:
                    claims.pop(key, None)
                    if not claims:
                        del self._uses[dev]
            else:
                if claims is None:
                    claims = self._uses[dev] = {}
                claims[key] = use
            self._dirty_slices.update(self._device_slices.get(dev, ()))

    # Cost and leaks are rendered by the claim's own shard.
    def _claim_cost(self, key: str, new: Claim | None, owned: bool) -> None:
        self._unindex_classes(key)
        if owned and new is not None and new.has_allocation:
            self._priced[key] = new
            for deviceclass in _classes_of(new):
                self._claims_of_class.setdefault(deviceclass, set()).add(key)
            self._cost_updates.append((key, self._price(new)))
        elif self._priced.pop(key, None) is not None:
            self._cost_updates.append((key, None))

    def _claim_leak(self, key: str, new: Claim | None, owned: bool) -> None:
        assert self.leaks is not None
        if owned and new is not None and new.has_allocation and new.reserved == 0:
            self.leaks.watch(key, new)
        else:
            self.leaks.forget(key)

    def _unindex_classes(self, key: str) -> None:
        previous = self._priced.get(key)
        if previous is None:
            return
        for deviceclass in _classes_of(previous):
            keys = self._claims_of_class.get(deviceclass)
            if keys is not None:
                keys.discard(key)
                if not keys:
                    del self._claims_of_class[deviceclass]

    def _price(self, claim: Claim) -> ClaimCost:
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
                found = self._classes.get(deviceclass)
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

    # --- slices ---------------------------------------------------------------------------------------
    def _slice(self, key: str, old: Slice | None, new: Slice | None, owned: bool) -> None:
        if old is not None:
            self._unindex_slice(key, old)
        if new is None:
            self._slices.pop(key, None)
            self._owned_slices.discard(key)
            self._contribution.pop(key, None)
            if self.slice_usage is not None:
                self.slice_usage.remove(key)
            return
        self._slices[key] = new
        if self._tainting:
            self._slices_of_driver.setdefault(new.driver, set()).add(key)
        if owned:
            self._owned_slices.add(key)
        else:
            self._owned_slices.discard(key)
        if self._allocations:
            for d in new.devices:
                dev = (new.driver, new.pool, d.name)
                holders = self._device_slices.get(dev, ())
                if key not in holders:
                    self._device_slices[dev] = (*holders, key)
        if self.pools is not None:
            pool = (new.driver, new.pool)
            self._pools.setdefault(pool, {}).setdefault(new.generation, set()).add(key)
            self._dirty_pools.add(pool)
            self._restructured.add(pool)
        if self._evaluate:
            self._dirty_slices.add(key)

    def _unindex_slice(self, key: str, old: Slice) -> None:
        if self._allocations:
            for d in old.devices:
                dev = (old.driver, old.pool, d.name)
                keys = tuple(k for k in self._device_slices.get(dev, ()) if k != key)
                if keys:
                    self._device_slices[dev] = keys
                else:
                    self._device_slices.pop(dev, None)
        if self.pools is not None:
            pool = (old.driver, old.pool)
            generations = self._pools.get(pool, {})
            members = generations.get(old.generation)
            if members is not None:
                members.discard(key)
                if not members:
                    del generations[old.generation]
            self._dirty_pools.add(pool)
            self._restructured.add(pool)
        if self._tainting:
            of_driver = self._slices_of_driver.get(old.driver)
            if of_driver is not None:
                of_driver.discard(key)
                if not of_driver:
                    del self._slices_of_driver[old.driver]

    def _uses_of(self, dev: DevKey) -> Iterable[Use]:
        claims = self._uses.get(dev)
        return claims.values() if claims else ()

    # --- batch end: evaluate what changed ----------------------------------------------------------
    def _flush(self) -> None:
        if self.costs is not None:
            self.costs.update(self._cost_updates)
            self._cost_updates = []
        usage_updates: list[tuple[str, SliceUsage | None]] = []
        for key in sorted(self._dirty_slices):
            s = self._slices.get(key)
            if s is None:
                continue
            usage, contribution = evaluate(s, self._uses_of, self._rules_for(s) if self._rules else ())
            if self._counting and self._contribution.get(key) != contribution:
                self._contribution[key] = contribution
                self._dirty_pools.add((s.driver, s.pool))
            usage_updates.append((key, usage if key in self._owned_slices else None))
        self._dirty_slices.clear()
        if self.slice_usage is not None:
            self.slice_usage.update(usage_updates)
        if self.pools is None:
            return
        pool_updates: list[tuple[str, PoolState | None]] = []
        for pool in sorted(self._dirty_pools):
            name = f"{pool[0]}/{pool[1]}"
            generations = self._pools.get(pool)
            if not generations:
                self._pools.pop(pool, None)
                self._invalid.pop(pool, None)
                pool_updates.append((name, None))
                continue
            if self.shard.owns_name(name):
                pool_updates.append((name, self._pool_state(pool, generations)))
        self._dirty_pools.clear()
        self._restructured.clear()
        self.pools.update(pool_updates)

    def _pool_state(self, pool: PoolKey, generations: dict[int, set[str]]) -> PoolState:
        newest = max(generations)
        members = sorted(generations[newest])
        slices = [self._slices[k] for k in members]
        incomplete = any(s.slice_count != len(members) for s in slices)
        if pool in self._restructured or pool not in self._invalid:
            names: set[str] = set()
            total = 0
            for s in slices:
                total += len(s.devices)
                names.update(d.name for d in s.devices)
            self._invalid[pool] = len(names) != total
        invalid = self._invalid[pool]
        nodes: dict[str, list[int]] = {}
        if not incomplete and not invalid:
            for key in members:
                for node, counts in self._contribution.get(key, {}).items():
                    sums = nodes.setdefault(node, [0, 0, 0])
                    for i in range(3):
                        sums[i] += counts[i]
        return PoolState(
            driver=pool[0],
            pool=pool[1],
            generation=newest,
            incomplete=incomplete,
            invalid=invalid,
            nodes=tuple((node, *counts) for node, counts in sorted(nodes.items())),  # type: ignore[misc]
        )

    # --- introspection (tests, self-metrics) ---------------------------------------------------------
    def sizes(self) -> dict[str, int]:
        with self._lock:
            return {
                "slices": len(self._slices),
                "devices_in_use": len(self._uses),
                "pools": len(self._pools),
                "leak_clock": len(self.leaks) if self.leaks is not None else 0,
            }


def _classes_of(claim: Claim) -> Sequence[str]:
    """The DeviceClasses a claim's allocation is priced through (a changed class re-prices it)."""
    requests = dict(claim.request_classes)
    return sorted({requests[r.request] for r in claim.results if r.request in requests})
