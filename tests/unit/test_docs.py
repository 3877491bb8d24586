"""docs/metrics.md must describe exactly what the code exports."""

from __future__ import annotations

from pathlib import Path

from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import HistogramDataPoint, InMemoryMetricReader, Sum

from otel_dra.cluster import joins
from otel_dra.cluster.exporter import SEED_FAMILIES, ClusterState, all_families
from otel_dra.cluster.selection import FamilySelection
from otel_dra.kube.client import RequestRecord
from otel_dra.plugin import driver as plugin_driver
from otel_dra.plugin import metrics as plugin_metrics
from otel_dra.plugin import server as plugin_server
from otel_dra.telemetry.naming import prometheus_name

DOC = Path(__file__).resolve().parents[2] / "docs" / "metrics.md"
NAMES = [f.prom_name for f in all_families()]


def _table_rows() -> dict[str, tuple[str, ...]]:
    rows = {}
    for line in DOC.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 7 and cells[0] not in ("OTel instrument", "---"):
            rows[cells[0]] = tuple(cells)
    return rows


def _fmt_labels(labels) -> str:
    return ", ".join(labels)


def compatibility_matrix() -> str:
    """The family x Kubernetes minor table of docs/metrics.md, from each family's `kubernetes`."""
    from otel_dra.testbed.build import KUBERNETES_RELEASES, version_key

    minors = [release.minor for release in KUBERNETES_RELEASES]
    lines = ["| family | " + " | ".join(minors) + " |", "|---|" + "---|" * len(minors)]
    for fam in sorted(all_families(), key=lambda f: f.prom_name):
        since = version_key(fam.kubernetes or minors[0])
        cells = ["yes" if version_key(minor) >= since else "no" for minor in minors]
        lines.append(f"| {fam.prom_name} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def test_compatibility_matrix_is_the_families_own():
    """Regenerate the table with `python -c "from tests.unit.test_docs import compatibility_matrix as m;
    print(m())"` when a family or a supported minor is added."""
    assert compatibility_matrix() in DOC.read_text()


def test_state_families_documented():
    rows = _table_rows()
    for fam in all_families():
        g = fam.gauge
        assert fam.gauge.name in rows, f"{g.name} missing from docs/metrics.md"
        _otel, unit, prom, kind, labels, stability, meaning = rows.pop(g.name)
        assert (unit, prom, kind, labels, stability) == (
            g.unit,
            fam.prom_name,
            "gauge",
            _fmt_labels(g.labels),
            fam.stability,
        ), g.name
        # A family that names the oldest Kubernetes serving what it reads says so.
        if fam.kubernetes:
            assert meaning.startswith(f"Kubernetes {fam.kubernetes}+"), g.name
    assert all(not name.startswith("kube_") for name in rows), f"documented but not exported: {sorted(rows)}"


class _NoClient:
    """ClusterState only uses its client in reflector threads, which this test never starts."""


def _exported(reader: InMemoryMetricReader) -> dict[str, tuple[str, str, str, list[str]]]:
    """Each metric the SDK exports: unit, Prometheus name, kind, attribute keys of its first point."""
    exported = {}
    for rm in reader.get_metrics_data().resource_metrics:
        for sm in rm.scope_metrics:
            for metric in sm.metrics:
                point = metric.data.data_points[0]
                counter = isinstance(metric.data, Sum) and metric.data.is_monotonic
                kind = "histogram" if isinstance(point, HistogramDataPoint) else "counter" if counter else "gauge"
                prom = prometheus_name(metric.name, metric.unit, counter=counter)
                exported[metric.name] = (metric.unit, prom, kind, list(point.attributes.keys()))
    return exported


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
    state.record_dropped_points(3)
    for r in state.reflectors:
        r._last_sync_wall = 1.0
    exported = {
        name: (unit, prom, kind, ", ".join(keys)) for name, (unit, prom, kind, keys) in _exported(reader).items()
    }
    plugin = {i.name for i in plugin_metrics.INSTRUMENTS}
    rows = {k: v for k, v in _table_rows().items() if not k.startswith("kube_") and k not in plugin}
    documented = {name: (r[1], r[2], r[3], r[4]) for name, r in rows.items()}
    assert exported == documented
    provider.shutdown()


def test_plugin_metrics_documented():
    """Every plugin instrument, as the SDK exports it, is a row of the plugin table."""
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    m = plugin_metrics.PluginMetrics(provider)
    m.prepared(True, 0.01)
    m.unprepared(True, 0.01)
    m.observe_request(RequestRecord("GET", "h:1", "/", 503, 0.01, True))
    m.claim_error("prepare", "NotFound")
    m.observe_state(lambda: 2, lambda: [("node-a", "gpu-0", "Healthy")], lambda: 1)
    stability = {i.name: i.stability for i in plugin_metrics.INSTRUMENTS}
    exported = {
        name: (unit, prom, kind, ", ".join(sorted(keys)), stability[name])
        for name, (unit, prom, kind, keys) in _exported(reader).items()
    }
    provider.shutdown()
    names = {i.name for i in plugin_metrics.INSTRUMENTS}
    assert set(exported) == names
    rows = _table_rows()
    documented = {
        name: (r[1], r[2], r[3], ", ".join(sorted(filter(None, r[4].split(", ")))), r[5])
        for name, r in rows.items()
        if name in names
    }
    assert exported == documented
    # The upstream names, byte for byte (the others are ours: otel_dra_plugin_*).
    assert sorted(v[1] for v in exported.values() if not v[1].startswith("otel_dra_plugin_")) == [
        "dra_example_driver_fatal_background_errors_total",
        "dra_example_driver_prepare_claim_duration_seconds",
        "dra_example_driver_prepare_claims_total",
        "dra_example_driver_unprepare_claim_duration_seconds",
        "dra_example_driver_unprepare_claims_total",
        "rest_client_request_duration_seconds",
        "rest_client_request_retries_total",
        "rest_client_requests_total",
    ]


def test_plugin_span_attributes_documented():
    text = DOC.read_text()
    section = text[text.index("## Plugin traces") :]
    constants = [
        getattr(module, name)
        for module in (plugin_driver, plugin_server)
        for name in dir(module)
        if name.isupper() and isinstance(getattr(module, name), str)
    ]
    attributes = [
        c for c in constants if c.startswith(("dra.", "rpc.", "k8s.", "http.", "url.", "server.", "error.", "network."))
    ]
    assert len(attributes) >= 20
    for attribute in attributes:
        assert f"`{attribute}`" in section, f"span attribute {attribute} is not documented in docs/metrics.md"


def test_joined_family_needs_documented():
    """The table of "Choosing families" in docs/metrics.md is what each joined family reads."""
    text = DOC.read_text()
    section = text[text.index("### Choosing families") : text.index("## Exporter self-metrics")]
    documented = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 2 and cells[0].startswith("`kube_"):
            documented[cells[0].strip("`")] = tuple(r.strip("` ") for r in cells[1].split(","))
    assert documented == {f.prom_name: f.reads for f in joins.ALL_FAMILIES}
    # The example allowlist is the seven seed families.
    example = FamilySelection.parse(
        section.split("--metric-allowlist='", 1)[1].split("'", 1)[0], allow=True, names=NAMES
    )
    assert example is not None
    assert [n for n in NAMES if example.serves(n)] == [f.prom_name for f in SEED_FAMILIES]


def test_process_families_documented():
    """The process_* table of docs/metrics.md lists exactly what the pipeline serves, type and HELP."""
    from tests.helpers import PROCESS_FAMILIES

    section = DOC.read_text().split("## Process metrics (both binaries)", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 5 and cells[0] not in ("Prometheus name", "---"):
            rows[cells[0]] = (cells[1], cells[4])
    assert rows == PROCESS_FAMILIES


def test_the_testbed_release_table_is_the_tables_own() -> None:
    """docs/testbed.md's release table is generated from otel_dra/testbed/releases.py (the command is
    in the comment above the table)."""
    from otel_dra.testbed.releases import release_table

    text = (Path(__file__).resolve().parents[2] / "docs" / "testbed.md").read_text()
    begin, end = text.index("-->\n", text.index("<!-- releases:begin")) + 4, text.index("<!-- releases:end -->")
    assert text[begin:end] == release_table()
