"""``otel-dra binding-controller``: the binding-condition controller's flags, its wiring and its
command (the controller itself: :mod:`otel_dra.binding`)."""

from __future__ import annotations

import argparse
import logging
import math
import time
from collections.abc import Callable
from typing import Any

from otel_dra import __version__
from otel_dra.cli.flags import add_flag, add_kubeconfig_flag, add_logging_flags, dns_subdomain
from otel_dra.cli.lifecycle import stop_on_signals, wait_for
from otel_dra.cli.web import (
    WebOptions,
    add_metrics_listen_flags,
    add_web_flags,
    describe,
    serve_registry,
    warn_if_metrics_off,
    web_options,
)
from otel_dra.records import record

log = logging.getLogger("otel_dra")

SERVICE_NAME = "otel-dra-binding-controller"
# An hour: far past kube-scheduler's binding timeout (DynamicResourcesArgs.bindingTimeout, 10 minutes
# by default), after which it gives the devices up anyway; a longer delay is a typo.
MAX_ATTACH_DELAY = 3600.0


def seconds_at_most(high: float) -> Callable[[str], float]:
    """Seconds in [0, ``high``], ``s`` suffix allowed (0: at once)."""

    def parse(text: str) -> float:
        raw = text.strip().removesuffix("s")
        try:
            value = float(raw)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
        if not math.isfinite(value) or not 0 <= value <= high:
            raise argparse.ArgumentTypeError(f"{text!r} must be between 0 and {high:g} seconds")
        return value

    return parse


def fraction(text: str) -> float:
    """A number in [0, 1]."""
    try:
        value = float(text.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value) or not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"{text!r} must be between 0 and 1")
    return value


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "binding-controller",
        help="set the binding conditions of allocated DRA devices after a delay, or fail a fraction of them",
        description="Watches ResourceClaims; for each allocated device of --driver-name that publishes "
        "bindingConditions (the plugin's --binding-conditions), sets them True in the claim's status.devices "
        "--attach-delay seconds after the allocation was seen, or sets its first bindingFailureConditions "
        "entry True for a deterministic --failure-fraction of them, so kube-scheduler binds the pod or gives "
        "the devices up. Metrics on --metrics-port (Prometheus) and over OTLP, traces over OTLP, both "
        "configured with the standard OTEL_* variables.",
    )
    add_kubeconfig_flag(p)
    add_flag(
        p,
        "--driver-name",
        "OTEL_DRA_DRIVER_NAME",
        "the DRA driver whose allocated devices this controller attaches",
        default="gpu.example.com",
        type=dns_subdomain(63),
    )
    add_flag(
        p,
        "--attach-delay",
        "OTEL_DRA_ATTACH_DELAY",
        f"seconds from seeing an allocation to setting its conditions (0..{MAX_ATTACH_DELAY:g})",
        default=2.0,
        type=seconds_at_most(MAX_ATTACH_DELAY),
    )
    add_flag(
        p,
        "--failure-fraction",
        "OTEL_DRA_FAILURE_FRACTION",
        "fraction (0..1) of allocated devices whose attachment fails, chosen by a hash of the claim's UID "
        "and the device (the same in every run)",
        default=0.0,
        type=fraction,
    )
    add_metrics_listen_flags(p)
    add_web_flags(p)
    add_logging_flags(p)
    p.set_defaults(func=cmd_binding_controller)


