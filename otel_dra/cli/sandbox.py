"""``otel-dra sandbox``: a local control plane with sample DRA objects and the exporter on :8080.

The zero-setup way to see the exporter work: it builds the testbed binaries on first use (several
minutes, cached afterwards), starts etcd + kube-apiserver in a temporary directory, loads the
sample fixture set (otel_dra/fixtures/sample.yaml) and serves /metrics until Ctrl-C, after which
nothing is left running.
"""

from __future__ import annotations

import argparse
import logging
import tempfile
from pathlib import Path
from typing import Any

from otel_dra.cli.exporter import start_exporter
from otel_dra.cli.flags import add_flag, add_logging_flags, int_in
from otel_dra.cli.lifecycle import stop_on_signals, wait_for
from otel_dra.cli.testbed import add_kubernetes_version_flag

log = logging.getLogger("otel_dra.sandbox")


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "sandbox",
        help="run the exporter against a local testbed loaded with sample DRA objects",
        description=__doc__,
    )
    p.add_argument("--dir", default=None, help="testbed state directory (default: a temporary one)")
    add_flag(p, "--port", "OTEL_DRA_PORT", "exporter listen port", default=8080, type=int_in(0, 65535))
    add_flag(p, "--address", "OTEL_DRA_ADDRESS", "exporter listen address", default="127.0.0.1")
    add_kubernetes_version_flag(p)
    add_logging_flags(p)
    p.set_defaults(func=cmd_sandbox)


def cmd_sandbox(args: argparse.Namespace) -> int:
    from otel_dra.fixtures import apply_all, sample_objects
    from otel_dra.kube.client import KubeClient, load_credentials
    from otel_dra.testbed import find_or_build_binaries, running

    stop = stop_on_signals()
    binaries = find_or_build_binaries(args.kubernetes_version)
    with tempfile.TemporaryDirectory(prefix="otel-dra-sandbox-") as tmp:
        directory = Path(args.dir) if args.dir else Path(tmp)
        with running(directory, binaries=binaries, kubernetes_version=args.kubernetes_version) as testbed:
            kubeconfig = str(testbed.kubeconfig)
            apply_all(KubeClient(load_credentials(kubeconfig)), sample_objects())
            try:
                app = start_exporter(kubeconfig=kubeconfig, address=args.address, port=args.port)
            except OSError as exc:
                log.error("cannot listen on port %d: %s", args.port, exc)
                return 2
            while not stop.is_set() and not app.state.wait_synced(1):
                pass
            host = args.address or "127.0.0.1"
            print(
                f"\nsandbox ready:\n"
                f"  curl -s http://{host}:{app.port}/metrics | grep ^kube_\n"
                f"  KUBECONFIG={kubeconfig} kubectl get resourceclaims -A   "
                f"(kubectl: {binaries.kubectl})\n"
                f"Ctrl-C stops the exporter and the testbed.\n",
                flush=True,
            )
            try:
                wait_for(stop)
            finally:
                app.stop()
    return 0
