"""``otel-dra plugin``: the example DRA kubelet plugin's flags, its wiring and its command."""

from __future__ import annotations

import argparse
import gc
import logging
import os
import signal
import sys
import time
from collections.abc import Callable, MutableMapping
from pathlib import Path
from typing import Any

from otel_dra import __version__
from otel_dra.cli.flags import (
    UsageError,
    add_flag,
    add_kubeconfig_flag,
    add_logging_flags,
    boolean,
    directory,
    dns_subdomain,
    int_in,
)
from otel_dra.cli.lifecycle import stop_on_signals, wait_for
from otel_dra.cli.web import WebOptions, add_web_flags, describe, serve_registry, warn_if_metrics_off, web_options
from otel_dra.records import record

log = logging.getLogger("otel_dra")

DEVICE_SOURCES = ("simulated", "nvml")
# Kept here (not imported from the plugin) so that --help loads no plugin module; a unit test
# checks they are the plugin's.
PROFILE_CHOICES = ("gpu", "gpu-partitionable", "cpu", "net")
BINDING_CONDITION = "Attached"
BINDING_FAILURE_CONDITION = "AttachFailed"
TAINT_CHOICES = ("NoSchedule", "NoExecute", "none")
GPU_IS_LOST = 15  # NVML_ERROR_GPU_IS_LOST
# An unprepare's CDI spec removal and checkpoint write come this long after its answer
# (plugin/cleanup.py): the unprepares of a pod's teardown share one checkpoint write.
UNPREPARE_CLEANUP_DELAY_S = 0.2
# gRPC core's experiments for the plugin's server, unless GRPC_EXPERIMENTS says otherwise. With
# the EventEngine listener (grpcio's default) each call that comes after a quiet spell, as a
# kubelet's do, wakes gRPC's event-engine threads; with the listener before it, accepted
# connections are polled by the server's own completion-queue thread: 1.80 ms of server CPU per
# call 0.5 s apart instead of 2.35, answered as fast (p50 1.57 against 1.61 ms; grpcio 1.85,
# `python -m bench.floor`, docs/benchmarks-log.md, issue 29). gRPC reads the variable once, when
# it is first imported; a name a later grpcio no longer knows is logged by gRPC and ignored.
GRPC_EXPERIMENTS = "-event_engine_listener"


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "plugin",
        help="run the example DRA kubelet plugin (simulated or NVML GPUs), with metrics and traces",
        description="A DRA kubelet plugin like kubernetes-sigs/dra-example-driver: registers with the "
        "kubelet, publishes this node's devices as ResourceSlices, prepares and unprepares claims "
        "(CDI specs, checkpoint). Metrics on --metrics-port (Prometheus) and over OTLP, traces over "
        "OTLP, both configured with the standard OTEL_* variables.",
    )
    add_flag(p, "--node-name", "NODE_NAME", "this node's name (required)", type=dns_subdomain(253))
    add_flag(
        p,
        "--driver-name",
        "DRIVER_NAME",
        "the DRA driver name (the kubelet's rules: at most 63 bytes, a DNS subdomain in any case)",
        default="gpu.example.com",
        type=parse_driver_name,
    )
    add_flag(
        p,
        "--num-devices",
        "NUM_DEVICES",
        "simulated GPUs to publish",
        default=8,
        type=int_in(0, 1024),
    )
    add_flag(
        p,
        "--device-profile",
        "DEVICE_PROFILE",
        "what the simulated devices are: gpu (dra-example-driver's), gpu-partitionable (whole GPUs and "
        "partitions consuming shared counters), cpu (NUMA nodes), net (NICs shared by bandwidth); docs/plugin.md",
        default="gpu",
        choices=PROFILE_CHOICES,
    )
    add_flag(
        p,
        "--partitions",
        "PARTITIONS",
        "gpu-partitionable: partition devices per GPU, each an equal part of its memory and compute",
        default=2,
        type=int_in(1, 8),
    )
    add_flag(
        p,
        "--cpus-per-numa-node",
        "CPUS_PER_NUMA_NODE",
        "cpu: CPUs of each simulated NUMA node (what an allocated one adds to the node's allocatable cpu)",
        default=16,
        type=int_in(1, 1024),
    )
    add_flag(
        p,
        "--gpu-allow-multiple-allocations",
        "GPU_ALLOW_MULTIPLE_ALLOCATIONS",
        "gpu: let several claims share a GPU, each consuming part of its memory and compute",
        default=False,
        type=boolean,
    )
    add_flag(
        p,
        "--binding-conditions",
        "BINDING_CONDITIONS",
        f"devices wait for attachment before their pod binds (bindingConditions {BINDING_CONDITION}, "
        f"failure {BINDING_FAILURE_CONDITION}; set by otel-dra binding-controller)",
        default=False,
        type=boolean,
    )
    add_flag(p, "--cdi-root", "CDI_ROOT", "directory for CDI spec files", default=Path("/etc/cdi"), type=directory)
    add_flag(
        p,
        "--kubelet-plugins-directory-path",
        "KUBELET_PLUGINS_DIRECTORY_PATH",
        "the kubelet's plugins directory (dra.sock, checkpoint)",
        default=Path("/var/lib/kubelet/plugins"),
        type=directory,
    )
    add_flag(
        p,
        "--kubelet-registrar-directory-path",
        "KUBELET_REGISTRAR_DIRECTORY_PATH",
        "the kubelet's plugin registration directory",
        default=Path("/var/lib/kubelet/plugins_registry"),
        type=directory,
    )
    add_flag(
        p,
        "--metrics-port",
        "METRICS_PORT",
        "port for /metrics (-1: off, 0: pick a free one)",
        default=-1,
        type=int_in(-1, 65535),
    )
    add_web_flags(p)
    add_flag(
        p,
        "--healthcheck-port",
        "HEALTHCHECK_PORT",
        "port for the gRPC health service (-1: off, 0: pick a free one)",
        default=-1,
        type=int_in(-1, 65535),
    )
    add_kubeconfig_flag(p)
    add_flag(
        p,
        "--device-source",
        "DEVICE_SOURCE",
        "simulated GPUs, or real NVIDIA GPUs found through NVML",
        default="simulated",
        choices=DEVICE_SOURCES,
    )
    add_flag(
        p,
        "--remove-slices-on-exit",
        "REMOVE_SLICES_ON_EXIT",
        "delete this node's ResourceSlices on a clean shutdown",
        default=False,
        type=boolean,
    )
    add_flag(
        p,
        "--device-health",
        "DEVICE_HEALTH",
        "serve device health to the kubelet (DRAResourceHealth, into the pods' allocatedResourcesStatus)",
        default=True,
        type=boolean,
    )
    add_flag(
        p,
        "--health-check-timeout",
        "HEALTH_CHECK_TIMEOUT",
        "seconds the kubelet keeps a device's health without news (the stream refreshes at a third of it)",
        default=30,
        type=int_in(1, 3600),
    )
    add_flag(
        p,
        "--unhealthy-device-taint",
        "UNHEALTHY_DEVICE_TAINT",
        "taint effect for unhealthy devices in the ResourceSlice (<driver>/unhealthy), or none",
        default="NoSchedule",
        choices=TAINT_CHOICES,
    )
    add_flag(
        p,
        "--health-dir",
        "HEALTH_DIR",
        "simulated devices: a file <dir>/<device> makes the device unhealthy until removed "
        "(default: <kubelet-plugins-directory-path>/<driver>/health)",
        default=None,
        type=Path,
    )
    add_logging_flags(p)
    # cli.main leaves the cyclic GC off through start-up; cmd_plugin turns it on once started.
    p.set_defaults(func=cmd_plugin, gc_after_start=True)


