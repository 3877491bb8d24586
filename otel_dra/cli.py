"""The ``otel-dra`` command. The only module that wires telemetry, Kubernetes and servers together."""

from __future__ import annotations

import argparse
import logging
import os
import re
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
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
    """A flag whose default comes from ``env``. An invalid value in the environment is reported
    (exit 2, naming the variable) only when this subcommand runs: the plugin's generic names
    (NODE_NAME, METRICS_PORT ...) must not break other subcommands that happen to see them."""
    default = kwargs.pop("default", None)
    raw = os.environ.get(env)
    if raw is not None:
        convert = kwargs.get("type")
        choices = kwargs.get("choices")
        error = None
        if choices is not None and raw not in choices:
            error = f"environment variable {env}={raw!r}: expected one of {', '.join(choices)}"
        else:
            try:
                default = convert(raw) if convert else raw
            except argparse.ArgumentTypeError as exc:
                error = f"environment variable {env}: {exc}"
        if error is not None:
            errors: list[str] | None = parser.get_default("env_errors")
            if errors is None:
                errors = []
                parser.set_defaults(env_errors=errors)
            errors.append(error)
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
    from otel_dra.telemetry.priority import ScrapePriority
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

    priority = ScrapePriority()
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
            priority=priority,
        )
    server = MetricsServer(Endpoints(scrape, state.not_synced, on_scrape, priority), address, port)
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


# --- plugin ------------------------------------------------------------------------------------
# Object names the API server accepts for nodes and DRA drivers (DNS subdomains; drivers <= 63).
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
DEVICE_SOURCES = ("simulated", "nvml")


def _dns_subdomain(max_len: int) -> Callable[[str], str]:
    def parse(text: str) -> str:
        value = text.strip()
        if not value or len(value) > max_len or not _DNS_SUBDOMAIN.match(value):
            raise argparse.ArgumentTypeError(
                f"{text!r} is not a lowercase DNS subdomain of at most {max_len} characters"
            )
        return value

    return parse


def _directory(text: str) -> Path:
    if not text.strip():
        raise argparse.ArgumentTypeError("must not be empty")
    return Path(text).expanduser().absolute()


def _plugin_parser(sub: Any) -> None:
    p = sub.add_parser(
        "plugin",
        help="run the example DRA kubelet plugin (simulated or NVML GPUs), with metrics and traces",
        description="A DRA kubelet plugin like kubernetes-sigs/dra-example-driver: registers with the "
        "kubelet, publishes this node's devices as ResourceSlices, prepares and unprepares claims "
        "(CDI specs, checkpoint). Metrics on --metrics-port (Prometheus) and over OTLP, traces over "
        "OTLP, both configured with the standard OTEL_* variables.",
    )
    _add(p, "--node-name", "NODE_NAME", "this node's name (required)", type=_dns_subdomain(253))
    _add(p, "--driver-name", "DRIVER_NAME", "the DRA driver name", default="gpu.example.com", type=_dns_subdomain(63))
    _add(
        p,
        "--num-devices",
        "NUM_DEVICES",
        "simulated GPUs to publish",
        default=8,
        type=_int_in(0, 1024),
    )
    _add(p, "--cdi-root", "CDI_ROOT", "directory for CDI spec files", default=Path("/etc/cdi"), type=_directory)
    _add(
        p,
        "--kubelet-plugins-directory-path",
        "KUBELET_PLUGINS_DIRECTORY_PATH",
        "the kubelet's plugins directory (dra.sock, checkpoint)",
        default=Path("/var/lib/kubelet/plugins"),
        type=_directory,
    )
    _add(
        p,
        "--kubelet-registrar-directory-path",
        "KUBELET_REGISTRAR_DIRECTORY_PATH",
        "the kubelet's plugin registration directory",
        default=Path("/var/lib/kubelet/plugins_registry"),
        type=_directory,
    )
    _add(
        p,
        "--metrics-port",
        "METRICS_PORT",
        "port for /metrics (-1: off, 0: pick a free one)",
        default=-1,
        type=_int_in(-1, 65535),
    )
    _add(
        p,
        "--healthcheck-port",
        "HEALTHCHECK_PORT",
        "port for the gRPC health service (-1: off, 0: pick a free one)",
        default=-1,
        type=_int_in(-1, 65535),
    )
    p.add_argument(
        "--kubeconfig",
        default=None,
        help="kubeconfig file; default: KUBECONFIG (path list), else in-cluster, else ~/.kube/config",
    )
    _add(
        p,
        "--device-source",
        "DEVICE_SOURCE",
        "simulated GPUs, or real NVIDIA GPUs found through NVML",
        default="simulated",
        choices=DEVICE_SOURCES,
    )
    _add(
        p,
        "--remove-slices-on-exit",
        "REMOVE_SLICES_ON_EXIT",
        "delete this node's ResourceSlices on a clean shutdown",
        default=False,
        type=_bool,
    )
    _add_common(p)
    p.set_defaults(func=cmd_plugin)


