"""Joins across resources, kept up to date change by change: device allocation, pool and node
utilization, shared counters, claim cost and leaked claims.

The three object stores tell :class:`Joins` about every change (old and new slim object). Joins
keeps indexes over *all* objects (every shard needs them: a claim and the slice holding its device
may belong to different shards) and re-renders, into its own :class:`SeriesStore`s, only what a
change touches:

- a claim change re-evaluates the slices holding the devices its allocation names (before and
  after), and their pools; re-prices the claim; moves it on or off the leak clock;
- a slice change re-evaluates the slice and its pool;
- a change of what a pool's allocated devices consume from a shared counter set (a claim or a
  slice change) re-evaluates the slices of that pool generation that define or consume that set;
- a DeviceClass change re-prices the claims allocated through it;
- a DeviceTaintRule change re-evaluates the slices of the driver (and pool) it selects (rules are
  few and change rarely); so does a new API server version for the rules without a device
  selector, which match every device before Kubernetes v1.37.1 and none since
  (:meth:`Joins.set_server_version`).

So the work per change is bounded by the objects it touches (a slice has at most 128 devices), not
by the size of the cluster. Changes of one full relist are applied as one batch, and each touched
slice and pool is evaluated once per batch. See docs/metrics.md for the semantics.

Only what the served families need is built (``select``, see :mod:`otel_dra.cluster.selection`):
a store whose families are all off does not exist, and neither does the work and the indexes that
only it needs (slice evaluation and the device index, pool sums, pricing, the leak clock). Each
family names the resources it reads (``Family.reads``); :attr:`Joins.reads` is their union, the
resources the exporter must watch for the joins.

This module is the engine: the indexes, the listeners and the batch. The families and the values
they render are data in :mod:`otel_dra.cluster.joined_families`; what a slice, a pool generation
or a claim's price comes to is computed by the pure functions of :mod:`otel_dra.cluster.evaluation`;
the leak clock is :mod:`otel_dra.cluster.leaks`.
"""

from __future__ import annotations

import bisect
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from otel_dra.cluster.deviceclass import DeviceClass
from otel_dra.cluster.devicetaintrule import DeviceTaintRule, absent_selector_matches_all
from otel_dra.cluster.evaluation import (
    Contribution,
    CounterLookup,
    DevKey,
    SetKey,
    Use,
    claim_uses,
    classes_of,
    consumption,
    evaluate,
    pool_invalid,
    price,
)
from otel_dra.cluster.families import Family
from otel_dra.cluster.joined_families import (
    CLAIMS,
    COST_FAMILIES,
    LEAK_FAMILIES,
    POOL_COUNT_FAMILIES,
    POOL_FAMILIES,
    RULES,
    SLICE_FAMILIES,
    ClaimCost,
    LeakedClaim,
    PoolState,
    SliceUsage,
)
from otel_dra.cluster.leaks import LeakClock
from otel_dra.cluster.resourceclaim import Claim
from otel_dra.cluster.resourceslice import BLOCKING_EFFECTS, Amounts, Slice
from otel_dra.cluster.selection import EVERYTHING, FamilySelection
from otel_dra.cluster.sharding import Shard
from otel_dra.cluster.store import SEGMENT, Change, SeriesStore
from otel_dra.kube.version import KubeVersion

log = logging.getLogger(__name__)

