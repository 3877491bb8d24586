"""The status of each prepared device in its ResourceClaim (``status.devices``), written off the
kubelet's path.

After a successful prepare the driver hands the claim's prepared devices to a
:class:`DeviceStatusWriter`; after an unprepare, a clear. The writer keeps, per claim, the entries
this plugin wants there and writes them from one background thread: the prepare RPC never waits
for an API round trip (the kubelet times prepare and unprepare, and we benchmark them against the
Go driver). What waits is coalesced by claim UID: one entry per claim, the latest wanted state,
which replaces an older one not yet written (a clear replaces an apply). So memory is bounded by
the claims prepared here, and nothing is lost while the API server is away: a failed write is
retried with backoff (logged once per claim with the reason, counted in
``otel_dra_plugin_device_status_writes_total{result="error"}``) until it succeeds or something newer
replaces it.

Writes are server-side apply on the status subresource (``application/apply-patch+yaml``; JSON is
YAML), with a field manager of this driver on this node (:func:`field_manager`) and ``force``:
``status.devices`` is a list-map keyed by (driver, device, pool, shareID), and each entry's
``conditions`` a list-map keyed by type, so the API server merges our entries with those of other
writers (other drivers, a controller that owns other condition types on the same entry) and only
ever removes what this manager set. Clearing is applying an empty ``devices`` list with the same
manager: the API server removes the entries (or, in a shared entry, the fields) only we owned.

Unprepare: the kubelet unprepares a claim once no pod on this node uses it. Where the claim's
allocation is for this node alone (its node selector names only this node, as the scheduler's for
devices of a node's own slices), no pod elsewhere can use it either, so the claim is deallocated
next (or deleted, with its pod's template), and the API server itself removes the status entries
of deallocated devices (kube-apiserver's resourceclaim strategy, ``dropDeallocatedStatusDevices``;
tested on every version we support). Such a claim's clear is not written: one request per claim
less, which is half of what device status costs a node (docs/benchmarks-log.md, issue 29). Until
the deallocation the entries still say Ready; a pod that comes to the same claim on this node
meanwhile is prepared, and written, again. Claims that other nodes may use (devices not of one
node), and those of the checkpoint at start (their allocation was not read), are cleared as before.

The applied object carries the claim's ``metadata.uid``, which works as a precondition: an apply
to a claim deleted and re-created with the same name is refused (422, ``metadata.uid``: "field is
immutable", measured on kube-apiserver 1.37; :func:`uid_conflict`), one to a deleted claim answers
404, so the entries of a claim never land on its successor. Either answer ends that claim's work
quietly (debug log, ``result="gone"``).

What a restarted plugin does: the driver hands over every claim of its checkpoint at start (a
plugin killed between a prepare and its write must still write it). Those are read first (one GET
each, off the kubelet's path): a claim whose entries are there as wanted, applied by our manager,
is not written again; otherwise the write keeps the ``lastTransitionTime`` of a Ready condition that
is already True (the condition did not change, the plugin only restarted). After that, the writer
remembers what it wrote since it started, and a repeated prepare (the kubelet's, after its own
restart) of a claim written as wanted costs nothing.

Each request is a CLIENT span in the claim's own trace (trace id = the claim's UID, as the claim
spans of :mod:`otel_dra.plugin.driver`), with the HTTP attributes of the driver's claim read.
"""

from __future__ import annotations

import json
import logging
import random
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any
from urllib.parse import quote, urlsplit

from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from otel_dra import __version__
from otel_dra.kube.client import ApiError, KubeClient
from otel_dra.kube.timestamps import format_time
from otel_dra.plugin.checkpoint import PreparedDevice
from otel_dra.plugin.metrics import APPLY, CLEAR, ERROR, GONE, SUCCESS, PluginMetrics
from otel_dra.plugin.state import ClaimRef
from otel_dra.telemetry.spans import SpanHandle, SpanRecorder
from otel_dra.telemetry.traceids import trace_id_of

log = logging.getLogger(__name__)

TRACER_SCOPE = "otel_dra.plugin"
API_VERSION = "resource.k8s.io/v1"
CLAIM_URL_TEMPLATE = "/apis/resource.k8s.io/v1/namespaces/{namespace}/resourceclaims/{name}"
STATUS_URL_TEMPLATE = CLAIM_URL_TEMPLATE + "/status"
APPLY_CONTENT_TYPE = "application/apply-patch+yaml"

