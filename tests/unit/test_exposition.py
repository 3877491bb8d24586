"""The pre-rendered exposition must equal what the OTel SDK's Prometheus reader would produce."""

from __future__ import annotations

import gzip

from opentelemetry.exporter.prometheus import PrometheusMetricReader
from opentelemetry.sdk.metrics import MeterProvider
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.openmetrics.exposition import generate_latest as generate_openmetrics

from otel_dra.cluster import deviceclass, resourceclaim, resourceslice
from otel_dra.telemetry.exposition import Assembler, Chunk, GaugeFamily, assemble
from otel_dra.telemetry.naming import prometheus_name
from tests.unit.sample_stores import register_sdk_gauges, sample_stores


def _stores():
    return sample_stores()


def _sdk_render(stores, openmetrics: bool) -> bytes:
    registry = CollectorRegistry()
    reader = PrometheusMetricReader(disable_target_info=True, scope_info_enabled=False, registry=registry)
    provider = MeterProvider(metric_readers=[reader])
    register_sdk_gauges(provider.get_meter("test"), stores, order=lambda o: (getattr(o, "namespace", ""), o.name))
    try:
        return generate_openmetrics(registry) if openmetrics else generate_latest(registry)
    finally:
        provider.shutdown()


def test_fast_path_equals_sdk_reader_text_and_openmetrics():
    stores = _stores()
    blocks = [b for s in stores for b in s.blocks()]
    assert all(any(c.data for c in chunks) for _, chunks in blocks), "every family must have samples in the fixture"
    for openmetrics in (False, True):
        ours = b"".join(assemble(CollectorRegistry(), blocks, openmetrics))
        assert ours == _sdk_render(stores, openmetrics)
        zipped = assemble(CollectorRegistry(), blocks, openmetrics, gzipped=True)
        assert gzip.decompress(b"".join(zipped)) == ours


def test_names_match_sdk_translation():
    names = {fam.prom_name for mod in (resourceclaim, resourceslice, deviceclass) for fam in mod.FAMILIES}
    assert names == {
        "kube_resourceclaim_status_allocated_device",
        "kube_resourceclaim_status_reserved_for_pod",
        "kube_resourceclaim_status_reserved_total",
        "kube_resourceslice_device_capacity_memory_bytes",
        "kube_resourceslice_device_capacity_multiprocessors",
        "kube_resourceslice_device_capacity_decoders",
        "kube_deviceclass_hourly_cost",
    }


def test_naming_rules():
    assert prometheus_name("otel_dra.watch.events", "{event}", counter=True) == "otel_dra_watch_events_total"
    assert prometheus_name("x.duration", "s") == "x_duration_seconds"
    assert prometheus_name("x_bytes", "By") == "x_bytes"
    assert prometheus_name("x_total", "1", counter=True) == "x_total"
    assert prometheus_name("rate", "By/s") == "rate_bytes_per_second"
    assert prometheus_name("9lives", "") == "_lives"


def test_label_values_are_escaped():
    from otel_dra.telemetry.exposition import GaugeFamily

    fam = GaugeFamily("g", "", "help", ("b", "a"))
    assert fam.render([(('x"y', "back\\slash\nnl"), 1.5)]) == b'g{a="back\\\\slash\\nnl",b="x\\"y"} 1.5\n'