@dataclass
class PluginApp:
    """A running plugin (used by the CLI and by in-process tests)."""

    server: Any
    publisher: Any
    driver: Any
    metrics_pipeline: Any
    tracing: Any
    metrics_server: Any = None
    health: Any = None
    remove_slices_on_exit: bool = False
    fatal: BaseException | None = None
    _stopped: bool = False

    @property
    def metrics_port(self) -> int | None:
        return None if self.metrics_server is None else int(self.metrics_server.port)

    @property
    def health_port(self) -> int | None:
        return None if self.health is None else int(self.health.port)

    def stop(self, remove_slices: bool | None = None) -> None:
        if self._stopped:
            return
        self._stopped = True
        if self.health is not None:
            self.health.stop()
        self.server.stop()
        self.publisher.stop()
        if self.remove_slices_on_exit if remove_slices is None else remove_slices:
            from otel_dra.kube.client import ApiError

            try:
                self.publisher.delete_all()
            except ApiError as exc:
                log.error("could not delete this node's ResourceSlices: %s", exc)
        if self.metrics_server is not None:
            self.metrics_server.stop()
        self.tracing.shutdown()
        self.metrics_pipeline.shutdown()


def start_plugin(
    *,
    node_name: str,
    kubeconfig: str | None,
    driver_name: str = "gpu.example.com",
    num_devices: int = 8,
    cdi_root: Path = Path("/etc/cdi"),
    plugins_dir: Path = Path("/var/lib/kubelet/plugins"),
    registrar_dir: Path = Path("/var/lib/kubelet/plugins_registry"),
    metrics_port: int = -1,
    metrics_address: str = "",
    healthcheck_port: int = -1,
    device_source: str = "simulated",
    remove_slices_on_exit: bool = False,
    resync: float = 30.0,
    nvml: Any = None,
    tracer_provider: Any = None,
    on_fatal: Callable[[BaseException], None] | None = None,
) -> PluginApp:
    """Start the plugin. ``tracer_provider`` and ``nvml`` replace what the environment would give
    (tests); ``on_fatal`` is called from a background thread when the plugin cannot go on."""
    from otel_dra.kube.client import KubeClient, RetryPolicy, load_credentials
    from otel_dra.plugin.cdi import CdiWriter
    from otel_dra.plugin.checkpoint import Checkpoint
    from otel_dra.plugin.devices import Device, simulated_devices
    from otel_dra.plugin.driver import Driver, Inventory
    from otel_dra.plugin.metrics import PluginMetrics
    from otel_dra.plugin.server import HealthServer, PluginServer
    from otel_dra.plugin.slices import SlicePublisher
    from otel_dra.telemetry.exposition import assemble
    from otel_dra.telemetry.http import Endpoints, MetricsServer
    from otel_dra.telemetry.provider import build_metrics_pipeline, make_resource
    from otel_dra.telemetry.tracing import TracingPipeline, build_tracing_pipeline

    credentials = load_credentials(kubeconfig)
    log.info("using Kubernetes credentials from %s (server %s)", credentials.source, credentials.host)
    if tracer_provider is not None:
        tracing = TracingPipeline(tracer_provider, make_resource("otel-dra-plugin", __version__))
    else:
        tracing = build_tracing_pipeline(service_name="otel-dra-plugin", version=__version__)
    if tracing.enabled:
        log.info("exporting traces (%s) to %s", tracing.exporter_name, tracing.otlp.endpoint if tracing.otlp else "-")
    pipeline = build_metrics_pipeline(service_name="otel-dra-plugin", version=__version__)
    if pipeline.otlp is not None:
        log.info("pushing metrics over OTLP (%s) to %s", pipeline.otlp.protocol, pipeline.otlp.endpoint)
    metrics = PluginMetrics(pipeline.meter_provider)
    client = KubeClient(
        credentials,
        observer=metrics.observe_request,
        retry=RetryPolicy(),
        user_agent=f"otel-dra-plugin/{__version__}",
    )

    if device_source == "nvml":
        from otel_dra.plugin.nvml import discover as nvml_discover

        def discover() -> list[Device]:
            return nvml_discover(nvml)
    else:

        def discover() -> list[Device]:
            return simulated_devices(node_name, num_devices)

    started: list[Any] = []
    try:
        devices = discover()  # at start-up, so that a broken device source fails loudly here
        log.info("%d device(s) from %s: %s", len(devices), device_source, ", ".join(d.name for d in devices) or "-")
        inventory = Inventory(devices)
        cdi = CdiWriter(cdi_root, driver_name, node_name)
        cdi.write_common()
        checkpoint = Checkpoint(plugins_dir / driver_name / "checkpoint.json")
        driver = Driver(
            client=client,
            driver_name=driver_name,
            node_name=node_name,
            inventory=inventory,
            cdi=cdi,
            checkpoint=checkpoint,
            metrics=metrics,
            tracer_provider=tracing.tracer_provider,
        )
        server = PluginServer(
            driver,
            tracing.tracer_provider,
            driver_name=driver_name,
            plugins_dir=plugins_dir,
            registrar_dir=registrar_dir,
        )
        server.start()
        started.append(server)
        app = PluginApp(server, None, driver, pipeline, tracing, remove_slices_on_exit=remove_slices_on_exit)

        def fatal(exc: BaseException) -> None:
            metrics.fatal_error()
            app.fatal = exc
            if on_fatal is not None:
                on_fatal(exc)

        publisher = SlicePublisher(
            client,
            driver_name=driver_name,
            node_name=node_name,
            discover=discover,
            on_devices=inventory.replace,
            on_fatal=fatal,
            resync=resync,
        )
        app.publisher = publisher
        publisher.start()
        started.append(publisher)
        if healthcheck_port >= 0:
            app.health = HealthServer(server, healthcheck_port).start()
            started.append(app.health)
            log.info("serving gRPC health on :%d", app.health.port)
        if metrics_port >= 0:

            def scrape(openmetrics: bool, gzipped: bool) -> list[bytes]:
                return assemble(pipeline.registry, [], openmetrics, gzipped)

            app.metrics_server = MetricsServer(Endpoints(scrape, lambda: None), metrics_address, metrics_port).start()
            log.info("serving metrics on %s:%d", metrics_address or "0.0.0.0", app.metrics_server.port)
    except BaseException:
        for part in reversed(started):
            part.stop()
        tracing.shutdown()
        pipeline.shutdown()
        raise
    return app