# Off the kubelet's path in time too, not only in thread: a write waits while a prepare or an
# unprepare call runs (``call``) and SETTLE_S after the last one ended (its answer still to be
# sent), since a thread building and sending a request can take the GIL from the call for up to
# the interpreter's switch interval (5 ms), as the span recorder's worker waits (telemetry/spans.py).
# Measured on a loaded 2-core testbed (API server on the same cores), one claim per call, calls
# 0.1 s apart, 228 calls each: prepare p50 8.0 ms with this wait, 8.4 ms without, 8.5 ms with no
# writer at all; within that machine's noise, so the writer costs the call nothing measurable. A
# node whose calls never pause still gets each write within MAX_DEFER_S.
SETTLE_S = 0.01
MAX_DEFER_S = 1.0

# The Ready condition each entry carries (the API's convention for status.devices: True once the
# device is configured as the class and claim ask).
READY = "Ready"
READY_REASON = "Prepared"

# Limits of the API (k8s.io/api resource/v1 and its validation), checked here so that one bad
# device loses its data, not the whole claim's write.
FIELD_MANAGER_MAX = 128  # bytes, printable (apimachinery ValidateFieldManager)
DATA_MAX_BYTES = 10 * 1024  # AllocatedDeviceStatusDataMaxLength
INTERFACE_NAME_MAX = 256  # NetworkDeviceDataInterfaceNameMaxLength
HARDWARE_ADDRESS_MAX = 128  # NetworkDeviceDataHardwareAddressMaxLength
MAX_IPS = 16  # NetworkDeviceDataMaxIPs

# Span attributes: those of the driver's claim read (semantic conventions), the claim's, and ours.
K8S_NAMESPACE = "k8s.namespace.name"
ERROR_TYPE = "error.type"
HTTP_METHOD = "http.request.method"
HTTP_STATUS = "http.response.status_code"
HTTP_RESEND_COUNT = "http.request.resend_count"
URL_FULL = "url.full"
URL_TEMPLATE = "url.template"
SERVER_ADDRESS = "server.address"
SERVER_PORT = "server.port"
CLAIM_NAME = "dra.claim.name"
CLAIM_UID = "dra.claim.uid"
DRIVER = "dra.driver.name"
POOL = "dra.pool.name"
DEVICES = "dra.devices"
STATUS_OPERATION = "dra.device_status.operation"  # apply or clear

DeviceData = Callable[[str], tuple[Mapping[str, Any] | None, Mapping[str, Any] | None]]


def field_manager(driver: str, node: str) -> str:
    """``<driver>/<node>``: one manager per driver and node, so that the plugins of two nodes
    sharing a claim never remove each other's entries. The API takes up to 128 printable bytes;
    driver names (≤ 63) and node names (≤ 253) are ASCII, so only a long node name is cut, with a
    hash of the whole name kept so that two cut names still differ."""
    name = f"{driver}/{node}"
    if len(name.encode()) <= FIELD_MANAGER_MAX and name.isprintable():
        return name
    import hashlib

    digest = hashlib.sha256(name.encode()).hexdigest()[:12]
    keep = "".join(c if c.isprintable() and c.isascii() else "_" for c in name)
    return f"{keep[: FIELD_MANAGER_MAX - len(digest) - 1]}~{digest}"


def device_key(entry: Mapping[str, Any]) -> tuple[str, str, str, str]:
    """How ``status.devices`` is keyed: (driver, pool, device, shareID)."""
    return (
        str(entry.get("driver") or ""),
        str(entry.get("pool") or ""),
        str(entry.get("device") or ""),
        str(entry.get("shareID") or ""),
    )


class InvalidDeviceData(ValueError):
    """What a device reports for the claim's status breaks a limit of the API."""


