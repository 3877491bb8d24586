"""``otel-dra exporter``: the cluster-state exporter's flags, its wiring and its command."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from otel_dra import __version__
from otel_dra.cli.flags import (
    UsageError,
    add_flag,
    add_kubeconfig_flag,
    add_logging_flags,
    boolean,
    int_in,
    positive_seconds,
)
from otel_dra.cli.lifecycle import stop_on_signals, wait_for
from otel_dra.cli.web import WebOptions, add_web_flags, build_access, describe, web_options
from otel_dra.cluster.sharding import Shard, ordinal_from_pod_name

log = logging.getLogger("otel_dra")


def _device_attributes(text: str) -> Any:
    from otel_dra.cluster.resourceslice import DeviceAttributes

    try:
        return DeviceAttributes.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


METRIC_LISTS = {
    True: ("--metric-allowlist", "OTEL_DRA_METRIC_ALLOWLIST"),
    False: ("--metric-denylist", "OTEL_DRA_METRIC_DENYLIST"),
}


def _metric_list(allow: bool) -> Callable[[str], Any]:
    """A FamilySelection, or None for an empty list (see otel_dra/cluster/selection.py)."""

    def parse(text: str) -> Any:
        from otel_dra.cluster.exporter import all_families
        from otel_dra.cluster.selection import FamilySelection

        try:
            return FamilySelection.parse(text, allow=allow, names=[f.prom_name for f in all_families()])
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return parse


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "exporter",
        help="serve DRA cluster-state metrics (ResourceClaims, ResourceSlices, DeviceClasses)",
        description="Watches resource.k8s.io/v1 objects and serves their metrics on /metrics "
        "(Prometheus) and, when OTEL_EXPORTER_OTLP_ENDPOINT is set, pushes them over OTLP.",
    )
    add_kubeconfig_flag(p)
    add_flag(p, "--address", "OTEL_DRA_ADDRESS", "listen address (default: all interfaces)", default="")
    add_flag(p, "--port", "OTEL_DRA_PORT", "listen port (0: pick a free one)", default=8080, type=int_in(0, 65535))
    add_web_flags(p)
    add_logging_flags(p)
    add_flag(
        p,
        "--stale-after",
        "OTEL_DRA_STALE_AFTER",
        "seconds a broken watch may take to recover before /metrics answers 500",
        default=30.0,
        type=positive_seconds,
    )
    add_flag(p, "--page-size", "OTEL_DRA_PAGE_SIZE", "objects per list page", default=500, type=int_in(1, 10000))
    add_flag(
        p,
        "--target-info",
        "OTEL_DRA_TARGET_INFO",
        "emit the target_info series with the OTel resource attributes",
        default=True,
        type=boolean,
    )
    add_flag(
        p,
        "--shard",
        "OTEL_DRA_SHARD",
        "this replica's shard number, or 'auto' to take it from the StatefulSet ordinal in POD_NAME",
        default="0",
    )
    add_flag(p, "--total-shards", "OTEL_DRA_TOTAL_SHARDS", "number of shards", default=1, type=int_in(1, 1024))
    from otel_dra.cluster.resourceslice import DEFAULT_DEVICE_ATTRIBUTES, MAX_DEVICE_ATTRIBUTES

    add_flag(
        p,
        "--device-attributes",
        "OTEL_DRA_DEVICE_ATTRIBUTES",
        f"comma-separated device attributes that kube_resourceslice_device_info carries as labels "
        f"(at most {MAX_DEVICE_ATTRIBUTES}; default {DEFAULT_DEVICE_ATTRIBUTES})",
        default=_device_attributes(DEFAULT_DEVICE_ATTRIBUTES),
        type=_device_attributes,
    )
    add_flag(
        p,
        "--leak-grace-period",
        "OTEL_DRA_LEAK_GRACE_PERIOD",
        "seconds a claim may stay allocated and reserved by nobody before kube_resourceclaim_leaked reports it",
        default=600.0,
        type=positive_seconds,
    )
    for allow, (flag, env) in METRIC_LISTS.items():
        which = "only the families" if allow else "every family but those"
        add_flag(
            p,
            flag,
            env,
            f"comma-separated regular expressions over Prometheus family names: serve {which} that one of them "
            "matches in full (cluster-state families only; the allowlist and the denylist are mutually exclusive)",
            default=None,
            type=_metric_list(allow),
        )
    add_flag(
        p,
        "--watch-pods",
        "OTEL_DRA_WATCH_PODS",
        "watch pods for kube_pod_resourceclaim_info and device health (needs list and watch on pods)",
        default=True,
        type=boolean,
    )
    add_flag(
        p,
        "--claim-latency",
        "OTEL_DRA_CLAIM_LATENCY",
        "measure each claim's allocation and binding-condition waits and its pods' start as histograms "
        "(otel_dra_claim_*_duration_seconds, otel_dra_pod_startup_duration_seconds); a claim's trace "
        "(OTEL_EXPORTER_OTLP_TRACES_ENDPOINT) is emitted either way",
        default=True,
        type=boolean,
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


def _families(args: argparse.Namespace) -> Any:
    """The FamilySelection of --metric-allowlist or --metric-denylist; None: every family."""
    allow, deny = args.metric_allowlist, args.metric_denylist
    if allow is not None and deny is not None:
        (a_flag, a_env), (d_flag, d_env) = METRIC_LISTS[True], METRIC_LISTS[False]
        raise UsageError(f"{a_flag} ({a_env}) and {d_flag} ({d_env}) are mutually exclusive: give one of them")
    selection = allow if allow is not None else deny
    if selection is not None:
        flag, env = METRIC_LISTS[selection.allow]
        for entry in selection.unmatched:
            log.warning("%s (%s): %r matches no family", flag, env, entry)
    return selection


@dataclass
class ExporterApp:
    """A running exporter (used by the CLI and by in-process tests)."""

    server: Any
    state: Any
    pipeline: Any
    pusher: Any = None
    # The Kubernetes authorizer of /metrics (--authorization=kubernetes), for its counters.
    authorizer: Any = None
    tracing: Any = None  # the claims' spans (SpanSinkPipeline)

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
        if self.tracing is not None:
            self.tracing.shutdown()  # exports what is queued
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
    families: Any = None,
    watch_pods: bool = True,
    web: WebOptions | None = None,
    claim_latency: bool = True,
    span_exporter: Any = None,
) -> ExporterApp:
    """``span_exporter``: replaces the one the ``OTEL_*`` variables configure (tests)."""
    from otel_dra.cluster.exporter import ClusterState
    from otel_dra.cluster.lifecycle import SCOPE as LIFECYCLE_SCOPE
    from otel_dra.cluster.lifecycle import ClaimLifecycle
    from otel_dra.kube.client import KubeClient, load_credentials
    from otel_dra.telemetry.http import MetricsServer
    from otel_dra.telemetry.priority import ScrapePriority
    from otel_dra.telemetry.provider import build_metrics_pipeline
    from otel_dra.telemetry.tracing import build_span_sink

    credentials = load_credentials(kubeconfig)
    log.info("using Kubernetes credentials from %s (server %s)", credentials.source, credentials.host)
    pipeline = build_metrics_pipeline(
        service_name="otel-dra-exporter",
        version=__version__,
        target_info=target_info,
    )
    if pipeline.otlp is not None:
        log.info("pushing metrics over OTLP (%s) to %s", pipeline.otlp.protocol, pipeline.otlp.endpoint)
    tracing = build_span_sink(
        service_name="otel-dra-exporter",
        scope=LIFECYCLE_SCOPE,
        version=__version__,
        meter_provider=pipeline.meter_provider,
        exporter=span_exporter,
    )
    lifecycle = None
    if tracing.sink is not None or claim_latency:
        lifecycle = ClaimLifecycle(pipeline.meter_provider, tracing.sink, tracing.sampler)
    if tracing.sink is not None:
        assert lifecycle is not None
        tracing.sink.backfill_from(lifecycle.backfill)  # what the first list shows, paced
        where = tracing.otlp.endpoint if tracing.otlp is not None else "the configured exporter"
        log.info("tracing each claim's life to %s (sampler %s)", where, tracing.sampler.get_description())
    client = KubeClient(credentials, user_agent=f"otel-dra-exporter/{__version__}")
    state = ClusterState(
        client,
        pipeline.meter_provider,
        otlp=pipeline.otlp is not None,
        stale_after=stale_after,
        page_size=page_size,
        shard=shard,
        leak_grace=leak_grace,
        pods=watch_pods,
        lifecycle=lifecycle,
        **({"device_attributes": device_attributes} if device_attributes is not None else {}),
        **({"families": families} if families is not None else {}),
    )
    if state.shard.sharded:
        log.info("serving shard %d of %d", state.shard.index, state.shard.total)
    if families is not None:
        _log_served_families(state, families)
    priority = ScrapePriority()
    pusher = _state_pusher(state, pipeline, priority) if pipeline.otlp is not None else None
    web = web or WebOptions()
    access = build_access(web, client)
    server = MetricsServer(_endpoints(state, pipeline, priority), address, port, access.security, web.limits)
    state.start()
    server.start()
    if pusher is not None:
        pusher.start()
    log.info(
        "serving /metrics, /healthz, /readyz on %s:%d (/metrics: %s)",
        address or "0.0.0.0",
        server.port,
        describe(access),
    )
    return ExporterApp(server, state, pipeline, pusher, access.authorizer, tracing)


def _log_served_families(state: Any, families: Any) -> None:
    from otel_dra.cluster.exporter import all_families

    served = sum(len(store.families) for store in state.series_stores)
    log.info(
        "serving %d of the %d cluster-state families (%s)",
        served,
        len(all_families()),
        METRIC_LISTS[families.allow][0],
    )


def _endpoints(state: Any, pipeline: Any, priority: Any) -> Any:
    """What the exporter's HTTP server answers: /metrics from the state's blocks (only once the
    caches are in sync), /readyz from whether they are, and each scrape's time."""
    from otel_dra.telemetry.exposition import Assembler
    from otel_dra.telemetry.http import Endpoints, NotReady

    # A scrape thread waiting for the GIL while another thread runs Python (a watch burst, an OTLP
    # push) waits up to the switch interval; 1 ms instead of 5 ms keeps scrapes responsive. Not
    # before the caches are first in sync: until then nothing is served, and the reflector threads
    # turning the initial lists into series switch less at the default 5 ms (workload L synced
    # 12-16% sooner than at 1 ms in paired runs, docs/benchmarks.md). The first check that finds
    # them in sync (a readiness probe, a scrape) shortens it, once.
    serving = threading.Event()
    assembler = Assembler()  # remembers each family's buffers between scrapes

    def not_synced() -> str | None:
        reason: str | None = state.not_synced()
        if reason is None and not serving.is_set():
            sys.setswitchinterval(0.001)
            serving.set()
        return reason

    def scrape(openmetrics: bool, gzipped: bool) -> list[bytes]:
        reason = not_synced()
        if reason is not None:
            raise NotReady(reason)
        return assembler.assemble(pipeline.registry, state.blocks(), openmetrics, gzipped)

    def on_scrape(seconds: float, cpu_seconds: float, ok: bool) -> None:
        if ok:
            state.record_collection(seconds, "prometheus", cpu_seconds)

    return Endpoints(scrape, not_synced, on_scrape, priority)


