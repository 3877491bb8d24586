"""Scale benchmark (issue #5): workload L and the 1k/10k/100k scaling series, in one run.

    python -m bench.scale --claims 1000 10000 100000 [--json bench/results/scale/scale.json]

Per size, on a fresh testbed loaded with bench/workload.py (100 namespaces, 50 DeviceClasses,
claims/10 slices of 8 NVIDIA-shaped GPUs, every claim allocated and reserved by one pod, and that
Pod object, bound and running, with its device's health; ``--no-pods``: no Pod objects, the
workload of the runs before issue 13's pod families):

A. exporter, Prometheus only: initial sync, scrape latency (curl, plain and gzip), API requests
   per scrape, RSS, the exporter's own collection time and CPU (self-metrics);
B. the same exporter under 200 status changes/s (bench/churn.py): scrape latency, and the lag from a
   write returning to the change being visible in /metrics (probe writes on one claim);
C. the list-per-scrape baseline (bench/baseline.py): list the three resources and render;
D. exporter with OTLP push every 10 s (--otlp-interval) to a sink (bench/sink.py): CPU and wall
   time per push (from self-metrics), scrape latency while pushes run (120 s back to back,
   --overlap-seconds, then 60 s spaced 0.5 s apart), RSS;
E. the exporter of A under 100 re-allocations/s (bench/churn.py realloc: each deallocates a claim
   and allocates it on another device, which moves device allocation, counters and pool counts):
   scrape latency, collection time, and the lag from a re-allocation to the pool aggregate
   (kube_resourcepool_devices_allocated) showing it.

``--families all,seed`` runs phase A once more per further family set (seed: only the seven seed
families, ``--metric-allowlist``; that exporter watches no pods), on the same loaded testbed, before
the first set's phase A.

``--exporter-path DIR`` runs the exporter processes from another source tree (put first on
PYTHONPATH), e.g. an export of an older commit, to compare two versions with the same harness.
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
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench import write_json
from bench.baseline import scrape_once
from bench.exporter import Exporter, api_requests, free_port, get, machine, percentile
from bench.workload import DRIVER, Workload, load
from otel_dra.cluster.exporter import SEED_FAMILIES, all_families
from otel_dra.fixtures import create
from otel_dra.kube.client import KubeClient, load_credentials
from otel_dra.testbed import find_binaries, running
from otel_dra.testbed.build import kubernetes_release


def curl_time(port: int, gzip: bool = False) -> float:
    cmd = [
        *PIN["scraper"],
        "curl",
        "-s",
        "-o",
        "/dev/null",
        "-w",
        "%{http_code} %{time_total}",
        f"http://127.0.0.1:{port}/metrics",
    ]
    if gzip:
        cmd[-1:-1] = ["-H", "Accept-Encoding: gzip"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.split()
    assert out[0] == "200", out
    return float(out[1])


def scrapes(port: int, count: int, gzip: bool = False) -> dict[str, float]:
    times = [curl_time(port, gzip) for _ in range(count)]
    return {"p50_ms": round(statistics.median(times) * 1000, 1), "p95_ms": round(percentile(times, 0.95) * 1000, 1)}


def self_metric(port: int, name: str, exporter: str) -> tuple[float, float]:
    """(sum, count) of one of the exporter's histograms."""
    _code, body = get(f"http://127.0.0.1:{port}/metrics")
    text = body.decode()
    total = count = 0.0
    for kind in ("sum", "count"):
        m = re.search(rf'^{name}_{kind}{{exporter="{exporter}"}} (\S+)$', text, re.M)
        if m:
            if kind == "sum":
                total = float(m[1])
            else:
                count = float(m[1])
    return total, count


