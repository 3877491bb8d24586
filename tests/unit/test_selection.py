"""--metric-allowlist / --metric-denylist: the lists' semantics, the errors at start-up, and that a
family that is off costs nothing (never built, never rendered, its resource not watched when
nothing served needs it)."""

from __future__ import annotations

import gc
import logging
import random
import re
import tracemalloc
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from opentelemetry.sdk.metrics import MeterProvider

from bench.memory import fill
from bench.workload import Workload
from otel_dra.cli import main
from otel_dra.cluster import deviceclass, devicetaintrule, joined_families, pod, resourceclaim, resourceslice
from otel_dra.cluster.exporter import SEED_FAMILIES, ClusterState, all_families, object_families
from otel_dra.cluster.selection import EVERYTHING, FamilySelection
from otel_dra.cluster.store import ObjectStore
from otel_dra.telemetry.exposition import GaugeFamily
from tests.helpers import SEED_FAMILIES as SEED_NAMES
from tests.unit.test_state_families import load_golden

NAMES = [f.prom_name for f in all_families()]


def allow(text: str) -> FamilySelection:
    selection = FamilySelection.parse(text, allow=True, names=NAMES)
    assert selection is not None
    return selection


def deny(text: str) -> FamilySelection:
    selection = FamilySelection.parse(text, allow=False, names=NAMES)
    assert selection is not None
    return selection


def served(selection: FamilySelection) -> list[str]:
    return [n for n in NAMES if selection.serves(n)]


# --- the lists ---------------------------------------------------------------------------------------
def test_entries_match_whole_prometheus_family_names():
    assert tuple(f.prom_name for f in SEED_FAMILIES) == SEED_NAMES
    # An exact name is that family only, although three others start with it.
    assert served(allow("kube_resourceslice_device_capacity")) == ["kube_resourceslice_device_capacity"]
    # The Prometheus name, not the OTel instrument name (kube_resourceslice_device_capacity_memory).
    assert served(allow("kube_resourceslice_device_capacity_memory_bytes,kube_deviceclass_info")) == [
        "kube_resourceslice_device_capacity_memory_bytes",
        "kube_deviceclass_info",
    ]
    with pytest.raises(ValueError, match="matches no family"):
        allow("kube_resourceslice_device_capacity_memory")
    # kube-state-metrics lists anchored for its substring matching mean the same here.
    assert served(allow("^kube_resourcepool_.+$")) == served(allow("kube_resourcepool_.+"))
    assert len(served(allow("kube_resourcepool_.+"))) == len(joined_families.POOL_FAMILIES)
    # A part of a name selects nothing (kube-state-metrics would select every family containing it).
    with pytest.raises(ValueError, match="matches no family"):
        allow("_info")


def test_lists_are_trimmed_and_a_denylist_serves_the_rest():
    # White space and empty entries (a YAML block scalar) do not count; repeats are one entry.
    selection = deny("\n kube_resourceclaim_.+ ,, kube_resourceclaim_.+\n")
    assert selection.entries == ("kube_resourceclaim_.+",)
    assert not any(n.startswith("kube_resourceclaim_") for n in served(selection))
    assert len(served(selection)) == len(NAMES) - sum(n.startswith("kube_resourceclaim_") for n in NAMES)
    assert FamilySelection.parse(" , ", allow=True, names=NAMES) is None  # no entries: not given
    assert served(EVERYTHING) == NAMES


def test_invalid_and_unmatched_entries():
    with pytest.raises(ValueError, match=r"'kube_\(' is not a regular expression"):
        allow("kube_deviceclass_info,kube_(")
    with pytest.raises(ValueError, match="matches no family"):
        deny("kube_typo,otel_dra_watch_events_total,target_info")  # self-metrics are not families
    partly = allow("kube_deviceclass_info,kube_typo")
    assert partly.unmatched == ("kube_typo",)
    assert served(partly) == ["kube_deviceclass_info"]