def parse_driver_name(text: str) -> str:
    """``--driver-name``: exactly what the kubelet registers (no stripping: it would not either)."""
    from otel_dra.plugin.registration import driver_name_problem

    problem = driver_name_problem(text)
    if problem is not None:
        raise argparse.ArgumentTypeError(f"{text!r} {problem}")
    return text


def _prepared_devices(checkpoint: Any) -> int:
    """Devices of the claims in the checkpoint (0 while it is unreadable: uids() is then empty)."""
    from otel_dra.plugin.checkpoint import CheckpointError

    total = 0
    for uid in checkpoint.uids():
        try:
            entry = checkpoint.get(uid)
        except CheckpointError:
            return 0
        total += len(entry.devices) if entry is not None else 0
    return total


def _recheck(publishers: list[Any]) -> None:
    for publisher in publishers:
        publisher.recheck_soon()


@record
class PluginApp:
    """A running plugin (used by the CLI and by in-process tests)."""

    server: Any
    publisher: Any
    driver: Any
    metrics_pipeline: Any
    tracing: Any
    metrics_server: Any = None
    # The Kubernetes authorizer of /metrics (--authorization=kubernetes), for its counters.
    metrics_authorizer: Any = None
    health: Any = None
    # Device health (plugin.health): the state, its source (simulated directory or NVML events).
    device_health: Any = None
    health_source: Any = None
    remove_slices_on_exit: bool = False
    fatal: BaseException | None = None
    _stopped: bool = False

    def flush_spans(self) -> None:
        """Make the SDK spans of every call answered so far (tests read their exporter next)."""
        self.driver.spans.flush()

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
        if self.health_source is not None:
            self.health_source.stop()
        self.server.stop()
        self.driver.close()  # the files of the unprepares answered go now
        self.publisher.stop()
        if self.remove_slices_on_exit if remove_slices is None else remove_slices:
            from otel_dra.kube.client import ApiError

            try:
                self.publisher.delete_all()
            except ApiError as exc:
                log.error("could not delete this node's ResourceSlices: %s", exc)
        if self.metrics_server is not None:
            self.metrics_server.stop()
        if self.driver.device_status is not None:
            # After the server: no prepare or unprepare hands it more. Pending writes are tried
            # once more (bounded wait); the next start writes what is still missing.
            self.driver.device_status.stop()
        self.driver.spans.close()  # the spans of the last calls, before the provider flushes
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
    web: WebOptions | None = None,
    device_health: bool = True,
    health_check_timeout: int = 30,
    unhealthy_device_taint: str = "NoSchedule",
    health_dir: Path | None = None,
    health_poll: float = 1.0,
    profile: str = "gpu",
    partitions: int = 2,
    allow_multiple: bool = False,
    binding_conditions: bool = False,
    cpus_per_numa_node: int = 16,
) -> PluginApp:
    """Start the plugin. ``tracer_provider`` and ``nvml`` replace what the environment would give
    (tests); ``on_fatal`` is called from a background thread when the plugin cannot go on.
    ``profile``, ``partitions``, ``allow_multiple`` and ``binding_conditions``: the device profile
    (:mod:`otel_dra.plugin.profiles`); ValueError for a combination it does not have."""
    from otel_dra.kube.client import KubeClient, RetryPolicy, load_credentials
    from otel_dra.plugin.health import HealthStreams
    from otel_dra.plugin.metrics import PluginMetrics
    from otel_dra.plugin.server import HealthServer, PluginServer
    from otel_dra.plugin.slices import SlicePublisher

    credentials = load_credentials(kubeconfig)
    log.info("using Kubernetes credentials from %s (server %s)", credentials.source, credentials.host)
    tracing, pipeline = _plugin_telemetry(tracer_provider)
    metrics = PluginMetrics(pipeline.meter_provider)
    client = KubeClient(
        credentials,
        observer=metrics.observe_request,
        retry=RetryPolicy(),
        user_agent=f"otel-dra-plugin/{__version__}",
    )
    from otel_dra.plugin.profiles import ProfileOptions

    options = ProfileOptions(profile, num_devices, partitions, allow_multiple, binding_conditions, cpus_per_numa_node)
    if device_source == "nvml" and (profile != "gpu" or allow_multiple):
        raise ValueError("NVML devices are published as they are: only --device-profile gpu, without sharing")
    discover = _device_discovery(device_source, node_name, driver_name, options, nvml)
    started: list[Any] = []  # stopped again, last first, when a later step fails
    try:
        inventory, health_state, on_devices = _node_devices(discover, device_source)
        driver = _claim_driver(
            client, metrics, tracing, inventory, driver_name, node_name, cdi_root, plugins_dir, profile
        )
        started.append(driver.device_status)
        publishers: list[SlicePublisher] = []
        server = PluginServer(
            driver,
            driver_name=driver_name,
            plugins_dir=plugins_dir,
            registrar_dir=registrar_dir,
            # A kubelet that (re)registers the plugin may just have deleted the node's slices. A
            # registration before the publisher exists needs nothing: its first reconcile is to come.
            on_registered=lambda: _recheck(publishers),
            health=HealthStreams(health_state, node_name, timeout_seconds=health_check_timeout)
            if device_health
            else None,
        )
        server.start()
        started.append(server)
        app = PluginApp(server, None, driver, pipeline, tracing, remove_slices_on_exit=remove_slices_on_exit)
        app.device_health = health_state
        _observe_plugin_state(metrics, driver.checkpoint, health_state, server.health, node_name)
        publisher = _start_publisher(
            app,
            client,
            metrics,
            driver_name=driver_name,
            node_name=node_name,
            discover=discover,
            on_devices=on_devices,
            on_fatal=on_fatal,
            resync=resync,
            unhealthy_device_taint=unhealthy_device_taint,
        )
        publishers.append(publisher)
        started.append(publisher)
        _observe_pool(metrics, profile, inventory, publisher)
        app.health_source = _start_health_source(
            health_state, device_source, nvml, health_dir or plugins_dir / driver_name / "health", health_poll
        )
        if app.health_source is not None:
            started.append(app.health_source)
        if healthcheck_port >= 0:
            app.health = HealthServer(server, healthcheck_port).start()
            started.append(app.health)
            log.info("serving gRPC health on :%d", app.health.port)
        if metrics_port >= 0:
            _serve_plugin_metrics(app, client, web or WebOptions(), metrics_address, metrics_port)
    except BaseException:
        for part in reversed(started):
            part.stop()
        tracing.shutdown()
        pipeline.shutdown()
        raise
    return app


