"""Soak benchmark (issue 15, item 6): one exporter with OTLP on, under steady churn, for a long time.

    python -m bench.soak --claims 10000 --rate 200 --minutes 30 [--json bench/results/soak/soak.json] [--plot PNG]

The PNG (RSS, scrape latency and changes per second over time) goes to ``--plot``, by default beside
``--json`` with the same name (bench/results/soak/soak.png), so the picture is always the run's own.

On a fresh testbed (kube-apiserver + etcd) loaded with bench/workload.py, `otel-dra exporter` runs
as its own process, pushing OTLP/HTTP every ``--otlp-interval`` seconds to a sink process
(bench/sink.py, as in bench.scale's phase D), while bench/churn.py patches ``--rate`` random claim
statuses per second (a new reserving pod each: new label values all the time) for ``--minutes``
minutes counted from the exporter being ready. Meanwhile:

- every ``--sample-seconds``: the exporter's RSS, threads, open file descriptors and CPU time
  (/proc), the machine's load average, and the OTLP pushes the exporter logged so far (it runs
  with ``--log-level debug``, which logs one ``OTLP state push: ... ok=True|False`` line per push);
- every ``--scrape-seconds`` (fixed rate, as Prometheus scrapes): one full plain ``GET /metrics``
  with curl (a new connection each, timed to the last byte);
- every ``--stats-seconds``: one untimed scrape read for the exporter's self-metrics (claim watch
  events: the changes it actually saw; pushes and their CPU).

Reported: scrape p50 / p95 per ``--window-minutes`` window, changes applied per second, OTLP
exports ok / failed, threads and fds ranges, and the **RSS slope after warm-up**: least squares
over the samples after ``--warmup-minutes``, in MiB per 10 minutes, against the target of
≤ 1 MiB per 10 minutes (``--slope-limit``), also for a few other warm-ups so that the choice
can be judged.
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import math
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench import write_json
from bench.exporter import Exporter, curl_scrape, free_port, get, machine, percentile
from bench.scale import exporter_pythonpath
from bench.workload import Workload, load
from otel_dra.kube.client import KubeClient, load_credentials
from otel_dra.testbed import find_binaries, running
from otel_dra.testbed.build import kubernetes_release

# --- the arithmetic (tests/unit/test_bench_soak.py) --------------------------------------------------

TEN_MINUTES = 600.0


def least_squares(points: Sequence[tuple[float, float]]) -> tuple[float, float, float]:
    """(slope, intercept, standard error of the slope) of the least-squares line through
    ``points`` (x, y). Needs at least two distinct x; the error needs three points."""
    n = len(points)
    if n < 2:
        raise ValueError("a slope needs at least two points")
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    if sxx == 0:
        raise ValueError("a slope needs two distinct x")
    slope = sum((x - mx) * (y - my) for x, y in points) / sxx
    intercept = my - slope * mx
    if n < 3:
        return slope, intercept, math.nan
    residual = sum((y - (intercept + slope * x)) ** 2 for x, y in points)
    return slope, intercept, math.sqrt(residual / (n - 2) / sxx)


def after_warmup(points: Sequence[tuple[float, float]], warmup_s: float) -> list[tuple[float, float]]:
    """The points at or after ``warmup_s`` (x in seconds from the start)."""
    return [(x, y) for x, y in points if x >= warmup_s]


def rss_slope(points: Sequence[tuple[float, float]], warmup_s: float) -> dict[str, float]:
    """The RSS trend after warm-up: ``points`` are (seconds, MiB); the slope is in MiB per 10
    minutes, with its standard error, over the points at or after ``warmup_s``."""
    kept = after_warmup(points, warmup_s)
    slope, intercept, error = least_squares(kept)
    return {
        "warmup_s": warmup_s,
        "samples": len(kept),
        "from_s": kept[0][0],
        "to_s": kept[-1][0],
        "slope_mib_per_10min": slope * TEN_MINUTES,
        "stderr_mib_per_10min": error * TEN_MINUTES,
        "intercept_mib": intercept,
    }


def verdict(slope_mib_per_10min: float, limit: float) -> str:
    """``met`` when the RSS grows by at most ``limit`` MiB per 10 minutes (a falling RSS is no
    leak), else ``not met``."""
    return "met" if slope_mib_per_10min <= limit else "not met"


def windows(samples: Sequence[tuple[float, float]], window_s: float, end_s: float) -> list[dict[str, Any]]:
    """Per window ``[k * window_s, (k + 1) * window_s)`` up to ``end_s``: the number of
    ``samples`` (t, value) whose t falls in it, and their p50 / p95 (nearest rank, as the other
    benchmarks; None for an empty window). A last partial window is kept when it has samples."""
    out = []
    count = max(1, math.ceil(end_s / window_s - 1e-9))
    for k in range(count):
        lo, hi = k * window_s, (k + 1) * window_s
        values = [v for t, v in samples if lo <= t < hi or (k == count - 1 and t == hi)]
        out.append(
            {
                "from_s": lo,
                "to_s": min(hi, end_s),
                "n": len(values),
                "p50": statistics.median(values) if values else None,
                "p95": percentile(values, 0.95) if values else None,
            }
        )
    return out


def interpolate(counter: Sequence[tuple[float, float]], t: float) -> float:
    """The value of a counter sampled as (t, value), increasing t, at ``t`` inside its range (linear
    between the samples around it)."""
    for (t0, v0), (t1, v1) in itertools.pairwise(counter):
        if t0 <= t <= t1:
            return v0 if t1 == t0 else v0 + (v1 - v0) * (t - t0) / (t1 - t0)
    raise ValueError(f"{t} is outside the samples")


def rates(counter: Sequence[tuple[float, float]], window_s: float, end_s: float) -> list[dict[str, Any]]:
    """Per window of ``window_s`` up to ``end_s``: the rate of a monotonic counter sampled as (t,
    value), over the part of the window the samples cover (interpolated at its ends); None where
    they cover none of it."""
    out = []
    count = max(1, math.ceil(end_s / window_s - 1e-9))
    for k in range(count):
        lo, hi = k * window_s, min((k + 1) * window_s, end_s)
        rate = None
        if len(counter) >= 2:
            a, b = max(lo, counter[0][0]), min(hi, counter[-1][0])
            if b > a:
                rate = (interpolate(counter, b) - interpolate(counter, a)) / (b - a)
        out.append({"from_s": lo, "to_s": hi, "per_s": rate})
    return out


# --- measuring -------------------------------------------------------------------------------------

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
PUSH_LINE = re.compile(rb"OTLP state push: ([\d.]+)s wall, ([\d.]+)s CPU, ok=(True|False)")


def proc_sample(pid: int) -> dict[str, float]:
    """The process's RSS, its anonymous and file-backed parts and its peak (MiB), threads, open fds
    and CPU seconds (user + system). The parts tell a heap that shrinks from code and library pages
    the kernel reclaimed (file-backed, read again from disk when touched)."""
    out: dict[str, float] = {}
    names = {"VmRSS": "rss_mib", "VmHWM": "hwm_mib", "RssAnon": "rss_anon_mib", "RssFile": "rss_file_mib"}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in names:
            out[names[key]] = round(int(value.split()[0]) / 1024, 2)
        elif key == "Threads":
            out["threads"] = int(value)
    out["fds"] = len(os.listdir(f"/proc/{pid}/fd"))
    stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    out["cpu_s"] = round((int(stat[11]) + int(stat[12])) / CLOCK_TICKS, 2)  # utime, stime
    return out


class PushLog:
    """Counts the exporter's ``OTLP state push`` debug lines as its log grows."""

    def __init__(self, path: Path) -> None:
        self._file = open(path, "rb")  # noqa: SIM115 - closed in close()
        self._rest = b""
        self.ok = self.failed = 0
        self.cpu_s = self.wall_s = 0.0
        self.errors = 0  # "OTLP export of cluster state failed" (an exception in the pusher)

    def poll(self) -> None:
        data = self._rest + self._file.read()
        *lines, self._rest = data.split(b"\n")
        for line in lines:
            m = PUSH_LINE.search(line)
            if m:
                self.wall_s += float(m[1])
                self.cpu_s += float(m[2])
                if m[3] == b"True":
                    self.ok += 1
                else:
                    self.failed += 1
            elif b"OTLP export of cluster state failed" in line:
                self.errors += 1

    def close(self) -> None:
        self._file.close()


