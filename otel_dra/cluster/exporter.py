"""The cluster-state collector: reflectors, object stores, the joins across them, self-metrics.

It is given a KubeClient and meter providers; it knows nothing of HTTP serving or of the plugin.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

from opentelemetry.metrics import CallbackOptions, MeterProvider, Observation

from otel_dra import __version__
from otel_dra.cluster import deviceclass, devicetaintrule, joined_families, pod, resourceclaim, resourceslice
from otel_dra.cluster.families import Family
from otel_dra.cluster.joins import Joins
from otel_dra.cluster.lifecycle import ClaimLifecycle, listeners
from otel_dra.cluster.resourceslice import DEFAULT_ATTRIBUTES, DeviceAttributes
from otel_dra.cluster.selection import EVERYTHING, FamilySelection
from otel_dra.cluster.sharding import Shard
from otel_dra.cluster.store import Listener, ObjectStore, Parser, SeriesStore
from otel_dra.kube.client import KubeClient
from otel_dra.kube.reflector import Reflector, ResourceType
from otel_dra.telemetry.exposition import Chunk, GaugeFamily
from otel_dra.telemetry.otlp_encode import MetricHeader, PointGroup

log = logging.getLogger(__name__)

SCOPE = "otel_dra.cluster"

# Seconds; scrape/collection durations of this exporter are milliseconds to seconds.
DURATION_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class _SelfMetrics:
    """Instruments about the exporter itself (on the main MeterProvider, so pull and push)."""

    def __init__(self, provider: MeterProvider) -> None:
        meter = provider.get_meter(SCOPE, __version__)
        self.events = meter.create_counter(
            "otel_dra.watch.events", "{event}", "Watch events received, by resource and event type."
        )
        self.relists = meter.create_counter(
            "otel_dra.relists", "{relist}", "Full relists after the initial one, by resource and reason."
        )
        self.list_errors = meter.create_counter(
            "otel_dra.list.errors",
            "{error}",
            "Failed list requests, by resource and HTTP code (0: no answer).",
        )
        self.watch_errors = meter.create_counter(
            "otel_dra.watch.errors",
            "{error}",
            "Failed or broken watches, by resource and HTTP code (0: no answer).",
        )
        self.invalid = meter.create_counter(
            "otel_dra.objects.invalid",
            "{problem}",
            "Problems found in objects (invalid annotations or quantities, malformed fields), counted once "
            "per object change.",
        )
        self.duration = meter.create_histogram(
            "otel_dra.collection.duration",
            "s",
            "Time taken to produce one collection, by exporter (prometheus: one /metrics body; "
            "otlp: one push of the cluster state).",
            explicit_bucket_boundaries_advisory=DURATION_BUCKETS,
        )
        self.cpu = meter.create_histogram(
            "otel_dra.collection.cpu_time",
            "s",
            "CPU time of the thread producing one collection, by exporter (as for the duration).",
            explicit_bucket_boundaries_advisory=DURATION_BUCKETS,
        )

        self.otlp_dropped = meter.create_counter(
            "otel_dra.otlp.points.dropped",
            "{point}",
            "Cluster-state data points of OTLP pushes the endpoint did not take (refused, failed, or not "
            "answered within the export timeout); not retried later, the next push carries the current state.",
        )

    # ReflectorEvents
    def watch_event(self, resource: str, event_type: str) -> None:
        self.events.add(1, {"resource": resource, "type": event_type})

    def relist(self, resource: str, reason: str) -> None:
        self.relists.add(1, {"resource": resource, "reason": reason})

    def list_error(self, resource: str, status: int) -> None:
        self.list_errors.add(1, {"resource": resource, "code": str(status)})

    def watch_error(self, resource: str, status: int) -> None:
        self.watch_errors.add(1, {"resource": resource, "code": str(status)})


class _Watched(NamedTuple):
    """One resource the collector may watch."""

    resource: ResourceType
    parse: Parser[Any]
    owns: Callable[[dict[str, Any]], bool]  # which objects this replica renders (sharding)
    listener: Listener[Any] | None  # the joins' hook
    discover: Callable[[KubeClient], ResourceType | None] | None = None  # where it is served
    optional: bool = False  # may be missing (not served, or not allowed) without being out of sync
    on_connect: Callable[[], None] | None = None  # at start-up and after reconnects (Reflector)


def object_families(
    device_attributes: DeviceAttributes = DEFAULT_ATTRIBUTES,
) -> dict[str, tuple[Family[Any], ...]]:
    """Each watched resource's own families (rendered per object), by resource plural."""
    return {
        resourceclaim.RESOURCE.plural: resourceclaim.FAMILIES + resourceclaim.STATE_FAMILIES,
        resourceslice.RESOURCE.plural: resourceslice.FAMILIES + resourceslice.state_families(device_attributes),
        deviceclass.RESOURCE.plural: deviceclass.FAMILIES + deviceclass.STATE_FAMILIES,
        devicetaintrule.RESOURCE.plural: devicetaintrule.FAMILIES + devicetaintrule.STATE_FAMILIES,
        pod.RESOURCE.plural: pod.STATE_FAMILIES,
    }