def _node_devices(discover: Callable[[], Any], source: str) -> tuple[Any, Any, Callable[[list[Any]], None]]:
    """This node's devices, found now (so that a broken device source fails loudly at start-up):
    the driver's inventory, the health state of each, and what keeps both up to date when the slice
    publisher finds them again (with what the API server does not take left out)."""
    from otel_dra.plugin.devices import Device
    from otel_dra.plugin.driver import Inventory
    from otel_dra.plugin.health import HealthState

    devices = list(discover().devices)
    log.info("%d device(s) from %s: %s", len(devices), source, ", ".join(d.name for d in devices) or "-")
    inventory = Inventory(devices)
    health_state = HealthState()
    health_state.set_devices([d.name for d in devices])

    def on_devices(found: list[Device]) -> None:
        inventory.replace(found)
        health_state.set_devices([d.name for d in found])

    return inventory, health_state, on_devices


def _claim_driver(
    client: Any,
    metrics: Any,
    tracing: Any,
    inventory: Any,
    driver_name: str,
    node_name: str,
    cdi_root: Path,
    plugins_dir: Path,
    profile: str = "gpu",
) -> Any:
    """The driver that prepares claims, with its CDI directory (the common spec written), its
    checkpoint (an unreadable one is reported, not fatal) and its device status writer (started,
    the checkpoint's claims handed to it: they are written again where their status is missing).
    The device ``profile`` decides the CDI class, the variables' prefix, and whether claims
    configure devices (GpuConfig) at all."""
    from otel_dra.plugin.cdi import CdiWriter
    from otel_dra.plugin.checkpoint import Checkpoint
    from otel_dra.plugin.devicestatus import DeviceStatusWriter
    from otel_dra.plugin.driver import Driver
    from otel_dra.plugin.profiles import CDI_CLASSES, ENV_PREFIXES, GPU, GPU_PARTITIONABLE

    cdi = CdiWriter(cdi_root, driver_name, node_name, CDI_CLASSES[profile])
    cdi.write_common()
    checkpoint = Checkpoint(plugins_dir / driver_name / "checkpoint.json")
    if checkpoint.broken is not None:
        # Not fatal: exiting would restart into the same file (a crash loop); every claim's
        # prepare and unprepare reports it instead until the operator acts (docs/plugin.md, "The checkpoint").
        log.error("%s", checkpoint.broken)
    device_status = DeviceStatusWriter(
        client,
        driver_name=driver_name,
        node_name=node_name,
        device_data=inventory.status_data,
        metrics=metrics,
        tracer_provider=tracing.tracer_provider,
    )
    driver = Driver(
        client=client,
        driver_name=driver_name,
        node_name=node_name,
        inventory=inventory,
        cdi=cdi,
        checkpoint=checkpoint,
        metrics=metrics,
        tracer_provider=tracing.tracer_provider,
        device_status=device_status.start(),
        env_prefix=ENV_PREFIXES[profile],
        gpu_config=profile in (GPU, GPU_PARTITIONABLE),
        cleanup_delay=UNPREPARE_CLEANUP_DELAY_S,
    )
    driver.profile = profile
    driver.reapply_device_status()
    return driver