@record
class BindingControllerApp:
    """A running controller (used by the CLI and by in-process tests)."""

    controller: Any  # otel_dra.binding.controller.BindingController
    metrics_pipeline: Any
    tracing: Any
    metrics_server: Any = None
    metrics_authorizer: Any = None
    _stopped: bool = False

    @property
    def metrics_port(self) -> int | None:
        return None if self.metrics_server is None else int(self.metrics_server.port)

    def flush_spans(self) -> None:
        """Make the SDK spans of every write so far (tests read their exporter next)."""
        self.controller.spans.flush()

    def stop(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        if self.metrics_server is not None:
            self.metrics_server.stop()
        self.controller.stop()  # its spans are made before the provider flushes
        self.tracing.shutdown()
        self.metrics_pipeline.shutdown()


def start_binding_controller(
    *,
    kubeconfig: str | None,
    driver_name: str = "gpu.example.com",
    attach_delay: float = 2.0,
    failure_fraction: float = 0.0,
    metrics_port: int = -1,
    metrics_address: str = "",
    web: WebOptions | None = None,
    tracer_provider: Any = None,
) -> BindingControllerApp:
    """Start the controller. ``tracer_provider`` replaces what the environment would give (tests)."""
    from otel_dra.binding.controller import BindingController
    from otel_dra.kube.client import KubeClient, load_credentials
    from otel_dra.telemetry.provider import build_metrics_pipeline, make_resource
    from otel_dra.telemetry.tracing import TracingPipeline, build_tracing_pipeline

    credentials = load_credentials(kubeconfig)
    log.info("using Kubernetes credentials from %s (server %s)", credentials.source, credentials.host)
    if tracer_provider is not None:
        tracing = TracingPipeline(tracer_provider, make_resource(SERVICE_NAME, __version__))
    else:
        tracing = build_tracing_pipeline(service_name=SERVICE_NAME, version=__version__)
    if tracing.enabled:
        log.info("exporting traces (%s) to %s", tracing.exporter_name, tracing.otlp.endpoint if tracing.otlp else "-")
    pipeline = build_metrics_pipeline(service_name=SERVICE_NAME, version=__version__)
    if pipeline.otlp is not None:
        log.info("pushing metrics over OTLP (%s) to %s", pipeline.otlp.protocol, pipeline.otlp.endpoint)
    client = KubeClient(credentials, user_agent=f"{SERVICE_NAME}/{__version__}")
    controller = BindingController(
        client,
        driver=driver_name,
        meter_provider=pipeline.meter_provider,
        tracer_provider=tracing.tracer_provider,
        attach_delay=attach_delay,
        failure_fraction=failure_fraction,
    )
    app = BindingControllerApp(controller, pipeline, tracing)
    try:
        controller.start()
        if metrics_port >= 0:
            _serve_metrics(app, client, web or WebOptions(), metrics_address, metrics_port)
    except BaseException:
        app.stop()
        raise
    log.info(
        "attaching devices of driver %s %g s after their allocation, failing a fraction %g of them",
        driver_name,
        attach_delay,
        failure_fraction,
    )
    return app


def _serve_metrics(app: BindingControllerApp, client: Any, web: WebOptions, address: str, port: int) -> None:
    """/metrics of the controller's registry, /readyz once the claims are listed and watched."""
    app.metrics_server, access = serve_registry(
        app.metrics_pipeline.registry, app.controller.not_synced, client, web, address, port
    )
    app.metrics_authorizer = access.authorizer
    log.info(
        "serving /metrics, /healthz, /readyz on %s:%d (/metrics: %s)",
        address or "0.0.0.0",
        app.metrics_server.port,
        describe(access),
    )


def cmd_binding_controller(args: argparse.Namespace) -> int:
    from otel_dra.kube.client import CredentialsError
    from otel_dra.telemetry.otlp import ConfigError

    web = web_options(args)
    warn_if_metrics_off(args.metrics_port, web)
    stop = stop_on_signals()
    try:
        app = start_binding_controller(
            kubeconfig=args.kubeconfig,
            driver_name=args.driver_name,
            attach_delay=args.attach_delay,
            failure_fraction=args.failure_fraction,
            metrics_port=args.metrics_port,
            metrics_address=args.metrics_address,
            web=web,
        )
    except (CredentialsError, ConfigError) as exc:
        log.error("%s", exc)
        return 2
    except OSError as exc:
        log.error("cannot listen on %s:%d: %s", args.metrics_address or "0.0.0.0", args.metrics_port, exc)
        return 2
    wait_for(stop)
    started = time.monotonic()
    app.stop()
    log.info("stopped in %.1fs", time.monotonic() - started)
    return 0