# --pin: the exporter runs on CPU 0 and the OTLP sink on CPU 1, so that a receiver on the same
# machine does not take the exporter's CPU (as a Collector on another node would not).
# --pin-scraper: once synced (the sync itself runs unpinned), the exporter on CPU 0 and the scraping
# curl on CPU 1, so that the client's share of a loopback transfer does not land on the exporter's
# core and where the kernel places the two does not decide the figure (bench/sendpath.py;
# Prometheus runs on another machine).
PIN: dict[str, list[str]] = {"exporter": [], "sink": [], "scraper": []}
# Phase D: the OTLP export interval, and how long scrapes run back to back against the pushes.
OVERLAP = {"interval": 10.0, "seconds": 120.0}
# Environment of the exporter processes (--exporter-path).
EXPORTER_ENV: dict[str, str] = {}


def series_counts(body: bytes) -> dict[str, Any]:
    """Samples served, split into the seven seed families, the families beyond the seed, and the rest
    (self-metrics, target_info)."""
    seed = {f.prom_name for f in SEED_FAMILIES}
    beyond = {f.prom_name for f in all_families()} - seed
    by_family: dict[str, int] = {}
    other = 0
    for line in body.splitlines():
        if not line or line.startswith(b"#"):
            continue
        name = line.split(b"{", 1)[0].split(b" ", 1)[0].decode()
        if name in seed or name in beyond:
            by_family[name] = by_family.get(name, 0) + 1
        else:
            other += 1
    return {
        "series_seed": sum(v for k, v in by_family.items() if k in seed),
        "series_beyond_seed": sum(v for k, v in by_family.items() if k in beyond),
        "series_other": other,
        "series_beyond_seed_by_family": {k: v for k, v in sorted(by_family.items()) if k in beyond},
    }


def cache_objects(body: bytes) -> dict[str, int]:
    """Objects in the exporter's cache by watched resource (otel_dra_cache_objects): which resources
    it watches (the seed-only exporter must not watch pods)."""
    out = {}
    for m in re.finditer(rb'^otel_dra_cache_objects\{[^}]*resource="([^"]+)"[^}]*\} (\S+)$', body, re.M):
        out[m[1].decode()] = int(float(m[2]))
    return dict(sorted(out.items()))


def realloc_probes(admin: KubeClient, port: int, count: int) -> list[float]:
    """Seconds from re-allocating claim 0 (to the probe slice's device and back) to /metrics
    showing it: in the seed family kube_resourceclaim_status_allocated_device and, where the
    exporter serves it, in the probe pool's kube_resourcepool_devices_allocated (the whole join
    path, claim -> slice -> pool)."""
    path = "/apis/resource.k8s.io/v1/namespaces/bench-000/resourceclaims/claim-000000/status"
    original = admin.get_json(path)["status"]["allocation"]["devices"]["results"]
    probe = [{"request": "gpu", "driver": DRIVER, "pool": "probe", "device": "probe-0"}]
    joins = b"kube_resourcepool_devices_allocated{" in get(f"http://127.0.0.1:{port}/metrics")[1]
    lags = []
    for i in range(count):
        results = probe if i % 2 == 0 else original
        r = results[0]
        claim = f'device_name="{r["device"]}",driver="{DRIVER}",namespace="bench-000",pool="{r["pool"]}"'
        needles = [f'kube_resourceclaim_status_allocated_device{{{claim},resourceclaim_name="claim-000000"}} 1.0']
        if joins:
            labels = f'driver="{DRIVER}",node_name="probe-node",pool="probe"'
            needles.append(f"kube_resourcepool_devices_allocated{{{labels}}} {1.0 if i % 2 == 0 else 0.0}")
        release = {"status": {"allocation": None, "reservedFor": None}}
        admin.send_json("PATCH", path, release, content_type="application/merge-patch+json")
        body = {"status": {"allocation": {"devices": {"results": results}}}}
        admin.send_json("PATCH", path, body, content_type="application/merge-patch+json")
        written = time.monotonic()
        while True:
            code, payload = get(f"http://127.0.0.1:{port}/metrics")
            if code == 200 and all(n.encode() in payload for n in needles):
                lags.append(time.monotonic() - written)
                break
            if time.monotonic() - written > 60:
                raise RuntimeError("re-allocation never became visible")
        time.sleep(0.5)
    return lags