def self_metrics(body: bytes) -> dict[str, float]:
    """From a /metrics body: claim watch events by type, and the OTLP collection count, sum and CPU."""
    out: dict[str, float] = {}
    for m in re.finditer(rb"^otel_dra_watch_events_total\{([^}]*)\} (\S+)$", body, re.M):
        labels = m[1].decode()
        if 'resource="resourceclaims"' in labels:
            kind = re.search(r'type="([^"]+)"', labels)
            if kind:
                out[f"claim_events_{kind[1].lower()}"] = float(m[2])
    for m in re.finditer(rb"^otel_dra_(relists|watch_errors|list_errors)_total\{[^}]*\} (\S+)$", body, re.M):
        key = m[1].decode()
        out[key] = out.get(key, 0.0) + float(m[2])
    for name, key in (
        ("otel_dra_collection_duration_seconds_count", "otlp_pushes"),
        ("otel_dra_collection_duration_seconds_sum", "otlp_wall_s"),
        ("otel_dra_collection_cpu_time_seconds_sum", "otlp_cpu_s"),
        ("otel_dra_collection_duration_seconds_count", "prometheus_collections"),
        ("otel_dra_collection_duration_seconds_sum", "prometheus_wall_s"),
        ("otel_dra_collection_cpu_time_seconds_sum", "prometheus_cpu_s"),
    ):
        exporter = "prometheus" if key.startswith("prometheus") else "otlp"
        m = re.search(rb"^" + name.encode() + rb'\{exporter="' + exporter.encode() + rb'"\} (\S+)$', body, re.M)
        if m:
            out[key] = float(m[1])
    return out