# --- the command line ----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("argv", "env", "message"),
    [
        (["--metric-allowlist=kube_("], {}, "argument --metric-allowlist: 'kube_(' is not a regular expression"),
        ([], {"OTEL_DRA_METRIC_DENYLIST": "kube_["}, "environment variable OTEL_DRA_METRIC_DENYLIST: 'kube_['"),
        (["--metric-denylist=kube_typo"], {}, "argument --metric-denylist: 'kube_typo' matches no family"),
        ([], {"OTEL_DRA_METRIC_ALLOWLIST": "typo"}, "environment variable OTEL_DRA_METRIC_ALLOWLIST: 'typo' matches"),
        (
            ["--metric-allowlist=kube_deviceclass_info", "--metric-denylist=kube_deviceclass_hourly_cost"],
            {},
            "--metric-allowlist (OTEL_DRA_METRIC_ALLOWLIST) and --metric-denylist (OTEL_DRA_METRIC_DENYLIST) are "
            "mutually exclusive",
        ),
        (
            ["--metric-denylist=kube_deviceclass_hourly_cost"],
            {"OTEL_DRA_METRIC_ALLOWLIST": "kube_deviceclass_info"},
            "are mutually exclusive",
        ),
    ],
)
def test_bad_lists_stop_the_exporter_with_exit_2(monkeypatch, capsys, argv, env, message):
    root = logging.getLogger()
    monkeypatch.setattr(root, "handlers", list(root.handlers))  # main() logs to the captured stderr
    monkeypatch.setattr(root, "level", root.level)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    try:
        code = main(["exporter", "--kubeconfig", "/nonexistent", *argv])
    except SystemExit as exc:  # argparse: a bad flag value
        code = exc.code
    assert code == 2
    assert message in capsys.readouterr().err


def test_an_entry_that_matches_nothing_is_a_warning(caplog):
    from otel_dra.cli.exporter import _families

    args = SimpleNamespace(metric_allowlist=allow("kube_deviceclass_.+,kube_typo"), metric_denylist=None)
    with caplog.at_level(logging.WARNING, logger="otel_dra"):
        assert _families(args) is args.metric_allowlist
    assert "--metric-allowlist (OTEL_DRA_METRIC_ALLOWLIST): 'kube_typo' matches no family" in caplog.text


# --- what is built ---------------------------------------------------------------------------------------
def state(families: FamilySelection = EVERYTHING, **options: Any) -> ClusterState:
    """A ClusterState whose reflectors are never started (its client is never used)."""
    return ClusterState(object(), MeterProvider(), families=families, **options)  # type: ignore[arg-type]


def watched(s: ClusterState) -> dict[str, tuple[list[str], bool]]:
    """resource -> (its own families, whether the joins hear its changes)."""
    return {st.resource: ([f.prom_name for f in st.families], st._listener is not None) for st in s.stores}


def test_seed_only_builds_the_three_seed_stores_and_nothing_else():
    s = state(allow(",".join(SEED_NAMES)))
    assert watched(s) == {
        "resourceclaims": ([f.prom_name for f in resourceclaim.FAMILIES], False),
        "resourceslices": ([f.prom_name for f in resourceslice.FAMILIES], False),
        "deviceclasses": ([f.prom_name for f in deviceclass.FAMILIES], False),
    }
    assert s.taint_rules is None and [r.resource.plural for r in s.reflectors] == list(watched(s))
    assert s.joins.stores == [] and s.joins.reads == frozenset() and s.joins.leaks is None
    assert [f.prom_name for st in s.series_stores for f in st.families] == list(SEED_NAMES)
    # The slim objects keep what the seed families read, and nothing the families that are off read.
    golden(s)
    claims = [c for c in s.claims.objects() if c.has_allocation] if s.claims else []
    assert claims and all(c.allocated and not (c.results or c.request_classes or c.conditions) for c in claims)
    assert all(c.created is c.allocation_time is c.status_time is None for c in claims)
    devices = [d for sl in (s.slices.objects() if s.slices else []) for d in sl.devices]
    assert any(d.capacity[0] is not None for d in devices)
    assert not any(d.info or d.capacities or d.taints or d.counters or d.defaults for d in devices)


