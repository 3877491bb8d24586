"""The exporter's whole state (ClusterState: parsers, object stores, joins, self-metrics, as the
exporter wires them) fed with objects directly instead of by its reflectors, and what it serves."""

from __future__ import annotations

import copy
import shutil
import subprocess
from collections.abc import Callable
from typing import Any

from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.resources import Resource
from prometheus_client import CollectorRegistry
from prometheus_client.openmetrics.parser import text_string_to_metric_families as parse_openmetrics
from prometheus_client.parser import text_string_to_metric_families as parse_text

from otel_dra.cluster.exporter import ClusterState
from otel_dra.cluster.store import ObjectStore
from otel_dra.telemetry.exposition import assemble
from otel_dra.telemetry.otlp_encode import RequestBuilder
from tests.unit.test_state_families import load_golden

KINDS = ("ResourceClaim", "ResourceSlice", "DeviceClass", "DeviceTaintRule", "Pod")

_HEADERS: dict[str, tuple[bytes, bytes]] = {}
_BUILDER = RequestBuilder(Resource.create({"service.name": "fuzz"}), "otel_dra.cluster", "0")

# Pods that reference the golden claims and report the health of their devices (the golden objects
# have no such pod: their pods are made by the integration test).
PODS: list[dict[str, Any]] = [
    {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "health-pod", "namespace": "gold-taint", "uid": "pod-health", "resourceVersion": "900"},
        "spec": {
            "containers": [{"name": "c", "image": "x", "resources": {"claims": [{"name": "dev"}]}}],
            "resourceClaims": [
                {"name": "dev", "resourceClaimName": "health"},
                {"name": "tpl", "resourceClaimTemplateName": "one-dev"},
            ],
        },
        "status": {
            "resourceClaimStatuses": [{"name": "tpl", "resourceClaimName": "health-pod-tpl-x7k2p"}],
            "containerStatuses": [
                {
                    "name": "c",
                    "allocatedResourcesStatus": [
                        {
                            "name": "claim:dev/dev",
                            "resources": [
                                {"resourceID": "taint.example.com/gold-taint/t2", "health": "Unhealthy"},
                                {"resourceID": "taint.example.com/gold-taint/t1", "health": "Healthy"},
                            ],
                        },
                        {"name": "example.com/gpu", "resources": [{"resourceID": "GPU-1", "health": "Healthy"}]},
                    ],
                }
            ],
            "initContainerStatuses": [
                {
                    "name": "init",
                    "allocatedResourcesStatus": [
                        {"name": "claim:tpl", "resources": [{"resourceID": "a.example.com/p/d", "health": "Unknown"}]}
                    ],
                }
            ],
        },
    },
    {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "plain", "namespace": "gold-cost", "uid": "pod-plain", "resourceVersion": "901"},
        "spec": {"containers": [{"name": "c", "image": "x"}]},
        "status": {"phase": "Running"},
    },
]


class _Collect:
    def __init__(self, kind: str, into: list[tuple[str, dict[str, Any]]]) -> None:
        self.kind, self.into = kind, into

    def upsert(self, obj: dict[str, Any]) -> None:
        self.into.append((self.kind, copy.deepcopy(obj)))


def seeds() -> list[tuple[str, dict[str, Any]]]:
    """(kind, object): the golden objects (tests/golden/state_objects.yaml) of every watched kind,
    allocated and with status as in the golden test, and the pods above."""
    out: list[tuple[str, dict[str, Any]]] = []
    load_golden({kind: _Collect(kind, out) for kind in KINDS if kind != "Pod"})
    out.extend(("Pod", copy.deepcopy(p)) for p in PODS)
    return out


def safe_key(obj: dict[str, Any]) -> str | None:
    """The store key of an object, as object_key makes it, or None where that is not defined."""
    meta = obj.get("metadata") or {}
    if not isinstance(meta, dict):
        return None
    namespace = meta.get("namespace") or ""
    return f"{namespace}/{meta.get('name', '')}" if namespace else str(meta.get("name", ""))