def _observe_plugin_state(metrics: Any, checkpoint: Any, health_state: Any, streams: Any, node_name: str) -> None:
    """The plugin's observable gauges: prepared devices, device health, the kubelet's health streams."""
    metrics.observe_state(
        prepared_devices=lambda: _prepared_devices(checkpoint),
        device_health=lambda: [(node_name, e.device, e.health.name.title()) for e in health_state.snapshot()],
        health_streams=None if streams is None else lambda: streams.active,
    )


def _observe_pool(metrics: Any, profile: str, inventory: Any, publisher: Any) -> None:
    """The published pool's gauges: its devices (the inventory is what was published, less what the
    API server does not take) and the features left out."""
    from otel_dra.plugin.devices import FEATURES

    metrics.observe_pool(
        profile,
        lambda: [d.partition for d in inventory.devices()],
        lambda: [(f, FEATURES[f]) for f in sorted(publisher.features_off)],
    )


def _plugin_telemetry(tracer_provider: Any) -> tuple[Any, Any]:
    """The plugin's tracing pipeline (on ``tracer_provider`` when given) and metrics pipeline."""
    from otel_dra.telemetry.provider import build_metrics_pipeline, make_resource
    from otel_dra.telemetry.tracing import TracingPipeline, build_tracing_pipeline

    if tracer_provider is not None:
        tracing = TracingPipeline(tracer_provider, make_resource("otel-dra-plugin", __version__))
    else:
        tracing = build_tracing_pipeline(service_name="otel-dra-plugin", version=__version__)
    if tracing.enabled:
        log.info("exporting traces (%s) to %s", tracing.exporter_name, tracing.otlp.endpoint if tracing.otlp else "-")
    pipeline = build_metrics_pipeline(service_name="otel-dra-plugin", version=__version__)
    if pipeline.otlp is not None:
        log.info("pushing metrics over OTLP (%s) to %s", pipeline.otlp.protocol, pipeline.otlp.endpoint)
    return tracing, pipeline


