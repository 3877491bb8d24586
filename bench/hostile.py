"""Hostile and heavy clients (issue 15, item 5) against a real exporter on a real testbed.

    python -m bench.hostile --claims 10000 [--slow 500] [--heavy 20] [--before DIR] [--json out.json]

On a fresh testbed loaded with bench/workload.py, `otel-dra exporter` as its own process:

1. quiet: ``--scrapes`` sequential normal scrapes (curl, a new connection each): p50 / p95;
2. under load, three phases: ``slow`` (``--slow`` slowloris connections), ``heavy`` (``--heavy``
   clients scraping the full /metrics back to back) and ``both``. A load process (``--load``, its
   own interpreter, so that its GIL is not the measuring client's) holds the slowloris connections
   open (each sends a partial request and one more header line every 5 s, and reconnects as soon as
   the server closes it) and runs the heavy clients; meanwhile the same normal scrapes, and the
   exporter's threads, RSS and file descriptors sampled every 0.25 s;
3. after: the load stopped, the exporter's threads and RSS, whether it is alive (/healthz), and the
   quiet scrapes again.

The heavy clients connect from their own loopback address (``--heavy-from one``: all from
127.0.0.2, one runaway client with many connections; ``each``: 127.0.1.1, 127.0.1.2, ...: as many
clients as connections), the normal scrapes from 127.0.0.1, so that the server's per-client limit
(``--web-max-requests-per-client``) applies to them as it would to real clients. ``--per-client
4,1024`` runs the exporter once per value (1024: no limit in effect), on the same testbed.

``--before DIR`` runs the same phases, on the same testbed, against the exporter of another source
tree (e.g. ``git archive main | tar -x -C DIR``): the server before the limits.
"""

from __future__ import annotations

import argparse
import json
import os
import selectors
import signal
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
from bench.exporter import Exporter, curl_scrape, get, machine, percentile
from bench.scale import exporter_pythonpath
from bench.workload import Workload, load
from otel_dra.kube.client import KubeClient, load_credentials
from otel_dra.testbed import find_binaries, running

# --- the load process -------------------------------------------------------------------------------


def _slowloris(port: int, count: int, stop: threading.Event, stats: dict[str, int]) -> None:
    """``count`` connections that never finish their request; reopened when the server closes one."""
    sel = selectors.DefaultSelector()
    next_line: dict[socket.socket, float] = {}

    def open_one() -> None:
        try:
            sock = socket.create_connection(("127.0.0.1", port), timeout=5)
            sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: bench\r\nUser-Agent: slowloris\r\n")
        except OSError:
            stats["connect_errors"] += 1
            return
        sock.setblocking(False)
        sel.register(sock, selectors.EVENT_READ)
        next_line[sock] = time.monotonic() + 5.0
        stats["opened"] += 1

    def drop(sock: socket.socket) -> None:
        sel.unregister(sock)
        next_line.pop(sock, None)
        sock.close()
        stats["closed_by_server"] += 1

    for _ in range(count):
        open_one()
    while not stop.is_set():
        for key, _ in sel.select(0.2):
            sock = key.fileobj
            try:
                data = sock.recv(65536)  # type: ignore[union-attr]
            except BlockingIOError:
                continue
            except OSError:
                data = b""
            if data.startswith(b"HTTP/1.1 408"):
                stats["got_408"] += 1
            drop(sock)  # type: ignore[arg-type]
        now = time.monotonic()
        for sock, due in list(next_line.items()):
            if due <= now:
                try:
                    sock.send(b"X-Slow: %d\r\n" % int(now))
                    next_line[sock] = now + 5.0
                except OSError:
                    drop(sock)
        while len(next_line) < count and not stop.is_set():
            open_one()
    for sock in list(next_line):
        sock.close()


