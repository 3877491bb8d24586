"""The scrape cache (issue 29) never serves a series that changed.

A scrape reuses, per family, the buffers it built before when the family's chunks are the same
objects (``SeriesStore.blocks`` + ``Assembler``). The property: objects of every watched kind are
changed (mutated, valid or not), added under new names, deleted and relisted between scrapes in
every format (text or OpenMetrics, plain or gzip), and each scrape of the long-lived exporter, from
one Assembler, equals byte for byte what a fresh exporter fed the same objects renders without any
cache. And a scrape after no change hands over exactly the buffers of the one before (the same
objects: nothing was rendered, joined or compressed again).
"""

from __future__ import annotations

import copy
import gzip
from typing import Any

import pytest
from hypothesis import given, note, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from otel_dra.telemetry.exposition import Assembler, assemble
from tests.fuzz.conftest import examples
from tests.fuzz.mutations import mutated
from tests.fuzz.world import World, safe_key, seeds

pytestmark = pytest.mark.fuzz

SEEDS = seeds()
FORMATS = [(om, gz) for om in (False, True) for gz in (False, True)]
# The SDK's part of a scrape (self-metrics) is not what is cached: both sides leave it empty.
REGISTRY = CollectorRegistry()


def _body(parts: list[bytes], gzipped: bool) -> bytes:
    # A gzip body is a series of members; Python's reader, like Go's, reads them as one stream.
    return gzip.decompress(b"".join(parts)) if gzipped else b"".join(parts)


def _fresh(objects: dict[tuple[str, str], dict[str, Any]], openmetrics: bool) -> bytes:
    world = World(list(((kind, obj) for (kind, _key), obj in objects.items())))
    try:
        return b"".join(assemble(REGISTRY, world.state.blocks(), openmetrics))
    finally:
        world.close()


@st.composite
def _steps(draw: st.DrawFn) -> list[tuple[str, int, Any]]:
    """(action, seed index, argument) several times: ``change`` (mutated copy of the seed at its
    key), ``copy`` (the seed under a new name, a new key), ``delete``, ``relist`` (the same kind's
    objects again, one left out), ``none`` (nothing: the next scrape must reuse everything)."""
    out = []
    for _ in range(draw(st.integers(1, 6))):
        action = draw(st.sampled_from(["change", "change", "copy", "delete", "relist", "none"]))
        index = draw(st.integers(0, len(SEEDS) - 1))
        argument: Any = None
        if action == "change":
            argument = draw(mutated(SEEDS[index][1], max_mutations=2))[0]
        elif action == "copy":
            argument = draw(st.sampled_from(["a-copy", "zz-copy", "0-copy"]))
        out.append((action, index, argument))
    return out


@settings(max_examples=examples(20), deadline=None)
@given(steps=_steps(), formats=st.lists(st.sampled_from(FORMATS), min_size=1, max_size=6))
def test_a_cached_scrape_equals_a_fresh_render(steps: list[tuple[str, int, Any]], formats: list[Any]) -> None:
    live = World(SEEDS)
    assembler = Assembler()
    objects = {(kind, str(safe_key(obj))): copy.deepcopy(obj) for kind, obj in SEEDS}
    rv = 10_000
    try:
        for om, gz in FORMATS:  # every format cached before the changes
            assembler.assemble(REGISTRY, live.state.blocks(), om, gz)
        for n, (action, index, argument) in enumerate(steps):
            kind, seed = SEEDS[index]
            key = (kind, str(safe_key(seed)))
            rv += 1
            if action == "change":
                obj = copy.deepcopy(argument)
                if isinstance(obj.get("metadata"), dict):
                    obj["metadata"]["resourceVersion"] = str(rv)
                if safe_key(obj) is None:
                    continue
                live.stores[kind].upsert(copy.deepcopy(obj))
                objects[(kind, str(safe_key(obj)))] = obj
            elif action == "copy":
                obj = copy.deepcopy(seed)
                obj["metadata"]["name"] = f"{argument}-{obj['metadata'].get('name', '')}"
                obj["metadata"]["resourceVersion"] = str(rv)
                obj["metadata"]["uid"] = f"uid-{rv}"
                live.stores[kind].upsert(copy.deepcopy(obj))
                objects[(kind, str(safe_key(obj)))] = obj
            elif action == "delete" and key in objects:
                live.stores[kind].delete(objects.pop(key))
            elif action == "relist":
                kept = {k: v for k, v in objects.items() if k[0] == kind and k != key}
                live.stores[kind].replace([copy.deepcopy(v) for v in kept.values()])
                objects = {k: v for k, v in objects.items() if k[0] != kind} | kept
            om, gz = formats[n % len(formats)]
            before = assembler.assemble(REGISTRY, live.state.blocks(), om, gz)
            note(f"step {n}: {action} {kind} {key[1]} as {'OpenMetrics' if om else 'text'}{' gzip' if gz else ''}")
            assert _body(before, gz) == _fresh(objects, om)
            if action == "none":
                again = assembler.assemble(REGISTRY, live.state.blocks(), om, gz)
                assert len(again) == len(before)
                # The SDK's part (first) is rendered each time; every other buffer is the same object.
                assert all(a is b for a, b in zip(again[1:], before[1:], strict=True))
    finally:
        live.close()
