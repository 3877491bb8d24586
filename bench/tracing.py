"""What tracing each claim's life costs the exporter (issue 28): scrape latency, CPU and RSS with
tracing off and on, under claim churn, against one loaded testbed.

    python -m bench.tracing --claims 100000 --json bench/results/tracing/L.json     # loads a fresh testbed
    python -m bench.tracing --kubeconfig /tmp/held-L/tb/kubeconfig --claims 100000  # a held one (bench.held)

Three exporters, one after the other in each round (the order turns round by round), each its own
process against the same objects:

- ``off``: no claim latency, no tracing (``--claim-latency=false``, no traces endpoint): the
  exporter as it was before issue 28;
- ``latency``: the default: the claim lifecycle's histograms, tracing off (no
  ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``);
- ``on``: tracing on, every claim sampled (ratio 1.0), the spans sent over OTLP/HTTP to
  bench/sink.py (its own process: receiving costs the exporter nothing).

For each: initial sync (process start → /readyz), the backfill of what the first list showed (a
root per claim and the allocations the objects show, paced) until none is left, then ``--rate``
claim status changes per second (bench/churn.py ``reserve``: each replaces a claim's reserving pod,
two spans when traced) for ``--churn-seconds``; meanwhile curl scrapes, plain and gzip, the
exporter's CPU per second of churn and its RSS; at the end the spans exported and dropped (self-
metrics) and what the sink received.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench import write_json
from bench.exporter import Exporter, alternating_rounds, free_port, get, machine, on_testbed, ratios
from bench.scale import scrapes
from bench.soak import git_commit, proc_sample
from bench.workload import Workload

VARIANTS = ("off", "latency", "on")
NAMESPACES = 100  # workload L's shape (bench.held, bench.scale)


def variant_setup(name: str, sink_port: int) -> tuple[dict[str, str], list[str]]:
    """The exporter's environment and flags of one variant."""
    if name == "off":
        return {}, ["--claim-latency=false"]
    if name == "latency":
        return {}, []
    return {
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": f"http://127.0.0.1:{sink_port}/v1/traces",
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf",
        "OTEL_TRACES_SAMPLER_ARG": "1.0",
    }, []


def metric(port: int, name: str, labels: str = "") -> float:
    """One sample of the exporter's /metrics (0 when absent: a counter not yet added to)."""
    _code, body = get(f"http://127.0.0.1:{port}/metrics")
    match = re.search(rf"^{re.escape(name)}(?:{{{re.escape(labels)}}})? (\S+)$", body.decode(), re.M)
    return float(match[1]) if match else 0.0


def sink_spans(port: int) -> int:
    """Spans the sink received since the last call (it forgets them when asked)."""
    _code, body = get(f"http://127.0.0.1:{port}/spans")
    return sum(len(v) for v in json.loads(body or b"{}").values())