def _heavy(port: int, source: str, stop: threading.Event, stats: dict[str, int], lock: threading.Lock) -> None:
    """Full scrapes back to back from ``source``, one connection each, the body read and dropped."""
    buf = bytearray(1 << 20)
    while not stop.is_set():
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=60, source_address=(source, 0)) as sock:
                sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: bench\r\nConnection: close\r\n\r\n")
                first = b""
                size = 0
                while n := sock.recv_into(buf):
                    if not first:
                        first = bytes(buf[:12])
                    size += n
            ok = first.startswith(b"HTTP/1.1 200")
        except OSError:
            ok, size = False, 0
        with lock:
            stats["heavy_ok" if ok else "heavy_failed"] += 1
            stats["heavy_bytes"] += size


def heavy_source(heavy_from: str, i: int) -> str:
    """The loopback address heavy client ``i`` connects from (the normal scrapes use 127.0.0.1)."""
    return "127.0.0.2" if heavy_from == "one" else f"127.0.{1 + i // 250}.{1 + i % 250}"


def run_load(port: int, slow: int, heavy: int, heavy_from: str) -> int:
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    stats = dict.fromkeys(
        ("opened", "closed_by_server", "got_408", "connect_errors", "heavy_ok", "heavy_failed", "heavy_bytes"), 0
    )
    lock = threading.Lock()
    threads = [threading.Thread(target=_slowloris, args=(port, slow, stop, stats))]
    threads += [
        threading.Thread(target=_heavy, args=(port, heavy_source(heavy_from, i), stop, stats, lock))
        for i in range(heavy)
    ]
    for t in threads:
        t.start()
    print("started", flush=True)
    stop.wait()
    for t in threads:
        t.join(120)
    print(json.dumps(stats), flush=True)
    return 0


# --- the measuring side -----------------------------------------------------------------------------


# --gzip: the normal scrapes ask for gzip, as Prometheus does.
NORMAL_HEADERS: list[str] = []


def scrape_series(port: int, count: int) -> dict[str, Any]:
    results = [curl_scrape(port, 30.0, NORMAL_HEADERS) for _ in range(count)]
    times = [t for code, t in results if code == 200]
    return {
        "n": count,
        "failed": sum(1 for code, _ in results if code != 200),
        "p50_ms": round(statistics.median(times) * 1000, 1) if times else None,
        "p95_ms": round(percentile(times, 0.95) * 1000, 1) if times else None,
    }


def proc(pid: int) -> dict[str, int]:
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM", "Threads"):
            out[key] = int(value.split()[0])
    out["fds"] = len(os.listdir(f"/proc/{pid}/fd"))
    return out


