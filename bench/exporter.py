"""Exporter benchmark against a real testbed API server.

    python -m bench.exporter --claims 1000 10000 [--scrapes 30] [--json out.json]

For each size: a fresh testbed, the workload of bench/workload.py loaded with concurrent creates,
then `otel-dra exporter` started as its own process and measured:

- initial sync: process start -> /readyz 200 (includes interpreter start-up and imports)
- /metrics latency p50/p95 over K sequential scrapes, plain and with gzip
- exporter RSS (VmRSS after the scrapes, VmHWM peak)
- API server requests per scrape: the apiserver's own apiserver_request_total for the
  resource.k8s.io group and pods (all verbs but WATCH), before vs after the K scrapes
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

from bench import write_json
from bench.workload import Workload, load
from otel_dra.kube.client import KubeClient, load_credentials
from otel_dra.testbed import find_binaries, running

T = TypeVar("T")


def machine() -> dict[str, Any]:
    cpu = "unknown"
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            cpu = line.split(":", 1)[1].strip()
            break
    mem_kb = int(re.search(r"MemTotal:\s+(\d+)", Path("/proc/meminfo").read_text())[1])  # type: ignore[index]
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "memory_gib": round(mem_kb / 2**20, 1),
        "python": platform.python_version(),
        "kernel": platform.release(),
    }


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def get(url: str, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    req = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()
    except OSError:
        return 0, b""


def api_requests(admin: KubeClient) -> float:
    """The API server's requests so far for what the exporter reads: the resource.k8s.io group and
    pods (all verbs but WATCH)."""
    text = admin.request("GET", "/metrics").data.decode()
    total = 0.0
    for line in text.splitlines():
        if line.startswith("apiserver_request_total{") and (
            'group="resource.k8s.io"' in line or ('group=""' in line and 'resource="pods"' in line)
        ):
            if 'verb="WATCH"' in line:
                continue
            total += float(line.rsplit(" ", 1)[1])
    return total


def proc_status(pid: int) -> dict[str, int]:
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(("VmRSS", "VmHWM")):
            key, value = line.split(":", 1)
            out[key] = int(value.split()[0]) * 1024
    return out


def curl_scrape(port: int, timeout: float, headers: Sequence[str] = ()) -> tuple[int, float]:
    """One scrape of /metrics by curl (a new connection, timed to the last byte): (HTTP code,
    seconds); (0, timeout) when curl got no answer in ``timeout`` seconds."""
    out = subprocess.run(
        [
            *("curl", "-s", "-o", "/dev/null", "--max-time", f"{timeout:g}", "-w", "%{http_code} %{time_total}"),
            *headers,
            f"http://127.0.0.1:{port}/metrics",
        ],
        capture_output=True,
        text=True,
    ).stdout.split()
    return (int(out[0]), float(out[1])) if len(out) == 2 else (0, timeout)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def alternating_rounds(
    names: Sequence[str], rounds: int, run: Callable[[str], dict[str, Any]]
) -> list[list[dict[str, Any]]]:
    """``run(name)`` for every name, ``rounds`` times, the order reversed every other round (so that
    neither side always goes first on a machine that warms or tires)."""
    out = []
    for i in range(rounds):
        order = list(names) if i % 2 == 0 else list(names)[::-1]
        print(f"round {i + 1}: {', '.join(order)}", flush=True)
        out.append([run(name) for name in order])
    return out


def on_testbed(
    kubeconfig: str | None, workload: Workload, workdir: Path, measure: Callable[[str], T], results: dict[str, Any]
) -> T:
    """``measure(kubeconfig)`` against a held testbed (bench.held) when ``kubeconfig`` is given, else
    against a fresh one in ``workdir`` loaded with ``workload`` (its load time into ``results``)."""
    if kubeconfig:
        return measure(kubeconfig)
    with running(workdir / "tb", binaries=find_binaries()) as tb:
        admin = KubeClient(load_credentials(str(tb.kubeconfig)), max_connections=32)
        results["load_s"] = round(load(admin, workload, concurrency=16), 1)
        print(f"loaded {workload.claims} claims in {results['load_s']} s", flush=True)
        return measure(str(tb.kubeconfig))


def ratios(figures: dict[str, float], base: dict[str, float]) -> dict[str, float]:
    """Each figure over the base's (where the base has a non-zero one)."""
    return {key: round(value / base[key], 3) for key, value in figures.items() if base.get(key)}