def _device_discovery(
    device_source: str, node_name: str, driver_name: str, options: Any, nvml: Any
) -> Callable[[], Any]:
    """What finds this node's pool of devices, at start-up and at each resync of the slices."""
    from otel_dra.plugin.devices import Device, Pool
    from otel_dra.plugin.profiles import build

    if device_source != "nvml":
        pool = build(node_name, driver_name, options)
        log.info(
            "device profile %s: %d device(s), %d of them partitions, %d counter set(s)",
            options.profile,
            len(pool.devices),
            sum(1 for d in pool.devices if d.partition),
            len(pool.counter_sets),
        )

        def simulated() -> Pool:
            return pool

        return simulated

    from otel_dra.plugin.nvml import DiscoveryError
    from otel_dra.plugin.nvml import discover as nvml_discover

    last: list[Device] = []

    def discover() -> Pool:
        return build_pool(find())

    def build_pool(devices: list[Device]) -> Pool:
        pool = Pool(tuple(devices))
        if options.binding_conditions:
            from otel_dra.plugin.profiles import with_binding_conditions

            pool = with_binding_conditions(pool)
        return pool

    def find() -> list[Device]:
        try:
            found = nvml_discover(nvml)
        except DiscoveryError as exc:
            # A GPU fallen off the bus fails discovery (NVML_ERROR_GPU_IS_LOST): keep publishing
            # what was there, so that the health monitor's taint marks it, instead of a fatal
            # error at the next resync. Any other discovery error stays fatal.
            if last and getattr(exc.__cause__, "value", None) == GPU_IS_LOST:
                log.warning("device discovery failed, keeping the devices found before: %s", exc)
                return list(last)
            raise
        last[:] = found
        return found

    return discover


def _start_publisher(
    app: PluginApp,
    client: Any,
    metrics: Any,
    *,
    driver_name: str,
    node_name: str,
    discover: Callable[[], list[Any]],
    on_devices: Callable[[list[Any]], None],
    on_fatal: Callable[[BaseException], None] | None,
    resync: float,
    unhealthy_device_taint: str,
) -> Any:
    """The ResourceSlice publisher, started: it republishes when a device's health changes, and an
    error it cannot get past is the plugin's fatal error."""
    from otel_dra.plugin.health import DeviceTaints
    from otel_dra.plugin.slices import SlicePublisher

    health_state = app.device_health

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
        on_devices=on_devices,
        on_fatal=fatal,
        resync=resync,
        device_taints=None
        if unhealthy_device_taint == "none"
        else DeviceTaints(health_state, driver_name, unhealthy_device_taint),
    )
    app.publisher = publisher
    health_state.add_listener(publisher.trigger)  # a sick or recovered device: republish now
    publisher.start()
    return publisher


