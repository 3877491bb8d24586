"""Prepare and unprepare: what the plugin does when the kubelet calls it.

Prepare reads the ResourceClaim from the API server (the kubelet sends only namespace, name and
UID), turns its allocation into prepared devices and CDI edits (:mod:`otel_dra.plugin.state`: the
UID checked, the results for this driver and this node's pool, what the spec sets for each device
from the claim's opaque device configuration and admin access as in dra-example-driver), writes a
CDI spec for the claim, records it in the checkpoint and returns the CDI device ids. Unprepare
removes the spec and the checkpoint entry, during the call or, with ``cleanup_delay``, just after
its answer (:mod:`otel_dra.plugin.cleanup`: the kubelet does not wait for files it never reads).
An unusable claim or configuration fails that claim's prepare with the reason. Both are
idempotent; failures are reported per claim (the kubelet retries those claims), never as a failed
RPC. This module is the orchestration: locks, the API reads, the files, spans and metrics.

Every claim is one span with children for reading the claim, writing the CDI spec and writing the
checkpoint. Attribute names: docs/metrics.md#plugin-traces.

One trace per ResourceClaim: the claim's trace id is its UID (:mod:`otel_dra.telemetry.traceids`),
and the cluster exporter, another process, emits the claim's root span (span id
``root_span_id(trace id)``) and its lifecycle phases into that trace. Nothing passes between the
two: the claim span here is a root of the recorder whose parent is that derived root, so it joins
the claim's trace as the root's child, sampled as the root is (its flag is what this process's
sampler says of the root; with the default ``traceidratio`` every process decides the same from
the trace id). The RPC's span (:mod:`otel_dra.plugin.server`) stays in its own trace, the
caller's when a ``traceparent`` came (our kubelet simulator sends one, the real kubelet none), a
new one otherwise; the RPC span links to each claim's span (link attribute
``k8s.resourceclaim.uid``) and each claim span links back to the RPC's. The choice is the same
with or without a ``traceparent``: a call may carry several claims, and a claim is prepared in
several calls (retries, after a restart), so no call's trace could hold a claim's whole life.
A claim's trace in Jaeger: its UID without the dashes is the trace id ("Lookup by Trace ID").
A UID that is not a UUID (only from a caller other than the kubelet: the API server's UIDs are
UUIDs) has no derived trace, and its claim span stays a child of the RPC's span as before.

The first (not cached) successful prepare of a claim records the seconds since its allocation in
``otel_dra.plugin.claim.allocation_to_prepared``, with an exemplar of the claim span (when it is
sampled): see :func:`allocation_time`.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any, Literal, overload
from urllib.parse import quote, urlsplit

from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from otel_dra import __version__
from otel_dra.kube.client import ApiError, KubeClient
from otel_dra.kube.timestamps import time_or_none
from otel_dra.plugin.cdi import CdiWriter
from otel_dra.plugin.checkpoint import Checkpoint, CheckpointError, PreparedClaim, PreparedDevice
from otel_dra.plugin.cleanup import Deferred
from otel_dra.plugin.devices import Device
from otel_dra.plugin.devicestatus import DeviceStatusWriter
from otel_dra.plugin.metrics import PluginMetrics
from otel_dra.plugin.state import (
    ClaimError,
    DeviceState,
    Edit,
    allocated_as,
    check_prepared,
    node_local,
    prepared_edits,
)
from otel_dra.plugin.state import ClaimRef as ClaimRef  # the RPC servers (server.py) take it from here
from otel_dra.records import record
from otel_dra.telemetry.spans import SpanHandle, SpanRecorder
from otel_dra.telemetry.traceids import parent_context, trace_id_of

log = logging.getLogger(__name__)

TRACER_SCOPE = "otel_dra.plugin"

# --- span attributes ---------------------------------------------------------------------------
# Semantic-convention names where they exist ...
K8S_NAMESPACE = "k8s.namespace.name"
ERROR_TYPE = "error.type"
HTTP_METHOD = "http.request.method"
HTTP_STATUS = "http.response.status_code"
URL_FULL = "url.full"
URL_TEMPLATE = "url.template"
SERVER_ADDRESS = "server.address"
SERVER_PORT = "server.port"
# ... project-defined ones otherwise (documented in docs/metrics.md).
CLAIM_NAME = "dra.claim.name"
CLAIM_UID = "dra.claim.uid"
# The pods the claim is reserved for (status.reservedFor), so that a trace joins the pod that waited
# for it: the semconv attributes when there is one pod, the project's arrays always.
K8S_POD_NAME = "k8s.pod.name"
K8S_POD_UID = "k8s.pod.uid"
CLAIM_POD_NAMES = "dra.claim.pod.names"
CLAIM_POD_UIDS = "dra.claim.pod.uids"
DRIVER = "dra.driver.name"
POOL = "dra.pool.name"
DEVICES = "dra.devices"
RESULT = "dra.result"
CACHED = "dra.claim.cached"
CDI_SPEC = "dra.cdi.spec_file"
CDI_DEVICE_IDS = "dra.cdi.device_ids"
# The device profile (otel_dra.plugin.profiles), and per device of dra.devices (same order) its
# allocation's shareID and, for partitions, the device they are part of ("" for none); each
# array only when some device has one.
PROFILE = "dra.device.profile"
SHARE_IDS = "dra.devices.share_ids"
PARENTS = "dra.devices.parents"
# On the RPC span's link to a claim's span (in the claim's own trace): which claim it is.
LINK_CLAIM_UID = "k8s.resourceclaim.uid"

CLAIM_URL_TEMPLATE = "/apis/resource.k8s.io/v1/namespaces/{namespace}/resourceclaims/{name}"

# Kubernetes object names and namespaces; UIDs become file names, so no path characters.
_NAME = re.compile(r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$")
_NAMESPACE = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
_UID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")

_LOCK_STRIPES = 64


@record(frozen=True)
class ClaimResult:
    devices: tuple[PreparedDevice, ...] = ()
    error: str = ""

    @property
    def ok(self) -> bool:
        return not self.error


class Inventory:
    """The devices this node publishes, by name. Thread-safe; replaced when discovery changes."""

    def __init__(self, devices: Sequence[Device] = ()) -> None:
        self._lock = threading.Lock()
        self._devices: dict[str, Device] = {d.name: d for d in devices}

    def replace(self, devices: Sequence[Device]) -> None:
        with self._lock:
            self._devices = {d.name: d for d in devices}

    def get(self, name: str) -> Device | None:
        with self._lock:
            return self._devices.get(name)

    def devices(self) -> list[Device]:
        with self._lock:
            return list(self._devices.values())

    def status_data(self, name: str) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
        """What device ``name`` reports in a claim's status.devices: (data, networkData); nothing
        for a device no longer published."""
        device = self.get(name)
        return device.status_data() if device is not None else (None, None)


class Driver:
    def __init__(
        self,
        *,
        client: KubeClient,
        driver_name: str,
        node_name: str,
        inventory: Inventory,
        cdi: CdiWriter,
        checkpoint: Checkpoint,
        metrics: PluginMetrics,
        tracer_provider: trace.TracerProvider,
        api_timeout: tuple[float, float] = (5.0, 15.0),
        clock: Callable[[], float] = time.perf_counter,
        wall_clock: Callable[[], float] = time.time,
        env_prefix: str = "GPU",
        gpu_config: bool = True,
        device_status: DeviceStatusWriter | None = None,
        cleanup_delay: float | None = None,
        cleanup_retry: float = 5.0,
    ) -> None:
        """``clock`` times the driver's work; ``wall_clock`` (Unix seconds) is compared with the
        claim's allocation time; ``env_prefix`` and ``gpu_config`` are the device profile's
        (:class:`otel_dra.plugin.state.DeviceState`); ``device_status``: what writes the prepared
        devices' status into their claims (None: not written); ``cleanup_delay``: an unprepare's
        CDI spec removal and checkpoint write are made that many seconds after the answer, on a
        thread of their own (cleanup.py; :meth:`close` stops it), None: during the call; what fails
        there is tried again ``cleanup_retry`` seconds later, then after twice as long each time,
        up to 5 minutes."""
        self.client = client
        self.driver_name = driver_name
        self.node_name = node_name
        self.pool_name = node_name  # one pool per node, named after it (as the example driver)
        self.inventory = inventory
        self.cdi = cdi
        self.checkpoint = checkpoint
        self.metrics = metrics
        self.device_status = device_status
        self.profile = "gpu"  # the device profile's name, for the spans (set by the CLI)
        # What an allocation prepares here (pure: no I/O).
        self.state = DeviceState(
            driver_name, self.pool_name, inventory.get, cdi.device_ids, env_prefix=env_prefix, gpu_config=gpu_config
        )
        # Spans are kept as data during the call and made by the recorder's worker after it
        # (telemetry/spans.py: the SDK's span path costs a cold call about 0.2 ms a span).
        self.spans = SpanRecorder(tracer_provider, TRACER_SCOPE, __version__)
        self._api_timeout = api_timeout
        self._clock = clock
        self._wall_clock = wall_clock
        self._stripes = [threading.Lock() for _ in range(_LOCK_STRIPES)]
        self._cleanup = (
            None
            if cleanup_delay is None
            else Deferred(self._clean_up, delay=cleanup_delay, retry=cleanup_retry, name="unprepare-cleanup")
        )
        api = urlsplit(client.host)
        self._api_address = api.hostname or ""
        self._api_port = api.port or (443 if api.scheme == "https" else 80)

    @contextmanager
    def _claim_lock(self, uid: str) -> Iterator[None]:
        """Serialises work on one claim (prepare vs unprepare) without serialising all claims."""
        with self._stripes[hash(uid) % _LOCK_STRIPES]:
            yield

    # --- the two operations --------------------------------------------------------------------
    def prepare(self, claims: Sequence[ClaimRef], parent: SpanHandle | None = None) -> dict[str, ClaimResult]:
        """``parent``: the RPC's span, which the claims' spans link to (see the module notes; a claim
        without a derived trace is its child)."""
        with self._status_held():
            return {
                ref.uid: self._one("prepare", ref, self._prepare_claim, self.metrics.prepared, parent) for ref in claims
            }

    def unprepare(self, claims: Sequence[ClaimRef], parent: SpanHandle | None = None) -> dict[str, ClaimResult]:
        with self._status_held():
            return {
                ref.uid: self._one("unprepare", ref, self._unprepare_claim, self.metrics.unprepared, parent)
                for ref in claims
            }

    def _status_held(self) -> AbstractContextManager[None]:
        """No device status write starts while the kubelet waits for this call (devicestatus.py)."""
        return self.device_status.call() if self.device_status is not None else nullcontext()

    def _one(
        self,
        operation: str,
        ref: ClaimRef,
        work: Callable[[ClaimRef, SpanHandle, _Stopwatch], tuple[PreparedDevice, ...]],
        record: Callable[[bool, float], None],
        parent: SpanHandle | None,
    ) -> ClaimResult:
        watch = _Stopwatch(self._clock)
        attributes: dict[str, Any] = {
            K8S_NAMESPACE: ref.namespace,
            CLAIM_NAME: ref.name,
            CLAIM_UID: ref.uid,
            DRIVER: self.driver_name,
            POOL: self.pool_name,
            PROFILE: self.profile,
        }
        # Exceptions are recorded here, by hand, so that the claim span gets the error type too.
        span = self._claim_span(f"{operation} claim", ref, attributes, parent)
        with span:
            try:
                devices = work(ref, span, watch)
            except Exception as exc:
                if isinstance(exc, CheckpointError):
                    # The checkpoint file is unusable: the message says why and the way out.
                    exc = ClaimError("CheckpointUnreadable", str(exc))
                kind = exc.kind if isinstance(exc, ClaimError) else "Internal"
                self.metrics.claim_error(operation, kind)
                if not isinstance(exc, ClaimError):
                    log.exception("%s of claim %s failed unexpectedly", operation, ref)
                message = f"{operation} claim {ref}: {exc}"
                span.record_exception(exc)
                span.set_status(Status(StatusCode.ERROR, str(exc)))
                span.set_attribute(ERROR_TYPE, kind)
                span.set_attribute(RESULT, "error")
                result = ClaimResult(error=message)
                log.warning("%s", message)
            else:
                span.set_attribute(RESULT, "success")
                span.set_attribute(DEVICES, [d.device_name for d in devices])
                if any(d.share_id for d in devices):
                    span.set_attribute(SHARE_IDS, [d.share_id for d in devices])
                parents = [self._parent(d.device_name) for d in devices]
                if any(parents):
                    span.set_attribute(PARENTS, parents)
                if operation == "prepare":
                    # What the kubelet hands to the runtime: which CDI edits a container gets.
                    span.set_attribute(
                        CDI_DEVICE_IDS, list(dict.fromkeys(i for d in devices for i in d.cdi_device_ids))
                    )
                result = ClaimResult(devices=devices)
                log.debug("%s claim %s: %s", operation, ref, ", ".join(d.device_name for d in devices) or "-")
            # Read before the span ends, so that the claim span always covers the time observed:
            # ending it hands the span to the processor, and the GIL may go to another thread
            # (the device status writer, the span worker) for a switch interval, 5 ms, meanwhile.
            elapsed = watch.elapsed()
        record(result.ok, elapsed)
        return result

    def _parent(self, device_name: str) -> str:
        """The device a partition is part of ("" for a whole device, or one no longer published)."""
        device = self.inventory.get(device_name)
        return device.parent if device is not None else ""

    def _claim_span(self, name: str, ref: ClaimRef, attributes: dict[str, Any], rpc: SpanHandle | None) -> SpanHandle:
        """The claim's span: in the claim's own trace, linked both ways with the RPC's (see the
        module notes)."""
        trace_id = trace_id_of(ref.uid) if self.spans.enabled else None
        if trace_id is None:
            # No UUID, no trace of its own to join (or tracing off): a step of the RPC, as before.
            if rpc is None:
                return self.spans.start(name, attributes=attributes, record_exceptions=False)
            return rpc.child(name, attributes=attributes, record_exceptions=False)
        span = self.spans.start(
            name,
            attributes=attributes,
            context=self.spans.derived_parent(trace_id, name),
            # The spans themselves, not their contexts: their ids are then reserved on the span
            # worker, after the call, rather than here (two sampler decisions per claim).
            links=[(rpc, None)] if rpc is not None else (),
            record_exceptions=False,
        )
        if rpc is not None:
            rpc.add_link(span, {LINK_CLAIM_UID: ref.uid})
        return span

    # --- prepare -------------------------------------------------------------------------------
    def _prepare_claim(self, ref: ClaimRef, span: SpanHandle, watch: _Stopwatch) -> tuple[PreparedDevice, ...]:
        _validate(ref, full=True)
        with self._claim_lock(ref.uid):
            cached = self.checkpoint.get(ref.uid)
            if cached is not None:
                # Prepared before (maybe by an earlier run of the plugin): same answer, no API call.
                check_prepared(ref, cached)
                span.set_attribute(CACHED, True)
                if not self.cdi.claim_spec_path(ref.uid).exists():
                    self._write_cdi(ref, span, prepared_edits(ref.uid, cached))
                if self.device_status is not None:
                    # Under the claim's lock, so that the writer sees prepare and unprepare in the
                    # order they happened; it skips a state it wrote already (module notes there).
                    self.device_status.prepared(ref, cached.devices)
                return cached.devices
            span.set_attribute(CACHED, False)
            # First from the API server's watch cache (resourceVersion=0: no etcd round trip, about
            # 2 ms less per prepare on the testbed; docs/benchmarks.md, real kubelet). The kubelet
            # calls only after it saw the claim allocated and reserved for the pod, and while it is
            # reserved its allocation cannot change; so a cached copy with this UID and an
            # allocation is the current allocation. A cache that lags (no such claim yet, another
            # UID, no allocation yet) costs a second, quorum read, whose answer then decides.
            claim = self._read_claim(ref, span, cached=True)
            if claim is None or not allocated_as(ref, claim):
                claim = self._read_claim(ref, span)
            span.set_attributes(consumer_pod_attributes(claim))
            # The duration histogram times the driver's own work, as upstream's does: there the
            # kubelet-plugin helper reads the claim before the driver (and its timer) gets it. The
            # read has its own metrics (rest_client_request_duration_seconds{verb="GET"}) and span;
            # a claim whose read failed is observed with the time the failed read took.
            watch.restart()
            prepared = self.state.prepare(ref, claim)
            self._write_cdi(ref, span, prepared.edits)
            with span.child("write checkpoint"):
                try:
                    self.checkpoint.put(ref.uid, PreparedClaim(ref.namespace, ref.name, prepared.devices))
                except OSError as exc:
                    raise ClaimError("CheckpointWriteFailed", f"cannot write the checkpoint: {exc}") from exc
            self._allocation_to_prepared(claim, span)
            if self.device_status is not None:
                generation = (claim.get("metadata") or {}).get("generation")
                self.device_status.prepared(
                    ref,
                    prepared.devices,
                    generation if isinstance(generation, int) else None,
                    node_local=node_local(claim, self.node_name),
                )
            return prepared.devices

    def _allocation_to_prepared(self, claim: Mapping[str, Any], span: SpanHandle) -> None:
        """Prepared, for the first time here: the seconds since the claim's allocation, once per
        device class of this driver's results, with the claim span as the exemplar's."""
        allocated = allocation_time(claim)
        if allocated is None:
            return
        # Not below 0: the scheduler's clock is another machine's.
        seconds = max(0.0, self._wall_clock() - allocated)
        context = parent_context(span.span_context()) if self.spans.enabled else None
        for device_class in device_classes(claim, self.driver_name):
            self.metrics.allocation_to_prepared(seconds, self.driver_name, device_class, context)

    @overload
    def _read_claim(
        self, ref: ClaimRef, parent: SpanHandle, *, cached: Literal[False] = False
    ) -> Mapping[str, Any]: ...
    @overload
    def _read_claim(self, ref: ClaimRef, parent: SpanHandle, *, cached: bool) -> Mapping[str, Any] | None: ...

    def _read_claim(self, ref: ClaimRef, parent: SpanHandle, *, cached: bool = False) -> Mapping[str, Any] | None:
        """The claim from the API server; ``cached``: from its watch cache, None if not there."""
        path = f"/apis/resource.k8s.io/v1/namespaces/{quote(ref.namespace)}/resourceclaims/{quote(ref.name)}"
        query = {"resourceVersion": "0"} if cached else None
        attributes: dict[str, Any] = {
            HTTP_METHOD: "GET",
            URL_FULL: self.client.host + path + ("?resourceVersion=0" if cached else ""),
            URL_TEMPLATE: CLAIM_URL_TEMPLATE,
            SERVER_ADDRESS: self._api_address,
            SERVER_PORT: self._api_port,
            K8S_NAMESPACE: ref.namespace,
        }
        with parent.child(f"GET {CLAIM_URL_TEMPLATE}", kind=SpanKind.CLIENT, attributes=attributes) as span:
            headers: dict[str, str] = {}
            span.inject(headers)  # the API server joins the trace when it traces
            try:
                claim = self.client.get_json(path, query, headers=headers, timeout=self._api_timeout)
            except ApiError as exc:
                if exc.status:
                    span.set_attribute(HTTP_STATUS, exc.status)
                if cached and exc.status == 404:
                    return None  # not in the cache (yet), no error: the quorum read decides
                span.set_attribute(ERROR_TYPE, str(exc.status) if exc.status else type(exc.__cause__).__name__)
                if exc.status == 404:
                    raise ClaimError("NotFound", f"ResourceClaim {ref.namespace}/{ref.name} not found") from exc
                if exc.status == 0:
                    raise ClaimError("APIUnavailable", f"cannot reach the API server: {exc}") from exc
                raise ClaimError(f"HTTP{exc.status}", f"reading the ResourceClaim failed: {exc}") from exc
            except ValueError as exc:  # not JSON
                raise ClaimError("InvalidResponse", f"the API server sent no valid JSON: {exc}") from exc
            span.set_attribute(HTTP_STATUS, 200)
        if not isinstance(claim, dict):
            raise ClaimError("InvalidClaim", "the ResourceClaim is not a JSON object")
        return claim

    def _write_cdi(self, ref: ClaimRef, parent: SpanHandle, devices: Sequence[Edit]) -> None:
        path = self.cdi.claim_spec_path(ref.uid)
        with parent.child("write CDI spec", attributes={CDI_SPEC: str(path)}):
            try:
                self.cdi.write_claim(ref.uid, devices)
            except OSError as exc:
                raise ClaimError("CDIWriteFailed", f"cannot write CDI spec {path}: {exc}") from exc

    # --- unprepare -----------------------------------------------------------------------------
    def _unprepare_claim(self, ref: ClaimRef, span: SpanHandle, watch: _Stopwatch) -> tuple[PreparedDevice, ...]:
        _validate(ref, full=False)
        with self._claim_lock(ref.uid):
            entry = self.checkpoint.get(ref.uid)
            # The spec goes whether or not an entry was there: a prepare that failed after
            # writing it left one.
            if self._cleanup is not None and self._cleanup.submit(ref.uid):
                # The devices are free once the checkpoint forgets the claim; the files follow
                # after the answer (cleanup.py), whose worker waits for this claim's lock.
                if entry is not None:
                    self.checkpoint.remove(ref.uid, write=False)
            else:
                self._remove_files(ref, span, entry is not None)
            if entry is None:
                return ()  # never prepared here, or already unprepared: nothing left to do
            if self.device_status is not None:
                self.device_status.unprepared(ref)
            return entry.devices

    def _remove_files(self, ref: ClaimRef, span: SpanHandle, in_checkpoint: bool) -> None:
        path = self.cdi.claim_spec_path(ref.uid)
        with span.child("remove CDI spec", attributes={CDI_SPEC: str(path)}):
            try:
                self.cdi.remove_claim(ref.uid)
            except OSError as exc:
                raise ClaimError("CDIRemoveFailed", f"cannot remove CDI spec {path}: {exc}") from exc
        if in_checkpoint:
            with span.child("write checkpoint"):
                try:
                    self.checkpoint.remove(ref.uid)
                except OSError as exc:
                    raise ClaimError("CheckpointWriteFailed", f"cannot write the checkpoint: {exc}") from exc

    def _clean_up(self, uids: list[str]) -> list[str]:
        """The deferred part of the unprepares of ``uids`` (cleanup.py); the UIDs to try again."""
        failed: list[str] = []
        for uid in uids:
            with self._claim_lock(uid):
                try:
                    if self.checkpoint.get(uid) is not None:
                        continue  # prepared again meanwhile: the spec there is the new prepare's
                    self.cdi.remove_claim(uid)
                except (CheckpointError, OSError) as exc:
                    self.metrics.claim_error("unprepare", _file_error_kind(exc, "CDIRemoveFailed"))
                    log.warning("unprepared claim %s: cannot remove its CDI spec yet (retried): %s", uid, exc)
                    failed.append(uid)
        try:
            self.checkpoint.flush()
        except (CheckpointError, OSError) as exc:
            self.metrics.claim_error("unprepare", _file_error_kind(exc, "CheckpointWriteFailed"))
            log.warning("unprepared claims %s: cannot write the checkpoint yet (retried): %s", ", ".join(uids), exc)
            return uids
        return failed

    def settle(self, timeout: float = 10.0) -> bool:
        """Wait until the unprepares answered so far have removed their files (False: not within
        ``timeout``, or some removal fails; it is retried)."""
        return self._cleanup is None or self._cleanup.flush(timeout)

    def close(self) -> None:
        """After the last call: the files of the unprepares answered are removed now."""
        if self._cleanup is not None:
            self._cleanup.close()

    def forget_gone_claim(self, ref: ClaimRef) -> None:
        """A claim of the checkpoint that no longer exists, or is no longer allocated the devices
        prepared for it (read at start, see devicestatus.py): its entry goes, as its unprepare
        would remove it. One is left behind where a machine crash lost an unprepare's checkpoint
        write (not fsynced, Checkpoint.remove; nor is the directory after a rename), or the plugin
        was killed before its deferred write ran (cleanup.py); the kubelet never unprepares it
        again, and a claim allocated anew must not be answered from it. An unprepare that still
        comes finds nothing to do."""
        with self._claim_lock(ref.uid):
            try:
                entry = self.checkpoint.get(ref.uid)
                if entry is None or entry.name != ref.name or entry.namespace != ref.namespace:
                    return
                self.cdi.remove_claim(ref.uid)
                self.checkpoint.remove(ref.uid)
            except (CheckpointError, OSError) as exc:
                log.warning("claim %s is gone; its checkpoint entry stays: %s", ref, exc)
                return
        log.info("claim %s is gone or allocated anew: removed from the checkpoint (no unprepare came)", ref)

    def reapply_device_status(self) -> int:
        """Hand every claim of the checkpoint to the device status writer (at start: a plugin
        stopped between a prepare and its status write still writes it); how many."""
        if self.device_status is None:
            return 0
        claims = []
        try:
            for uid in self.checkpoint.uids():
                entry = self.checkpoint.get(uid)
                if entry is not None:
                    claims.append((ClaimRef(entry.namespace, uid, entry.name), entry.devices))
        except CheckpointError:
            return 0  # logged at start; every prepare and unprepare reports it for its claim
        self.device_status.on_gone = self.forget_gone_claim
        self.device_status.reapply(claims)
        return len(claims)


def _file_error_kind(exc: Exception, os_error_kind: str) -> str:
    """The error type of a deferred file step: an unusable checkpoint is its own kind, as in a call."""
    return "CheckpointUnreadable" if isinstance(exc, CheckpointError) else os_error_kind


class _Stopwatch:
    """Times one claim for the duration histogram."""

    __slots__ = ("_clock", "_start")

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._start = clock()

    def restart(self) -> None:
        self._start = self._clock()

    def elapsed(self) -> float:
        return self._clock() - self._start


def consumer_pod_attributes(claim: Mapping[str, Any]) -> dict[str, Any]:
    """Span attributes of the pods in the claim's status.reservedFor (pods: apiGroup "" and
    resource "pods"; the namespace is the claim's, already in k8s.namespace.name)."""
    status = claim.get("status")
    reserved = status.get("reservedFor") if isinstance(status, dict) else None
    pods = [
        (str(r.get("name", "")), str(r.get("uid", "")))
        for r in reserved or []
        if isinstance(r, dict) and r.get("resource") == "pods" and not r.get("apiGroup")
    ]
    if not pods:
        return {}
    attributes: dict[str, Any] = {CLAIM_POD_NAMES: [n for n, _ in pods], CLAIM_POD_UIDS: [u for _, u in pods]}
    if len(pods) == 1:
        attributes[K8S_POD_NAME], attributes[K8S_POD_UID] = pods[0]
    return attributes