def under_load(ex: Exporter, args: argparse.Namespace, slow: int, heavy: int) -> dict[str, Any]:
    """Normal scrapes while a load process holds ``slow`` slowloris connections and runs ``heavy``
    back-to-back full scrapes; the exporter's threads, RSS and file descriptors sampled meanwhile."""
    loader = subprocess.Popen(
        [
            *(sys.executable, "-m", "bench.hostile", "--load", str(ex.port)),
            *("--slow", str(slow), "--heavy", str(heavy), "--heavy-from", args.heavy_from),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert loader.stdout is not None
    loader.stdout.readline()  # "started"
    samples: list[dict[str, int]] = []
    sampling = threading.Event()

    def sample() -> None:
        while not sampling.wait(0.25):
            if ex.proc.poll() is not None:
                return
            samples.append(proc(ex.proc.pid))

    sampler = threading.Thread(target=sample)
    sampler.start()
    result: dict[str, Any] = {"slow": slow, "heavy": heavy}
    try:
        time.sleep(args.settle)  # the slow connections opened, the heavy scrapes running
        result["scrapes"] = scrape_series(ex.port, args.scrapes)
    finally:
        sampling.set()
        sampler.join()
        loader.terminate()
        out, _ = loader.communicate(timeout=180)
    result["load"] = json.loads(out.strip().splitlines()[-1]) if out.strip() else {}
    result["process_max"] = {k: max(s[k] for s in samples) for k in samples[0]} if samples else {}
    result["alive"] = ex.proc.poll() is None
    time.sleep(2)
    return result


def measure(ex: Exporter, args: argparse.Namespace) -> dict[str, Any]:
    result: dict[str, Any] = {"initial_sync_seconds": round(ex.wait_ready(timeout=600), 2)}
    for _ in range(3):
        curl_scrape(ex.port, 30.0, NORMAL_HEADERS)  # warm-up
    result["quiet"] = scrape_series(ex.port, args.scrapes)
    result["quiet_process"] = proc(ex.proc.pid)
    quiet = result["quiet"]["p50_ms"]
    for name, slow, heavy in (("slow", args.slow, 0), ("heavy", 0, args.heavy), ("both", args.slow, args.heavy)):
        if ex.proc.poll() is not None:
            break
        phase = result[name] = under_load(ex, args, slow, heavy)
        p50 = phase["scrapes"]["p50_ms"]
        phase["p50_vs_quiet"] = round(p50 / quiet, 2) if quiet and p50 else None
        print(json.dumps({name: phase}), flush=True)
    time.sleep(3)
    alive = ex.proc.poll() is None and get(f"http://127.0.0.1:{ex.port}/healthz")[0] == 200
    result["alive_after"] = alive
    if alive:
        result["after_process"] = proc(ex.proc.pid)
        result["after"] = scrape_series(ex.port, args.scrapes)
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--claims", type=int, default=10000)
    parser.add_argument("--pods", action="store_true", help="with one Pod per claim (slower to load)")
    parser.add_argument("--slow", type=int, default=500, help="slowloris connections")
    parser.add_argument("--heavy", type=int, default=20, help="concurrent full-scrape clients")
    parser.add_argument("--heavy-from", choices=("one", "each"), default="one", help="heavy clients' addresses")
    parser.add_argument(
        "--per-client",
        default="4",
        help="comma-separated --web-max-requests-per-client values, one exporter run each",
    )
    parser.add_argument("--scrapes", type=int, default=30, help="normal scrapes per phase")
    parser.add_argument("--settle", type=float, default=5.0, help="seconds of load before measuring")
    parser.add_argument("--gzip", action="store_true", help="normal scrapes ask for gzip (as Prometheus does)")
    parser.add_argument("--before", type=Path, default=None, help="also run the exporter of this source tree")
    parser.add_argument("--before-first", action="store_true", help="run the --before tree first")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--load", type=int, default=None, help=argparse.SUPPRESS)  # the load process
    args = parser.parse_args()
    if args.load is not None:
        return run_load(args.load, args.slow, args.heavy, args.heavy_from)
    if args.gzip:
        NORMAL_HEADERS.extend(["-H", "Accept-Encoding: gzip"])
    results: dict[str, Any] = {"machine": machine(), "date": time.strftime("%Y-%m-%d")}
    results["args"] = {k: str(v) for k, v in vars(args).items() if k != "load"}
    here = {"PYTHONPATH": exporter_pythonpath(Path(__file__).resolve().parents[1])}
    variants: list[tuple[str, dict[str, str], list[str]]] = [
        (f"per-client-{n}", here, ["--web-max-requests-per-client", n]) for n in args.per_client.split(",")
    ]
    if args.before is not None:
        variants.append(("before", {"PYTHONPATH": exporter_pythonpath(args.before.resolve())}, []))
        if args.before_first:
            variants.reverse()
    w = Workload(claims=args.claims, pods=args.pods)
    with (
        tempfile.TemporaryDirectory(prefix="otel-dra-hostile-") as tmp,
        running(Path(tmp) / "testbed", binaries=find_binaries()) as tb,
    ):
        admin = KubeClient(load_credentials(str(tb.kubeconfig)), max_connections=32)
        results["load_seconds"] = round(load(admin, w), 1)
        for name, env, extra in variants:
            ex = Exporter(str(tb.kubeconfig), Path(tmp) / f"exporter-{name}.log", env=env, extra_args=extra)
            try:
                results[name] = measure(ex, args)
            finally:
                if ex.proc.poll() is None:
                    ex.stop()
            print(json.dumps({name: results[name]}), flush=True)
    if args.json:
        write_json(args.json, results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
