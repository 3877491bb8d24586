"""In-process memory of the exporter's cache at N claims, without an API server or HTTP.

    python -m bench.memory 100000 [--otlp] [--allowlist REGEXES] [--pods]
    python -m bench.memory 100000 --exporter-path /tmp/older-tree     # another version of otel_dra

Feeds the stores of a ClusterState the bench/workload.py objects (DeviceClasses, slices, claims;
with --pods one Pod per claim too),
as a full list in key order like the API server's, then joins every segment (as the first scrape,
and with --otlp the first push, would) and reports the process's RSS growth and the time the first
push took to join (and, from 7ee9e26 on, encode) the points. It measures the
cache and the joins, not the benchmark's process (interpreter, HTTP server, watch buffers): use it
to compare versions at sizes the full harness takes too long for, not as the RSS of a deployment.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any


def rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS"):
            return int(line.split()[1]) / 1024
    return 0.0


def _objects(make: Callable[[int], dict[str, Any]], count: int, prefix: str) -> Iterator[dict[str, Any]]:
    status_write = {"manager": "bench", "operation": "Update", "subresource": "status", "time": "2026-11-30T00:00:01Z"}
    for i in range(count):
        obj = make(i)
        obj["metadata"].update(
            resourceVersion=str(i + 1),
            uid=f"{prefix}{i}",
            creationTimestamp="2026-11-30T00:00:00Z",
            managedFields=[status_write],
        )
        yield obj


def fill(state: Any, w: Any) -> None:
    """Feed ``state``'s ``classes``, ``slices`` and ``claims`` stores the objects of Workload ``w``,
    each as one full list in key order (a store that is None, a resource not watched, is skipped);
    with ``w.pods`` its ``pods`` store the pods."""
    from bench.workload import claim, device_class, pod, resource_slice

    # The API server lists by key: namespace, then name.
    order = [j for ns in range(w.namespaces) for j in range(ns, w.claims, w.namespaces)]
    for store, make, count, prefix in (
        (state.classes, device_class, w.classes, "d"),
        (state.slices, lambda i: resource_slice(i, w), w.slices, "s"),
        (state.claims, lambda i: claim(order[i], w), w.claims, "c"),
        (getattr(state, "pods", None) if w.pods else None, lambda i: pod(order[i], w), w.claims, "p"),
    ):
        if store is not None:
            store.replace(_objects(make, count, prefix))


def measure(claims: int, otlp: bool, allowlist: str = "", pods: bool = False) -> dict[str, Any]:
    from opentelemetry.sdk.metrics import MeterProvider

    from bench.workload import Workload
    from otel_dra.cluster.exporter import ClusterState

    w = Workload(claims=claims, namespaces=100, classes=50, pods=pods)
    options: dict[str, Any] = {}
    if allowlist:  # the version measured has metric lists
        from bench.scale import SEED_ALLOWLIST
        from otel_dra.cluster.exporter import all_families
        from otel_dra.cluster.selection import FamilySelection

        names = [f.prom_name for f in all_families()]
        entries = SEED_ALLOWLIST if allowlist == "seed" else allowlist
        options["families"] = FamilySelection.parse(entries, allow=True, names=names)
    state = ClusterState(object(), MeterProvider(), otlp=otlp, **options)  # type: ignore[arg-type]
    before = rss_mib()
    start = time.perf_counter()
    fill(state, w)
    build = time.perf_counter() - start
    stores = getattr(state, "series_stores", state.stores)  # older versions have no joins
    body = sum(len(c.data) for s in stores for _, chunks in s.blocks() for c in chunks)
    first_push = 0.0
    if otlp:
        start = time.perf_counter()
        for s in stores:
            s.otlp_metrics()  # newer versions encode the points here, at the first push
        first_push = time.perf_counter() - start
    gc.collect()
    return {
        "claims": claims,
        "otlp": otlp,
        "allowlist": allowlist,
        "pods": claims if pods and getattr(state, "pods", None) is not None else 0,
        "build_s": round(build, 1),
        "first_push_points_s": round(first_push, 1),
        "body_mb": round(body / 1e6, 1),
        "rss_growth_mib": round(rss_mib() - before),
        "rss_mib": round(rss_mib()),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("claims", type=int)
    parser.add_argument("--otlp", action="store_true", help="also encode OTLP points (as when pushing)")
    parser.add_argument("--exporter-path", type=Path, default=None, help="measure otel_dra from this source tree")
    parser.add_argument("--allowlist", default="", help="a --metric-allowlist; seed: the seven seed families")
    parser.add_argument("--pods", action="store_true", help="also one Pod per claim (the pods store)")
    args = parser.parse_args()
    if args.exporter_path is not None:
        from bench.scale import exporter_pythonpath

        cmd = [sys.executable, "-m", "bench.memory", str(args.claims), *(["--otlp"] if args.otlp else [])]
        cmd += ["--allowlist", args.allowlist] if args.allowlist else []
        cmd += ["--pods"] if args.pods else []
        env_path = exporter_pythonpath(args.exporter_path.resolve())
        env = {**os.environ, "PYTHONPATH": f"{env_path}:{Path(__file__).resolve().parents[1]}"}
        return subprocess.run(cmd, env=env, check=False).returncode
    print(json.dumps(measure(args.claims, args.otlp, args.allowlist, args.pods)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
