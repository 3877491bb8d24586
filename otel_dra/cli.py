"""The ``otel-dra`` command. The only module that wires telemetry, Kubernetes and servers together."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from otel_dra import __version__
from otel_dra.cluster.sharding import Shard, ordinal_from_pod_name

log = logging.getLogger("otel_dra")


class UsageError(ValueError):
    """A flag or environment variable with an invalid value."""


# --- flag helpers: every flag has an environment variable; both are validated ------------------
def _env(name: str, default: str | None) -> str | None:
    return os.environ.get(name, default)


def _int_in(lo: int, hi: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if not lo <= value <= hi:
            raise argparse.ArgumentTypeError(f"{value} is outside {lo}..{hi}")
        return value

    return parse


def _positive_seconds(text: str) -> float:
    raw = text.strip().removesuffix("s")
    try:
        value = float(raw)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not 0 < value < 86400:
        raise argparse.ArgumentTypeError(f"{text!r} must be between 0 and 86400 seconds")
    return value


def _device_attributes(text: str) -> Any:
    from otel_dra.cluster.resourceslice import DeviceAttributes

    try:
        return DeviceAttributes.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off", ""):
        return False
    raise argparse.ArgumentTypeError(f"{text!r} is not a boolean (true/false)")


def _add(parser: argparse.ArgumentParser, flag: str, env: str, help: str, **kwargs: Any) -> None:
    default = kwargs.pop("default", None)
    raw = os.environ.get(env)
    if raw is not None:
        convert = kwargs.get("type")
        choices = kwargs.get("choices")
        if choices is not None and raw not in choices:
            raise UsageError(f"environment variable {env}={raw!r}: expected one of {', '.join(choices)}")
        try:
            default = convert(raw) if convert else raw
        except argparse.ArgumentTypeError as exc:
            raise UsageError(f"environment variable {env}: {exc}") from None
    parser.add_argument(flag, default=default, help=f"{help} [env {env}]", **kwargs)


# --- exporter ----------------------------------------------------------------------------------
def _exporter_parser(sub: Any) -> None:
    p = sub.add_parser(
        "exporter",
        help="serve DRA cluster-state metrics (ResourceClaims, ResourceSlices, DeviceClasses)",
        description="Watches resource.k8s.io/v1 objects and serves their metrics on /metrics "
        "(Prometheus) and, when OTEL_EXPORTER_OTLP_ENDPOINT is set, pushes them over OTLP.",
    )
    p.add_argument(
        "--kubeconfig",
        default=None,
        help="kubeconfig file; default: KUBECONFIG (path list), else in-cluster, else ~/.kube/config",
    )
    _add(p, "--address", "OTEL_DRA_ADDRESS", "listen address (default: all interfaces)", default="")
    _add(p, "--port", "OTEL_DRA_PORT", "listen port (0: pick a free one)", default=8080, type=_int_in(0, 65535))
    _add_common(p)
    _add(
        p,
        "--stale-after",
        "OTEL_DRA_STALE_AFTER",
        "seconds a broken watch may take to recover before /metrics answers 500",
        default=30.0,
        type=_positive_seconds,
    )
    _add(p, "--page-size", "OTEL_DRA_PAGE_SIZE", "objects per list page", default=500, type=_int_in(1, 10000))
    _add(
        p,
        "--target-info",
        "OTEL_DRA_TARGET_INFO",
        "emit the target_info series with the OTel resource attributes",
        default=True,
        type=_bool,
    )
    _add(
        p,
        "--shard",
        "OTEL_DRA_SHARD",
        "this replica's shard number, or 'auto' to take it from the StatefulSet ordinal in POD_NAME",
        default="0",
    )
    _add(p, "--total-shards", "OTEL_DRA_TOTAL_SHARDS", "number of shards", default=1, type=_int_in(1, 1024))
    from otel_dra.cluster.resourceslice import DEFAULT_DEVICE_ATTRIBUTES, MAX_DEVICE_ATTRIBUTES

    _add(
        p,
        "--device-attributes",
        "OTEL_DRA_DEVICE_ATTRIBUTES",
        f"comma-separated device attributes that kube_resourceslice_device_info carries as labels "
        f"(at most {MAX_DEVICE_ATTRIBUTES}; default {DEFAULT_DEVICE_ATTRIBUTES})",
        default=_device_attributes(DEFAULT_DEVICE_ATTRIBUTES),
        type=_device_attributes,
    )
    _add(
        p,
        "--leak-grace-period",
        "OTEL_DRA_LEAK_GRACE_PERIOD",
        "seconds a claim may stay allocated and reserved by nobody before kube_resourceclaim_leaked reports it",
        default=600.0,
        type=_positive_seconds,
    )
    p.set_defaults(func=cmd_exporter)


def _shard(args: argparse.Namespace) -> Shard:

    raw = str(args.shard).strip()
    try:
        if raw == "auto":
            pod = os.environ.get("POD_NAME", "")
            if not pod:
                raise ValueError("--shard=auto needs the POD_NAME environment variable (the downward API)")
            index = ordinal_from_pod_name(pod)
        else:
            try:
                index = int(raw)
            except ValueError:
                raise ValueError(f"--shard {raw!r}: expected a number or 'auto'") from None
        return Shard(index, args.total_shards)
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def _add_common(p: argparse.ArgumentParser) -> None:
    _add(p, "--log-format", "OTEL_DRA_LOG_FORMAT", "text or json", default="text", choices=("text", "json"))
    _add(
        p,
        "--log-level",
        "OTEL_DRA_LOG_LEVEL",
        "debug, info, warning, error",
        default="info",
        choices=("debug", "info", "warning", "error"),
    )


@dataclass
class ExporterApp:
    """A running exporter (used by the CLI and by in-process tests)."""

    server: Any
    state: Any
    pipeline: Any
    pusher: Any = None

    @property
    def port(self) -> int:
        return int(self.server.port)

    _stopped: bool = False

    def stop(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        self.server.stop()
        self.state.stop()
        if self.pusher is not None:
            self.pusher.shutdown()  # pushes the final state once
        self.pipeline.shutdown()


def start_exporter(
    *,
    kubeconfig: str | None,
    address: str = "",
    port: int = 8080,
    stale_after: float = 30.0,
    page_size: int = 500,
    target_info: bool = True,
    shard: Shard | None = None,
    device_attributes: Any = None,
    leak_grace: float = 600.0,
) -> ExporterApp:
    from otel_dra.cluster.exporter import ClusterState
    from otel_dra.kube.client import KubeClient, load_credentials
    from otel_dra.telemetry.exposition import assemble
    from otel_dra.telemetry.http import Endpoints, MetricsServer, NotReady
    from otel_dra.telemetry.provider import build_metrics_pipeline

    # A scrape thread waiting for the GIL while another thread runs Python (a watch burst, an OTLP
    # push) waits up to the switch interval; 1 ms instead of 5 ms keeps scrapes responsive.
    sys.setswitchinterval(0.001)
    credentials = load_credentials(kubeconfig)
    log.info("using Kubernetes credentials from %s (server %s)", credentials.source, credentials.host)
    pipeline = build_metrics_pipeline(
        service_name="otel-dra-exporter",
        version=__version__,
        target_info=target_info,
    )
    if pipeline.otlp is not None:
        log.info("pushing metrics over OTLP (%s) to %s", pipeline.otlp.protocol, pipeline.otlp.endpoint)
    client = KubeClient(credentials, user_agent=f"otel-dra-exporter/{__version__}")
    state = ClusterState(
        client,
        pipeline.meter_provider,
        otlp=pipeline.otlp is not None,
        stale_after=stale_after,
        page_size=page_size,
        shard=shard,
        leak_grace=leak_grace,
        **({"device_attributes": device_attributes} if device_attributes is not None else {}),
    )
    if state.shard.sharded:
        log.info("serving shard %d of %d", state.shard.index, state.shard.total)

    def scrape(openmetrics: bool, gzipped: bool) -> list[bytes]:
        reason = state.not_synced()
        if reason is not None:
            raise NotReady(reason)
        return assemble(pipeline.registry, state.blocks(), openmetrics, gzipped)

    def on_scrape(seconds: float, cpu_seconds: float, ok: bool) -> None:
        if ok:
            state.record_collection(seconds, "prometheus", cpu_seconds)

    pusher = None
    if pipeline.otlp is not None:
        from otel_dra.cluster.exporter import SCOPE
        from otel_dra.telemetry.otlp_encode import RequestBuilder
        from otel_dra.telemetry.otlp_push import PreEncodedPusher, raw_sender

        def on_export(seconds: float, cpu_seconds: float, ok: bool) -> None:
            state.record_collection(seconds, "otlp", cpu_seconds)
            log.debug("OTLP state push: %.3fs wall, %.3fs CPU, ok=%s", seconds, cpu_seconds, ok)

        pusher = PreEncodedPusher(
            state.otlp_source,
            RequestBuilder(pipeline.resource, SCOPE, __version__),
            raw_sender(pipeline.otlp),
            on_export=on_export,
        )
    server = MetricsServer(Endpoints(scrape, state.not_synced, on_scrape), address, port)
    state.start()
    server.start()
    if pusher is not None:
        pusher.start()
    log.info("serving /metrics, /healthz, /readyz on %s:%d", address or "0.0.0.0", server.port)
    return ExporterApp(server, state, pipeline, pusher)


def stop_on_signals() -> threading.Event:
    """An event set by SIGTERM or SIGINT; install it before starting anything long-lived."""
    stop = threading.Event()

    def handler(signum: int, frame: object) -> None:
        log.info("received %s, shutting down", signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
    return stop


def wait_for(stop: threading.Event) -> None:
    while not stop.wait(3600):
        pass


def cmd_exporter(args: argparse.Namespace) -> int:
    from otel_dra.kube.client import CredentialsError
    from otel_dra.telemetry.otlp import ConfigError

    shard = _shard(args)
    stop = stop_on_signals()
    try:
        app = start_exporter(
            shard=shard,
            kubeconfig=args.kubeconfig,
            address=args.address,
            port=args.port,
            stale_after=args.stale_after,
            page_size=args.page_size,
            target_info=args.target_info,
            device_attributes=args.device_attributes,
            leak_grace=args.leak_grace_period,
        )
    except (CredentialsError, ConfigError) as exc:
        log.error("%s", exc)
        return 2
    except OSError as exc:
        log.error("cannot listen on %s:%d: %s", args.address or "0.0.0.0", args.port, exc)
        return 2
    wait_for(stop)
    started = time.monotonic()
    app.stop()
    log.info("stopped in %.1fs", time.monotonic() - started)
    return 0


# --- main --------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="otel-dra", description="OpenTelemetry-native observability for DRA")
    parser.add_argument("--version", action="version", version=f"otel-dra {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    _exporter_parser(sub)
    try:
        from otel_dra.testbed.cli import add_subcommands
    except ImportError:  # pragma: no cover - during development only
        pass
    else:
        add_subcommands(sub)
    try:
        from otel_dra.sandbox import add_subcommand
    except ImportError:  # pragma: no cover
        pass
    else:
        add_subcommand(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    from otel_dra.logs import setup_logging

    try:
        parser = build_parser()
    except UsageError as exc:
        print(f"otel-dra: error: {exc}", file=sys.stderr)
        return 2
    args = parser.parse_args(argv)
    setup_logging(getattr(args, "log_format", "text"), getattr(args, "log_level", "info"))
    try:
        result: int = args.func(args)
    except UsageError as exc:
        print(f"otel-dra: error: {exc}", file=sys.stderr)
        return 2
    return result
