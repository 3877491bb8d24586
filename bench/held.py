"""Load a workload into a testbed once and keep it, so that several exporters can be measured
against the same objects (loading workload L takes half an hour of both cores).

    python -m bench.held 100000 --dir /tmp/held-L          # prints the kubeconfig once loaded; Ctrl-C ends it
    bench/held_exporter.sh /tmp/held-L/tb/kubeconfig TREE NAME [exporter args]   # one exporter, measured

The testbed is the benchmark's (bench/workload.py objects: claims, one reserving pod each, slices,
classes), on the Kubernetes version of OTEL_DRA_KUBERNETES_VERSION (the testbed's default: the
newest). docs/benchmarks-log.md, "Runs 4-8" and "The runs of 2026-12-02", were measured this way.
"""

from __future__ import annotations

import argparse
import signal
import sys
import time
from pathlib import Path

from bench.workload import Workload, load
from otel_dra.kube.client import KubeClient, load_credentials
from otel_dra.testbed import find_binaries, running


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("claims", type=int)
    parser.add_argument("--dir", type=Path, required=True, help="the testbed's state (etcd data, kubeconfig)")
    parser.add_argument("--no-pods", action="store_true", help="without the reserving pods")
    args = parser.parse_args()
    w = Workload(claims=args.claims, namespaces=100, classes=50, pods=not args.no_pods)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    with running(args.dir / "tb", binaries=find_binaries()) as tb:
        admin = KubeClient(load_credentials(str(tb.kubeconfig)), max_connections=32)
        print(f"loaded in {load(admin, w, concurrency=16):.1f} s", flush=True)
        print(f"KUBECONFIG {tb.kubeconfig}", flush=True)
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            pass
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