def run_variant(
    name: str, kubeconfig: str, claims: int, args: argparse.Namespace, workdir: Path, sink_port: int
) -> dict[str, Any]:
    env, flags = variant_setup(name, sink_port)
    sink_spans(sink_port)  # forget what an earlier variant sent
    ex = Exporter(kubeconfig, workdir / f"exporter-{name}.log", env=env, extra_args=flags)
    r: dict[str, Any] = {"variant": name}
    try:
        r["initial_sync_s"] = round(ex.wait_ready(), 2)
        r["rss_ready_mib"] = proc_sample(ex.proc.pid)["rss_mib"]
        if name == "on":
            # The first list's spans (a root per claim, allocations the objects show), backfilled
            # at a paced rate: until none is left, or five minutes.
            start = time.monotonic()
            while time.monotonic() - start < 300 and (
                metric(ex.port, "otel_dra_tracing_backfill_objects") > 0
                or metric(ex.port, "otel_dra_tracing_queue_spans") > 0
            ):
                time.sleep(0.5)
            r["backlog_drained_s"] = round(time.monotonic() - start, 1)
            r["backlog_exported"] = metric(ex.port, "otel_dra_tracing_spans_exported_total", 'result="success"')
            r["backlog_dropped"] = metric(ex.port, "otel_dra_tracing_spans_dropped_total")
        time.sleep(2)
        churn = subprocess.Popen(
            [sys.executable, "-m", "bench.churn", kubeconfig, str(claims), str(NAMESPACES), str(args.rate)],
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            time.sleep(args.warmup)
            before = proc_sample(ex.proc.pid)
            t0 = time.monotonic()
            r["scrape"] = scrapes(ex.port, args.scrapes, gzip=False)
            r["gzip_scrape"] = scrapes(ex.port, args.scrapes, gzip=True)
            remaining = args.churn_seconds - (time.monotonic() - t0)
            if remaining > 0:
                time.sleep(remaining)
            after = proc_sample(ex.proc.pid)
            elapsed = time.monotonic() - t0
        finally:
            churn.terminate()
            r["churn"] = (churn.communicate(timeout=60)[0] or "").strip()
        # CPU per second of churn, scrapes included (the same scrapes in every variant).
        r["cpu_per_s"] = round((after["cpu_s"] - before["cpu_s"]) / elapsed, 3)
        r["rss_mib"] = after["rss_mib"]
        r["rss_peak_mib"] = after["hwm_mib"]
        r["churn_seconds"] = round(elapsed, 1)
        if name == "on":
            time.sleep(2)  # the last batch (at most a second old)
            r["spans_exported"] = metric(ex.port, "otel_dra_tracing_spans_exported_total", 'result="success"')
            r["spans_failed"] = metric(ex.port, "otel_dra_tracing_spans_exported_total", 'result="failure"')
            r["spans_dropped"] = metric(ex.port, "otel_dra_tracing_spans_dropped_total")
            r["sink_spans"] = sink_spans(sink_port)
    finally:
        ex.stop()
    print(f"  {name}: {json.dumps(r)}", flush=True)
    return r


def summarize(rounds: list[list[dict[str, Any]]]) -> dict[str, Any]:
    """Per variant the median over rounds; ratios against ``off`` and against ``latency``."""
    by: dict[str, list[dict[str, Any]]] = {}
    for round_ in rounds:
        for r in round_:
            by.setdefault(r["variant"], []).append(r)

    def med(name: str, *path: str) -> float:
        values = []
        for r in by[name]:
            v: Any = r
            for p in path:
                v = v[p]
            values.append(v)
        return float(statistics.median(values))

    out: dict[str, Any] = {}
    for name in by:
        out[name] = {
            "scrape_p50_ms": med(name, "scrape", "p50_ms"),
            "gzip_p50_ms": med(name, "gzip_scrape", "p50_ms"),
            "cpu_per_s": med(name, "cpu_per_s"),
            "rss_mib": med(name, "rss_mib"),
            "initial_sync_s": med(name, "initial_sync_s"),
        }
    for name, base in (("latency", "off"), ("on", "off"), ("on", "latency")):
        if name in by and base in by:
            out[f"{name}_vs_{base}"] = ratios(out[name], out[base])
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--claims", type=int, default=100000)
    parser.add_argument("--kubeconfig", default=None, help="a held testbed (bench.held) instead of a fresh one")
    parser.add_argument("--no-pods", action="store_true", help="a fresh testbed without the reserving Pods")
    parser.add_argument("--rate", type=float, default=100.0, help="claim status changes per second")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--scrapes", type=int, default=15, help="per kind (plain, gzip) and variant")
    parser.add_argument("--warmup", type=float, default=10.0, help="seconds of churn before measuring")
    parser.add_argument("--churn-seconds", type=float, default=60.0, help="seconds of churn measured")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    variants = [v for v in args.variants.split(",") if v]
    unknown = set(variants) - set(VARIANTS)
    if unknown:
        parser.error(f"unknown variants {sorted(unknown)}; choose from {VARIANTS}")
    results: dict[str, Any] = {
        "benchmark": "tracing",
        "machine": machine(),
        "commit": git_commit(),
        "args": vars(args) | {"json": str(args.json)},
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    with tempfile.TemporaryDirectory(prefix="otel-dra-bench-tracing-") as tmp:
        workdir = Path(tmp)
        sink_port = free_port()
        sink = subprocess.Popen([sys.executable, "-m", "bench.sink", str(sink_port)])
        try:
            w = Workload(claims=args.claims, namespaces=NAMESPACES, classes=50, pods=not args.no_pods)
            results["rounds"] = on_testbed(
                args.kubeconfig,
                w,
                workdir,
                lambda kubeconfig: alternating_rounds(
                    variants,
                    args.rounds,
                    lambda v: run_variant(v, kubeconfig, args.claims, args, workdir, sink_port),
                ),
                results,
            )
        finally:
            sink.terminate()
    results["summary"] = summarize(results["rounds"])
    print(json.dumps(results["summary"], indent=2))
    if args.json:
        write_json(args.json, results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