def probe_slice() -> dict[str, Any]:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": "probe-node-gpu.nvidia.com"},
        "spec": {
            "driver": DRIVER,
            "nodeName": "probe-node",
            "pool": {"name": "probe", "generation": 1, "resourceSliceCount": 1},
            "devices": [{"name": "probe-0"}],
        },
    }


def lag_probes(admin: KubeClient, port: int, count: int) -> list[float]:
    """Seconds from a status write returning to the change showing in /metrics."""
    path = "/apis/resource.k8s.io/v1/namespaces/bench-000/resourceclaims/claim-000000/status"
    lags = []
    for i in range(count):
        name = f"probe-{i}-{int(time.time())}"
        body = {
            "status": {"reservedFor": [{"resource": "pods", "name": name, "uid": f"00000000-0000-4000-9000-{i:012d}"}]}
        }
        admin.send_json("PATCH", path, body, content_type="application/merge-patch+json")
        written = time.monotonic()
        needle = f'pod_name="{name}"'.encode()
        while True:
            code, payload = get(f"http://127.0.0.1:{port}/metrics")
            if code == 200 and needle in payload:
                lags.append(time.monotonic() - written)
                break
            if time.monotonic() - written > 60:
                raise RuntimeError("probe change never became visible")
        time.sleep(0.5)
    return lags


def churn_phase(
    r: dict[str, Any],
    name: str,
    ex: Exporter,
    admin: KubeClient,
    scrape_count: int,
    kubeconfig: str,
    churn_args: list[str],
    probes: Callable[[KubeClient, int, int], list[float]],
) -> None:
    """Scrapes, collection time, lag (``probes``) and RSS while bench/churn.py runs with
    ``churn_args``; results go into ``r`` under keys starting with ``name``."""
    churn = subprocess.Popen(
        [sys.executable, "-m", "bench.churn", kubeconfig, str(r["claims"]), *churn_args],
        stdout=subprocess.PIPE,
        text=True,
    )
    time.sleep(5)
    s0, c0 = self_metric(ex.port, "otel_dra_collection_duration_seconds", "prometheus")
    r[f"{name}_scrape"] = scrapes(ex.port, scrape_count)
    s1, c1 = self_metric(ex.port, "otel_dra_collection_duration_seconds", "prometheus")
    r[f"{name}_collection_ms_mean"] = round(1000 * (s1 - s0) / max(1.0, c1 - c0), 2)
    lags = probes(admin, ex.port, 10)
    r[f"{name}_lag_s"] = {"p50": round(statistics.median(lags), 3), "max": round(max(lags), 3)}
    churn.terminate()
    r[f"{name}_rate"] = (churn.communicate(timeout=60)[0] or "").strip()
    r[f"rss_after_{name}_mib"], _ = ex.rss_mib()


def overlap_scrapes(
    port: int, sink_port: int, baseline: dict[str, float], seconds: float, gap: float = 0.0, prefix: str = ""
) -> dict[str, Any]:
    """Scrape while pushes run, ``gap`` seconds apart (0: back to back); split scrapes by whether
    they overlapped a push.

    Back to back, scrapes leave the pusher no gap to step into (see priority.py), so once its
    deferral budget is spent every request overlaps a scrape: a worst case no Prometheus produces
    (one scrape per target per interval). Spaced scrapes show the designed behaviour.
    A push is a burst of POSTs at the sink (gaps under 1 s), widened by 0.2 s at the start to
    cover building the first request."""
    samples = []
    since = time.time()
    end = since + seconds
    while time.time() < end:
        start = time.time()
        samples.append((start, curl_time(port)))
        time.sleep(gap)
    posts = sorted(tuple(w) for w in json.loads(get(f"http://127.0.0.1:{sink_port}/windows")[1]) if w[1] >= since)
    bursts: list[list[float]] = []
    for a, b in posts:
        if bursts and a - bursts[-1][1] < 1.0:
            bursts[-1][1] = max(bursts[-1][1], b)
        else:
            bursts.append([a - 0.2, b])
    overlapped = [t for s, t in samples if any(s < b and s + t > a for a, b in bursts)]
    alone = [t for s, t in samples if not any(s < b and s + t > a for a, b in bursts)]
    out: dict[str, Any] = {"overlap_scrapes": len(overlapped), "alone_scrapes": len(alone)}
    if overlapped:
        out["overlap_p50_ms"] = round(statistics.median(overlapped) * 1000, 1)
        out["overlap_p95_ms"] = round(percentile(overlapped, 0.95) * 1000, 1)
        out["overlap_slowdown_p50"] = round(out["overlap_p50_ms"] / baseline["p50_ms"], 2)
    if alone:
        out["alone_p50_ms"] = round(statistics.median(alone) * 1000, 1)
        out["alone_p95_ms"] = round(percentile(alone, 0.95) * 1000, 1)
    return {prefix + k: v for k, v in out.items()}