def _state_pusher(state: Any, pipeline: Any, priority: Any) -> Any:
    """The OTLP push of the cluster state (pre-encoded points), yielding to scrapes (``priority``)."""
    from otel_dra.cluster.exporter import SCOPE
    from otel_dra.telemetry.otlp_encode import RequestBuilder
    from otel_dra.telemetry.otlp_push import PreEncodedPusher, raw_sender

    def on_export(seconds: float, cpu_seconds: float, ok: bool) -> None:
        state.record_collection(seconds, "otlp", cpu_seconds)
        log.debug("OTLP state push: %.3fs wall, %.3fs CPU, ok=%s", seconds, cpu_seconds, ok)

    return PreEncodedPusher(
        state.otlp_source,
        RequestBuilder(pipeline.resource, SCOPE, __version__),
        raw_sender(pipeline.otlp),
        on_export=on_export,
        on_dropped=state.record_dropped_points,
        priority=priority,
    )


def cmd_exporter(args: argparse.Namespace) -> int:
    from otel_dra.kube.client import CredentialsError
    from otel_dra.telemetry.otlp import ConfigError

    shard = _shard(args)
    families = _families(args)
    web = web_options(args)
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
            families=families,
            watch_pods=args.watch_pods,
            web=web,
            claim_latency=args.claim_latency,
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
