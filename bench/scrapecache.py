"""What a scrape costs when little or nothing changed (issue 29): this tree against another (today's
code before the change, or any older tree), in one run, against one loaded testbed.

    python -m bench.scrapecache --kubeconfig /tmp/held-L/tb/kubeconfig --claims 100000 \\
        --tree base=/tmp/otel-dra-base --tree new=. --json bench/results/scrapecache/L.json
    python -m bench.scrapecache --claims 20000 --tree base=/tmp/otel-dra-base --tree new=.   # loads a testbed

Each round starts one exporter per tree in turn (the order turns round by round), all on the same
objects, and measures, after two warm-up scrapes of each kind:

- ``quiet``: ``--scrapes`` curl scrapes plain, then as many with ``Accept-Encoding: gzip`` (what
  Prometheus asks for), with nothing changing: p50 / p95, the exporter's CPU per scrape (its
  /proc utime + stime over the scrapes, sending included) and the CPU of building the bodies alone
  (its ``otel_dra_collection_cpu_time_seconds`` over the same scrapes);
- ``churn``: the same while bench/churn.py writes ``--rate`` claim status changes per second;
- ``floor``: the bytes of one plain and one gzip body of that exporter, sent by a minimal server in
  this process (one buffer, ``sendall``) to the same curl: what sending the bytes alone costs here;
- the exporter's RSS at the end.

``--families seed`` runs the exporters with ``--metric-allowlist`` on the seven seed families.
"""

from __future__ import annotations

import argparse
import json
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from bench import write_json
from bench.exporter import Exporter, alternating_rounds, get, machine, on_testbed, percentile, ratios
from bench.scale import SEED_ALLOWLIST, curl_time, exporter_pythonpath
from bench.soak import git_commit, proc_sample
from bench.workload import Workload

NAMESPACES = 100  # the workloads' shape (bench.held, bench.scale)


def collection_cpu(port: int) -> float:
    """The exporter's summed CPU seconds of building /metrics bodies (its self-metric)."""
    _code, body = get(f"http://127.0.0.1:{port}/metrics")
    match = re.search(rb'^otel_dra_collection_cpu_time_seconds_sum\{exporter="prometheus"\} (\S+)$', body, re.M)
    return float(match[1]) if match else 0.0


def body(port: int, gzip: bool) -> bytes:
    cmd = ["curl", "-s", f"http://127.0.0.1:{port}/metrics"]
    if gzip:
        cmd[1:1] = ["-H", "Accept-Encoding: gzip"]
    return subprocess.run(cmd, capture_output=True, check=True).stdout


def scrapes(pid: int, port: int, count: int, gzip: bool) -> dict[str, float]:
    """``count`` timed scrapes: p50 / p95 and CPU per scrape, the process's (sending included) and
    that of building the bodies alone. The self-metric is read by plain scrapes of their own: the
    first read's build lands in the second read, so the build figure averages ``count`` scrapes and
    one plain one."""
    built0 = collection_cpu(port)
    cpu0 = proc_sample(pid)["cpu_s"]
    times = sorted(curl_time(port, gzip) for _ in range(count))
    cpu1 = proc_sample(pid)["cpu_s"]
    built1 = collection_cpu(port)
    return {
        "p50_ms": round(statistics.median(times) * 1000, 2),
        "p95_ms": round(percentile(times, 0.95) * 1000, 2),
        "cpu_ms_per_scrape": round((cpu1 - cpu0) * 1000 / count, 2),
        "build_cpu_ms_per_scrape": round((built1 - built0) * 1000 / (count + 1), 2),
    }


class FloorServer:
    """Serves one fixed HTTP body per request: the cost of sending the bytes and nothing else."""

    def __init__(self, payload: bytes, gzip: bool) -> None:
        self.payload = payload
        head = f"HTTP/1.1 200 OK\r\nContent-Length: {len(payload)}\r\nConnection: close\r\n"
        if gzip:
            head += "Content-Encoding: gzip\r\n"
        self.head = (head + "\r\n").encode()
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                request = b""
                while b"\r\n\r\n" not in request:
                    chunk = conn.recv(4096)
                    if not chunk:
                        break
                    request += chunk
                conn.sendall(self.head)
                conn.sendall(self.payload)

    def close(self) -> None:
        self.sock.close()


def floor(port: int, count: int) -> dict[str, float]:
    out: dict[str, float] = {}
    for gzip in (False, True):
        server = FloorServer(body(port, gzip), gzip)
        try:
            # curl_time asks /metrics of 127.0.0.1:port; the floor server answers any path.
            times = sorted(curl_time(server.port, gzip) for _ in range(count))
        finally:
            server.close()
        out["gzip_p50_ms" if gzip else "p50_ms"] = round(statistics.median(times) * 1000, 2)
        out["gzip_bytes" if gzip else "bytes"] = len(server.payload)
    return out