# --families: what the exporter serves, as environment (phase A runs once per set, B-E with the first).
SEED_ALLOWLIST = ",".join(f.prom_name for f in SEED_FAMILIES)
FAMILY_SETS: dict[str, dict[str, str]] = {"all": {}, "seed": {"OTEL_DRA_METRIC_ALLOWLIST": SEED_ALLOWLIST}}


def phase_a(
    r: dict[str, Any], n: int, k: int, kubeconfig: str, admin: KubeClient, workdir: Path, families: str
) -> Exporter:
    """Phase A into ``r`` with the exporter serving the family set ``families``: initial sync,
    scrapes plain and gzip, API requests per scrape, series, collection time, RSS. Returns the
    running exporter."""
    env = {**EXPORTER_ENV, **FAMILY_SETS[families]}
    ex = Exporter(kubeconfig, workdir / f"exporter-{families}-{n}.log", prefix=PIN["exporter"], env=env)
    r["families"] = families
    r["initial_sync_s"] = round(ex.wait_ready(), 2)
    if PIN["scraper"]:  # the sync ran unpinned; the scrapes with the exporter on CPU 0, all threads
        subprocess.run(["taskset", "-a", "-p", "-c", "0", str(ex.proc.pid)], check=True, capture_output=True)
    for _ in range(2):
        curl_time(ex.port)
    before = api_requests(admin)
    r["scrape"] = scrapes(ex.port, k)
    r["scrape_gzip"] = scrapes(ex.port, k, gzip=True)
    r["api_requests_per_scrape"] = (api_requests(admin) - before) / (2 * k)
    _code, body = get(f"http://127.0.0.1:{ex.port}/metrics")
    r["series"] = sum(1 for line in body.splitlines() if line and not line.startswith(b"#"))
    r.update(series_counts(body))
    r["cache_objects"] = cache_objects(body)
    r["body_mb"] = round(len(body) / 1e6, 1)
    s, c = self_metric(ex.port, "otel_dra_collection_duration_seconds", "prometheus")
    cs, cc = self_metric(ex.port, "otel_dra_collection_cpu_time_seconds", "prometheus")
    r["collection_ms_mean"] = round(1000 * s / c, 2)
    r["collection_cpu_ms_mean"] = round(1000 * cs / cc, 2)
    r["rss_mib"], r["peak_rss_mib"] = ex.rss_mib()
    print(f"[{n}] A ({families}) {r['scrape']} gzip {r['scrape_gzip']} rss {r['rss_mib']}", flush=True)
    return ex