@pytest.mark.parametrize(
    ("families", "expected"),
    [
        # Costs read claims and classes, not slices; the claims' own families are off.
        (
            allow("kube_resourceclaim_hourly_cost"),
            {"resourceclaims": ([], True), "deviceclasses": ([], True)},
        ),
        # Free devices need the claims' allocations and the taint rules.
        (
            allow("kube_resourcepool_devices_free"),
            {"resourceclaims": ([], True), "resourceslices": ([], True), "devicetaintrules": ([], True)},
        ),
        # The pool's device count and generation need the slices only.
        (allow("kube_resourcepool_(devices|generation)"), {"resourceslices": ([], True)}),
        (allow("kube_resourceclaim_leaked"), {"resourceclaims": ([], True)}),
        (allow("kube_devicetaintrule_info"), {"devicetaintrules": (["kube_devicetaintrule_info"], False)}),
        # No join: every store renders its own families, nothing listens.
        (
            deny(
                "kube_resource(slice_device_allocated.*|slice_device_free_capacity|slice_counter_set_free|pool_.+|claim_hourly_cost|claim_.*priced.*|claim_leaked)"
            ),
            {
                "resourceclaims": ([f.prom_name for f in resourceclaim.FAMILIES + resourceclaim.STATE_FAMILIES], False),
                "resourceslices": ([f.prom_name for f in resourceslice.FAMILIES + resourceslice.STATE_FAMILIES], False),
                "deviceclasses": ([f.prom_name for f in deviceclass.FAMILIES + deviceclass.STATE_FAMILIES], False),
                "devicetaintrules": (
                    [f.prom_name for f in devicetaintrule.FAMILIES + devicetaintrule.STATE_FAMILIES],
                    False,
                ),
                "pods": ([f.prom_name for f in pod.STATE_FAMILIES], False),
            },
        ),
        # Shared counters pool-wide: the counter sets' capacity needs the slices only, what is left
        # the claims too; free partitions the taint rules too.
        (allow("kube_resourcepool_counter_set_capacity"), {"resourceslices": ([], True)}),
        (
            allow("kube_resourcepool_(counter_set_free|partitions_allocated)"),
            {"resourceclaims": ([], True), "resourceslices": ([], True)},
        ),
        (
            allow("kube_resourcepool_partitions_free"),
            {"resourceclaims": ([], True), "resourceslices": ([], True), "devicetaintrules": ([], True)},
        ),
        # Pods: their own families only.
        (allow("kube_pod_.+"), {"pods": ([f.prom_name for f in pod.STATE_FAMILIES], False)}),
        (allow("kube_pod_resourceclaim_info"), {"pods": (["kube_pod_resourceclaim_info"], False)}),
    ],
)
def test_a_resource_is_watched_only_when_a_served_family_needs_it(families, expected):
    assert watched(state(families)) == expected


def test_pods_are_watched_only_with_watch_pods_and_a_served_pod_family():
    assert state().pods is not None and state(allow("kube_pod_.+")).pods is not None
    assert state(pods=False).pods is None and "pods" not in watched(state(pods=False))
    assert state(allow("kube_pod_.+"), pods=False).pods is None
    s = state(deny("kube_pod_.+"))
    assert s.pods is None and "pods" not in watched(s)
    assert "pods" not in [r.resource.plural for r in s.reflectors]
    # Optional: a 403 (RBAC) is logged once and the rest is served; pods need no API discovery.
    (reflector,) = [r for r in state().reflectors if r.resource.plural == "pods"]
    assert reflector.optional and reflector.discover is None


def test_the_charts_pod_families_are_the_families_that_read_pods():
    """The Helm chart asks for pods RBAC only when its metric lists serve one of the families it
    lists as reading pods (otel-dra.exporterWatchesPods in _helpers.tpl): they must be the
    exporter's, its own pod families and any joined family that reads pods."""
    helpers = Path(__file__).parents[2] / "deploy" / "helm" / "otel-dra" / "templates" / "_helpers.tpl"
    [listed] = re.findall(r'\$podFamilies := list((?: "[^"]*")+) }}', helpers.read_text())
    chart = re.findall(r'"([^"]*)"', listed)
    reads_pods = [f.prom_name for f in object_families()[pod.RESOURCE.plural]]
    reads_pods += [f.prom_name for f in joined_families.ALL_FAMILIES if pod.RESOURCE.plural in f.reads]
    assert sorted(chart) == sorted(reads_pods)
    assert len(chart) == len(set(chart))


