"""Fuzzing the cluster-state exporter: mutated objects of every watched kind go through parsing,
the object stores, the joins, Prometheus/OpenMetrics rendering and OTLP encoding.

Properties, for every example:

- nothing raises (a malformed object may be dropped; then the invalid-objects counter says so);
- the exposition parses (prometheus_client's text and OpenMetrics parsers; promtool on a sample);
- the OTLP push parses, with a point per exposition sample;
- one bad object among the good ones hides none of their series: their own series stay byte for
  byte, and every joined entry that rendered still renders (the joins' values may change: they
  legitimately depend on the bad object, as a pool depends on its slices);
- deleting it again brings back exactly the exposition without it (incremental upkeep).

And fields the exporter validates, given invalid values, are counted as invalid objects without
dropping the object's other series.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
from hypothesis import event, given, note, settings
from hypothesis import strategies as st

from tests.fuzz.conftest import examples
from tests.fuzz.mutations import at, mutated, paths
from tests.fuzz.world import (
    KINDS,
    Sampler,
    World,
    cached,
    changed,
    check_parses,
    points,
    promtool_check,
    safe_key,
    samples,
    seeds,
)

pytestmark = pytest.mark.fuzz

SEEDS = seeds()
SEED_KEYS = {(kind, safe_key(obj)) for kind, obj in SEEDS}
# The full expositions (not just what changed) are parsed, and promtool run, every this many
# examples; the OpenMetrics parser reads what changed every OPENMETRICS_EVERY (the sample lines are
# the same bytes as in the text format, which is parsed every time).
FULL_CHECK_EVERY = 100
OPENMETRICS_EVERY = 10


def _without(index: int) -> World:
    return World([s for i, s in enumerate(SEEDS) if i != index])


_world = cached(lambda name: _without(int(name)))
_baselines: dict[int, Any] = {}
_full_check = Sampler(FULL_CHECK_EVERY)
_openmetrics_check = Sampler(OPENMETRICS_EVERY)


def _baseline(index: int, world: World) -> Any:
    if index not in _baselines:
        text, om = world.exposition(), world.exposition(openmetrics=True)
        check_parses(text, om)
        promtool_check(text)
        _baselines[index] = (text, world.families(), world.own_lines(), world.rendered())
    return _baselines[index]


def _seeds_of(kind: str) -> list[int]:
    return [i for i, (k, _obj) in enumerate(SEEDS) if k == kind]


@pytest.mark.parametrize("kind", KINDS)
@settings(max_examples=examples(2))  # with test_invalid_fields_are_counted: a kind's CI count
@given(data=st.data())
def test_mutated_object_among_good_ones(kind: str, data: st.DataObject) -> None:
    index = data.draw(st.sampled_from(_seeds_of(kind)), label="seed")
    obj, mutations = data.draw(mutated(SEEDS[index][1]), label="mutations")
    note(f"seed {kind} {safe_key(SEEDS[index][1])}: {mutations}")
    key = safe_key(obj)
    # A mutated name that is another seed's would replace that object: not what this is about.
    if (kind, key) in SEED_KEYS and key != safe_key(SEEDS[index][1]):
        event("renamed onto another seed: skipped")
        return
    world = _world(str(index))
    try:
        _check(world, index, kind, obj)
    except BaseException:
        _world.discard(str(index))  # type: ignore[attr-defined]
        raise


def _check(world: World, index: int, kind: str, obj: dict[str, Any]) -> None:
    text0, families0, own0, rendered0 = _baseline(index, world)
    store = world.stores[kind]
    problems = world.problems()

    store.upsert(obj)

    key = safe_key(obj)
    parsed = key is not None and store.get(key) is not None
    event(f"{kind}: parsed" if parsed else f"{kind}: dropped")
    if not parsed:
        assert world.problems() > problems, "a dropped object is counted as invalid"
    text = world.exposition()
    diff_text, diff_om = changed(families0, world.families())
    check_parses(diff_text, diff_om if _openmetrics_check() else None)
    if _full_check():
        check_parses(text, world.exposition(openmetrics=True))
        promtool_check(text)
    assert points(world.otlp()) == samples(text), "one OTLP point per exposition sample"
    # The good objects' own series, byte for byte; every joined entry that rendered still renders,
    # but the bad object's own and its pool's (a pool's state depends on each of its slices).
    assert own0 <= world.own_lines(), "a bad object hid good objects' series"
    own = {(store.resource, key)}
    if kind == "ResourceSlice" and parsed:
        s = store.get(key)  # type: ignore[arg-type]
        own.add(("resource pools", f"{s.driver}/{s.pool}"))
    lost = rendered0 - world.rendered() - own
    assert not lost, f"entries that rendered without the bad object do not with it: {sorted(lost)}"

    store.delete(obj)
    assert world.exposition() == text0, "deleting the bad object again does not restore the exposition"


# --- invalid values of the fields the exporter validates are counted ---------------------------------
_BAD_TIMES = st.sampled_from(
    ["", "yesterday", "2026-11-30T03:26:06", "2026-11-30", "2026-13-40T25:61:61Z", "2026-11-30T03:26:06+25:00"]
) | st.sampled_from([0, 1.8e9, True, [], {}])
_BAD_QUANTITIES = st.sampled_from(["0x10", "", " ", "1e400", "abc", "1 Gi", "1,5", "NaN", "Inf", "1Gi1", "٣", "²"]) | (
    st.sampled_from([True, None, [], {}])
)
_BAD_COSTS = st.sampled_from(["1e3", "-1", "abc", "", "NaN", "Inf", "1,5", "٣", "1.", ".5", "+2", "1 2", "0x10"])
_NOT_STRINGS = st.sampled_from([5, None, [], {}, True, 1.5])
_NOT_LISTS = st.sampled_from(["x", {"a": 1}, 5, True])
_NOT_OBJECTS = st.sampled_from(["x", ["a"], 5, True])


def _dra_resource(path: tuple[Any, ...], obj: dict[str, Any]) -> bool:
    """A pod's allocatedResourcesStatus entry of a DRA claim ("claim:..."), not of a device plugin."""
    entry = obj["status"][path[1]][path[2]]["allocatedResourcesStatus"][path[4]]
    return str(entry.get("name", "")).startswith("claim:")