def otlp_phase(r: dict[str, Any], n: int, k: int, kubeconfig: str, workdir: Path, families: str) -> None:
    """Phase D into ``r``: an exporter serving ``families`` and pushing OTLP to a sink, scraped meanwhile."""
    sink_port = free_port()
    sink = subprocess.Popen([*PIN["sink"], sys.executable, "-m", "bench.sink", str(sink_port)])
    ex = Exporter(
        kubeconfig,
        workdir / f"exporter-otlp-{n}.log",
        env={
            **EXPORTER_ENV,
            **FAMILY_SETS[families],
            "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{sink_port}",
            "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
            "OTEL_METRIC_EXPORT_INTERVAL": str(int(OVERLAP["interval"] * 1000)),
        },
        prefix=PIN["exporter"],
    )
    r["otlp_initial_sync_s"] = round(ex.wait_ready(), 2)
    deadline = time.monotonic() + 600
    while self_metric(ex.port, "otel_dra_collection_duration_seconds", "otlp")[1] < 2:
        if time.monotonic() > deadline:
            raise RuntimeError("no OTLP pushes")
        time.sleep(1)
    r["otlp_scrape"] = scrapes(ex.port, k)
    r.update(overlap_scrapes(ex.port, sink_port, r["scrape"], seconds=OVERLAP["seconds"]))
    r.update(overlap_scrapes(ex.port, sink_port, r["scrape"], seconds=60, gap=0.5, prefix="spaced_"))
    r["otlp_interval_s"] = OVERLAP["interval"]
    s, c = self_metric(ex.port, "otel_dra_collection_duration_seconds", "otlp")
    cs, cc = self_metric(ex.port, "otel_dra_collection_cpu_time_seconds", "otlp")
    r["otlp_push_wall_s_mean"] = round(s / c, 3)
    r["otlp_push_cpu_s_mean"] = round(cs / cc, 3)
    r["otlp_pushes"] = int(c)
    r["otlp_bytes_received"] = int(json.loads(get(f"http://127.0.0.1:{sink_port}/")[1] or b"0"))
    r["otlp_scrape_slowdown"] = round(r["otlp_scrape"]["p50_ms"] / r["scrape"]["p50_ms"], 2)
    r["otlp_rss_mib"], r["otlp_peak_rss_mib"] = ex.rss_mib()
    ex.stop()
    sink.terminate()
    print(f"[{n}] D push {r['otlp_push_cpu_s_mean']} s CPU, scrape {r['otlp_scrape']}", flush=True)


def run_size(
    n: int,
    k: int,
    workdir: Path,
    phases: str = "ABCD",
    families: tuple[str, ...] = ("all",),
    pods: bool = True,
) -> dict[str, Any]:
    w = Workload(claims=n, namespaces=100, classes=50, pods=pods)
    r: dict[str, Any] = {
        "claims": n,
        "pods": n if pods else 0,
        "slices": w.slices,
        "devices": w.devices,
        "classes": w.classes,
        "seed_series": w.expected_series(),
        "pod_series": w.expected_pod_series(),
    }
    with running(workdir / f"tb-{n}", binaries=find_binaries()) as tb:
        kubeconfig = str(tb.kubeconfig)
        admin = KubeClient(load_credentials(kubeconfig), max_connections=32)
        times: dict[str, float] = {}
        r["load_s"] = round(load(admin, w, concurrency=16, times=times), 1)
        r.update({f"load_{step}": round(seconds, 1) for step, seconds in times.items()})
        print(f"[{n}] loaded in {r['load_s']}s {times}", flush=True)

        # A with the other family sets first (one exporter at a time), then with the first one,
        # whose exporter phases B and E go on measuring.
        for name in families[1:]:
            phase_a(r.setdefault(f"families_{name}", {}), n, k, kubeconfig, admin, workdir, name).stop()
        ex = phase_a(r, n, k, kubeconfig, admin, workdir, families[0])

        if "B" not in phases and "E" not in phases:
            ex.stop()
        # B: churn at 200 changes/s
        if "B" in phases:
            churn_phase(r, "churn", ex, admin, k, kubeconfig, ["100", "200"], lag_probes)
            print(f"[{n}] B {r['churn_scrape']} lag {r['churn_lag_s']} {r['churn_rate']}", flush=True)

        # E: re-allocation churn at 100 changes/s (two writes each)
        if "E" in phases:
            create(admin, probe_slice())
            time.sleep(2)
            churn_phase(r, "realloc", ex, admin, k, kubeconfig, ["100", "100", "realloc"], realloc_probes)
            print(f"[{n}] E {r['realloc_scrape']} lag {r['realloc_lag_s']} {r['realloc_rate']}", flush=True)
        if "B" in phases or "E" in phases:
            ex.stop()

        # C: baseline
        if "C" in phases:
            base = [scrape_once(admin) for _ in range(3)]
            r["baseline_scrape_ms"] = round(statistics.median(t for t, _ in base) * 1000, 1)
            r["speedup_vs_baseline"] = round(r["baseline_scrape_ms"] / r["scrape"]["p50_ms"], 1)
            print(f"[{n}] C baseline {r['baseline_scrape_ms']} ms", flush=True)

        # D: OTLP push every OVERLAP['interval'] seconds
        if "D" in phases:
            otlp_phase(r, n, k, kubeconfig, workdir, families[0])
    return r


