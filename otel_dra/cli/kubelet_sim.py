"""``otel-dra kubelet-sim``: the kubelet emulator's flags, its wiring and its command."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import Any

from otel_dra import __version__, kubeletsim
from otel_dra.cli.flags import UsageError, add_flag, add_kubeconfig_flag, add_logging_flags, int_in
from otel_dra.cli.lifecycle import stop_on_signals, wait_for
from otel_dra.kubeletsim.sim import DEFAULT_REGISTRY_DIR
from otel_dra.telemetry.tracing import TracingPipeline, build_tracing_pipeline

log = logging.getLogger("otel_dra.kubelet_sim")


def _node(text: str) -> tuple[str, Path]:
    name, _, directory = text.partition("=")
    if not name or "/" in name:
        raise argparse.ArgumentTypeError(f"expected NAME or NAME=REGISTRY_DIR, got {text!r}")
    return name, Path(directory) if directory else DEFAULT_REGISTRY_DIR


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "kubelet-sim",
        help="play the kubelet's DRA part (registration, prepare/unprepare, pod status) for fake nodes",
        description=kubeletsim.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--node",
        dest="nodes",
        action="append",
        type=_node,
        required=True,
        metavar="NAME[=REGISTRY_DIR]",
        help=f"a node to emulate and the directory its plugins register in (default {DEFAULT_REGISTRY_DIR}); "
        "repeatable",
    )
    add_kubeconfig_flag(p)
    add_flag(p, "--workers", "KUBELET_SIM_WORKERS", "pods handled in parallel", default=4, type=int_in(1, 64))
    add_logging_flags(p)
    p.set_defaults(func=cmd_kubelet_sim)


def cmd_kubelet_sim(args: argparse.Namespace) -> int:
    from otel_dra.kube.client import ApiError, CredentialsError, KubeClient, load_credentials
    from otel_dra.kubeletsim.sim import KubeletSim
    from otel_dra.telemetry.otlp import ConfigError

    nodes = dict(args.nodes)
    if len(nodes) != len(args.nodes):
        raise UsageError("--node: a node was given twice")
    stop = stop_on_signals()
    try:
        tracing = build_tracing_pipeline(service_name="otel-dra-kubelet-sim", version=__version__)
        client = KubeClient(load_credentials(args.kubeconfig), user_agent="otel-dra-kubelet-sim")
        sim = KubeletSim(client, nodes, workers=args.workers, tracer=kubelet_tracer(tracing)).start()
    except (CredentialsError, ApiError, ConfigError) as exc:
        log.error("%s", exc)
        return 2
    try:
        wait_for(stop)
    finally:
        sim.stop()
        tracing.shutdown()
    return 0


def kubelet_tracer(tracing: TracingPipeline) -> Any:
    """The emulator's tracer when tracing is configured: its CLIENT span per call becomes the
    parent of the plugin's spans (traceparent in the gRPC metadata), as a traced kubelet's would."""
    return tracing.tracer_provider.get_tracer("otel_dra.kubeletsim", __version__) if tracing.enabled else None
