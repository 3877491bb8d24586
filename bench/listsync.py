"""Initial sync of two exporter source trees on one loaded testbed, alternated (issue 13).

    python -m bench.listsync --claims 5000 --tree old=/work/main --tree new=. [--rounds 3]

Per size: one testbed loaded with bench/workload.py (claims, pods, slices), then for each round
an exporter from each tree (``name=DIR``, optionally ``name=DIR:--page-size=1000``), one at a
time: seconds from process start to /readyz, and the exporter's CPU seconds (user+system) by
then. Also, per object of one real 500-object page of pods and of claims, the API server's answer
time and size as JSON and as protobuf, and the decode time with json, orjson (if installed) and the
trimmed protobuf messages (decode_times).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench import write_json
from bench.exporter import Exporter
from bench.scale import exporter_pythonpath
from bench.workload import Workload, load
from otel_dra.cluster import pod
from otel_dra.kube import protobuf
from otel_dra.kube.client import KubeClient, load_credentials
from otel_dra.testbed import find_binaries, running


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def decode_times(admin: KubeClient) -> dict[str, float]:
    """Per object, for one real 500-object page of pods and of claims: the API server's time to
    answer it as JSON and as protobuf, its size, and the client's decode into the dicts the parsers
    read (``json.loads``; orjson if installed; the trimmed protobuf messages and ``from_protobuf``)."""
    out: dict[str, float] = {}
    # Claims have no protobuf decoder any more (listed as JSON: decoding them from protobuf cost
    # more, 38.3 against 16.1 us per claim at fff7414); their answer sizes and times still show.
    item_decoders: dict[str, Callable[[bytes], dict[str, Any]] | None] = {"pod": pod.from_protobuf, "claim": None}
    for kind, path in (("pod", "/api/v1/pods"), ("claim", "/apis/resource.k8s.io/v1/resourceclaims")):
        item_decoder = item_decoders[kind]
        start = time.perf_counter()
        raw = admin.get_bytes(path, {"limit": 500})
        json_fetch = time.perf_counter() - start
        start = time.perf_counter()
        pb = admin.get_bytes(path, {"limit": 500}, headers={"Accept": protobuf.ACCEPT})
        pb_fetch = time.perf_counter() - start
        n = len(json.loads(raw)["items"])
        out[f"{kind}_json_bytes"] = round(len(raw) / n)
        out[f"{kind}_protobuf_bytes"] = round(len(pb) / n)
        out[f"{kind}_json_fetch_us"] = round(json_fetch / n * 1e6, 1)
        out[f"{kind}_protobuf_fetch_us"] = round(pb_fetch / n * 1e6, 1)
        decoders: dict[str, Any] = {"json": json.loads}
        try:
            import orjson

            decoders["orjson"] = orjson.loads
        except ImportError:
            pass
        gc.disable()  # as the reflector decodes a list (otel_dra/cluster/store.py, _gc_paused)
        for name, loads in decoders.items():
            start = time.perf_counter()
            for _ in range(10):
                loads(raw)
            out[f"{kind}_{name}_us"] = round((time.perf_counter() - start) / 10 / n * 1e6, 1)
        if item_decoder is not None:
            start = time.perf_counter()
            for _ in range(10):
                [item_decoder(item) for item in protobuf.list_page(pb).items]
            out[f"{kind}_protobuf_us"] = round((time.perf_counter() - start) / 10 / n * 1e6, 1)
        gc.enable()
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--claims", type=int, nargs="+", default=[5000])
    parser.add_argument("--tree", action="append", required=True, help="name=DIR[:extra-args,comma-separated]")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    trees = []
    for spec in args.tree:
        name, rest = spec.split("=", 1)
        path, _, extra = rest.partition(":")
        env = {"PYTHONPATH": exporter_pythonpath(Path(path).resolve())}
        trees.append((name, env, [a for a in extra.split(",") if a]))
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="otel-dra-listsync-") as tmp:
        for n in args.claims:
            w = Workload(claims=n, namespaces=100, classes=50, pods=True)
            with running(Path(tmp) / f"tb-{n}", binaries=find_binaries()) as tb:
                admin = KubeClient(load_credentials(str(tb.kubeconfig)), max_connections=32)
                r: dict[str, Any] = {"claims": n, "load_s": round(load(admin, w, concurrency=16), 1)}
                r["decode"] = decode_times(admin)
                print(f"[{n}] loaded in {r['load_s']} s; decode {r['decode']}", flush=True)
                runs: dict[str, list[tuple[float, float]]] = {name: [] for name, _, _ in trees}
                for i in range(args.rounds):
                    for name, env, extra in trees:
                        log = Path(tmp) / f"ex-{name}-{n}-{i}.log"
                        ex = Exporter(str(tb.kubeconfig), log, env=env, extra_args=extra)
                        sync = ex.wait_ready()
                        cpu = cpu_seconds(ex.proc.pid)
                        ex.stop()
                        runs[name].append((round(sync, 2), round(cpu, 2)))
                        print(f"[{n}] {name} round {i}: sync {sync:.2f} s, cpu {cpu:.2f} s", flush=True)
                r["runs"] = runs
                r["median"] = {
                    name: {"sync_s": statistics.median(s for s, _ in v), "cpu_s": statistics.median(c for _, c in v)}
                    for name, v in runs.items()
                }
                print(json.dumps(r), flush=True)
                results.append(r)
                if args.json:
                    write_json(args.json, results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
