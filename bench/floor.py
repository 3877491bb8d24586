"""``python -m bench.floor``: what the plugin's Python stack costs at least for a round of the
real-kubelet bench (bench/plugin_real.py), measured apart from the plugin: the CPU floor under
issue 29's "CPU per round <= 1.5x the Go driver" target.

A round of 10 pods is 20 gRPC calls from the kubelet (a prepare and an unprepare per pod, about a
second apart) and at least 20 API requests (the claim read in each prepare, as the Go driver does
too, and the claim's device status write after it). Measured here, on one testbed API server:

- **gRPC**: a grpcio server as the plugin runs it (synchronous server, a thread pool, a unix socket;
  gRPC's experiments as ``otel-dra plugin`` sets them, and grpcio's default for comparison) with an
  empty unary handler, answering ``--calls`` calls ``--gap`` seconds apart from a client in another
  process: the server process's CPU (every thread, from /proc/<pid>/task/*/schedstat) per call;
- **API requests**: ``--calls`` GETs of a ResourceClaim (the plugin's claim read) through the
  plugin's KubeClient (urllib3, TLS, its request observer unset), ``--gap`` seconds apart: the
  requesting thread's CPU per request; and the same through ``http.client`` alone, for scale.

The floor of a round is 20 gRPC calls plus 20 requests at those costs: no span, metric, file or
JSON of the plugin's own in it.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import ssl
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from bench import write_json
from bench.exporter import machine

CALLS_PER_ROUND = 20  # 10 pods: a prepare and an unprepare each
REQUESTS_PER_ROUND = 20  # 10 claim reads, 10 device status writes


def _process_cpu_ns() -> int:
    total = 0
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                total += int(f.read().split()[0])
        except OSError:
            pass  # a thread that ended meanwhile
    return total


def serve_grpc(socket_path: str) -> None:
    """The server side (a process of its own): says "ready", then on each line from stdin prints
    the process's CPU in ns since it said ready."""
    from concurrent import futures

    import grpc

    def empty(request: bytes, context: Any) -> bytes:
        return b""

    handler = grpc.method_handlers_generic_handler("bench.Floor", {"Call": grpc.unary_unary_rpc_method_handler(empty)})
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    server.add_generic_rpc_handlers((handler,))
    server.add_insecure_port(f"unix://{socket_path}")
    server.start()
    time.sleep(0.5)
    start = _process_cpu_ns()
    print("ready", flush=True)
    for _ in sys.stdin:
        print(_process_cpu_ns() - start, flush=True)
    server.stop(0)


def grpc_cpu_per_call(experiments: str | None, calls: int, gap: float, work: Path) -> dict[str, float]:
    import grpc

    socket_path = str(work / f"floor-{len(os.listdir(work))}.sock")
    env = {k: v for k, v in os.environ.items() if k != "GRPC_EXPERIMENTS"}
    if experiments is not None:
        env["GRPC_EXPERIMENTS"] = experiments
    server = subprocess.Popen(
        [sys.executable, "-m", "bench.floor", "--serve-grpc", socket_path],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env=env,
        text=True,
    )
    assert server.stdin is not None and server.stdout is not None
    try:
        if server.stdout.readline().strip() != "ready":
            raise RuntimeError("the gRPC server did not start")
        channel = grpc.insecure_channel(f"unix://{socket_path}")
        call = channel.unary_unary("/bench.Floor/Call")
        latencies = []
        for _ in range(calls):
            time.sleep(gap)
            started = time.perf_counter()
            call(b"x" * 200)
            latencies.append(time.perf_counter() - started)
        channel.close()
        server.stdin.write("report\n")
        server.stdin.flush()
        cpu_ns = int(server.stdout.readline())
    finally:
        server.stdin.close()
        server.wait(timeout=30)
    return {
        "server_cpu_ms_per_call": round(cpu_ns / 1e6 / calls, 3),
        "call_p50_ms": round(statistics.median(latencies) * 1000, 3),
    }


