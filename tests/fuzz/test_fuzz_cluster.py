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

from typing import Any

import pytest
from hypothesis import event, given, note
from hypothesis import strategies as st

from tests.fuzz.mutations import mutated
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
