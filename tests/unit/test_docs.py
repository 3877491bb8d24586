"""docs/metrics.md must describe exactly what the code exports."""

from __future__ import annotations

from pathlib import Path

from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import HistogramDataPoint, InMemoryMetricReader, Sum

from otel_dra.cluster import deviceclass, devicetaintrule, joins, resourceclaim, resourceslice
from otel_dra.cluster.exporter import ClusterState
from otel_dra.telemetry.naming import prometheus_name

DOC = Path(__file__).resolve().parents[2] / "docs" / "metrics.md"


def _table_rows() -> dict[str, tuple[str, ...]]:
    rows = {}
    for line in DOC.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 7 and cells[0] not in ("OTel instrument", "---"):
            rows[cells[0]] = tuple(cells)
    return rows


def _fmt_labels(labels) -> str:
    return ", ".join(labels)


def _state_families():
    for module in (resourceclaim, resourceslice, deviceclass, devicetaintrule):
        yield from module.FAMILIES
        yield from module.STATE_FAMILIES
    yield from joins.ALL_FAMILIES


def test_state_families_documented():
    rows = _table_rows()
    for fam in _state_families():
        g = fam.gauge
        assert fam.gauge.name in rows, f"{g.name} missing from docs/metrics.md"
        _otel, unit, prom, kind, labels, stability, _ = rows.pop(g.name)
        assert (unit, prom, kind, labels, stability) == (
            g.unit,
            fam.prom_name,
            "gauge",
            _fmt_labels(g.labels),
            fam.stability,
        ), g.name
    assert all(not name.startswith("kube_") for name in rows), f"documented but not exported: {sorted(rows)}"


class _NoClient:
    """ClusterState only uses its client in reflector threads, which this test never starts."""


def test_self_metrics_documented():
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    state = ClusterState(_NoClient(), provider)  # type: ignore[arg-type]
    m = state._metrics
    m.watch_event("resourceclaims", "ADDED")
    m.relist("resourceclaims", "expired")
    m.list_error("resourceclaims", 500)
    m.watch_error("resourceclaims", 0)
    state._count_problem("deviceclasses")
    state.record_collection(0.01, "prometheus", 0.005)
    for r in state.reflectors:
        r._last_sync_wall = 1.0
    data = reader.get_metrics_data()
    exported = {}
    for rm in data.resource_metrics:
        for sm in rm.scope_metrics:
            for metric in sm.metrics:
                point = metric.data.data_points[0]
                counter = isinstance(metric.data, Sum) and metric.data.is_monotonic
                kind = "histogram" if isinstance(point, HistogramDataPoint) else "counter" if counter else "gauge"
                exported[metric.name] = (
                    metric.unit,
                    prometheus_name(metric.name, metric.unit, counter=counter),
                    kind,
                    ", ".join(point.attributes.keys()),
                )
    rows = {k: v for k, v in _table_rows().items() if not k.startswith("kube_")}
    documented = {name: (r[1], r[2], r[3], r[4]) for name, r in rows.items()}
    assert exported == documented
    provider.shutdown()
