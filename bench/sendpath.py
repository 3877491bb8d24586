"""A quiet scrape of a large body, this tree's metrics server against another tree's, alternated.

    python -m bench.sendpath --before DIR [--rounds 150] [--mb 28] [--pin] [--json out.json]

Each tree's ``MetricsServer`` runs in its own interpreter and serves the same pre-rendered body
(``--mb`` megabytes of device_info-like lines in ~1.8 MB buffers, as the exporter's families are),
so nothing but the server differs: no testbed, no exporter, no rendering. The rounds alternate the
order of the two servers; each scrape is ``curl`` (a new connection), timed by curl (connect, first
byte, last byte). The servers also time their own ``send_buffers`` call (the one ``sendmsg`` of the
body). ``--pin`` runs the servers on CPU 1 and curl on CPU 0 (``taskset``), to tell what the server
does from where the kernel's scheduler happens to place the sending thread relative to the client.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from bench import write_json
from bench.exporter import machine

# Run in each server's interpreter: the tree's own otel_dra, its send_buffers timed; on SIGTERM the
# send times go to stdout as one JSON line.
_SERVER = r"""
import json, os, signal, sys, time
sys.path.insert(0, sys.argv[1])
import otel_dra.telemetry.http as http
line = (b'kube_resourceclaim_device_info{namespace="ns-0001",claim="claim-00001",'
        b'driver="gpu.example.com",pool="node-0001",device="gpu-3"} 1\n')
buf = line * 14000
parts = [buf] * max(1, int(float(sys.argv[2]) * 1e6) // len(buf))
sends = []
original = http.send_buffers
def timed(sock, body):
    start = time.perf_counter()
    original(sock, body)
    sends.append((time.perf_counter() - start) * 1000)
http.send_buffers = timed
endpoints = http.Endpoints(scrape=lambda om, gz: parts, ready=lambda: None)
server = http.MetricsServer(endpoints, address="127.0.0.1", port=0)
server.start()
def done(*_):
    print(json.dumps({"send_ms": sends, "body_bytes": sum(map(len, parts))}), flush=True)
    os._exit(0)
signal.signal(signal.SIGTERM, done)
print(server.port, flush=True)
while True:
    time.sleep(1)
"""


def _median(values: list[float]) -> float:
    return round(statistics.median(values), 2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", type=Path, required=True, help="the other source tree")
    parser.add_argument("--rounds", type=int, default=150)
    parser.add_argument("--mb", type=float, default=28.0, help="body size in MB")
    parser.add_argument("--pin", action="store_true", help="servers on CPU 1, curl on CPU 0")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()

    trees = {"after": Path(__file__).resolve().parent.parent, "before": args.before.resolve()}
    server_prefix = ["taskset", "-c", "1"] if args.pin else []
    client_prefix = ["taskset", "-c", "0"] if args.pin else []
    procs: dict[str, subprocess.Popen[str]] = {}
    ports: dict[str, int] = {}
    try:
        for name, tree in trees.items():
            proc = subprocess.Popen(
                [*server_prefix, sys.executable, "-c", _SERVER, str(tree), str(args.mb)],
                stdout=subprocess.PIPE,
                text=True,
            )
            procs[name] = proc
            assert proc.stdout is not None
            ports[name] = int(proc.stdout.readline())
        timings: dict[str, list[list[float]]] = {name: [] for name in trees}
        names = list(trees)
        for round_ in range(args.rounds):
            for name in names if round_ % 2 == 0 else names[::-1]:
                out = subprocess.run(
                    [
                        *client_prefix,
                        "curl",
                        "-sS",
                        "-o",
                        os.devnull,
                        "-w",
                        "%{time_connect} %{time_starttransfer} %{time_total}",
                        f"http://127.0.0.1:{ports[name]}/metrics",
                    ],
                    check=True,
                    capture_output=True,
                    text=True,
                ).stdout
                timings[name].append([float(x) * 1000 for x in out.split()])
        result: dict[str, Any] = {"machine": machine(), "args": {k: str(v) for k, v in vars(args).items()}}
        for name, proc in procs.items():
            proc.send_signal(signal.SIGTERM)
            assert proc.stdout is not None
            sent = json.loads(proc.stdout.readline())
            proc.wait(10)
            connect, first_byte, total = (list(c) for c in zip(*timings[name], strict=True))
            result[name] = {
                "tree": str(trees[name]),
                "body_bytes": sent["body_bytes"],
                "connect_ms_p50": _median(connect),
                "first_byte_ms_p50": _median(first_byte),
                "total_ms_p50": _median(total),
                "send_ms_p50": _median(sent["send_ms"]),
                "scrapes": len(total),
            }
            print(f"{name}: {result[name]}")
        if args.json is not None:
            write_json(args.json, result)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()


if __name__ == "__main__":
    main()