def exporter_pythonpath(tree: Path) -> str:
    """PYTHONPATH that makes ``python -m otel_dra`` import the package from ``tree``. PYTHONPATH
    alone is not enough: an editable install maps ``otel_dra`` with a meta-path finder, and ``-m``
    puts the working directory first on sys.path. A sitecustomize (run after .pth files) replaces
    the editable finder with one for ``tree``."""
    boot = Path(tempfile.mkdtemp(prefix="otel-dra-boot-"))
    (boot / "sitecustomize.py").write_text(
        f"""import sys
from importlib.machinery import PathFinder


class _Tree:
    @classmethod
    def find_spec(cls, fullname, path=None, target=None):
        return PathFinder.find_spec(fullname, [{str(tree)!r}]) if fullname == "otel_dra" else None


sys.meta_path[:] = [_Tree] + [f for f in sys.meta_path if not getattr(f, "__module__", "").startswith("__editable__")]
"""
    )
    return str(boot)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--claims", type=int, nargs="+", default=[1000, 10000, 100000])
    parser.add_argument("--scrapes", type=int, default=20)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--phases", default="ABCDE", help="which of the phases A-E to run (A always runs)")
    parser.add_argument("--exporter-path", type=Path, default=None, help="run the exporter from this source tree")
    parser.add_argument("--pin", action="store_true", help="exporter on CPU 0, OTLP sink on CPU 1 (taskset)")
    parser.add_argument("--pin-scraper", action="store_true", help="exporter on CPU 0, curl on CPU 1 (taskset)")
    parser.add_argument(
        "--pods",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="create one Pod per claim (default; --no-pods: the workload of the runs before issue 13's pod families)",
    )
    parser.add_argument(
        "--families",
        default="all",
        help="comma-separated family sets (all; seed: --metric-allowlist of the seven seed families): phase A runs "
        "once per set, the other phases with the first",
    )
    # A push of workload L takes 2-5 s: at a 10 s interval, 120 s of back-to-back scrapes give
    # hundreds of scrapes both overlapping a push and not, interleaved in time (at 3 s and 25 s,
    # as first, pushes ran most of the time and the few non-overlapping scrapes made p95 noisy).
    parser.add_argument("--otlp-interval", type=float, default=10.0, help="phase D: OTLP export interval, seconds")
    parser.add_argument(
        "--overlap-seconds", type=float, default=120.0, help="phase D: seconds of back-to-back scrapes against pushes"
    )
    args = parser.parse_args()
    if args.pin:
        PIN.update(exporter=["taskset", "-c", "0"], sink=["taskset", "-c", "1"])
    if args.pin_scraper:
        PIN.update(scraper=["taskset", "-c", "1"])
    OVERLAP.update(interval=args.otlp_interval, seconds=args.overlap_seconds)
    if args.exporter_path:
        EXPORTER_ENV["PYTHONPATH"] = exporter_pythonpath(args.exporter_path.resolve())
    results: dict[str, Any] = {
        "machine": machine(),
        "date": time.strftime("%Y-%m-%d"),
        "pinned": args.pin,
        "scraper_pinned": args.pin_scraper,
        "exporter_path": str(args.exporter_path) if args.exporter_path else None,
        "kubernetes": kubernetes_release().version,
        "runs": [],
    }
    with tempfile.TemporaryDirectory(prefix="otel-dra-scale-") as tmp:
        for n in args.claims:
            run = run_size(n, args.scrapes, Path(tmp), args.phases, tuple(args.families.split(",")), args.pods)
            print(json.dumps(run), flush=True)
            results["runs"].append(run)
            if args.json:
                write_json(args.json, results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
