"""The ``otel-dra`` command line: the top-level parser and ``main``.

Each command lives in a module of its own, which owns its flags, its wiring and its ``cmd_*``
function: ``exporter``, ``plugin``, ``binding_controller``, ``webhook``, ``testbed``, ``kubelet_sim``,
``demo``, ``sandbox``. Flags and their environment variables are declared with :mod:`otel_dra.cli.flags`;
signal handling and waiting are in :mod:`otel_dra.cli.lifecycle`. This package is the only one that
wires the layers (telemetry, Kubernetes client, cluster collector, plugin, binding controller,
admission webhook, emulator, testbed) together.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import sys
from collections.abc import Sequence

from otel_dra import __version__
from otel_dra.cli.flags import UsageError

__all__ = ["COMMANDS", "UsageError", "build_parser", "main"]

# The commands, each a module of this package named like it (``-`` as ``_``), in the order of
# `otel-dra --help`. Imported only when a parser for them is built: the testbed and demo modules
# pull in yaml, the emulator and the OTel SDK's exporters at import, which the plugin (started on
# every node, measured in CPU until the kubelet registers it) has no use for.
COMMANDS = ("exporter", "plugin", "binding-controller", "webhook", "testbed", "sandbox", "kubelet-sim", "demo")


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The ``otel-dra`` parser; with ``only``, the same parser holding just that command."""
    parser = argparse.ArgumentParser(prog="otel-dra", description="OpenTelemetry-native observability for DRA")
    parser.add_argument("--version", action="version", version=f"otel-dra {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS if only is None else (only,):
        importlib.import_module(f"otel_dra.cli.{command.replace('-', '_')}").add_parser(sub)
    return parser


def _command_of(argv: Sequence[str]) -> str | None:
    """The command ``argv`` names first, if it names one before any option (``otel-dra plugin
    ...``); None otherwise (``--help``, ``--version``, a typo: the full parser answers those)."""
    for arg in argv:
        if arg.startswith("-"):
            return None
        return arg if arg in COMMANDS else None
    return None


def main(argv: Sequence[str] | None = None) -> int:
    # Start-up (importing the command's modules, building its objects) allocates tens of thousands
    # of objects that live as long as the process: the cyclic GC's collections meanwhile find next
    # to nothing and cost about 4% of the plugin's start-up CPU (issue 12). Off until the command
    # runs; a command that sets ``gc_after_start`` (the plugin) turns it back on itself once started.
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        return _main(argv)
    finally:
        if gc_was_enabled:
            gc.enable()


def _main(argv: Sequence[str] | None) -> int:
    from otel_dra.logs import setup_logging

    if argv is None:
        argv = sys.argv[1:]
    try:
        parser = build_parser(_command_of(argv))
    except UsageError as exc:
        print(f"otel-dra: error: {exc}", file=sys.stderr)
        return 2
    args = parser.parse_args(argv)
    for error in getattr(args, "env_errors", None) or []:
        print(f"otel-dra: error: {error}", file=sys.stderr)
    if getattr(args, "env_errors", None):
        return 2
    setup_logging(getattr(args, "log_format", "text"), getattr(args, "log_level", "info"))
    if not getattr(args, "gc_after_start", False):
        gc.enable()
    try:
        result: int = args.func(args)
    except UsageError as exc:
        print(f"otel-dra: error: {exc}", file=sys.stderr)
        return 2
    return result