class World:
    def __init__(self, objects: list[tuple[str, dict[str, Any]]]) -> None:
        self.reader = InMemoryMetricReader()
        self.provider = MeterProvider(metric_readers=[self.reader], shutdown_on_exit=False)
        # leak_grace 0: a claim allocated and reserved by nobody is leaked at once, so that the leak
        # family has series and nothing depends on the time the test takes.
        self.state = ClusterState(object(), self.provider, otlp=True, leak_grace=0.0)  # type: ignore[arg-type]
        state = self.state
        stores = (state.claims, state.slices, state.classes, state.taint_rules, state.pods)
        assert all(s is not None for s in stores)
        self.stores: dict[str, ObjectStore[Any]] = dict(zip(KINDS, stores, strict=True))  # type: ignore[arg-type]
        for kind, obj in objects:
            self.stores[kind].upsert(copy.deepcopy(obj))
        self.otlp()  # from here on the stores encode OTLP points as they render

    # --- what it serves ------------------------------------------------------------------------
    def exposition(self, openmetrics: bool = False) -> bytes:
        return b"".join(assemble(CollectorRegistry(), self.state.blocks(), openmetrics))

    def otlp(self) -> list[ExportMetricsServiceRequest]:
        self.state.joins.tick()
        metrics = [m for store in self.state.series_stores for m in store.otlp_metrics()]
        return [ExportMetricsServiceRequest.FromString(r) for r in _BUILDER.requests(metrics, 1)]

    def families(self) -> dict[str, tuple[bytes, bytes, set[bytes]]]:
        """Per family (Prometheus name): its text and OpenMetrics headers and its series lines."""
        out: dict[str, tuple[bytes, bytes, set[bytes]]] = {}
        for gauge, chunks in self.state.blocks():
            lines = {line for chunk in chunks for line in chunk.data.split(b"\n") if line}
            if gauge.prom_name not in _HEADERS:
                _HEADERS[gauge.prom_name] = (gauge.header(False), gauge.header(True))
            out[gauge.prom_name] = (*_HEADERS[gauge.prom_name], lines)
        return out

    def own_lines(self) -> set[bytes]:
        """The series lines of the objects' own families (not the joins')."""
        lines: set[bytes] = set()
        for store in self.state.stores:
            for _gauge, chunks in store.blocks():
                for chunk in chunks:
                    lines.update(chunk.data.split(b"\n"))
        return lines

    def rendered(self) -> set[tuple[str, str]]:
        """(store, key) of every entry whose object parsed and whose series rendered."""
        return {
            (store.resource, key)
            for store in self.state.series_stores
            for key, entry in list(store._entries.items())  # test-only look inside: no public key list
            if entry.obj is not None
        }

    def problems(self) -> int:
        """The invalid-objects self-metric (otel_dra.objects.invalid), summed over resources."""
        data = self.reader.get_metrics_data()
        total = 0
        for rm in data.resource_metrics if data else ():
            for sm in rm.scope_metrics:
                for metric in sm.metrics:
                    if metric.name == "otel_dra.objects.invalid":
                        total += sum(int(p.value) for p in metric.data.data_points)  # type: ignore[union-attr]
        return total

    def close(self) -> None:
        self.provider.shutdown()


def changed(
    before: dict[str, tuple[bytes, bytes, set[bytes]]], after: dict[str, tuple[bytes, bytes, set[bytes]]]
) -> tuple[bytes, bytes]:
    """The text and OpenMetrics expositions of the series lines in ``after`` that are not in
    ``before``, under their families' headers. Both formats are read line by line, so this parses as
    the whole exposition would, at a fraction of the cost."""
    text: list[bytes] = []
    om: list[bytes] = []
    for name, (head, om_head, lines) in after.items():
        new = sorted(lines - before.get(name, (b"", b"", set()))[2])
        if new:
            body = b"\n".join(new) + b"\n"
            text += [head, body]
            om += [om_head, body]
    return b"".join(text), b"".join(om) + b"# EOF\n"


def samples(body: bytes) -> int:
    return sum(1 for line in body.split(b"\n") if line and not line.startswith(b"#"))


def check_parses(text: bytes, openmetrics: bytes | None) -> None:
    """Both expositions parse with prometheus_client's parsers, every sample line read as one sample."""
    parsed = sum(len(f.samples) for f in parse_text(text.decode()))
    assert parsed == samples(text), "text exposition: samples lost or merged by the parser"
    if openmetrics is None:
        return
    parsed = sum(len(f.samples) for f in parse_openmetrics(openmetrics.decode()))
    assert parsed == samples(openmetrics), "OpenMetrics exposition: samples lost or merged by the parser"


def promtool_check(text: bytes) -> None:
    """``promtool check metrics`` (Prometheus' own parser) parses the exposition. Its exit status is
    1 for a parse error, 3 for lint findings only: the seed's names have some
    (kube_resourceclaim_status_reserved_total is a gauge, ``counter_set`` names a type), kept byte
    for byte on purpose."""
    promtool = shutil.which("promtool")
    assert promtool, "promtool is needed (Debian package `prometheus`; .ci/run installs it)"
    check = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, timeout=60)
    assert check.returncode in (0, 3), (check.stdout + check.stderr).decode(errors="replace")[-4000:]


def points(requests: list[ExportMetricsServiceRequest]) -> int:
    return sum(
        len(m.gauge.data_points)
        for r in requests
        for rm in r.resource_metrics
        for sm in rm.scope_metrics
        for m in sm.metrics
    )


class Sampler:
    """Every ``every``-th call (the first included) says yes: for checks too slow for every example."""

    def __init__(self, every: int) -> None:
        self.every, self.calls = every, 0

    def __call__(self) -> bool:
        self.calls += 1
        return self.calls % self.every == 1 or self.every == 1


def cached(factory: Callable[[str], World]) -> Callable[[str], World]:
    """One world per name, kept while it passes; a failing example drops it (see ``discard``)."""
    worlds: dict[str, World] = {}

    def get(name: str) -> World:
        if name not in worlds:
            worlds[name] = factory(name)
        return worlds[name]

    def discard(name: str) -> None:
        world = worlds.pop(name, None)
        if world is not None:
            world.close()

    get.discard = discard  # type: ignore[attr-defined]
    return get