# (kind, path pattern ("*": any key or index), invalid values, whether the object is dropped, filter)
TARGETS: list[tuple[str, tuple[Any, ...], st.SearchStrategy[Any], bool, Any]] = [
    ("DeviceClass", ("metadata", "annotations", "hourly-cost"), _BAD_COSTS, False, None),
    ("ResourceClaim", ("metadata", "creationTimestamp"), _BAD_TIMES, False, None),
    ("ResourceClaim", ("status", "allocation", "allocationTimestamp"), _BAD_TIMES, False, None),
    (
        "ResourceClaim",
        ("status", "allocation", "devices", "results", "*", "consumedCapacity", "*"),
        _BAD_QUANTITIES,
        False,
        None,
    ),
    ("ResourceClaim", ("status", "allocation", "devices", "results", "*", "driver"), _NOT_STRINGS, False, None),
    ("ResourceClaim", ("status", "allocation", "devices", "results"), _NOT_LISTS, False, None),
    ("ResourceClaim", ("status", "reservedFor"), _NOT_LISTS, False, None),
    ("ResourceClaim", ("status", "devices", "*", "conditions"), _NOT_LISTS, False, None),
    ("ResourceClaim", ("status",), _NOT_OBJECTS, False, None),
    ("ResourceSlice", ("spec", "devices", "*", "capacity", "*", "value"), _BAD_QUANTITIES, False, None),
    ("ResourceSlice", ("spec", "sharedCounters", "*", "counters", "*", "value"), _BAD_QUANTITIES, False, None),
    (
        "ResourceSlice",
        ("spec", "devices", "*", "consumesCounters", "*", "counters", "*", "value"),
        _BAD_QUANTITIES,
        False,
        None,
    ),
    ("ResourceSlice", ("spec", "devices", "*", "taints", "*", "timeAdded"), _BAD_TIMES, False, None),
    ("ResourceSlice", ("spec", "devices", "*", "name"), _NOT_STRINGS, False, None),
    ("ResourceSlice", ("spec", "devices"), _NOT_LISTS, False, None),
    ("ResourceSlice", ("spec",), _NOT_OBJECTS, True, None),
    ("DeviceTaintRule", ("spec", "taint", "timeAdded"), _BAD_TIMES, False, None),
    ("DeviceTaintRule", ("spec", "taint"), _NOT_OBJECTS, False, None),
    ("DeviceTaintRule", ("spec", "deviceSelector"), _NOT_OBJECTS, False, None),
    ("DeviceTaintRule", ("status",), _NOT_OBJECTS, False, None),
    ("DeviceTaintRule", ("status", "conditions"), _NOT_LISTS, False, None),
    ("DeviceTaintRule", ("spec",), _NOT_OBJECTS, True, None),
    (
        "Pod",
        ("status", "*", "*", "allocatedResourcesStatus", "*", "resources", "*", "resourceID"),
        st.sampled_from(["", "a/b", "a//c", "a/b/c/d", "/b/c", 5, None]),
        False,
        _dra_resource,
    ),
    (
        "Pod",
        ("status", "*", "*", "allocatedResourcesStatus", "*", "resources", "*", "health"),
        st.sampled_from(["Sick", "healthy", "HEALTHY", " Healthy"]),  # absent (or not a string): Unknown
        False,
        _dra_resource,
    ),
]