def allocation_time(claim: Mapping[str, Any]) -> float | None:
    """When the claim was allocated, Unix seconds: ``status.allocation.allocationTimestamp``
    (kube-scheduler sets it where the DRADeviceBindingConditions/DRAResourceClaimDeviceStatus gates
    are on), else the newest status write of kube-scheduler in ``metadata.managedFields`` (the
    allocation is its write; while the claim is reserved for a running pod the scheduler writes
    its status no more), else None. Both are whole seconds."""
    status = claim.get("status")
    allocation = status.get("allocation") if isinstance(status, dict) else None
    stamp = time_or_none(allocation.get("allocationTimestamp")) if isinstance(allocation, dict) else None
    if stamp is not None:
        return stamp
    metadata = claim.get("metadata")
    fields = metadata.get("managedFields") if isinstance(metadata, dict) else None
    writes = [
        time_or_none(f.get("time"))
        for f in (fields if isinstance(fields, list) else [])
        if isinstance(f, dict) and f.get("subresource") == "status" and f.get("manager") == "kube-scheduler"
    ]
    times = [t for t in writes if t is not None]
    return max(times) if times else None


def device_classes(claim: Mapping[str, Any], driver: str) -> list[str]:
    """The deviceClassName of each request (``<request>`` or ``<request>/<subrequest>`` of
    ``firstAvailable``) that ``driver``'s allocation results name, each once, in result order; ""
    for a request the spec does not resolve."""
    spec = claim.get("spec")
    devices = spec.get("devices") if isinstance(spec, dict) else None
    requests = devices.get("requests") if isinstance(devices, dict) else None
    classes: dict[str, str] = {}
    for request in requests if isinstance(requests, list) else []:
        if not isinstance(request, dict) or not isinstance(request.get("name"), str):
            continue
        exactly = request.get("exactly")
        if isinstance(exactly, dict) and isinstance(exactly.get("deviceClassName"), str):
            classes[request["name"]] = exactly["deviceClassName"]
        elif isinstance(request.get("deviceClassName"), str):  # v1beta1's layout
            classes[request["name"]] = request["deviceClassName"]
        subrequests = request.get("firstAvailable")
        for sub in subrequests if isinstance(subrequests, list) else []:
            if (
                isinstance(sub, dict)
                and isinstance(sub.get("name"), str)
                and isinstance(sub.get("deviceClassName"), str)
            ):
                classes[f"{request['name']}/{sub['name']}"] = sub["deviceClassName"]
    status = claim.get("status")
    allocation = status.get("allocation") if isinstance(status, dict) else None
    allocated = allocation.get("devices") if isinstance(allocation, dict) else None
    results = allocated.get("results") if isinstance(allocated, dict) else None
    named = [
        classes.get(str(r.get("request")), "")
        for r in (results if isinstance(results, list) else [])
        if isinstance(r, dict) and r.get("driver") == driver
    ]
    return list(dict.fromkeys(named))


def _validate(ref: ClaimRef, *, full: bool) -> None:
    """Reject what the kubelet would never send; the UID becomes part of file names. fullmatch, not
    match: ``$`` also matches before a trailing newline, so "uid\n" passed (found by tests/fuzz)."""
    if not _UID.fullmatch(ref.uid):
        raise ClaimError("InvalidRequest", f"invalid claim UID {ref.uid!r}")
    if full or ref.namespace or ref.name:
        if not _NAMESPACE.fullmatch(ref.namespace):
            raise ClaimError("InvalidRequest", f"invalid claim namespace {ref.namespace!r}")
        if not _NAME.fullmatch(ref.name):
            raise ClaimError("InvalidRequest", f"invalid claim name {ref.name!r}")