def loadavg() -> float:
    return float(Path("/proc/loadavg").read_text().split()[0])


def watches_ended(admin: KubeClient) -> dict[str, float]:
    """WATCH requests the API server has finished, by resource (apiserver_request_total counts a
    request when it ends): each is one watch the exporter had to start again."""
    out: dict[str, float] = {}
    for m in re.finditer(
        r'^apiserver_request_total\{([^}]*verb="WATCH"[^}]*)\} (\S+)$',
        admin.request("GET", "/metrics").data.decode(),
        re.M,
    ):
        resource = re.search(r'resource="([^"]*)"', m[1])
        if resource:
            key = f"watches_ended_{resource[1]}"
            out[key] = out.get(key, 0.0) + float(m[2])
    return out


def soak(
    ex: Exporter, args: argparse.Namespace, kubeconfig: str, w: Workload, sink_port: int, admin: KubeClient
) -> dict[str, Any]:
    """The soak itself, from the exporter being ready: samples, scrapes, stats, for ``args.minutes``."""
    duration = args.minutes * 60
    pushes = PushLog(Path(ex.log.name))
    samples: list[dict[str, Any]] = []
    scrapes: list[dict[str, Any]] = []
    stats: list[dict[str, Any]] = []
    t0, t0_wall = time.monotonic(), time.time()
    stop = threading.Event()

    def sample() -> None:
        k = 0
        while not stop.is_set() and ex.proc.poll() is None:
            t = time.monotonic() - t0
            try:
                s: dict[str, Any] = {"t": round(t, 2), **proc_sample(ex.proc.pid), "load1": loadavg()}
            except (FileNotFoundError, ProcessLookupError):
                return
            pushes.poll()
            s.update(otlp_ok=pushes.ok, otlp_failed=pushes.failed, otlp_errors=pushes.errors)
            samples.append(s)
            k += 1
            stop.wait(max(0.0, t0 + k * args.sample_seconds - time.monotonic()))

    sampler = threading.Thread(target=sample, name="soak-sampler")
    sampler.start()
    churn = subprocess.Popen(
        [
            *(sys.executable, "-m", "bench.churn", kubeconfig, str(w.claims), str(w.namespaces), str(args.rate)),
            *("reserve", str(args.churn_workers)),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    churn_out = ""
    try:
        k = 0
        next_stats = 0.0
        while (now := time.monotonic() - t0) < duration:
            if ex.proc.poll() is not None:
                raise RuntimeError(f"the exporter exited ({ex.proc.returncode}); see {ex.log.name}")
            if now >= next_stats:
                code, body = get(f"http://127.0.0.1:{ex.port}/metrics")
                if code == 200:
                    stats.append({"t": round(time.monotonic() - t0, 2), **self_metrics(body), **watches_ended(admin)})
                del body
                next_stats += args.stats_seconds
            code, seconds = curl_scrape(ex.port, 60.0)
            scrapes.append({"t": round(now, 2), "code": code, "s": seconds})
            k += 1
            if k % 12 == 0:
                last = samples[-1] if samples else {}
                print(
                    f"[{now / 60:5.1f} min] scrape {seconds * 1000:.1f} ms, rss {last.get('rss_mib')} MiB, "
                    f"threads {last.get('threads')}, fds {last.get('fds')}, otlp ok {pushes.ok} "
                    f"failed {pushes.failed}, load {last.get('load1')}",
                    flush=True,
                )
            delay = t0 + k * args.scrape_seconds - time.monotonic()
            if delay > 0:
                time.sleep(delay)
        code, body = get(f"http://127.0.0.1:{ex.port}/metrics")
        if code == 200:
            stats.append({"t": round(time.monotonic() - t0, 2), **self_metrics(body), **watches_ended(admin)})
        del body
    finally:
        stop.set()
        sampler.join()
        pushes.poll()
        pushes.close()
        churn.terminate()
        churn_out = (churn.communicate(timeout=120)[0] or "").strip()
    sink_bytes = int(json.loads(get(f"http://127.0.0.1:{sink_port}/")[1] or b"0"))
    sink_posts = len(json.loads(get(f"http://127.0.0.1:{sink_port}/windows")[1] or b"[]"))
    return {
        "duration_s": duration,
        "t0_wall": t0_wall,
        "rate": args.rate,
        "samples": samples,
        "scrapes": scrapes,
        "stats": stats,
        "churn": churn_out,
        "otlp": {
            "pushes_ok": pushes.ok,
            "pushes_failed": pushes.failed,
            "pusher_exceptions": pushes.errors,
            "push_cpu_s_mean": round(pushes.cpu_s / max(1, pushes.ok + pushes.failed), 4),
            "push_wall_s_mean": round(pushes.wall_s / max(1, pushes.ok + pushes.failed), 4),
            "sink_requests": sink_posts,
            "sink_bytes": sink_bytes,
        },
    }


def collection_means(stats: Sequence[dict[str, Any]]) -> dict[str, float | None]:
    """The exporter's own mean time (and CPU) per /metrics body and per OTLP push over the soak,
    from its self-metrics at the first and last stats scrape."""
    out: dict[str, float | None] = {}
    for exporter, count in (("prometheus", "prometheus_collections"), ("otlp", "otlp_pushes")):
        for kind in ("wall", "cpu"):
            key = f"{exporter}_{kind}_s"
            having = [s for s in stats if count in s and key in s]  # the first reads may predate any
            n = having[-1][count] - having[0][count] if len(having) >= 2 else 0
            out[f"{exporter}_{kind}"] = round(1000 * (having[-1][key] - having[0][key]) / n, 2) if n > 0 else None
    return out


def summarize(run: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """The figures of the docs table from a soak's raw samples."""
    samples, scrapes, stats = run["samples"], run["scrapes"], run["stats"]
    duration = run["duration_s"]
    window = args.window_minutes * 60
    rss = [(s["t"], s["rss_mib"]) for s in samples]
    ok_scrapes = [(s["t"], s["s"] * 1000) for s in scrapes if s["code"] == 200]
    warmup = args.warmup_minutes * 60
    slope = rss_slope(rss, warmup)
    post = after_warmup(rss, warmup)
    half = post[len(post) // 2][0] if len(post) > 3 else warmup
    alternatives = {}
    for minutes in sorted({0.0, 2.0, 5.0, 10.0, args.warmup_minutes}):
        if minutes * 60 < duration - 60 and len(after_warmup(rss, minutes * 60)) >= 3:
            alternatives[f"{minutes:g}"] = round(rss_slope(rss, minutes * 60)["slope_mib_per_10min"], 3)
    events = [(s["t"], s.get("claim_events_modified", 0.0)) for s in stats]
    applied = (events[-1][1] - events[0][1]) / (events[-1][0] - events[0][0]) if len(events) >= 2 else None
    cpu = [(s["t"], s["cpu_s"]) for s in samples]
    scrape_ms = [v for _, v in ok_scrapes]
    return {
        "rss_mib": {
            "start": rss[0][1],
            "at_warmup": post[0][1] if post else None,
            "end": rss[-1][1],
            "min_after_warmup": min(v for _, v in post) if post else None,
            "max": max(v for _, v in rss),
            "hwm_end": samples[-1]["hwm_mib"],
        },
        "rss_slope": {k: round(v, 3) for k, v in slope.items()},
        "rss_slope_second_half_mib_per_10min": round(rss_slope(rss, half)["slope_mib_per_10min"], 3)
        if len(after_warmup(rss, half)) >= 3
        else None,
        "rss_slope_by_warmup_minutes": alternatives,
        "slope_limit_mib_per_10min": args.slope_limit,
        "verdict": verdict(slope["slope_mib_per_10min"], args.slope_limit),
        "threads": {"min": min(s["threads"] for s in samples), "max": max(s["threads"] for s in samples)},
        "threads_after_warmup": sorted({s["threads"] for s in samples if s["t"] >= warmup}),
        "fds": {"min": min(s["fds"] for s in samples), "max": max(s["fds"] for s in samples)},
        "fds_after_warmup": sorted({s["fds"] for s in samples if s["t"] >= warmup}),
        "scrapes": len(scrapes),
        "scrapes_failed": sum(1 for s in scrapes if s["code"] != 200),
        "scrape_ms": {
            "p50": round(statistics.median(scrape_ms), 1),
            "p95": round(percentile(scrape_ms, 0.95), 1),
            "max": round(max(scrape_ms), 1),
        },
        "scrape_windows_ms": [
            {
                **w,
                "p50": None if w["p50"] is None else round(w["p50"], 1),
                "p95": None if w["p95"] is None else round(w["p95"], 1),
            }
            for w in windows(ok_scrapes, window, duration)
        ],
        "changes_per_s_seen": None if applied is None else round(applied, 1),
        "changes_per_s_windows": [
            {**r, "per_s": None if r["per_s"] is None else round(r["per_s"], 1)}
            for r in rates(events, window, duration)
        ],
        "exporter_cpu_share_windows": [
            {**r, "per_s": None if r["per_s"] is None else round(r["per_s"], 3)} for r in rates(cpu, window, duration)
        ],
        "load1": {
            "min": min(s["load1"] for s in samples),
            "max": max(s["load1"] for s in samples),
            "mean": round(statistics.fmean(s["load1"] for s in samples), 2),
        },
        "churn": run["churn"],
        "otlp": run["otlp"],
        "collection_ms_mean": collection_means(stats),
        "exporter_errors": {k: stats[-1].get(k, 0.0) for k in ("relists", "watch_errors", "list_errors")}
        if stats
        else {},
    }


# --- the probe (--probe-minutes): what grows inside the exporter ------------------------------------

# Appended to the exporter's sitecustomize (bench.scale.exporter_pythonpath): a daemon thread that
# every few minutes writes one JSON line: Python's allocated blocks, glibc's heap (mallinfo2: in use
# and free, summed over arenas; mmapped chunks), the collections per gc generation, every
# --probe-walk-minutes the gc-tracked objects by type and, with
# --tracemalloc, the traced memory and the 15 source lines whose allocations grew most since the
# first snapshot. It costs the exporter a thread and, per walk, a pass over every object under the
# GIL, so a run with it is a diagnosis, not the measurement. The walk is not harmless either:
# gc.get_objects() hands out tuples other threads are still building, and the one such tuple
# then fails to resize (SystemError "bad argument to internal function", seen once in 30 minutes:
# one claim's parse failed and its series were left out until its next change).
PROBE = """
import collections, ctypes, gc, json, os, sys, threading, time


def _soak_probe(path, every, walk_every, trace):
    if trace:
        import tracemalloc

        tracemalloc.start(1)
    try:
        libc = ctypes.CDLL("libc.so.6")

        class _Info(ctypes.Structure):
            _fields_ = [(n, ctypes.c_size_t) for n in (
                "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                "keepcost")]

        libc.mallinfo2.restype = _Info
    except (OSError, AttributeError):
        libc = None
    first = None
    n = 0
    while True:
        entry = {"time": time.time(), "blocks": sys.getallocatedblocks()}
        if libc is not None:
            m = libc.mallinfo2()
            entry["malloc_mib"] = {k: round(getattr(m, f) / 2**20, 2) for k, f in (
                ("arena", "arena"), ("in_use", "uordblks"), ("free", "fordblks"), ("mmap", "hblkhd"))}
        entry["gc_collections"] = [g["collections"] for g in gc.get_stats()]
        entry["gc_collected"] = [g["collected"] for g in gc.get_stats()]
        if n % walk_every == 0:
            objs = gc.get_objects()
            entry["gc_objects"] = len(objs)
            entry["types"] = collections.Counter(type(o).__name__ for o in objs).most_common(25)
            del objs
        n += 1
        if trace:
            snap = tracemalloc.take_snapshot()
            entry["traced_mib"] = round(tracemalloc.get_traced_memory()[0] / 2**20, 2)
            if first is None:
                first = snap
            else:
                entry["growth"] = [
                    (str(d.traceback), d.size_diff, d.count_diff) for d in snap.compare_to(first, "lineno")[:15]
                ]
        with open(path, "a") as f:
            f.write(json.dumps(entry) + "\\n")
        time.sleep(every)


if os.environ.get("OTEL_DRA_SOAK_PROBE"):
    _path, _every, _walk, _trace = os.environ["OTEL_DRA_SOAK_PROBE"].rsplit(":", 3)
    threading.Thread(
        target=_soak_probe, args=(_path, float(_every), int(_walk), _trace == "1"), name="soak-probe", daemon=True
    ).start()
"""


def with_probe(pythonpath: str) -> str:
    """``pythonpath`` (a boot directory from exporter_pythonpath) with the probe in its sitecustomize."""
    site = Path(pythonpath) / "sitecustomize.py"
    site.write_text(site.read_text() + PROBE)
    return pythonpath


def read_probe(path: Path, t0_wall: float) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        entry = json.loads(line)
        entry["t"] = round(entry.pop("time") - t0_wall, 1)
        out.append(entry)
    return out


# --- the plot --------------------------------------------------------------------------------------


def plot(run: dict[str, Any], summary: dict[str, Any], path: Path, title: str) -> None:
    """RSS (with the fitted line after warm-up), scrape latency (each scrape, p50 and p95 per window)
    and the changes per second the exporter saw, over time. matplotlib (a dev dependency) is imported
    here only, so the rest of the harness and its tests do not need it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    samples, scrapes = run["samples"], run["scrapes"]
    slope = summary["rss_slope"]
    fig, (ax_rss, ax_scrape, ax_rate) = plt.subplots(
        3, 1, figsize=(9, 8.5), sharex=True, gridspec_kw={"height_ratios": [3, 3, 1.4]}
    )
    minutes = [s["t"] / 60 for s in samples]
    ax_rss.plot(minutes, [s["rss_mib"] for s in samples], lw=1, color="tab:blue", label="exporter RSS")
    a, b = slope["from_s"], slope["to_s"]
    fit = [slope["intercept_mib"] + slope["slope_mib_per_10min"] / TEN_MINUTES * t for t in (a, b)]
    ax_rss.plot(
        [a / 60, b / 60],
        fit,
        color="tab:red",
        lw=1.5,
        ls="--",
        label=f"least squares after warm-up: {slope['slope_mib_per_10min']:+.2f} MiB / 10 min "
        f"(limit +{summary['slope_limit_mib_per_10min']:g}: {summary['verdict']})",
    )
    ax_rss.axvspan(0, slope["warmup_s"] / 60, color="0.9", label=f"warm-up ({slope['warmup_s'] / 60:g} min)")
    ax_rss.set_ylabel("RSS (MiB)")
    ax_rss.legend(loc="lower right", fontsize=8)
    ax_rss.grid(alpha=0.3)
    ax_rss.set_title(title, fontsize=10)

    ok = [s for s in scrapes if s["code"] == 200]
    ax_scrape.scatter([s["t"] / 60 for s in ok], [s["s"] * 1000 for s in ok], s=4, color="0.6", label="each scrape")
    wins = [w for w in summary["scrape_windows_ms"] if w["n"]]
    mids = [(w["from_s"] + w["to_s"]) / 120 for w in wins]
    ax_scrape.plot(mids, [w["p95"] for w in wins], marker="o", ms=3, color="tab:red", label="p95 per window")
    ax_scrape.plot(mids, [w["p50"] for w in wins], marker="o", ms=3, color="tab:green", label="p50 per window")
    ax_scrape.set_ylabel("full plain scrape (ms)")
    ax_scrape.set_ylim(bottom=0)
    ax_scrape.legend(loc="upper right", fontsize=8)
    ax_scrape.grid(alpha=0.3)

    rates_ = [r for r in summary["changes_per_s_windows"] if r["per_s"] is not None]
    ax_rate.step(
        [r["from_s"] / 60 for r in rates_] + ([rates_[-1]["to_s"] / 60] if rates_ else []),
        [r["per_s"] for r in rates_] + ([rates_[-1]["per_s"]] if rates_ else []),
        where="post",
        color="tab:purple",
    )
    ax_rate.axhline(run["rate"], color="0.5", lw=1, ls=":", label=f"target {run['rate']:g}/s")
    ax_rate.legend(loc="lower right", fontsize=8)
    ax_rate.set_ylabel("claim changes\nseen per s")
    ax_rate.set_ylim(bottom=0)
    ax_rate.set_xlabel("minutes since the exporter was ready")
    ax_rate.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_path(json_path: Path | None, plot: Path | None, no_plot: bool = False) -> Path | None:
    """Where the PNG goes: ``--plot``, else beside ``--json`` (same name, ``.png``); none with
    ``--no-plot`` or without either."""
    if no_plot:
        return None
    if plot is not None:
        return plot
    return json_path.with_suffix(".png") if json_path is not None else None


# --- wiring ----------------------------------------------------------------------------------------


def git_commit() -> str:
    root = Path(__file__).resolve().parents[1]
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "otel_dra"], cwd=root, capture_output=True, text=True)
    except OSError:
        return "unknown"
    return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--claims", type=int, default=10000)
    parser.add_argument("--rate", type=float, default=200.0, help="claim status changes per second (bench/churn.py)")
    parser.add_argument("--churn-workers", type=int, default=16, help="concurrent writers of bench/churn.py")
    parser.add_argument("--minutes", type=float, default=30.0, help="soak length, from the exporter being ready")
    parser.add_argument(
        "--warmup-minutes", type=float, default=5.0, help="samples before this are left out of the slope"
    )
    parser.add_argument("--slope-limit", type=float, default=1.0, help="MiB of RSS growth per 10 minutes allowed")
    parser.add_argument("--otlp-interval", type=float, default=10.0, help="OTLP export interval, seconds")
    parser.add_argument("--sample-seconds", type=float, default=2.0)
    parser.add_argument("--scrape-seconds", type=float, default=5.0)
    parser.add_argument("--stats-seconds", type=float, default=30.0)
    parser.add_argument("--window-minutes", type=float, default=2.0, help="window of the scrape percentiles")
    parser.add_argument("--pods", action="store_true", help="with one Pod per claim (slower to load)")
    parser.add_argument(
        "--probe-minutes", type=float, default=0.0, help="diagnosis: probe the exporter's heap every M minutes"
    )
    parser.add_argument(
        "--probe-walk-minutes", type=float, default=5.0, help="diagnosis: count objects by type every M minutes"
    )
    parser.add_argument("--tracemalloc", action="store_true", help="diagnosis: with --probe-minutes, tracemalloc too")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument(
        "--plot", type=Path, default=None, help="PNG of RSS and scrape latency over time (default: beside --json)"
    )
    parser.add_argument("--no-plot", action="store_true", help="no PNG, not even beside --json")
    args = parser.parse_args()
    args.plot = plot_path(args.json, args.plot, args.no_plot)

    w = Workload(claims=args.claims, pods=args.pods)
    results: dict[str, Any] = {
        "machine": machine(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "commit": git_commit(),
        "kubernetes": kubernetes_release().version,
        "args": {k: str(v) for k, v in vars(args).items()},
        "workload": {
            "claims": w.claims,
            "namespaces": w.namespaces,
            "slices": w.slices,
            "devices": w.devices,
            "classes": w.classes,
            "pods": w.claims if w.pods else 0,
        },
    }
    env = {"PYTHONPATH": exporter_pythonpath(Path(__file__).resolve().parents[1])}
    with (
        tempfile.TemporaryDirectory(prefix="otel-dra-soak-") as tmp,
        running(Path(tmp) / "testbed", binaries=find_binaries()) as tb,
    ):
        probe_path = Path(tmp) / "probe.jsonl"
        if args.probe_minutes:
            with_probe(env["PYTHONPATH"])
            walk = max(1, round(args.probe_walk_minutes / args.probe_minutes))
            env["OTEL_DRA_SOAK_PROBE"] = f"{probe_path}:{args.probe_minutes * 60:g}:{walk}:{int(args.tracemalloc)}"
        admin = KubeClient(load_credentials(str(tb.kubeconfig)), max_connections=32)
        results["load_seconds"] = round(load(admin, w), 1)
        print(f"loaded {w.claims} claims in {results['load_seconds']} s", flush=True)
        sink_port = free_port()
        sink = subprocess.Popen([sys.executable, "-m", "bench.sink", str(sink_port)])
        ex = Exporter(
            str(tb.kubeconfig),
            Path(tmp) / "exporter.log",
            env={
                **env,
                "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{sink_port}",
                "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
                "OTEL_METRIC_EXPORT_INTERVAL": str(int(args.otlp_interval * 1000)),
            },
            extra_args=["--log-level", "debug"],
        )
        try:
            results["initial_sync_s"] = round(ex.wait_ready(timeout=600), 2)
            run = soak(ex, args, str(tb.kubeconfig), w, sink_port, admin)
            _code, body = get(f"http://127.0.0.1:{ex.port}/metrics")
            results["series"] = sum(1 for line in body.splitlines() if line and not line.startswith(b"#"))
            results["body_mb"] = round(len(body) / 1e6, 1)
            del body
            results["exporter_alive"] = ex.proc.poll() is None
            if args.probe_minutes:
                results["probe"] = read_probe(probe_path, run["t0_wall"])
        finally:
            if ex.proc.poll() is None:
                ex.stop()
            sink.terminate()
            sink.wait(30)
            log_text = Path(ex.log.name).read_bytes().decode(errors="replace")
        problems = [line for line in log_text.splitlines() if " ERROR " in line or " WARNING " in line]
        results["exporter_log_problems"] = {"count": len(problems), "first": problems[:20]}
    summary = summarize(run, args)
    results["summary"] = summary
    results.update(samples=run["samples"], scrapes=run["scrapes"], stats=run["stats"])
    print(json.dumps(summary, indent=2), flush=True)
    s = summary["rss_slope"]
    print(
        f"RSS slope after {s['warmup_s'] / 60:g} min of warm-up: {s['slope_mib_per_10min']:+.3f} "
        f"± {s['stderr_mib_per_10min']:.3f} MiB / 10 min (limit {args.slope_limit:g}): {summary['verdict']}",
        flush=True,
    )
    if args.json:
        write_json(args.json, results, indent=1)
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        print(f"no {args.plot}: matplotlib is not installed (a dev dependency: pip install -e '.[dev]')", flush=True)
    elif args.plot:
        title = (
            f"otel-dra exporter soak: {w.claims:,} claims, {args.rate:g} changes/s, OTLP every "
            f"{args.otlp_interval:g} s, {args.minutes:g} min ({results['commit']}, {results['date']})"
        )
        plot(run, summary, args.plot, title)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