def cmd_plugin(args: argparse.Namespace) -> int:
    from otel_dra.kube.client import CredentialsError
    from otel_dra.plugin.checkpoint import CheckpointError
    from otel_dra.plugin.nvml import DiscoveryError
    from otel_dra.plugin.server import PluginStartError
    from otel_dra.telemetry.otlp import ConfigError

    if not args.node_name:
        raise UsageError("--node-name (or NODE_NAME) is required")
    # As for the exporter: a prepare whose API answer has arrived waits for the GIL up to the
    # switch interval while another thread (gRPC, telemetry export) runs Python; 1 ms, not 5.
    sys.setswitchinterval(0.001)
    stop = stop_on_signals()
    try:
        app = start_plugin(
            node_name=args.node_name,
            kubeconfig=args.kubeconfig,
            driver_name=args.driver_name,
            num_devices=args.num_devices,
            cdi_root=args.cdi_root,
            plugins_dir=args.kubelet_plugins_directory_path,
            registrar_dir=args.kubelet_registrar_directory_path,
            metrics_port=args.metrics_port,
            healthcheck_port=args.healthcheck_port,
            device_source=args.device_source,
            remove_slices_on_exit=args.remove_slices_on_exit,
            on_fatal=lambda exc: stop.set(),
        )
    except (CredentialsError, ConfigError) as exc:
        log.error("%s", exc)
        return 2
    except (PluginStartError, CheckpointError, DiscoveryError) as exc:
        log.error("%s", exc)
        return 1
    except OSError as exc:
        log.error("cannot start: %s", exc)
        return 1
    # SIGHUP: rediscover devices and republish now instead of at the next resync.
    signal.signal(signal.SIGHUP, lambda signum, frame: app.publisher.trigger())
    wait_for(stop)
    started = time.monotonic()
    app.stop()
    if app.fatal is not None:
        log.error("stopped after a fatal error: %s", app.fatal)
        return 1
    log.info("stopped in %.1fs", time.monotonic() - started)
    return 0


# --- main --------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="otel-dra", description="OpenTelemetry-native observability for DRA")
    parser.add_argument("--version", action="version", version=f"otel-dra {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    _exporter_parser(sub)
    _plugin_parser(sub)
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
    from otel_dra.kubeletsim.cli import add_subcommand as add_kubelet_sim

    add_kubelet_sim(sub)
    from otel_dra.demo import add_subcommand as add_demo

    add_demo(sub)
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