def run_tree(name: str, tree: Path, kubeconfig: str, args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    flags = ["--metric-allowlist", SEED_ALLOWLIST] if args.families == "seed" else []
    ex = Exporter(
        kubeconfig,
        workdir / f"exporter-{name}.log",
        env={"PYTHONPATH": exporter_pythonpath(tree)},
        extra_args=flags,
    )
    r: dict[str, Any] = {"tree": name}
    try:
        r["initial_sync_s"] = round(ex.wait_ready(), 2)
        pid, port = ex.proc.pid, ex.port
        for gzip in (False, True, False, True):
            curl_time(port, gzip)  # warm-up: the first gzip scrape compresses every chunk once
        r["quiet"] = {"plain": scrapes(pid, port, args.scrapes, False), "gzip": scrapes(pid, port, args.scrapes, True)}
        r["floor"] = floor(port, args.scrapes)
        if args.rate > 0:
            churn = subprocess.Popen(
                [sys.executable, "-m", "bench.churn", kubeconfig, str(args.claims), str(NAMESPACES), str(args.rate)],
                stdout=subprocess.PIPE,
                text=True,
            )
            try:
                time.sleep(args.warmup)
                r["churn"] = {
                    "plain": scrapes(pid, port, args.scrapes, False),
                    "gzip": scrapes(pid, port, args.scrapes, True),
                }
            finally:
                churn.terminate()
                r["churn"]["writes"] = (churn.communicate(timeout=60)[0] or "").strip()
        sample = proc_sample(pid)
        r["rss_mib"], r["rss_peak_mib"] = sample["rss_mib"], sample["hwm_mib"]
    finally:
        ex.stop()
    print(f"  {name}: {json.dumps(r)}", flush=True)
    return r


def summarize(rounds: list[list[dict[str, Any]]], trees: list[str]) -> dict[str, Any]:
    """Per tree the median over rounds of each figure; each tree against the first."""
    out: dict[str, Any] = {}
    for name in trees:
        runs = [r for round_ in rounds for r in round_ if r["tree"] == name]
        figures: dict[str, float] = {}
        for phase in ("quiet", "churn"):
            for kind in ("plain", "gzip"):
                for key in ("p50_ms", "cpu_ms_per_scrape", "build_cpu_ms_per_scrape"):
                    values = [r[phase][kind][key] for r in runs if phase in r]
                    if values:
                        figures[f"{phase}_{kind}_{key}"] = round(statistics.median(values), 2)
        for key in ("p50_ms", "gzip_p50_ms"):
            figures[f"floor_{key}"] = round(statistics.median(r["floor"][key] for r in runs), 2)
        figures["rss_mib"] = round(statistics.median(r["rss_mib"] for r in runs), 1)
        figures["initial_sync_s"] = round(statistics.median(r["initial_sync_s"] for r in runs), 2)
        out[name] = figures
    base = trees[0]
    for name in trees[1:]:
        out[f"{name}_vs_{base}"] = ratios(out[name], out[base])
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--claims", type=int, default=100000)
    parser.add_argument("--kubeconfig", default=None, help="a held testbed (bench.held) instead of a fresh one")
    parser.add_argument("--no-pods", action="store_true", help="a fresh testbed without the reserving Pods")
    parser.add_argument(
        "--tree", action="append", required=True, help="NAME=PATH of an otel-dra source tree; the first is the base"
    )
    parser.add_argument("--families", choices=("all", "seed"), default="all")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--scrapes", type=int, default=20, help="per kind (plain, gzip) and phase")
    parser.add_argument("--rate", type=float, default=100.0, help="claim status changes per second (0: no churn)")
    parser.add_argument("--warmup", type=float, default=5.0, help="seconds of churn before measuring")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    trees: dict[str, Path] = {}
    for spec in args.tree:
        name, sep, path = spec.partition("=")
        if not sep or not name or not Path(path, "otel_dra").is_dir():
            parser.error(f"--tree {spec!r}: expected NAME=PATH of a tree holding otel_dra/")
        trees[name] = Path(path).resolve()
    results: dict[str, Any] = {
        "benchmark": "scrapecache",
        "machine": machine(),
        "commit": git_commit(),
        "trees": {name: str(path) for name, path in trees.items()},
        "args": vars(args) | {"json": str(args.json)},
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    with tempfile.TemporaryDirectory(prefix="otel-dra-bench-scrapecache-") as tmp:
        workdir = Path(tmp)

        w = Workload(claims=args.claims, namespaces=NAMESPACES, classes=50, pods=not args.no_pods)
        results["rounds"] = on_testbed(
            args.kubeconfig,
            w,
            workdir,
            lambda kubeconfig: alternating_rounds(
                list(trees), args.rounds, lambda n: run_tree(n, trees[n], kubeconfig, args, workdir)
            ),
            results,
        )
    results["summary"] = summarize(results["rounds"], list(trees))
    print(json.dumps(results["summary"], indent=2))
    if args.json:
        write_json(args.json, results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
