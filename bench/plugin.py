"""Prepare/unprepare benchmark of the example kubelet plugin, through the kubelet emulator (issue #3).

    python -m bench.plugin [--rounds 6] [--pods 48] [--json bench/results/plugin/plugin.json]
    python -m bench.plugin --kubelet real [--rounds 3] [--pods 12] [--json ...]   (bench/plugin_real.py)

A real control plane (kube-apiserver, kube-scheduler, kube-controller-manager) and one node whose
plugin (``otel-dra plugin``, its own process) publishes 64 simulated GPUs. Each round creates
``--pods`` pods that take one GPU each through a ResourceClaimTemplate, waits until the emulator has
prepared every claim and reported every pod Running, then deletes them and waits until every claim
is unprepared and every pod gone. Rounds alternate between the plugin without tracing and the
plugin exporting a span per RPC, per claim and per step (sampler always_on) over OTLP/HTTP to a
sink process, restarting the plugin in between, so both variants see the same drift of the
machine.

Measured, per variant:
- per-claim prepare and unprepare latency as the kubelet sees it: the wall time of each
  NodePrepareResources / NodeUnprepareResources call (one claim per call, since each pod has one
  claim), gRPC and the claim read included; p50 / p99;
- the plugin's prepare histogram (``dra_example_driver_prepare_claim_duration_seconds``, the
  driver's work after reading the claim, as upstream's): mean, the share of claims under 5 ms,
  and p50 / p99 the way a dashboard (and upstream's 2.7 / ~5 ms figures) compute them,
  ``histogram_quantile`` over its buckets;
- with tracing on, the same driver time exactly, per claim, from the exported spans (claim span
  end minus claim-read span end, see :func:`bench.sink.driver_seconds`); p50 / p99;
- claims per second: claims prepared per second of a round, from the first prepare call starting
  to the last one returning (bounded by how fast the scheduler allocates, reported for context);
- the plugin's own CPU time per prepared+unprepared claim.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

from bench import write_json
from bench.exporter import free_port, machine, percentile
from otel_dra.cli.demo import NAMESPACE, demo_objects, start_plugin, workload_pod
from otel_dra.fixtures import apply_all
from otel_dra.kube.client import ApiError, KubeClient, load_credentials
from otel_dra.kubeletsim.sim import KubeletSim
from otel_dra.testbed import find_binaries, running

NODE = "bench-node"
DEVICES = 64


class Calls:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.calls: list[tuple[str, int, float, float]] = []  # method, claims, seconds, end time

    def __call__(self, method: str, claims: int, seconds: float) -> None:
        with self.lock:
            self.calls.append((method, claims, seconds, time.perf_counter()))

    def take(self) -> list[tuple[str, int, float, float]]:
        with self.lock:
            out, self.calls = self.calls, []
        return out


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def pods_left(client: KubeClient) -> int:
    return len(client.get_json(f"/api/v1/namespaces/{NAMESPACE}/pods")["items"])


def wait(what: str, predicate: Any, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.05)


_BUCKET = re.compile(r"^dra_example_driver_prepare_claim_duration_seconds_bucket\{(.*)\} (\S+)$")


def in_plugin(port: int) -> dict[str, Any]:
    """Sum and count of the plugin's own prepare/unprepare histograms (its view, without gRPC),
    and the prepare histogram's cumulative bucket counts (``le`` -> count)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    out: dict[str, Any] = {"prepare_buckets": {}}
    for line in text.splitlines():
        for op in ("prepare", "unprepare"):
            for part in ("sum", "count"):
                prefix = f'dra_example_driver_{op}_claim_duration_seconds_{part}{{result="success"}} '
                if line.startswith(prefix):
                    out[f"{op}_{part}"] = float(line[len(prefix) :])
        bucket = _BUCKET.match(line)
        if bucket and 'result="success"' in bucket.group(1):
            le = re.search(r'le="([^"]+)"', bucket.group(1))
            assert le, line
            out["prepare_buckets"][float(le.group(1))] = float(bucket.group(2))
    return out


