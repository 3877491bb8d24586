"""docs/metrics.md must describe exactly what the code exports."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import HistogramDataPoint, InMemoryMetricReader, Sum

from otel_dra.admission import metrics as webhook_metrics
from otel_dra.binding import controller as binding_controller
from otel_dra.binding import metrics as binding_metrics
from otel_dra.cli import build_parser
from otel_dra.cli.flags import add_flag
from otel_dra.cluster import joined_families
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
    # The claims' lifecycle: its histograms and its span queue's counters.
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from otel_dra.cluster.lifecycle import ClaimLifecycle
    from otel_dra.telemetry.spansink import SpanData, SpanSink

    sink = SpanSink(InMemorySpanExporter(), Resource.create({}), "t", "1", meter_provider=provider, max_queue=1)
    lifecycle = ClaimLifecycle(provider, sink)
    labels = {"deviceclass_name": "c", "driver": "d"}
    for histogram, extra in (
        (lifecycle._allocation_wait, {}),
        (lifecycle._binding_wait, {"outcome": "satisfied"}),
        (lifecycle._pod_start, {}),
    ):
        lifecycle._record(histogram, 1.0, {**labels, **extra}, 1, False, "x", None)
    sink.emit(SpanData("s", 1, 1, 0, 0, 1, {}))
    sink.emit(SpanData("s", 1, 2, 0, 0, 1, {}))  # the queue holds one: dropped
    sink.flush()
    exported = {
        name: (unit, prom, kind, ", ".join(keys)) for name, (unit, prom, kind, keys) in _exported(reader).items()
    }
    plugin = {i.name for i in plugin_metrics.INSTRUMENTS}
    binding = {i.name for i in binding_metrics.INSTRUMENTS}
    webhook = {i.name for i in webhook_metrics.INSTRUMENTS}
    rows = {k: v for k, v in _table_rows().items() if not k.startswith("kube_") and k not in plugin | binding | webhook}
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
    m.allocation_to_prepared(3.0, "gpu.example.com", "gpu.example.com")
    m.observe_state(lambda: 2, lambda: [("node-a", "gpu-0", "Healthy")], lambda: 1)
    m.observe_pool(
        "gpu-partitionable", lambda: [False, True], lambda: [("partition-type", "DRAPartitionableDevicesType")]
    )
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


def test_binding_controller_metrics_documented():
    """Every instrument of the binding controller, as the SDK exports it, is a row of its table."""
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    m = binding_metrics.ControllerMetrics(provider, "gpu.example.com", lambda: 1)
    m.condition_set("failed", 2.0)
    m.write_error(503)
    m.invalid_claim()
    exported = {
        name: (unit, prom, kind, ", ".join(sorted(keys)), "experimental")
        for name, (unit, prom, kind, keys) in _exported(reader).items()
    }
    provider.shutdown()
    names = {i.name for i in binding_metrics.INSTRUMENTS}
    assert set(exported) == names
    section = DOC.read_text().split("## Binding controller (`otel-dra binding-controller`)", 1)[1]
    rows = _table_rows()
    documented = {
        name: (r[1], r[2], r[3], ", ".join(sorted(filter(None, r[4].split(", ")))), r[5])
        for name, r in rows.items()
        if name in names and f"| {name} |" in section
    }
    assert exported == documented
    # And the span attributes of its traces.
    traces = section.split("### Binding controller traces", 1)[1]
    for attribute in binding_controller.SPAN_ATTRIBUTES:
        assert f"`{attribute}`" in traces, f"span attribute {attribute} is not documented in docs/metrics.md"
    assert f"`{binding_controller.SPAN_NAME}`" in traces


def test_webhook_metrics_documented():
    """Every instrument of the config webhook, as the SDK exports it, is a row of its table."""
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    m = webhook_metrics.WebhookMetrics(provider)
    m.review("DeviceClass", "denied", 0.001)
    m.invalid_request(400)
    exported = {
        name: (unit, prom, kind, ", ".join(sorted(keys)), "experimental")
        for name, (unit, prom, kind, keys) in _exported(reader).items()
    }
    provider.shutdown()
    names = {i.name for i in webhook_metrics.INSTRUMENTS}
    assert set(exported) == names
    section = DOC.read_text().split("## Config webhook (`otel-dra webhook`)", 1)[1]
    documented = {
        name: (r[1], r[2], r[3], ", ".join(sorted(filter(None, r[4].split(", ")))), r[5])
        for name, r in _table_rows().items()
        if name in names and f"| {name} |" in section
    }
    assert exported == documented
    # The buckets the table gives are the code's.
    row = _table_rows()[webhook_metrics.REVIEW_DURATION.name][6]
    buckets = " ".join(f"{b:g}".removeprefix("0") for b in webhook_metrics.REVIEW_DURATION.buckets)
    assert f"Buckets {buckets}." in row


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
    assert documented == {f.prom_name: f.reads for f in joined_families.ALL_FAMILIES}
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


def test_the_testbed_release_and_peer_tables_are_the_tables_own() -> None:
    """docs/testbed.md's release and peer tables are generated from otel_dra/testbed/releases.py
    (the command is in the comment above each table)."""
    from otel_dra.testbed.releases import peer_table, release_table

    text = (Path(__file__).resolve().parents[2] / "docs" / "testbed.md").read_text()
    for marker, table in (("releases", release_table()), ("peers", peer_table())):
        begin = text.index("-->\n", text.index(f"<!-- {marker}:begin")) + 4
        assert text[begin : text.index(f"<!-- {marker}:end -->")] == table, marker


# --- the flag tables of docs/exporter.md, plugin.md, binding-controller.md, testbed.md (testbed, demo) --

ROOT = Path(__file__).resolve().parents[2]
# The commands whose flags a doc's tables list; each table sits under a heading that names its
# command in backticks (`otel-dra testbed up`).
FLAG_DOCS = {
    "exporter.md": ("exporter",),
    "plugin.md": ("plugin",),
    "binding-controller.md": ("binding-controller",),
    "webhook.md": ("webhook",),
    "testbed.md": ("testbed build", "testbed up", "demo"),
}


def _cells(line: str) -> list[str]:
    return [c.strip() for c in re.split(r"(?<!\\)\|", line.strip().strip("|"))]


def flag_tables(text: str) -> dict[str, list[dict[str, str]]]:
    """Each table of ``text`` whose first column is ``flag``, as rows by column name, keyed by the
    command that the nearest heading above it names (`otel-dra <command>`)."""
    tables: dict[str, list[dict[str, str]]] = {}
    heading, code = "", False
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if line.startswith("```"):
            code = not code
        elif code:
            continue
        elif line.startswith("#"):
            heading = line
        elif line.startswith("| flag |"):
            command = re.search(r"`otel-dra ([a-z][a-z -]*)`", heading)
            assert command, f"a flag table under {heading!r} names no command in its heading"
            header = _cells(line)
            rows = []
            for row in lines[i + 2 :]:
                if not row.startswith("|"):
                    break
                rows.append(dict(zip(header, _cells(row), strict=True)))
            assert command.group(1) not in tables, f"two flag tables for `otel-dra {command.group(1)}`"
            tables[command.group(1)] = rows
    return tables


def command_flags(command: str) -> dict[str, argparse.Action]:
    """The options of ``otel-dra <command>`` (``testbed up``: a subcommand), by their long name, from
    the parser the CLI itself builds."""
    words = command.split()
    parser = build_parser(words[0])
    for word in words:
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        parser = sub.choices[word]
    return {
        a.option_strings[-1]: a for a in parser._actions if a.option_strings and not isinstance(a, argparse._HelpAction)
    }


def _shown_default(action: argparse.Action) -> str | None:
    """The default as a table writes it; None where the table describes it in words (no value)."""
    if action.required:
        return "required"
    if isinstance(action, argparse._StoreTrueAction):
        return "off"
    default = action.default
    if default is None or default in ("", [], {}):
        return None
    if isinstance(default, bool):
        return "true" if default else "false"
    if isinstance(default, float) and default.is_integer():
        return str(int(default))
    names = getattr(default, "names", None)  # --device-attributes: the parsed list
    return ",".join(names) if names is not None else str(default)


def flag_table_errors(command: str, rows: list[dict[str, str]], actions: dict[str, argparse.Action]) -> list[str]:
    """What a flag table gets wrong about ``actions``: a flag missing or unknown, another spelling,
    the environment variable ``add_flag`` binds, the default."""
    errors = []
    documented = {}
    for row in rows:
        names = re.findall(r"`(-[^`]+)`", row["flag"])
        if not names:
            errors.append(f"otel-dra {command}: a row names no flag: {row['flag']!r}")
            continue
        documented[names[-1]] = (names, row)
    for flag in sorted(set(actions) - set(documented)):
        errors.append(f"otel-dra {command} {flag} is not documented")
    for flag in sorted(set(documented) - set(actions)):
        errors.append(f"otel-dra {command} {flag} is documented but does not exist")
    for flag in sorted(set(actions) & set(documented)):
        action, (names, row) = actions[flag], documented[flag]
        if names != action.option_strings:
            errors.append(f"otel-dra {command} {flag}: documented as {names}, defined as {action.option_strings}")
        bound = re.search(r"\[env (\w+)\]", action.help or "")
        env = row.get("environment")
        if env is not None:
            if bound is not None and env != f"`{bound.group(1)}`":
                errors.append(f"otel-dra {command} {flag}: environment {env}, the flag reads {bound.group(1)}")
            # A flag without a variable of its own may name one its help text names (KUBECONFIG).
            if bound is None and env != "—" and env.strip("`") not in (action.help or ""):
                errors.append(f"otel-dra {command} {flag}: environment {env}, the flag reads none")
        shown, cell = _shown_default(action), row.get("default")
        if cell is not None and shown is not None and cell.replace("`", "").split(" (")[0].strip() != shown:
            errors.append(f"otel-dra {command} {flag}: default {cell!r}, the flag's is {shown!r}")
    return errors


def test_the_flag_tables_are_the_clis_flags() -> None:
    """Every flag of `otel-dra exporter`, `plugin`, `binding-controller`, `testbed build`, `testbed up`
    and `demo` is a row of its table in docs/, and every row is a flag, with the flag's environment
    variable and default."""
    errors = []
    for doc, commands in FLAG_DOCS.items():
        tables = flag_tables((ROOT / "docs" / doc).read_text())
        assert sorted(tables) == sorted(commands), f"docs/{doc}: flag tables for {sorted(tables)}"
        for command in commands:
            errors += flag_table_errors(command, tables[command], command_flags(command))
    assert errors == []


def test_the_flag_check_fails_for_an_undocumented_flag_or_a_wrong_row() -> None:
    """The check above finds a flag added without a row, a row without a flag, a wrong variable."""
    rows = flag_tables((ROOT / "docs" / "exporter.md").read_text())["exporter"]
    actions = command_flags("exporter")
    parser = argparse.ArgumentParser()
    add_flag(parser, "--new-flag", "OTEL_DRA_NEW_FLAG", "a flag without docs", default=3)
    actions["--new-flag"] = parser._actions[-1]
    wrong = [dict(row, environment="`OTEL_DRA_OTHER`") if row["flag"] == "`--port`" else row for row in rows]
    wrong.append({"flag": "`--gone`", "environment": "—", "default": "1", "meaning": "removed"})
    assert flag_table_errors("exporter", wrong, actions) == [
        "otel-dra exporter --new-flag is not documented",
        "otel-dra exporter --gone is documented but does not exist",
        "otel-dra exporter --port: environment `OTEL_DRA_OTHER`, the flag reads OTEL_DRA_PORT",
    ]


# --- links between the README and the docs ---------------------------------------------------------

LINKED_DOCS = ("README.md", "CONTRIBUTING.md", *(f"docs/{name}" for name in (*FLAG_DOCS, "deploy.md")))


def _anchors(text: str) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation but `-` and `_` dropped, spaces as `-`."""
    anchors: set[str] = set()
    code = False
    for line in text.splitlines():
        if line.startswith("```"):
            code = not code
        elif not code and line.startswith("#"):
            slug = re.sub(r"[^\w\- ]", "", line.lstrip("#").strip().lower()).replace(" ", "-")
            n = sum(1 for a in anchors if a == slug or re.fullmatch(re.escape(slug) + r"-\d+", a))
            anchors.add(f"{slug}-{n}" if n else slug)
    return anchors


def test_relative_links_and_anchors_resolve() -> None:
    """Every relative link of the README and of the docs pages it points to names a file that
    exists, and a heading of that file where it names one (docs moved out of the README keep working)."""
    broken = []
    for doc in LINKED_DOCS:
        path = ROOT / doc
        text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.S | re.M)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):
                continue
            file, _, anchor = target.partition("#")
            linked = (path.parent / file).resolve() if file else path
            if not linked.exists():
                broken.append(f"{doc}: {target} (no such file)")
            elif anchor and linked.suffix == ".md" and anchor not in _anchors(linked.read_text()):
                broken.append(f"{doc}: {target} (no such heading)")
    assert broken == []


def test_readme_stays_short_and_starts_with_the_two_commands() -> None:
    """The README is read in five minutes: at most 250 lines, and its first commands are the demo
    and the whole test suite (`.ci/run` calls `make test`)."""
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 250
    first = text.split("```sh\n", 1)[1].split("```", 1)[0].splitlines()
    assert [line.split()[:2] for line in first] == [["make", "run"], ["make", "test"]]