def test_the_joins_build_only_the_work_their_families_need():
    j = state(allow("kube_resourcepool_devices")).joins
    assert [st.resource for st in j.stores] == ["resource pools"]
    assert (j._evaluate, j._allocations, j._tainting, j._counting) == (True, False, False, True)
    j = state(allow("kube_resourcepool_generation")).joins
    assert (j._evaluate, j._counting) == (False, False)  # no slice is evaluated
    j = state(allow("kube_resourceslice_device_allocated")).joins
    assert [st.resource for st in j.stores] == ["slice usage"]
    assert (j._evaluate, j._allocations, j._tainting, j._counting) == (True, True, False, False)
    assert (j.costs, j.leaks, j.pools) == (None, None, None)


# --- what is served: each family, alone, exactly as with every family on ---------------------------------
def golden(s: ClusterState) -> dict[str, bytes]:
    load_golden(
        {
            "ResourceClaim": s.claims,
            "ResourceSlice": s.slices,
            "DeviceClass": s.classes,
            "DeviceTaintRule": s.taint_rules,
        }
    )
    return {g.prom_name: b"".join(c.data for c in chunks) for g, chunks in s.blocks()}


def test_each_family_alone_is_what_it_is_among_all():
    everything = golden(state(leak_grace=1.0))
    assert set(everything) == set(NAMES)
    for name in NAMES:
        assert golden(state(allow(name), leak_grace=1.0)) == {name: everything[name]}, name
    seed = golden(state(allow(",".join(SEED_NAMES)), leak_grace=1.0))
    assert seed == {n: everything[n] for n in SEED_NAMES}
    rest = golden(state(deny(",".join(SEED_NAMES)), leak_grace=1.0))
    assert rest == {n: v for n, v in everything.items() if n not in SEED_NAMES}
    # Any mix: what the slim objects keep and the joins compute for some families is enough for each.
    rng = random.Random(13)
    for _ in range(30):
        names = rng.sample(NAMES, rng.randint(2, 8))
        got = golden(state(allow(",".join(names)), leak_grace=1.0))
        assert got == {n: everything[n] for n in NAMES if n in names}, names


def test_otlp_carries_the_served_families_only():
    s = state(allow(",".join(SEED_NAMES)), otlp=True)
    golden(s)
    pushed = [header.name for store in s.series_stores for header, _groups in store.otlp_metrics()]
    assert pushed == [f.gauge.name for f in SEED_FAMILIES]


# --- what a family that is off costs: nothing --------------------------------------------------------------
def test_a_family_that_is_off_is_never_rendered(monkeypatch):
    rendered: set[str] = set()
    render = GaugeFamily.render

    def counting(self: GaugeFamily, samples: Any) -> bytes:
        rendered.add(self.prom_name)
        return render(self, samples)

    monkeypatch.setattr(GaugeFamily, "render", counting)
    s = state(allow(",".join(SEED_NAMES)), otlp=True)
    golden(s)
    for store in s.series_stores:
        store.otlp_metrics()
    assert rendered == set(SEED_NAMES)


def _retained(build: Any) -> int:
    """Bytes still allocated after ``build()`` (whose result is kept until measured)."""
    gc.collect()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        kept = build()
        gc.collect()
        size = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
    del kept
    return size


def test_seed_only_holds_no_more_than_bare_seed_stores():
    """With the seed allowlist the exporter's cache costs what three stores of the seed families
    alone cost (no joins, no indexes, no state families), and far less than every family."""
    w = Workload(claims=2000, namespaces=10, classes=20)

    def cluster(families: FamilySelection) -> ClusterState:
        s = state(families)
        fill(s, w)
        s.blocks()
        return s

    def bare() -> SimpleNamespace:
        stores = SimpleNamespace(
            claims=ObjectStore("resourceclaims", resourceclaim.parse, resourceclaim.FAMILIES),
            slices=ObjectStore("resourceslices", resourceslice.parse, resourceslice.FAMILIES),
            classes=ObjectStore("deviceclasses", deviceclass.parse, deviceclass.FAMILIES),
        )
        fill(stores, w)
        for store in (stores.claims, stores.slices, stores.classes):
            store.blocks()
        return stores

    cluster(EVERYTHING)  # fills the families' caches of rendered label pairs, which outlive a store
    seed = _retained(lambda: cluster(allow(",".join(SEED_NAMES))))
    alone = _retained(bare)
    everything = _retained(lambda: cluster(EVERYTHING))
    assert seed < 1.01 * alone + 64 * 1024, (seed, alone)
    assert everything > 1.8 * seed, (everything, seed)