def histogram_quantile(q: float, buckets: dict[float, float]) -> float:
    """Prometheus' histogram_quantile over cumulative ``le`` -> count: linear interpolation inside
    the bucket holding the rank, the first bucket starting at 0."""
    bounds = sorted(buckets)
    total = buckets[bounds[-1]]
    rank = q * total
    lower, below = 0.0, 0.0
    for le in bounds:
        count = buckets[le]
        if count >= rank:
            if le == float("inf"):
                return lower
            return lower + (le - lower) * (rank - below) / (count - below)
        lower, below = le, count
    return lower


def sink_driver_seconds(port: int) -> list[float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/driver", timeout=10) as resp:
        return list(json.loads(resp.read()))


def one_round(client: KubeClient, sim: KubeletSim, calls: Calls, pods: int, first: int) -> dict[str, Any]:
    calls.take()
    for i in range(pods):
        client.send_json("POST", f"/api/v1/namespaces/{NAMESPACE}/pods", workload_pod(first + i))
    wait("all pods prepared", lambda: sum(1 for c in calls.calls if c[0] == "NodePrepareResources") >= pods)
    wait("all pods running", lambda: len(sim.pods.prepared_pods()) >= pods)
    prepares = calls.take()
    for i in range(pods):
        try:
            client.request("DELETE", f"/api/v1/namespaces/{NAMESPACE}/pods/worker-{first + i}")
        except ApiError as exc:
            if exc.status != 404:
                raise
    wait("all pods gone", lambda: pods_left(client) == 0)
    unprepares = calls.take()
    prep = [c for c in prepares if c[0] == "NodePrepareResources"]
    span = max(c[3] for c in prep) - min(c[3] - c[2] for c in prep)
    return {
        "prepare_s": [c[2] for c in prep],
        "unprepare_s": [c[2] for c in unprepares if c[0] == "NodeUnprepareResources"],
        "claims_per_s": len(prep) / span,
    }


def summarize(rounds: list[dict[str, Any]], cpu: float) -> dict[str, Any]:
    prep = [x for r in rounds for x in r["prepare_s"]]
    unprep = [x for r in rounds for x in r["unprepare_s"]]
    ms = lambda v: round(v * 1000, 2)  # noqa: E731
    inside = [r["in_plugin"] for r in rounds if r.get("in_plugin")]
    mean = lambda op: sum(i[f"{op}_sum"] for i in inside) / max(1, sum(i[f"{op}_count"] for i in inside))  # noqa: E731
    buckets: dict[float, float] = {}
    for i in inside:
        for le, count in i["prepare_buckets"].items():
            buckets[le] = buckets.get(le, 0.0) + count
    driver = [x for r in rounds for x in r.get("driver_s", [])]
    exact = {}
    if driver:
        exact = {
            "driver_prepare_p50_ms": ms(statistics.median(driver)),
            "driver_prepare_p99_ms": ms(percentile(driver, 0.99)),
        }
    return {
        "in_plugin_prepare_mean_ms": ms(mean("prepare")),
        "in_plugin_prepare_histogram_p50_ms": ms(histogram_quantile(0.5, buckets)),
        "in_plugin_prepare_histogram_p99_ms": ms(histogram_quantile(0.99, buckets)),
        "in_plugin_prepare_share_under_5ms": round(buckets[0.005] / buckets[float("inf")], 4),
        **exact,
        "in_plugin_unprepare_mean_ms": ms(mean("unprepare")),
        "claims": len(prep),
        "prepare_p50_ms": ms(statistics.median(prep)),
        "prepare_p99_ms": ms(percentile(prep, 0.99)),
        "unprepare_p50_ms": ms(statistics.median(unprep)),
        "unprepare_p99_ms": ms(percentile(unprep, 0.99)),
        "claims_per_s": round(statistics.median(r["claims_per_s"] for r in rounds), 1),
        "plugin_cpu_ms_per_claim": ms(cpu / len(prep)),
    }


def main() -> int:
    # The real-kubelet mode has its own options (bench/plugin_real.py): hand it the rest.
    early = argparse.ArgumentParser(add_help=False)
    early.add_argument("--kubelet", choices=("emulator", "real"), default="emulator")
    known, rest = early.parse_known_args()
    if known.kubelet == "real":
        from bench.plugin_real import main as real_main

        return real_main(rest)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--kubelet",
        choices=("emulator", "real"),
        default="emulator",
        help="emulator (default): otel-dra kubelet-sim; real: a real kubelet + containerd node, "
        "side by side with the upstream Go driver (root; see bench/plugin_real.py)",
    )
    parser.add_argument("--rounds", type=int, default=6, help="rounds in all, alternating tracing off/on")
    parser.add_argument("--pods", type=int, default=48)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument(
        "--pin",
        action="store_true",
        help="the plugin alone on CPU 1, everything else (control plane, emulator, sink) on CPU 0, "
        "as on a real node, where the control plane does not share the plugin's CPUs",
    )
    args = parser.parse_args()
    prefix: list[str] = []
    if args.pin:
        os.sched_setaffinity(0, {0})  # inherited by every process started from here on
        prefix = ["taskset", "-c", "1"]
    sink_port = free_port()
    sink = subprocess.Popen([sys.executable, "-m", "bench.sink", str(sink_port)], stdout=subprocess.PIPE, text=True)
    rounds: dict[str, list[dict[str, Any]]] = {"off": [], "on": []}
    cpu = {"off": 0.0, "on": 0.0}
    try:
        with (
            tempfile.TemporaryDirectory(prefix="otel-dra-bench-plugin-") as tmp,
            running(Path(tmp) / "testbed", scheduler=True, controller_manager=True, binaries=find_binaries()) as tb,
        ):
            kubeconfig = str(tb.kubeconfig)
            client = KubeClient(load_credentials(kubeconfig))
            apply_all(client, demo_objects())
            calls = Calls()
            registry = Path(tmp) / "nodes" / NODE / "plugins_registry"
            sim = KubeletSim(client, {NODE: registry}, workers=8, on_rpc=calls).start()
            try:
                first = 0
                # Round -1 warms up (first connections, imports, page cache) and is not counted.
                for r in range(-1, args.rounds):
                    variant = "on" if r >= 0 and r % 2 else "off"
                    # Off: no OTLP endpoint at all (nothing exported); on: every span exported.
                    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
                    if variant == "on":
                        env["OTEL_EXPORTER_OTLP_PROTOCOL"] = "http/protobuf"
                        env["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"] = f"http://127.0.0.1:{sink_port}/v1/traces"
                        env["OTEL_TRACES_SAMPLER"] = "always_on"
                    metrics_port = free_port()
                    plugin = start_plugin(
                        NODE, Path(tmp) / "nodes", kubeconfig, metrics_port, env=env, num_devices=DEVICES, prefix=prefix
                    )
                    try:
                        wait("plugin registered", lambda: sim.watchers[NODE].plugin("gpu.example.com") is not None, 60)
                        before = cpu_seconds(plugin.process.pid)
                        result = one_round(client, sim, calls, args.pods, first)
                        cpu[variant] += cpu_seconds(plugin.process.pid) - before
                        result["in_plugin"] = in_plugin(metrics_port)
                        if variant == "on":
                            plugin.stop()  # flushes the last spans to the sink
                            result["driver_s"] = sink_driver_seconds(sink_port)
                    finally:
                        plugin.stop()
                        wait("plugin deregistered", lambda: sim.watchers[NODE].plugin("gpu.example.com") is None, 30)
                    first += args.pods
                    if r < 0:
                        continue
                    rounds[variant].append(result)
                    print(
                        variant,
                        {k: v for k, v in summarize([result], 0.0).items() if k != "plugin_cpu_ms_per_claim"},
                        flush=True,
                    )
            finally:
                sim.stop()
    finally:
        sink.terminate()
        sink.wait()
    out = {
        "machine": machine(),
        "date": time.strftime("%Y-%m-%d"),
        "pinned": args.pin,
        "pods_per_round": args.pods,
        "rounds_per_variant": args.rounds // 2,
        "tracing_off": summarize(rounds["off"], cpu["off"]),
        "tracing_on": summarize(rounds["on"], cpu["on"]),
    }
    off, on = out["tracing_off"], out["tracing_on"]
    out["tracing_overhead_p50"] = round(on["prepare_p50_ms"] / off["prepare_p50_ms"] - 1, 3)
    out["tracing_overhead_p99"] = round(on["prepare_p99_ms"] / off["prepare_p99_ms"] - 1, 3)
    print(json.dumps(out, indent=2))
    if args.json:
        write_json(args.json, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