def test_numbers_and_label_counts_equal_the_sdk_reader_also_when_remembered():
    """The per-family template and number cache: no labels, one label, several (out of key order);
    0.0 and -0.0 (one dict key, two texts), Go's exponent switch, and each value twice, so the
    second is the remembered text. (The SDK drops non-finite values; those are checked alone.)"""
    from opentelemetry.metrics import Observation

    from otel_dra.telemetry.exposition import GaugeFamily

    values = [0.0, -0.0, 1.0, 1796155228.0, 1.5e-7, 123456.0, 1234567.0, 0.0, 2.0]
    for labels in ((), ("only",), ("zeta", "alpha", "mid")):
        fam = GaugeFamily("edge.numbers", "s", "help", labels)
        samples = [(tuple(f"v{i}-{k}" for k in range(len(labels))), v) for i, v in enumerate(values)]
        ours = fam.render(samples) + fam.render(samples)

        registry = CollectorRegistry()
        reader = PrometheusMetricReader(disable_target_info=True, scope_info_enabled=False, registry=registry)
        provider = MeterProvider(metric_readers=[reader])
        try:
            for i, (sample_values, value) in enumerate(samples):
                # One gauge per sample (the SDK would merge equal attribute sets), in sample order.
                gauge = f"edge.numbers{i:02d}"
                attrs = dict(zip(labels, sample_values, strict=True))
                provider.get_meter("t").create_observable_gauge(
                    gauge, callbacks=[lambda _o, a=attrs, v=value: [Observation(v, a)]], unit="s"
                )
            text = generate_latest(registry).decode()
        finally:
            provider.shutdown()
        sdk = [line for line in text.splitlines() if line and not line.startswith("#")]
        # The SDK's names differ per gauge; the label sets and numbers must be ours.
        want = [line.split("{", 1)[1] if labels else line.split(" ", 1)[1] for line in sdk]
        got = [line.split("{", 1)[1] if labels else line.split(" ", 1)[1] for line in ours.decode().splitlines()]
        assert got == want + want, labels
    fam = GaugeFamily("g", "", "help", ("a",))
    nonfinite = [(("x",), float("nan")), (("y",), float("inf")), (("z",), -float("inf"))]
    assert fam.render(nonfinite * 2) == b'g{a="x"} NaN\ng{a="y"} +Inf\ng{a="z"} -Inf\n' * 2


def test_the_assembler_reuses_a_family_until_its_chunks_change():
    """One Assembler across scrapes: an unchanged family (the same chunk sequence) is not looked at
    again; a new sequence is; empty chunks send nothing (not even an empty gzip member)."""
    fam = GaugeFamily("x.y", "1", "X.", ("k",))
    other = GaugeFamily("z", "1", "Z.", ())
    a, empty, b = Chunk(fam.render([(("a",), 1.0)])), Chunk(b""), Chunk(fam.render([(("b",), 2.0)]))
    chunks, others = [a, empty, b], [Chunk(other.render([((), 3.0)]))]
    assembler = Assembler()
    for openmetrics in (False, True):
        for gzipped in (False, True):
            first = assembler.assemble(CollectorRegistry(), [(fam, chunks), (other, others)], openmetrics, gzipped)
            # The SDK's part, then per family its header and one buffer per non-empty chunk, then EOF.
            assert len(first) == 1 + 3 + 2 + (1 if openmetrics else 0)
            uncached = assemble(CollectorRegistry(), [(fam, chunks), (other, others)], openmetrics, gzipped)
            body = b"".join(first)
            assert body == b"".join(uncached)
            if gzipped:
                assert all(gzip.decompress(part) for part in first[1:])  # no empty member
            again = assembler.assemble(CollectorRegistry(), [(fam, chunks), (other, others)], openmetrics, gzipped)
            assert all(x is y for x, y in zip(again[1:], first[1:], strict=True))
    c = Chunk(fam.render([(("c",), 4.0)]))
    changed = assembler.assemble(CollectorRegistry(), [(fam, [a, c]), (other, others)], False)
    assert b'x_y{k="c"} 4.0' in b"".join(changed) and b'k="b"' not in b"".join(changed)
    # A family no longer given is no longer sent.
    assert b"# HELP z " not in b"".join(assembler.assemble(CollectorRegistry(), [(fam, [a, c])], False))


def test_the_assembler_pins_no_old_chunks_and_takes_concurrent_scrapes():
    """A format scraped once must not keep the chunks it was built from once they changed (at
    workload L that is up to a whole body), and scrapes may run in several threads at once."""
    import sys
    import threading

    fam = GaugeFamily("x", "1", "X.", ("k",))
    assembler = Assembler()
    first = fam.render([(("a",), 1.0)])
    alone = sys.getrefcount(first)
    assembler.assemble(CollectorRegistry(), [(fam, [Chunk(first)])], True)  # OpenMetrics, once
    assert sys.getrefcount(first) > alone  # held by what that scrape built
    for i in range(3):
        assembler.assemble(CollectorRegistry(), [(fam, [Chunk(fam.render([(("b",), float(i))]))])], False)
    assert sys.getrefcount(first) == alone

    errors: list[BaseException] = []

    def scrape(n: int) -> None:
        try:
            for i in range(300):
                chunks = [Chunk(fam.render([((str(i),), 1.0)]))]
                body = assembler.assemble(CollectorRegistry(), [(fam, chunks)] if i % 3 else [], n % 2 == 0, n % 3 == 0)
                assert body
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=scrape, args=(n,)) for n in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