def _start_health_source(health_state: Any, device_source: str, nvml: Any, health_dir: Path, poll: float) -> Any:
    """What tells the devices' health, started: a directory for simulated devices, NVML events for
    real ones; None when NVML cannot watch events (the devices are then reported healthy)."""
    if device_source == "simulated":
        from otel_dra.plugin.health import SimulatedHealth

        return SimulatedHealth(health_state, health_dir, poll_seconds=poll).start()
    if device_source == "nvml":
        from otel_dra.plugin.nvml import load_nvml
        from otel_dra.plugin.nvml_health import NvmlHealth

        nvml_module = nvml if nvml is not None else load_nvml()
        try:
            return NvmlHealth(health_state, nvml_module).start()
        except nvml_module.NVMLError as exc:
            # The devices were found: serve them, without health events, and say so.
            log.error("NVML event monitoring is unavailable, devices are reported healthy: %s", exc)
    return None


def _serve_plugin_metrics(app: PluginApp, client: Any, web: WebOptions, address: str, port: int) -> None:
    """/metrics of the plugin's own registry, behind the web options' security."""
    app.metrics_server, access = serve_registry(app.metrics_pipeline.registry, lambda: None, client, web, address, port)
    app.metrics_authorizer = access.authorizer
    log.info(
        "serving metrics on %s:%d (/metrics: %s)",
        address or "0.0.0.0",
        app.metrics_server.port,
        describe(access),
    )


def grpc_defaults(environ: MutableMapping[str, str]) -> bool:
    """Set the plugin's gRPC experiments (GRPC_EXPERIMENTS) in ``environ`` unless it names some
    already; True when gRPC, imported later, will see them. Must run before gRPC is imported."""
    if "grpc" in sys.modules:
        return False
    environ.setdefault("GRPC_EXPERIMENTS", GRPC_EXPERIMENTS)
    return environ["GRPC_EXPERIMENTS"] == GRPC_EXPERIMENTS


def cmd_plugin(args: argparse.Namespace) -> int:
    grpc_defaults(os.environ)  # before the imports below bring gRPC in
    from otel_dra.kube.client import CredentialsError
    from otel_dra.plugin.nvml import DiscoveryError
    from otel_dra.plugin.server import PluginStartError
    from otel_dra.telemetry.otlp import ConfigError

    if not args.node_name:
        raise UsageError("--node-name (or NODE_NAME) is required")
    from otel_dra.plugin.registration import startup_problem

    # Before anything starts: what the kubelet would refuse to register (or could not reach).
    problem = startup_problem(
        args.driver_name, args.kubelet_plugins_directory_path, args.kubelet_registrar_directory_path
    )
    if problem is not None:
        raise UsageError(problem)
    if args.device_source == "nvml" and (args.device_profile != "gpu" or args.gpu_allow_multiple_allocations):
        raise UsageError("--device-source nvml publishes the GPUs as they are: --device-profile gpu only, unshared")
    web = web_options(args)
    warn_if_metrics_off(args.metrics_port, web)
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
            web=web,
            device_health=args.device_health,
            health_check_timeout=args.health_check_timeout,
            unhealthy_device_taint=args.unhealthy_device_taint,
            health_dir=args.health_dir,
            profile=args.device_profile,
            partitions=args.partitions,
            allow_multiple=args.gpu_allow_multiple_allocations,
            binding_conditions=args.binding_conditions,
            cpus_per_numa_node=args.cpus_per_numa_node,
        )
    except (CredentialsError, ConfigError) as exc:
        log.error("%s", exc)
        return 2
    except (PluginStartError, DiscoveryError) as exc:
        log.error("%s", exc)
        return 1
    except OSError as exc:
        log.error("cannot start: %s", exc)
        return 1
    # SIGHUP: rediscover devices and republish now instead of at the next resync.
    signal.signal(signal.SIGHUP, lambda signum, frame: app.publisher.trigger())
    # What start-up built (modules, classes, gRPC's and the SDKs' state: ~40,000 objects) lives as
    # long as the process. Frozen, the cyclic GC's full collections no longer scan it, only what
    # came after: a full collection over it took 30-50 ms here, and with tracing on, spans waiting
    # up to 5 s in the batch processor get promoted and make such collections frequent, each one a
    # stall of whichever prepare is running (docs/benchmarks.md, real kubelet). No gc.collect()
    # first: it would cost that much CPU at start-up for a few cycles of import-time garbage.
    # cli.main kept the GC off through start-up (gc_after_start): on from here.
    gc.freeze()
    gc.enable()
    wait_for(stop)
    started = time.monotonic()
    app.stop()
    if app.fatal is not None:
        log.error("stopped after a fatal error: %s", app.fatal)
        return 1
    log.info("stopped in %.1fs", time.monotonic() - started)
    return 0