def timed_scrapes(port: int, count: int, headers: dict[str, str] | None = None) -> tuple[list[float], int]:
    times, size = [], 0
    for _ in range(count):
        start = time.perf_counter()
        code, body = get(f"http://127.0.0.1:{port}/metrics", headers)
        times.append(time.perf_counter() - start)
        assert code == 200, body[:200]
        size = len(body)
    return times, size


class Exporter:
    """``otel-dra exporter`` as its own process, logging to ``log``; ``prefix`` wraps the command
    (e.g. ``taskset -c 0``)."""

    def __init__(
        self,
        kubeconfig: str,
        log: Path,
        *,
        env: dict[str, str] | None = None,
        extra_args: Sequence[str] = (),
        prefix: Sequence[str] = (),
    ) -> None:
        self.port = free_port()
        self.log = open(log, "w")  # noqa: SIM115 - closed in stop()
        self.start = time.monotonic()
        self.proc = subprocess.Popen(
            [
                *prefix,
                sys.executable,
                "-m",
                "otel_dra",
                "exporter",
                "--kubeconfig",
                kubeconfig,
                "--address",
                "127.0.0.1",
                "--port",
                str(self.port),
                *extra_args,
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
        )

    def wait_ready(self, timeout: float = 900) -> float:
        """Seconds from process start to /readyz answering 200."""
        while get(f"http://127.0.0.1:{self.port}/readyz")[0] != 200:
            if self.proc.poll() is not None or time.monotonic() - self.start > timeout:
                raise RuntimeError(f"exporter did not become ready; see {self.log.name}")
            time.sleep(0.05)
        return time.monotonic() - self.start

    def rss_mib(self) -> tuple[float, float]:
        """(VmRSS, VmHWM) in MiB."""
        st = proc_status(self.proc.pid)
        return round(st["VmRSS"] / 2**20, 1), round(st["VmHWM"] / 2**20, 1)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(120)
        self.log.close()


def run_size(claims: int, scrapes: int, workdir: Path, extra_args: list[str]) -> dict[str, Any]:
    w = Workload(claims=claims)
    result: dict[str, Any] = {"claims": claims, "slices": w.slices, "devices": w.devices, "classes": w.classes}
    with running(workdir / f"testbed-{claims}", binaries=find_binaries()) as tb:
        admin = KubeClient(load_credentials(str(tb.kubeconfig)), max_connections=32)
        result["load_seconds"] = round(load(admin, w), 1)
        ex = Exporter(str(tb.kubeconfig), workdir / f"exporter-{claims}.log", extra_args=extra_args)
        try:
            result["initial_sync_seconds"] = round(ex.wait_ready(timeout=600), 2)
            timed_scrapes(ex.port, 2)  # warm-up: the first scrape joins the freshly filled cache
            before = api_requests(admin)
            plain, size = timed_scrapes(ex.port, scrapes)
            gz, gz_size = timed_scrapes(ex.port, scrapes, {"Accept-Encoding": "gzip"})
            after = api_requests(admin)
            _code, body = get(f"http://127.0.0.1:{ex.port}/metrics")
            series = sum(1 for line in body.splitlines() if line and not line.startswith(b"#"))
            rss, peak = ex.rss_mib()
            result.update(
                {
                    "series": series,
                    "expected_seed_series": w.expected_series(),
                    "body_bytes": size,
                    "gzip_bytes": gz_size,
                    "scrape_p50_ms": round(statistics.median(plain) * 1000, 1),
                    "scrape_p95_ms": round(percentile(plain, 0.95) * 1000, 1),
                    "gzip_p50_ms": round(statistics.median(gz) * 1000, 1),
                    "gzip_p95_ms": round(percentile(gz, 0.95) * 1000, 1),
                    "api_requests_per_scrape": (after - before) / (2 * scrapes),
                    "rss_mib": rss,
                    "peak_rss_mib": peak,
                }
            )
        finally:
            ex.stop()
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--claims", type=int, nargs="+", default=[1000, 10000])
    parser.add_argument("--scrapes", type=int, default=30)
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    parser.add_argument("--exporter-arg", action="append", default=[], help="extra exporter flag")
    args = parser.parse_args()
    results: dict[str, Any] = {"machine": machine(), "date": time.strftime("%Y-%m-%d"), "runs": []}
    with tempfile.TemporaryDirectory(prefix="otel-dra-bench-") as tmp:
        for n in args.claims:
            run = run_size(n, args.scrapes, Path(tmp), args.exporter_arg)
            print(json.dumps(run), flush=True)
            results["runs"].append(run)
    if args.json:
        write_json(args.json, results)
    print(json.dumps(results["machine"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