# The seven families of the kube-dra-exporter, kept byte for byte (docs/metrics.md).
SEED_FAMILIES: tuple[Family[Any], ...] = (*resourceclaim.FAMILIES, *resourceslice.FAMILIES, *deviceclass.FAMILIES)


def all_families() -> tuple[Family[Any], ...]:
    """Every cluster-state family, per-object and joined (what the metric lists select from)."""
    return (*(f for families in object_families().values() for f in families), *joined_families.ALL_FAMILIES)


class ClusterState:
    """Watches ResourceClaims, ResourceSlices, DeviceClasses (and DeviceTaintRules where served,
    pods where allowed and wanted: ``pods``) and serves their families and the joins across them.

    Only the families ``families`` selects are built (see otel_dra/cluster/selection.py); a
    resource is watched only when one of them needs it, its own or a join's (``Joins.reads``).
    ``stores`` holds the watched resources' stores; ``claims``, ``slices``, ``classes``,
    ``taint_rules`` and ``pods`` are None for a resource that is not watched."""

    def __init__(
        self,
        client: KubeClient,
        meter_provider: MeterProvider,
        *,
        otlp: bool = False,
        stale_after: float = 30.0,
        page_size: int = 500,
        shard: Shard | None = None,
        device_attributes: DeviceAttributes = DEFAULT_ATTRIBUTES,
        leak_grace: float = 600.0,
        families: FamilySelection = EVERYTHING,
        pods: bool = True,
        lifecycle: ClaimLifecycle | None = None,
    ) -> None:
        """``lifecycle``: each claim's trace and phase histograms (otel_dra/cluster/lifecycle.py),
        told of every claim change and of this replica's pods."""
        self._metrics = _SelfMetrics(meter_provider)
        self.lifecycle = lifecycle
        shard = shard or Shard()
        self.shard = shard
        self.joins = Joins(shard=shard, leak_grace=leak_grace, otlp=otlp, select=families)
        own = object_families(device_attributes)
        # The slim objects keep only the optional fields that a served family reads.
        serving = [*(f for fs in own.values() for f in families.select(fs)), *self.joins.families]
        keep = {name for f in serving for name in f.fields}
        if lifecycle is not None:
            keep |= resourceclaim.LIFECYCLE_FIELDS | pod.START_FIELDS
        # The API server's version decides what a DeviceTaintRule without a device selector matches
        # (every device before v1.37.1, none since), which only the joins' free-device counts use:
        # it is read by the rules' reflector, before its first list and after every reconnect, so
        # that an in-place upgrade is seen, and not at all when no served family needs the rules.
        self.server_version: devicetaintrule.ServerVersion | None = None
        if devicetaintrule.RESOURCE.plural in self.joins.reads:
            self.server_version = devicetaintrule.ServerVersion(client, self.joins.set_server_version)
        self.stores: list[ObjectStore[Any]] = []
        self.reflectors: list[Reflector] = []
        for watched in self._resources(shard, keep, device_attributes, pods):
            rtype = watched.resource
            served = families.select(own[rtype.plural])
            joined = rtype.plural in self.joins.reads
            # Claims always feed the lifecycle; pods only where a served family watches them anyway:
            # the claims' traces never widen what the exporter lists, nor the RBAC it needs (the
            # seed families watch no pods, so with them a claim's trace has no pod start spans).
            traced = lifecycle is not None and rtype.plural == resourceclaim.RESOURCE.plural
            if not served and not joined and not traced:
                log.info("not watching %s: no served family needs them", rtype.plural)
                continue
            store = self._store(watched, served, joined, otlp, lifecycle)
            self.stores.append(store)
            self.reflectors.append(
                Reflector(
                    client,
                    rtype,
                    store,
                    events=self._metrics,
                    stale_after=stale_after,
                    page_size=page_size,
                    discover=watched.discover,
                    optional=watched.optional,
                    on_connect=watched.on_connect,
                )
            )
        by_resource = {store.resource: store for store in self.stores}
        self.claims = by_resource.get(resourceclaim.RESOURCE.plural)
        self.slices = by_resource.get(resourceslice.RESOURCE.plural)
        self.classes = by_resource.get(deviceclass.RESOURCE.plural)
        self.taint_rules = by_resource.get(devicetaintrule.RESOURCE.plural)
        self.pods = by_resource.get(pod.RESOURCE.plural)
        if lifecycle is not None:
            by_plural = {r.resource.plural: r for r in self.reflectors}
            claims_reflector, pods_reflector = (
                by_plural.get(resourceclaim.RESOURCE.plural),
                by_plural.get(pod.RESOURCE.plural),
            )
            if claims_reflector is not None:
                lifecycle.claims_listed = lambda: claims_reflector.state().has_synced
            if pods_reflector is not None:
                lifecycle.pods_listed = lambda: pods_reflector.state().has_synced
        # Everything that renders series: the objects' own, then the joins'.
        self.series_stores: list[SeriesStore[Any]] = [*self.stores, *self.joins.stores]
        self._observe_cache(meter_provider)

    def _resources(
        self, shard: Shard, keep: set[str], device_attributes: DeviceAttributes, pods: bool
    ) -> list[_Watched]:
        """The resources the collector may watch, with their parsers (keeping the fields ``keep``
        names), which objects this replica renders, and the joins' hooks."""
        resources = [
            _Watched(resourceclaim.RESOURCE, resourceclaim.make_parser(keep), shard.owns, self.joins.claims_changed),
            _Watched(
                resourceslice.RESOURCE,
                resourceslice.make_parser(device_attributes, keep),
                shard.owns,
                self.joins.slices_changed,
            ),
            _Watched(deviceclass.RESOURCE, deviceclass.parse, shard.first_only(), self.joins.classes_changed),
            # DeviceTaintRules: optional (not served before 1.37 unless enabled), found by discovery.
            _Watched(
                devicetaintrule.RESOURCE,
                devicetaintrule.parse,
                shard.first_only(),
                self.joins.rules_changed,
                discover=devicetaintrule.discover,
                on_connect=self.server_version.refresh if self.server_version is not None else None,
            ),
        ]
        if pods:
            # Pods: their DRA references and device health (kube_pod_*). Optional: without list/watch
            # on pods (RBAC), the exporter logs it once and serves the rest.
            resources.append(_Watched(pod.resource(keep), pod.make_parser(keep), shard.owns, None, optional=True))
        else:
            log.info("not watching pods: --watch-pods is off")
        return resources

    def _store(
        self,
        watched: _Watched,
        served: tuple[Family[Any], ...],
        joined: bool,
        otlp: bool,
        lifecycle: ClaimLifecycle | None,
    ) -> ObjectStore[Any]:
        """The store of a watched resource: its served families, and the joins (when they read it)
        and the claims' traces told of its changes."""
        plural = watched.resource.plural
        traced: Listener[Any] | None = None
        if lifecycle is not None and plural == resourceclaim.RESOURCE.plural:
            traced = lifecycle.claims_changed  # every shard's claims: a pod's span needs its claim's UID
        elif lifecycle is not None and plural == pod.RESOURCE.plural:
            traced = lifecycle.pods_changed
        joins = watched.listener if joined else None
        return ObjectStore(
            plural,
            watched.parse,
            served,
            keep=watched.owns,
            listener=listeners(joins, traced),
            # Other shards' pods matter to nobody here: each pod's span comes from its own shard.
            listen_to_others=joins is not None or plural != pod.RESOURCE.plural,
            on_problem=self._count_problem,
            otlp=otlp,
        )

    def _observe_cache(self, meter_provider: MeterProvider) -> None:
        meter = meter_provider.get_meter(SCOPE, __version__)
        meter.create_observable_gauge(
            "otel_dra.cache.objects",
            [self._observe_objects],
            "{object}",
            "Objects held in the cache, by resource.",
        )
        meter.create_observable_gauge(
            "otel_dra.cache.synced",
            [self._observe_synced],
            "",
            "1 when the resource's cache is in sync with the API server (else /metrics answers 500).",
        )
        meter.create_observable_gauge(
            "otel_dra.cache.last_sync_timestamp",
            [self._observe_last_sync],
            "s",
            "Unix time of the last successful list or watch event/bookmark, by resource.",
        )

    def _count_problem(self, resource: str) -> None:
        self._metrics.invalid.add(1, {"resource": resource})

    # --- lifecycle -----------------------------------------------------------------------------
    def start(self) -> ClusterState:
        for reflector in self.reflectors:
            reflector.start()
        return self

    def stop(self) -> None:
        for reflector in self.reflectors:
            reflector.request_stop()
        for reflector in self.reflectors:
            reflector.stop()

    def not_synced(self) -> str | None:
        """None when every cache is in sync, else why not."""
        problems = []
        for reflector in self.reflectors:
            state = reflector.state()
            if not state.synced:
                what = "initial list not complete" if not state.has_synced else "watch broken"
                detail = f" ({state.error})" if state.error else ""
                problems.append(f"{reflector.resource.plural}: {what}{detail}")
        return "; ".join(problems) or None

    def wait_synced(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.not_synced() is None:
                return True
            time.sleep(0.05)
        return self.not_synced() is None

    # --- Prometheus: pre-rendered blocks -------------------------------------------------------
    def blocks(self) -> list[tuple[GaugeFamily, list[Chunk]]]:
        self.joins.tick()
        out: list[tuple[GaugeFamily, list[Chunk]]] = []
        for store in self.series_stores:
            out.extend(store.blocks())
        return out

    def record_collection(self, seconds: float, exporter: str, cpu_seconds: float | None = None) -> None:
        self._metrics.duration.record(seconds, {"exporter": exporter})
        if cpu_seconds is not None:
            self._metrics.cpu.record(cpu_seconds, {"exporter": exporter})

    def record_dropped_points(self, points: int) -> None:
        """An OTLP request of ``points`` cluster-state points was not delivered."""
        self._metrics.otlp_dropped.add(points)

    # --- OTLP: pre-encoded points ----------------------------------------------------------------
    def otlp_source(self) -> list[tuple[MetricHeader, list[PointGroup]]] | None:
        """What to push: None while out of sync (never push a partial or stale picture)."""
        if self.not_synced() is not None:
            return None
        self.joins.tick()
        out: list[tuple[MetricHeader, list[PointGroup]]] = []
        for store in self.series_stores:
            out.extend(store.otlp_metrics())
        return out

    def _observe_objects(self, options: CallbackOptions) -> Iterable[Observation]:
        for store in self.stores:
            yield Observation(len(store), {"resource": store.resource})

    def _observe_synced(self, options: CallbackOptions) -> Iterable[Observation]:
        for reflector in self.reflectors:
            yield Observation(1 if reflector.state().synced else 0, {"resource": reflector.resource.plural})

    def _observe_last_sync(self, options: CallbackOptions) -> Iterable[Observation]:
        for reflector in self.reflectors:
            last = reflector.state().last_sync
            if last is not None:
                yield Observation(last, {"resource": reflector.resource.plural})