def _matching(pattern: tuple[Any, ...]) -> list[tuple[int, tuple[Any, ...]]]:
    """(seed, concrete path) for every node of a seed that the pattern names."""
    out = []
    for i, (_kind, obj) in enumerate(SEEDS):
        for path in paths(obj):
            if len(path) == len(pattern) and all(p in ("*", step) for p, step in zip(pattern, path, strict=True)):
                out.append((i, path))
    return out


def _targets(kind: str) -> list[tuple[int, tuple[Any, ...], st.SearchStrategy[Any], bool]]:
    out = []
    for k, pattern, values, drops, keep in TARGETS:
        if k != kind:
            continue
        found = [(i, path) for i, path in _matching(pattern) if SEEDS[i][0] == kind]
        found = [(i, path) for i, path in found if keep is None or keep(path, SEEDS[i][1])]
        assert found, f"no {kind} seed has {pattern}: give one a value there (tests/fuzz/world.py, golden objects)"
        out.extend((i, path, values, drops) for i, path in found)
    return out


@pytest.mark.parametrize("kind", KINDS)
@settings(max_examples=examples(2))
@given(data=st.data())
def test_invalid_fields_are_counted(kind: str, data: st.DataObject) -> None:
    """A field the exporter validates, set to an invalid value, counts in otel_dra.objects.invalid and
    omits only what it feeds: the object's other series stay (unless it cannot be parsed at all)."""
    index, path, values, drops = data.draw(st.sampled_from(_targets(kind)), label="target")
    obj = copy.deepcopy(SEEDS[index][1])
    value = data.draw(values, label="invalid value")
    at(obj, path[:-1])[path[-1]] = value
    note(f"seed {kind} {safe_key(obj)}: {path} = {value!r}")
    world = _world(str(index))
    store = world.stores[kind]
    problems = world.problems()
    try:
        store.upsert(obj)
        assert world.problems() > problems, f"{path} = {value!r} is not counted as invalid"
        kept = store.get(safe_key(obj) or "") is not None
        assert kept != drops, "an invalid field dropped the whole object" if drops is False else "not dropped"
        store.delete(obj)
    except BaseException:
        _world.discard(str(index))  # type: ignore[attr-defined]
        raise