def checked_data(data: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """``data`` as the API takes it: a JSON object of at most 10 KiB."""
    if data is None:
        return None
    if not isinstance(data, Mapping):
        raise InvalidDeviceData(f"data is a {type(data).__name__}, not a JSON object")
    try:
        size = len(json.dumps(data, separators=(",", ":")).encode())
    except (TypeError, ValueError) as exc:
        raise InvalidDeviceData(f"data is not JSON: {exc}") from exc
    if size > DATA_MAX_BYTES:
        raise InvalidDeviceData(f"data is {size} bytes of JSON, more than the API's {DATA_MAX_BYTES}")
    return dict(data)


def checked_network_data(network: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """``networkData`` as the API takes it: interfaceName (≤ 256 bytes), ips (≤ 16 distinct, in
    CIDR notation), hardwareAddress (≤ 128 bytes); only the keys that are set."""
    if network is None:
        return None
    import ipaddress

    if not isinstance(network, Mapping):
        raise InvalidDeviceData(f"networkData is a {type(network).__name__}, not an object")
    unknown = set(network) - {"interfaceName", "ips", "hardwareAddress"}
    if unknown:
        raise InvalidDeviceData(f"networkData has unknown fields {sorted(unknown)}")
    out: dict[str, Any] = {}
    for key, limit in (("interfaceName", INTERFACE_NAME_MAX), ("hardwareAddress", HARDWARE_ADDRESS_MAX)):
        value = network.get(key)
        if value in (None, ""):
            continue
        if not isinstance(value, str) or len(value.encode()) > limit:
            raise InvalidDeviceData(f"networkData.{key} must be a string of at most {limit} bytes")
        out[key] = value
    ips = network.get("ips")
    if ips:
        if not isinstance(ips, Sequence) or isinstance(ips, str):
            raise InvalidDeviceData("networkData.ips must be a list")
        if len(ips) > MAX_IPS or len(set(ips)) != len(ips):
            raise InvalidDeviceData(f"networkData.ips must hold at most {MAX_IPS} distinct addresses")
        for ip in ips:
            if not isinstance(ip, str) or "/" not in ip:
                raise InvalidDeviceData(f"networkData.ips: {ip!r} is not in CIDR notation (192.0.2.5/24)")
            try:
                ipaddress.ip_interface(ip)
            except ValueError as exc:
                raise InvalidDeviceData(f"networkData.ips: {exc}") from exc
        out["ips"] = list(ips)
    return out or None


def device_entry(
    driver: str,
    device: PreparedDevice,
    *,
    data: Mapping[str, Any] | None,
    network_data: Mapping[str, Any] | None,
    message: str,
    transition_time: str,
    generation: int | None,
) -> dict[str, Any]:
    """One ``status.devices`` entry: the device's key, a Ready condition, its data and network
    data when it has them (already checked: :func:`checked_data`, :func:`checked_network_data`)."""
    condition: dict[str, Any] = {
        "type": READY,
        "status": "True",
        "reason": READY_REASON,
        "message": message,
        "lastTransitionTime": transition_time,
    }
    if generation is not None:
        condition["observedGeneration"] = generation
    entry: dict[str, Any] = {"driver": driver, "pool": device.pool_name, "device": device.device_name}
    if device.share_id:
        entry["shareID"] = device.share_id
    entry["conditions"] = [condition]
    if data is not None:
        entry["data"] = dict(data)
    if network_data is not None:
        entry["networkData"] = dict(network_data)
    return entry


def apply_body(ref: ClaimRef, entries: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The applied configuration: the claim by name and UID (the UID is a precondition), and only
    the entries this manager wants (none: it owns none any more)."""
    return {
        "apiVersion": API_VERSION,
        "kind": "ResourceClaim",
        "metadata": {"name": ref.name, "namespace": ref.namespace, "uid": ref.uid},
        "status": {"devices": list(entries)},
    }


def _comparable(entry: Mapping[str, Any]) -> tuple[Any, ...]:
    """An entry without what the API may add or what changes with time: the key, the Ready
    condition's status, reason, message and observedGeneration, the data and network data."""
    ready = next(
        (c for c in entry.get("conditions") or () if isinstance(c, Mapping) and c.get("type") == READY),
        {},
    )
    return (
        device_key(entry),
        ready.get("status"),
        ready.get("reason"),
        ready.get("message"),
        ready.get("observedGeneration"),
        json.dumps(entry.get("data"), sort_keys=True),
        json.dumps(entry.get("networkData"), sort_keys=True),
    )


def current_entries(claim: Mapping[str, Any], keys: Iterable[tuple[str, str, str, str]]) -> dict[tuple[str, ...], Any]:
    """The claim's ``status.devices`` entries with these keys."""
    wanted = set(keys)
    status = claim.get("status")
    devices = status.get("devices") if isinstance(status, Mapping) else None
    return {
        device_key(e): e
        for e in (devices if isinstance(devices, list) else [])
        if isinstance(e, Mapping) and device_key(e) in wanted
    }


def allocates(claim: Mapping[str, Any], driver: str, devices: Sequence[PreparedDevice]) -> bool:
    """Whether the claim's allocation holds every one of ``devices`` (driver, pool, device,
    shareID), as when they were prepared."""
    status = claim.get("status")
    allocation = status.get("allocation") if isinstance(status, dict) else None
    results = (allocation.get("devices") or {}).get("results") if isinstance(allocation, dict) else None
    held = {device_key(r) for r in results or () if isinstance(r, dict)}
    return all((driver, d.pool_name, d.device_name, d.share_id) in held for d in devices)


def applied_by(claim: Mapping[str, Any], manager: str) -> bool:
    """Whether ``manager`` owns fields of the claim's status through an apply."""
    metadata = claim.get("metadata")
    fields = metadata.get("managedFields") if isinstance(metadata, Mapping) else None
    return any(
        isinstance(f, Mapping)
        and f.get("manager") == manager
        and f.get("operation") == "Apply"
        and f.get("subresource") == "status"
        for f in (fields if isinstance(fields, list) else [])
    )


def ready_since(entry: Mapping[str, Any] | None) -> str | None:
    """The lastTransitionTime of an entry's Ready condition when that condition is True."""
    for c in (entry or {}).get("conditions") or ():
        if isinstance(c, Mapping) and c.get("type") == READY and c.get("status") == "True":
            since = c.get("lastTransitionTime")
            return since if isinstance(since, str) else None
    return None


def uid_conflict(exc: ApiError) -> bool:
    """Whether the API server refused an apply because the claim of that name has another UID.

    Measured on kube-apiserver 1.37: a status apply whose ``metadata.uid`` is not the stored
    claim's is 422 Invalid with the cause ``metadata.uid`` ("field is immutable"); 409 "uid
    mismatch" is the answer where the apply would create the object (not on a subresource; here
    for safety)."""
    if exc.status == 409:
        return "uid mismatch" in exc.message.lower()
    if exc.status != 422:
        return False
    try:
        details = json.loads(exc.body).get("details") or {}
    except (ValueError, AttributeError):
        return False
    causes = details.get("causes") if isinstance(details, dict) else None
    return any(isinstance(c, dict) and c.get("field") == "metadata.uid" for c in causes or ())


class _Want:
    """What the writer is to make of one claim's entries: ``devices`` (None: clear them)."""

    __slots__ = (
        "attempts",
        "devices",
        "generation",
        "logged",
        "not_before",
        "queued",
        "ref",
        "retry_after",
        "since",
        "verify",
    )

    def __init__(
        self,
        ref: ClaimRef,
        devices: tuple[PreparedDevice, ...] | None,
        generation: int | None,
        since: float,
        verify: bool,
    ) -> None:
        self.ref = ref
        self.devices = devices
        self.generation = generation
        self.since = since  # wall-clock seconds of the prepare: the Ready condition's transition
        self.verify = verify  # read the claim first (the claims of the checkpoint, at start)
        self.attempts = 0  # failed attempts so far
        self.not_before = 0.0  # monotonic time before which it is not tried again
        self.queued = time.monotonic()  # when this claim began to wait (kept when replaced)
        self.logged = False  # its failure has been logged (once per claim)
        self.retry_after: float | None = None  # what the API server's last answer asked for

    @property
    def operation(self) -> str:
        return CLEAR if self.devices is None else APPLY

    def fingerprint(self) -> tuple[tuple[str, str, str], ...]:
        """What de-duplicates a repeated prepare: the claim's devices."""
        return tuple(sorted((d.pool_name, d.device_name, d.share_id) for d in self.devices or ()))


class DeviceStatusWriter:
    """Writes the ``status.devices`` entries of prepared claims from a background thread (see the
    module notes). ``prepared``, ``unprepared`` and ``reapply`` return at once; ``start`` starts the
    thread; ``stop`` ends it after one last attempt of what is pending (bounded wait)."""

    def __init__(
        self,
        client: KubeClient,
        *,
        driver_name: str,
        node_name: str,
        device_data: DeviceData,
        metrics: PluginMetrics,
        tracer_provider: trace.TracerProvider,
        api_timeout: tuple[float, float] = (5.0, 15.0),
        backoff: tuple[float, float] = (0.5, 60.0),
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        """``device_data``: a device's (data, networkData) by name (None, None for a device that
        has none or is unknown); ``backoff``: first and longest wait between a claim's retries."""
        self.client = client
        self.driver_name = driver_name
        self.node_name = node_name
        self.pool_name = node_name  # one pool per node, named after it (as the driver's)
        self.manager = field_manager(driver_name, node_name)
        self._device_data = device_data
        self.metrics = metrics
        # Its own recorder on the plugin's provider: the write spans are made after each write, not
        # while the kubelet waits, and exported with the batch (no export between calls needed).
        self.spans = SpanRecorder(tracer_provider, TRACER_SCOPE, __version__, export_when_idle=False)
        self._api_timeout = api_timeout
        self._backoff = backoff
        self._wall_clock = wall_clock
        api = urlsplit(client.host)
        self._api_address = api.hostname or ""
        self._api_port = api.port or (443 if api.scheme == "https" else 80)
        self._cond = threading.Condition()
        self._pending: dict[str, _Want] = {}  # by claim UID, oldest first
        self._in_flight: str | None = None
        self._written: dict[str, tuple[tuple[str, str, str], ...]] = {}  # what was applied since start
        self._node_local: set[str] = set()  # claims whose allocation is this node's alone
        # Told, from the writer's thread, of a claim handed over by ``reapply`` that is gone (no
        # claim with its UID) or no longer allocated those devices: the driver drops what its
        # checkpoint still holds of it.
        self.on_gone: Callable[[ClaimRef], None] | None = None
        self._warned: set[tuple[str, str]] = set()  # (device, problem) logged once
        self._calls = 0  # prepare and unprepare calls running now
        self._quiet_since = 0.0  # when the last one ended
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._stop_deadline = 0.0

    # --- what the driver hands over (cheap: a dict operation under a lock) --------------------
    def prepared(
        self,
        ref: ClaimRef,
        devices: Sequence[PreparedDevice],
        generation: int | None = None,
        *,
        node_local: bool | None = None,
    ) -> None:
        """The claim was prepared with ``devices``; ``generation``: its metadata.generation when
        the driver read the claim (a prepare answered from the checkpoint did not); ``node_local``:
        whether its allocation is for this node alone (None: not known, as before)."""
        if node_local is not None:
            with self._cond:
                if node_local:
                    self._node_local.add(ref.uid)
                else:
                    self._node_local.discard(ref.uid)
        self._submit(_Want(ref, tuple(devices), generation, self._wall_clock(), verify=False))

    def unprepared(self, ref: ClaimRef) -> None:
        """The claim was unprepared: remove the entries this plugin wrote, or leave that to the API
        server where the allocation is this node's alone (module notes, "Unprepare")."""
        uid = ref.uid
        with self._cond:
            if uid in self._node_local and uid != self._in_flight:
                self._node_local.discard(uid)
                # An apply not yet made is not made; one made is removed with the allocation.
                self._pending.pop(uid, None)
                self._forget(uid)  # a later prepare of the same claim writes again
                self._cond.notify_all()  # flush() may wait for what was pending
                log.debug("device status of claim %s: left for the API server to remove", ref)
                return
        self._submit(_Want(ref, None, None, self._wall_clock(), verify=False))

    def reapply(self, claims: Iterable[tuple[ClaimRef, Sequence[PreparedDevice]]]) -> None:
        """The claims prepared before this start (the checkpoint's): each is read, and written
        when its entries are not there as wanted."""
        now = self._wall_clock()
        for ref, devices in claims:
            self._submit(_Want(ref, tuple(devices), None, now, verify=True))

    def _submit(self, want: _Want) -> None:
        uid = want.ref.uid
        with self._cond:
            old = self._pending.pop(uid, None)
            if old is not None:
                # The newest state wins; a claim backing off keeps backing off (the API server
                # that failed it is no better for a new state), and its failure stays logged.
                want.attempts, want.not_before, want.logged = old.attempts, old.not_before, old.logged
                want.queued = old.queued
                want.verify = want.verify and old.verify
                if want.generation is None and old.devices is not None and want.devices is not None:
                    want.generation = old.generation
            elif want.devices is not None and uid != self._in_flight and self._written.get(uid) == want.fingerprint():
                return  # written as wanted since this start: a repeated prepare costs nothing
            self._pending[uid] = want
            self._cond.notify_all()

    @contextmanager
    def call(self) -> Iterator[None]:
        """Around a prepare or unprepare call: no write starts while one runs (see SETTLE_S)."""
        with self._cond:
            self._calls += 1
        try:
            yield
        finally:
            with self._cond:
                self._calls -= 1
                self._quiet_since = time.monotonic()
                if not self._calls:
                    self._cond.notify_all()

    # --- life cycle ----------------------------------------------------------------------------
    def start(self) -> DeviceStatusWriter:
        self._thread = threading.Thread(target=self._work, name="device-status", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        """Stop after one more attempt of each pending write, waiting at most ``timeout`` seconds
        (what is left then is logged; a write in flight ends with its own timeout)."""
        with self._cond:
            self._stopping = True
            self._stop_deadline = time.monotonic() + timeout
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout + 0.5)
            if self._thread.is_alive():
                log.warning("device status writer still busy %.0f s after stop; leaving it", timeout)
        self.spans.close()

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until nothing is pending or in flight (tests); False when still busy at ``timeout``
        (a claim backing off counts as pending)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._pending or self._in_flight is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

    @property
    def pending(self) -> int:
        with self._cond:
            return len(self._pending) + (self._in_flight is not None)

    # --- the worker ----------------------------------------------------------------------------
    def _work(self) -> None:
        while True:
            with self._cond:
                want = self._next()
                if want is None:
                    break  # stopping
                self._in_flight = want.ref.uid
            try:
                done = self._attempt(want)
            except Exception:  # a bug: this claim is dropped, the writer goes on
                log.exception("device status of claim %s: unexpected error", want.ref)
                done = True
            with self._cond:
                self._in_flight = None
                if not done and want.ref.uid not in self._pending:  # else a newer state replaced it
                    want.attempts += 1
                    want.not_before = time.monotonic() + self._delay(want.attempts, want.retry_after)
                    self._pending[want.ref.uid] = want
                self._cond.notify_all()
        self._last_attempts()

    def _next(self) -> _Want | None:
        """The oldest pending claim that is neither backing off nor held back by a call; waits for
        one. Called locked.

        A scan of the pending claims: there are at most as many as claims prepared on this node,
        and nearly always none or a few."""
        while not self._stopping:
            now = time.monotonic()
            wait: float | None = None
            for uid, want in self._pending.items():
                ready_at = max(want.not_before, self._held_until(want))
                if ready_at <= now:
                    del self._pending[uid]
                    return want
                wait = ready_at - now if wait is None else min(wait, ready_at - now)
            self._cond.wait(wait)
        return None

    def _held_until(self, want: _Want) -> float:
        """Until when the calls hold a write back (see SETTLE_S). Called locked."""
        longest = want.queued + MAX_DEFER_S
        if self._calls:
            return longest  # or sooner: the call's end wakes the worker
        return min(self._quiet_since + SETTLE_S, longest)

    def _delay(self, attempts: int, retry_after: float | None = None) -> float:
        """Exponential, with jitter (the plugins of many nodes fail together when the API server
        does), and no sooner than the API server's Retry-After, within the longest wait."""
        first, longest = self._backoff
        delay = min(first * 2 ** (attempts - 1), longest) * random.uniform(0.5, 1.0)
        return float(min(max(delay, retry_after or 0.0), longest))

    def _last_attempts(self) -> None:
        """At stop: each pending claim once more, while the stop's wait lasts."""
        with self._cond:
            wants = list(self._pending.values())
            self._pending.clear()
        left = []
        for want in wants:
            remaining = self._stop_deadline - time.monotonic()
            if remaining <= 0.1:
                left.append(want)
                continue
            timeout = (min(self._api_timeout[0], remaining), min(self._api_timeout[1], remaining))
            try:
                if not self._attempt(want, timeout):
                    left.append(want)
            except Exception:
                log.exception("device status of claim %s: unexpected error", want.ref)
        if left:
            log.warning(
                "stopping with the device status of %d claim(s) not written: %s (written at the next start)",
                len(left),
                ", ".join(str(w.ref) for w in left[:10]) + (" ..." if len(left) > 10 else ""),
            )

    # --- one attempt ---------------------------------------------------------------------------
    def _attempt(self, want: _Want, timeout: tuple[float, float] | None = None) -> bool:
        """Write one claim's wanted state; True when that claim needs nothing more."""
        timeout = timeout or self._api_timeout
        ref = want.ref
        if want.devices is not None and not want.verify and self._written.get(ref.uid) == want.fingerprint():
            return True  # a repeated prepare that waited behind the write of the same state
        since: str | None = None
        if want.verify and want.devices is not None:
            claim = self._read(want, timeout)
            if claim is None:
                return False  # the read failed: retried
            if claim is _GONE or not allocates(claim, self.driver_name, want.devices):
                # Gone, or allocated to other devices since (deallocated and allocated again while
                # an unprepare's removal was lost): the checkpoint's entry describes nothing now.
                if claim is not _GONE:
                    log.info("claim %s is no longer allocated the devices this plugin prepared", ref)
                self._forget(ref.uid)
                if self.on_gone is not None:
                    self.on_gone(ref)
                return True
            entries = self._entries(want, claim.get("metadata", {}).get("generation"), None)
            present = current_entries(claim, (device_key(e) for e in entries))
            since = next((s for s in (ready_since(present.get(device_key(e))) for e in entries) if s), None)
            if (
                applied_by(claim, self.manager)
                and set(present) == {device_key(e) for e in entries}
                and all(_comparable(present[device_key(e)]) == _comparable(e) for e in entries)
            ):
                log.debug("device status of claim %s is as wanted; not written again", ref)
                self._written[ref.uid] = want.fingerprint()
                return True
            want.generation = claim.get("metadata", {}).get("generation")
        entries = self._entries(want, want.generation, since) if want.devices is not None else []
        return self._apply(want, entries, timeout)

    def _entries(self, want: _Want, generation: Any, since: str | None) -> list[dict[str, Any]]:
        message = f"prepared by {self.driver_name} on node {self.node_name}"
        # Only a generation the claim has: the API server does not track one for ResourceClaims
        # today (their spec is immutable), and an absent generation is not generation 0.
        generation = generation if isinstance(generation, int) and not isinstance(generation, bool) else None
        generation = generation if generation else None
        out = []
        for device in want.devices or ():
            data, network = self._checked(device.device_name)
            out.append(
                device_entry(
                    self.driver_name,
                    device,
                    data=data,
                    network_data=network,
                    message=message,
                    transition_time=since or format_time(want.since),
                    generation=generation,
                )
            )
        return out

    def _checked(self, device: str) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
        """The device's data and network data; a part the API would reject is left out, and said so
        once per device and problem (the rest of the entry, and the claim's other entries, stay)."""
        try:
            data, network = self._device_data(device)
        except Exception as exc:
            self._warn(device, "lookup", f"cannot get the status data of device {device}: {exc!r}")
            return None, None
        out: list[dict[str, Any] | None] = []
        for part, check, value in (("data", checked_data, data), ("networkData", checked_network_data, network)):
            try:
                out.append(check(value))
            except InvalidDeviceData as exc:
                self._warn(device, part, f"device {device}: {exc}; its {part} is left out of the claim status")
                out.append(None)
        return out[0], out[1]

    def _warn(self, device: str, problem: str, message: str) -> None:
        if (device, problem) not in self._warned:
            self._warned.add((device, problem))
            log.warning("%s", message)

    def _forget(self, uid: str) -> None:
        self._written.pop(uid, None)
        self._node_local.discard(uid)

    def _span(self, want: _Want, method: str, template: str, url: str) -> SpanHandle:
        name = f"{method} {template}"
        attributes: dict[str, Any] = {
            HTTP_METHOD: method,
            URL_FULL: url,
            URL_TEMPLATE: template,
            SERVER_ADDRESS: self._api_address,
            SERVER_PORT: self._api_port,
            K8S_NAMESPACE: want.ref.namespace,
            CLAIM_NAME: want.ref.name,
            CLAIM_UID: want.ref.uid,
            DRIVER: self.driver_name,
            POOL: self.pool_name,
            STATUS_OPERATION: want.operation,
        }
        if want.devices:
            attributes[DEVICES] = [d.device_name for d in want.devices]
        if want.attempts:
            attributes[HTTP_RESEND_COUNT] = want.attempts
        trace_id = trace_id_of(want.ref.uid) if self.spans.enabled else None
        # In the claim's trace, as a child of its root (the cluster exporter emits that); a UID that
        # is not a UUID has no trace of its own: a trace of the write alone.
        context = self.spans.derived_parent(trace_id, name) if trace_id is not None else None
        return self.spans.start(
            name, kind=SpanKind.CLIENT, attributes=attributes, context=context, record_exceptions=False
        )

    def _read(self, want: _Want, timeout: tuple[float, float]) -> Mapping[str, Any] | None:
        """The claim (a quorum read: at start, what is there now decides), ``_GONE`` when there is
        none with this UID, None when the read failed."""
        ref = want.ref
        path = f"/apis/resource.k8s.io/v1/namespaces/{quote(ref.namespace)}/resourceclaims/{quote(ref.name)}"
        with self._span(want, "GET", CLAIM_URL_TEMPLATE, self.client.host + path) as span:
            headers: dict[str, str] = {}
            span.inject(headers)
            try:
                claim = self.client.get_json(path, headers=headers, timeout=timeout)
            except (ApiError, ValueError) as exc:
                status = exc.status if isinstance(exc, ApiError) else 0
                if status:
                    span.set_attribute(HTTP_STATUS, status)
                if status == 404:
                    log.debug("device status of claim %s: the claim is gone", ref)
                    return _GONE
                self._failed(want, span, f"reading the claim failed: {exc}", status, exc)
                return None
            span.set_attribute(HTTP_STATUS, 200)
        if not isinstance(claim, dict) or claim.get("metadata", {}).get("uid") != ref.uid:
            log.debug("device status of claim %s: the claim is gone (another UID now)", ref)
            return _GONE
        return claim

    def _apply(self, want: _Want, entries: list[dict[str, Any]], timeout: tuple[float, float]) -> bool:
        ref = want.ref
        path = f"/apis/resource.k8s.io/v1/namespaces/{quote(ref.namespace)}/resourceclaims/{quote(ref.name)}/status"
        query = {"fieldManager": self.manager, "force": "true"}
        url = f"{self.client.host}{path}?fieldManager={quote(self.manager, safe='')}&force=true"
        with self._span(want, "PATCH", STATUS_URL_TEMPLATE, url) as span:
            headers: dict[str, str] = {}
            span.inject(headers)
            try:
                self.client.request(
                    "PATCH",
                    path,
                    query=query,
                    body=apply_body(ref, entries),
                    content_type=APPLY_CONTENT_TYPE,
                    headers=headers,
                    timeout=timeout,
                )
            except ApiError as exc:
                if exc.status:
                    span.set_attribute(HTTP_STATUS, exc.status)
                if exc.status == 404 or uid_conflict(exc):
                    # No such claim, or one of this name with another UID (the UID of the applied
                    # object is a precondition): nothing of ours is there, nothing is to be.
                    log.debug("device status of claim %s: the claim is gone (%s)", ref, exc)
                    self.metrics.device_status_write(want.operation, GONE)
                    self._forget(ref.uid)
                    return True
                self._failed(want, span, f"writing the status failed: {exc}", exc.status, exc)
                self.metrics.device_status_write(want.operation, ERROR)
                return False
            span.set_attribute(HTTP_STATUS, 200)
        self.metrics.device_status_write(want.operation, SUCCESS)
        if want.devices is None:
            self._forget(ref.uid)
        else:
            self._written[ref.uid] = want.fingerprint()
        if want.logged:
            log.info("device status of claim %s written after %d failed attempt(s)", ref, want.attempts)
        return True

    def _failed(self, want: _Want, span: SpanHandle, reason: str, status: int, exc: BaseException) -> None:
        span.set_attribute(ERROR_TYPE, str(status) if status else type(exc.__cause__ or exc).__name__)
        want.retry_after = exc.retry_after if isinstance(exc, ApiError) else None
        span.set_status(Status(StatusCode.ERROR, reason))
        if not want.logged:
            want.logged = True
            log.warning("device status (%s) of claim %s: %s; retrying with backoff", want.operation, want.ref, reason)
        else:
            log.debug(
                "device status (%s) of claim %s: %s (attempt %d)", want.operation, want.ref, reason, want.attempts + 1
            )


_GONE: Mapping[str, Any] = {}  # _read's answer for "no claim with this UID" (compared by identity)