def request_cpu(kubeconfig: str, path: str, calls: int, gap: float) -> dict[str, float]:
    from otel_dra.kube.client import KubeClient, load_credentials

    credentials = load_credentials(kubeconfig)
    client = KubeClient(credentials)
    client.get_json(path)  # the connection made
    spent = []
    for _ in range(calls):
        time.sleep(gap)
        started = time.thread_time()
        client.get_json(path)
        spent.append(time.thread_time() - started)
    # The same requests through http.client alone: TLS, HTTP/1.1 and the JSON decode, nothing else.
    context = ssl.create_default_context(cafile=credentials.ca_file)
    if credentials.cert_file:
        context.load_cert_chain(credentials.cert_file, credentials.key_file)
    url = urlsplit(credentials.host)
    connection = http.client.HTTPSConnection(url.hostname or "", url.port, context=context)
    headers = {"Accept": "application/json", **credentials.auth_headers()}
    connection.request("GET", path, headers=headers)
    connection.getresponse().read()
    bare = []
    for _ in range(calls):
        time.sleep(gap)
        started = time.thread_time()
        connection.request("GET", path, headers=headers)
        json.loads(connection.getresponse().read())
        bare.append(time.thread_time() - started)
    connection.close()
    return {
        "kubeclient_cpu_ms_per_request": round(statistics.fmean(spent) * 1000, 3),
        "http_client_cpu_ms_per_request": round(statistics.fmean(bare) * 1000, 3),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=30, help="gRPC calls and API requests per measurement")
    parser.add_argument("--gap", type=float, default=0.5, help="seconds between calls (the kubelet's are ~1 s apart)")
    parser.add_argument("--rounds", type=int, default=3, help="measurements of each, alternated; medians reported")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--serve-grpc", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_grpc:
        serve_grpc(args.serve_grpc)
        return 0

    from otel_dra.cli.plugin import GRPC_EXPERIMENTS
    from otel_dra.fixtures import create
    from otel_dra.testbed import find_binaries, running

    runs: dict[str, list[dict[str, float]]] = {"plugin": [], "default": [], "requests": []}
    with (
        tempfile.TemporaryDirectory(prefix="otel-dra-floor-", dir="/tmp") as tmp,  # short: unix sockets
        running(Path(tmp) / "tb", binaries=find_binaries()) as testbed,
    ):
        from otel_dra.kube.client import KubeClient, load_credentials

        admin = KubeClient(load_credentials(str(testbed.kubeconfig)))
        claim = {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaim",
            "metadata": {"name": "floor", "namespace": "default"},
            "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.example.com"}}]}},
        }
        create(admin, claim)
        path = "/apis/resource.k8s.io/v1/namespaces/default/resourceclaims/floor"
        for _ in range(args.rounds):
            runs["plugin"].append(grpc_cpu_per_call(GRPC_EXPERIMENTS, args.calls, args.gap, Path(tmp)))
            runs["default"].append(grpc_cpu_per_call(None, args.calls, args.gap, Path(tmp)))
            runs["requests"].append(request_cpu(str(testbed.kubeconfig), path, args.calls, args.gap))
            print(runs["plugin"][-1], runs["default"][-1], runs["requests"][-1], flush=True)

    def median(kind: str, key: str) -> float:
        return round(statistics.median(r[key] for r in runs[kind]), 3)

    grpc_ms = median("plugin", "server_cpu_ms_per_call")
    request_ms = median("requests", "kubeclient_cpu_ms_per_request")
    out: dict[str, Any] = {
        "machine": machine(),
        "date": time.strftime("%Y-%m-%d"),
        "calls": args.calls,
        "gap_s": args.gap,
        "rounds": args.rounds,
        "grpc_plugin_experiments": GRPC_EXPERIMENTS,
        "grpc_server_cpu_ms_per_call": grpc_ms,
        "grpc_server_cpu_ms_per_call_grpcio_default": median("default", "server_cpu_ms_per_call"),
        "grpc_call_p50_ms": median("plugin", "call_p50_ms"),
        "grpc_call_p50_ms_grpcio_default": median("default", "call_p50_ms"),
        "kubeclient_cpu_ms_per_request": request_ms,
        "http_client_cpu_ms_per_request": median("requests", "http_client_cpu_ms_per_request"),
        "floor_cpu_s_per_round": round((CALLS_PER_ROUND * grpc_ms + REQUESTS_PER_ROUND * request_ms) / 1000, 3),
        "runs": runs,
    }
    print(json.dumps(out, indent=2))
    if args.json:
        write_json(args.json, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
