"""The ``otel-dra`` command line: the top-level parser and ``main``.

Each command lives in a module of its own, which owns its flags, its wiring and its ``cmd_*``
function: ``exporter``, ``plugin``, ``testbed``, ``kubelet_sim``, ``demo``, ``sandbox``. Flags and
their environment variables are declared with :mod:`otel_dra.cli.flags`; signal handling and
waiting are in :mod:`otel_dra.cli.lifecycle`. This package is the only one that wires the layers
(telemetry, Kubernetes client, cluster collector, plugin, emulator, testbed) together.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from otel_dra import __version__
from otel_dra.cli import demo, exporter, kubelet_sim, plugin, sandbox, testbed
from otel_dra.cli.flags import UsageError

__all__ = ["UsageError", "build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="otel-dra", description="OpenTelemetry-native observability for DRA")
    parser.add_argument("--version", action="version", version=f"otel-dra {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    # The order is the order of `otel-dra --help`.
    for command in (exporter, plugin, testbed, sandbox, kubelet_sim, demo):
        command.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    from otel_dra.logs import setup_logging

    try:
        parser = build_parser()
    except UsageError as exc:
        print(f"otel-dra: error: {exc}", file=sys.stderr)
        return 2
    args = parser.parse_args(argv)
    for error in getattr(args, "env_errors", None) or []:
        print(f"otel-dra: error: {error}", file=sys.stderr)
    if getattr(args, "env_errors", None):
        return 2
    setup_logging(getattr(args, "log_format", "text"), getattr(args, "log_level", "info"))
    try:
        result: int = args.func(args)
    except UsageError as exc:
        print(f"otel-dra: error: {exc}", file=sys.stderr)
        return 2
    return result