PoolKey = tuple[str, str]  # (driver, pool)


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
        self._contribution: dict[str, Contribution] = {}  # slice key -> its part of the pool counts
        # Shared counters (since Kubernetes 1.35 pool-wide: a set is defined by a counters-only slice
        # and consumed by the devices of other slices of the same pool and generation).
        self._set_defined: dict[SetKey, list[str]] = {}  # counters-only slices defining the set (sorted)
        self._set_consumers: dict[SetKey, set[str]] = {}  # devices-only slices with devices consuming it
        self._consumed: dict[str, dict[SetKey, dict[str, float]]] = {}  # slice key -> what it consumes
        self._set_used: dict[SetKey, dict[str, float]] = {}  # what the generation's devices consume
        self._counters_free: dict[str, tuple[tuple[str, Amounts], ...]] = {}  # slices defining counter sets
        self._uses: dict[DevKey, dict[str, Use]] = {}  # device -> claim key -> use
        self._classes: dict[str, DeviceClass] = {}
        self._rules: dict[str, DeviceTaintRule] = {}  # blocking, evaluable DeviceTaintRules
        # What a rule without spec.deviceSelector matches on the API server's release: every device
        # before v1.37.1, none since. Until the version is read (or when it cannot be), the newest
        # releases' semantics (see devicetaintrule.absent_selector_matches_all).
        self._absent_matches_all = absent_selector_matches_all(None)
        # Owned, allocated claims, for re-pricing when a class changes.
        self._priced: dict[str, Claim] = {}
        self._claims_of_class: dict[str, set[str]] = {}
        # Work of the current batch.
        self._dirty_slices: set[str] = set()
        self._dirty_pools: set[PoolKey] = set()
        self._dirty_sets: set[SetKey] = set()
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
            self.costs.update((k, price(self._priced[k], self._classes)) for k in sorted(repriced) if k in self._priced)

    def rules_changed(self, changes: list[Change[DeviceTaintRule]]) -> None:
        if not self._tainting:
            return
        with self._lock:
            for key, old, new, _owned in changes:
                if new is not None and new.evaluable and new.effect in BLOCKING_EFFECTS:
                    self._rules[key] = new
                else:
                    self._rules.pop(key, None)
                # The slices the rule may select (before and after the change) are re-evaluated; a
                # rule that selects nothing on this release (no selector, since v1.37.1) has none.
                for rule in (old, new):
                    if rule is None or not self._selects_devices(rule):
                        continue
                    drivers = [rule.driver] if rule.driver else list(self._slices_of_driver)
                    for driver in drivers:
                        self._dirty_slices.update(
                            k for k in self._slices_of_driver.get(driver, ()) if rule.pool in ("", self._slices[k].pool)
                        )
            self._flush()

    def set_server_version(self, version: KubeVersion | None) -> None:
        """The API server's version (None: unknown), read at start-up and after reconnects. When it
        changes what a rule without a device selector matches (every device or none), every slice
        is evaluated again, once: only if such a rule exists, and only on an upgrade or downgrade
        across v1.37.1."""
        matches_all = absent_selector_matches_all(version)
        with self._lock:
            if matches_all == self._absent_matches_all:
                return
            self._absent_matches_all = matches_all
            if not self._tainting or all(r.selector_present for r in self._rules.values()):
                return
            for keys in self._slices_of_driver.values():
                self._dirty_slices.update(keys)
            self._flush()

    def _selects_devices(self, rule: DeviceTaintRule) -> bool:
        """False for a rule without spec.deviceSelector where such a rule matches no device."""
        return rule.selector_present or self._absent_matches_all

    def _rules_for(self, s: Slice) -> list[tuple[str, str]]:
        return [
            (r.pool, r.device) for r in self._rules.values() if r.driver in ("", s.driver) and self._selects_devices(r)
        ]

    def tick(self) -> None:
        """Bring time-based series up to date (called before each scrape and push)."""
        if self.leaks is not None:
            self.leaks.tick()

    # --- claims ---------------------------------------------------------------------------------------
    def _claim_uses(self, key: str, old: Claim | None, new: Claim | None) -> None:
        before, after = claim_uses(old), claim_uses(new)
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
            for deviceclass in classes_of(new):
                self._claims_of_class.setdefault(deviceclass, set()).add(key)
            self._cost_updates.append((key, price(new, self._classes)))
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
        for deviceclass in classes_of(previous):
            keys = self._claims_of_class.get(deviceclass)
            if keys is not None:
                keys.discard(key)
                if not keys:
                    del self._claims_of_class[deviceclass]

    # --- slices ---------------------------------------------------------------------------------------
    def _slice(self, key: str, old: Slice | None, new: Slice | None, owned: bool) -> None:
        if self._evaluate:
            self._index_counters(key, old, new)
        if old is not None:
            self._unindex_slice(key, old)
        if new is None:
            self._slices.pop(key, None)
            self._owned_slices.discard(key)
            self._contribution.pop(key, None)
            self._counters_free.pop(key, None)
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

    def _index_counters(self, key: str, old: Slice | None, new: Slice | None) -> None:
        """Index the pool-wide counter sets that the slice defines or consumes from; a set whose
        definition changed is re-joined at the end of the batch."""
        before, after = _defined_sets(old), _defined_sets(new)
        for set_key in before.keys() | after.keys():
            if before.get(set_key) == after.get(set_key):
                continue
            self._dirty_sets.add(set_key)
            if set_key not in after:
                keys = self._set_defined[set_key]
                keys.remove(key)
                if not keys:
                    del self._set_defined[set_key]
            elif set_key not in before:
                bisect.insort(self._set_defined.setdefault(set_key, []), key)
        consumed_before, consumed_after = _consumed_sets(old), _consumed_sets(new)
        for set_key in consumed_before - consumed_after:
            consumers = self._set_consumers[set_key]
            consumers.discard(key)
            if not consumers:
                del self._set_consumers[set_key]
        for set_key in consumed_after - consumed_before:
            self._set_consumers.setdefault(set_key, set()).add(key)
        if new is None:
            # What its devices consumed is consumed no more (a changed slice is recomputed instead).
            self._dirty_sets.update(self._consumed.pop(key, {}))

    def _counters_of(self, s: Slice) -> CounterLookup:
        def counters(set_name: str) -> tuple[Amounts, Mapping[str, float]]:
            set_key = (s.driver, s.pool, s.generation, set_name)
            defined = self._set_defined.get(set_key)
            amounts = dict(self._slices[defined[0]].counter_sets)[set_name] if defined else ()
            return amounts, self._set_used.get(set_key, {})

        return counters

    def _uses_of(self, dev: DevKey) -> Iterable[Use]:
        claims = self._uses.get(dev)
        return claims.values() if claims else ()

    # --- batch end: evaluate what changed ----------------------------------------------------------
    def _flush(self) -> None:
        if self.costs is not None:
            self.costs.update(self._cost_updates)
            self._cost_updates = []
        if self._evaluate:
            self._join_counters()
        usage_updates: list[tuple[str, SliceUsage | None]] = []
        for key in sorted(self._dirty_slices):
            s = self._slices.get(key)
            if s is None:
                continue
            usage, contribution = evaluate(
                s, self._uses_of, self._rules_for(s) if self._rules else (), self._counters_of(s)
            )
            if self._counting and self._contribution.get(key) != contribution:
                self._contribution[key] = contribution
                self._dirty_pools.add((s.driver, s.pool))
            if self._counting and self._counters_free.get(key, ()) != usage.counters_free:
                if usage.counters_free:
                    self._counters_free[key] = usage.counters_free
                else:
                    del self._counters_free[key]
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

    def _join_counters(self) -> None:
        """Bring the pool-wide counter sets up to date: what the changed slices' allocated devices
        consume, then, for each set whose consumption or definition changed, the slices that define
        or consume it (they are evaluated next, with the other changed slices)."""
        for key in self._dirty_slices:
            s = self._slices.get(key)
            if s is None:
                continue
            before = self._consumed.get(key, {})
            after = consumption(s, self._uses_of)
            if after != before:
                self._dirty_sets.update(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
                if after:
                    self._consumed[key] = after
                else:
                    self._consumed.pop(key, None)
        for set_key in self._dirty_sets:
            consumers = self._set_consumers.get(set_key, ())
            used: dict[str, float] = {}
            for key in consumers:
                for counter, value in self._consumed.get(key, {}).get(set_key, {}).items():
                    used[counter] = used.get(counter, 0.0) + value
            if used:
                self._set_used[set_key] = used
            else:
                self._set_used.pop(set_key, None)
            self._dirty_slices.update(consumers)
            self._dirty_slices.update(self._set_defined.get(set_key, ()))
        self._dirty_sets.clear()

    def _pool_state(self, pool: PoolKey, generations: dict[int, set[str]]) -> PoolState:
        newest = max(generations)
        members = sorted(generations[newest])
        slices = [self._slices[k] for k in members]
        incomplete = any(s.slice_count != len(members) for s in slices)
        if pool in self._restructured or pool not in self._invalid:
            self._invalid[pool] = pool_invalid(slices, complete=not incomplete)
        invalid = self._invalid[pool]
        state = PoolState(pool[0], pool[1], newest, incomplete, invalid)
        if incomplete or invalid or not self._counting:
            return state
        nodes: dict[str, list[int]] = {}
        partitions: dict[tuple[str, str], list[int]] = {}
        counters: dict[tuple[str, str, str], list[float]] = {}
        for key, s in zip(members, slices, strict=True):
            for part, counts in self._contribution.get(key, {}).items():
                if isinstance(part, tuple):
                    _add(partitions.setdefault(part, [0, 0, 0]), counts)
                    part = part[0]
                _add(nodes.setdefault(part, [0, 0, 0]), counts)
            # Two 1.34-style slices of a pool may each define a set of the same name: summed.
            for (set_name, amounts), (_, free) in zip(s.counter_sets, self._counters_free.get(key, ()), strict=True):
                for (counter, capacity), (_, left) in zip(amounts, free, strict=True):
                    _add(counters.setdefault((s.node_name, set_name, counter), [0.0, 0.0]), (capacity, left))
        return PoolState(
            pool[0],
            pool[1],
            newest,
            incomplete,
            invalid,
            nodes=tuple((node, *counts) for node, counts in sorted(nodes.items())),  # type: ignore[misc]
            partitions=tuple((*k, *counts) for k, counts in sorted(partitions.items())),  # type: ignore[misc]
            counters=tuple((*k, *values) for k, values in sorted(counters.items())),  # type: ignore[misc]
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


def _add(sums: list[Any], values: Sequence[Any]) -> None:
    for i, value in enumerate(values):
        sums[i] += value


def _defined_sets(s: Slice | None) -> dict[SetKey, Amounts]:
    """The pool-wide counter sets a counters-only slice defines."""
    if s is None or s.devices:
        return {}
    return {(s.driver, s.pool, s.generation, set_name): amounts for set_name, amounts in s.counter_sets}


def _consumed_sets(s: Slice | None) -> set[SetKey]:
    """The pool-wide counter sets that the devices of a devices-only slice consume from."""
    if s is None or s.counter_sets:
        return set()
    return {(s.driver, s.pool, s.generation, set_name) for d in s.devices for set_name, _ in d.counters}
