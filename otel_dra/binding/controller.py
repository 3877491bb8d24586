"""The binding-condition controller at work: a watch of ResourceClaims, a timer per waiting
allocation, and the status writes.

Work follows changes: the reflector (:mod:`otel_dra.kube.reflector`: list, then watch) hands every
claim version to :meth:`BindingController.upsert`, which keeps an entry only for a claim whose
allocation has results of the driver waiting for their binding conditions
(:func:`otel_dra.binding.claims.read_claim`). A new allocation gets a deadline ``attach_delay``
seconds after it was seen; one timer thread sleeps until the earliest deadline (a heap) and hands
due claims to a few writer threads. Nothing ever scans all claims, so 10^5 claims cost their watch
events and nothing more. A claim seen again with the same allocation keeps its deadline (a relist,
an unrelated change); a new allocation (the scheduler gave the devices up and allocated again)
starts over; a claim no longer waiting (its conditions set, by us or anyone) or deleted is dropped.

A restarted controller finds waiting allocations in its first list and gives each the full delay
from then. Its writes are idempotent: conditions already True are written as they are.

A write that fails for a reason that may pass (no answer, 429, 5xx, 403 while RBAC is fixed) is
retried with exponential backoff; one that cannot succeed (the claim is gone, 404; was re-created,
409 on the UID; changed its allocation, 422) is dropped, and the watch brings what comes next.
After a successful write the entry stays, marked written, until the watch shows the claim no
longer waiting, so that a version of the claim from before the write (still on its way) does not
start a second delay.

Each write is a span ``set binding conditions`` in the claim's trace (trace id = the claim's UID,
parented to the root span that the cluster exporter emits; docs/tracing.md), with the PATCH as its
child (its ``traceparent`` sent to the API server).
"""

from __future__ import annotations

import heapq
import json
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any
from urllib.parse import quote, urlsplit

from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from otel_dra import __version__
from otel_dra.binding.claims import (
    ATTACHED,
    FAILED,
    FIELD_MANAGER,
    STATUS_PATH_TEMPLATE,
    Allocation,
    DeviceKey,
    MalformedClaim,
    apply_body,
    new_conditions,
    outcome,
    read_claim,
    seconds_since_allocation,
)
from otel_dra.binding.metrics import SCOPE, ControllerMetrics
from otel_dra.kube.client import ApiError, KubeClient
from otel_dra.kube.reflector import Reflector, ResourceType
from otel_dra.telemetry.spans import SpanRecorder
from otel_dra.telemetry.traceids import parent_context, trace_id_of

log = logging.getLogger(__name__)

RESOURCE_CLAIMS = ResourceType("resourceclaims", "resource.k8s.io/v1")
SPAN_NAME = "set binding conditions"
APPLY_CONTENT_TYPE = "application/apply-patch+yaml"

# --- span attributes (docs/metrics.md, "Binding controller traces") ---------------------------------
K8S_NAMESPACE = "k8s.namespace.name"
CLAIM_NAME = "k8s.resourceclaim.name"
CLAIM_UID = "k8s.resourceclaim.uid"
DRIVER = "dra.driver"
DEVICES = "dra.devices"
OUTCOME = "otel_dra.binding.outcome"
FAILED_DEVICES = "otel_dra.binding.failed_devices"
HTTP_METHOD = "http.request.method"
HTTP_STATUS = "http.response.status_code"
URL_FULL = "url.full"
URL_TEMPLATE = "url.template"
SERVER_ADDRESS = "server.address"
SERVER_PORT = "server.port"
ERROR_TYPE = "error.type"
SPAN_ATTRIBUTES = (
    K8S_NAMESPACE,
    CLAIM_NAME,
    CLAIM_UID,
    DRIVER,
    DEVICES,
    OUTCOME,
    FAILED_DEVICES,
    HTTP_METHOD,
    HTTP_STATUS,
    URL_FULL,
    URL_TEMPLATE,
    SERVER_ADDRESS,
    SERVER_PORT,
    ERROR_TYPE,
)

# Answers after which the same write cannot succeed: the claim is gone (404), is another claim of
# the same name (409: metadata.uid), or no longer has these devices allocated (422).
_PERMANENT = frozenset({400, 404, 409, 422})

# Entry states.
_WAITING = "waiting"  # in the heap, until its deadline
_QUEUED = "queued"  # due, handed to the writers
_WRITING = "writing"
_WRITTEN = "written"  # written; kept until the watch shows the claim no longer waiting


class _Entry:
    """A claim whose allocation waits for its binding conditions."""

    __slots__ = ("allocation", "attempts", "due", "seen_wall", "seq", "state")

    def __init__(self, allocation: Allocation, seen_wall: float, due: float, seq: int) -> None:
        self.allocation = allocation
        self.seen_wall = seen_wall  # when it was seen: the allocation's time where it has none
        self.due = due  # monotonic
        self.seq = seq  # tells this entry's heap items from older ones of the same claim
        self.state = _WAITING
        self.attempts = 0


class BindingController:
    """Sets the binding conditions of ``driver``'s allocated devices (see the module notes).

    Implements the reflector's handler (``replace``, ``upsert``, ``delete``: called from the
    reflector's thread only). ``start`` starts the watch, the timer and the writers; ``stop`` ends
    them."""

    def __init__(
        self,
        client: KubeClient,
        *,
        driver: str,
        meter_provider: Any,
        tracer_provider: trace.TracerProvider,
        attach_delay: float = 2.0,
        failure_fraction: float = 0.0,
        writers: int = 4,
        retry_backoff: tuple[float, float] = (0.5, 30.0),
        write_timeout: tuple[float, float] = (5.0, 15.0),
        page_size: int = 500,
        stale_after: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        if attach_delay < 0:
            raise ValueError("attach_delay must not be negative")
        if not 0.0 <= failure_fraction <= 1.0:
            raise ValueError("failure_fraction must be between 0 and 1")
        self.client = client
        self.driver = driver
        self.attach_delay = attach_delay
        self.failure_fraction = failure_fraction
        self.retry_backoff = retry_backoff
        self.write_timeout = write_timeout
        self._clock = clock
        self._wall_clock = wall_clock
        self._cond = threading.Condition()
        self._entries: dict[str, _Entry] = {}
        self._heap: list[tuple[float, int, str]] = []
        self._seq = 0
        self._stopping = False
        self._work: queue.SimpleQueue[str | None] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._writers = writers
        self.metrics = ControllerMetrics(meter_provider, driver, self.pending)
        self.spans = SpanRecorder(tracer_provider, SCOPE, __version__)
        host = urlsplit(client.host)
        self._api_address = host.hostname or ""
        self._api_port = host.port or (443 if host.scheme == "https" else 80)
        self.reflector = Reflector(client, RESOURCE_CLAIMS, self, page_size=page_size, stale_after=stale_after)

    # --- lifecycle -------------------------------------------------------------------------------
    def start(self) -> BindingController:
        self._threads.append(threading.Thread(target=self._run_timer, name="binding-timer", daemon=True))
        for i in range(self._writers):
            self._threads.append(threading.Thread(target=self._run_writer, name=f"binding-writer-{i}", daemon=True))
        for thread in self._threads:
            thread.start()
        self.reflector.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        self.reflector.stop(timeout)
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        for _ in range(self._writers):
            self._work.put(None)
        deadline = time.monotonic() + timeout
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        self._threads.clear()
        self.spans.close()

    def not_synced(self) -> str | None:
        """None once the claims are listed and watched (readiness), else why not."""
        state = self.reflector.state()
        if state.synced:
            return None
        return f"resourceclaims not in sync: {state.error or 'not listed yet'}"

    def pending(self) -> int:
        """Allocations waiting whose conditions are not written yet."""
        with self._cond:
            return sum(1 for e in self._entries.values() if e.state != _WRITTEN)

    def entries(self) -> dict[str, str]:
        """Claim UID -> state of each entry (tests)."""
        with self._cond:
            return {uid: e.state for uid, e in self._entries.items()}

    # --- the reflector's handler ----------------------------------------------------------------
    def replace(self, objects: Iterable[dict[str, Any]]) -> None:
        listed: set[str] = set()
        for obj in objects:
            uid = self._upsert(obj)
            if uid:
                listed.add(uid)
        with self._cond:
            for uid in [u for u in self._entries if u not in listed]:
                del self._entries[uid]

    def upsert(self, obj: dict[str, Any]) -> None:
        self._upsert(obj)

    def delete(self, obj: dict[str, Any]) -> None:
        meta = obj.get("metadata") if isinstance(obj, dict) else None
        uid = meta.get("uid") if isinstance(meta, dict) else None
        if isinstance(uid, str):
            with self._cond:
                self._entries.pop(uid, None)

    def _upsert(self, obj: Any) -> str | None:
        """Track or drop the claim; its UID when it is tracked. Never raises (a bad object is
        logged, counted and skipped)."""
        try:
            allocation = read_claim(obj, self.driver)
        except MalformedClaim as exc:
            self.metrics.invalid_claim()
            log.warning("ResourceClaim %s: skipped, it is malformed: %s", _describe(obj), exc)
            self.delete(obj)
            return None
        except Exception:  # a bug must not stop the watch
            log.exception("ResourceClaim %s: skipped after an unexpected error", _describe(obj))
            return None
        if allocation is None or not allocation.waiting:
            self.delete(obj)
            return None
        with self._cond:
            entry = self._entries.get(allocation.uid)
            if entry is not None and entry.allocation.identity == allocation.identity:
                entry.allocation = allocation  # fresher conditions and generation; same deadline
                return allocation.uid
            now = self._clock()
            self._seq += 1
            entry = _Entry(allocation, self._wall_clock(), now + self.attach_delay, self._seq)
            self._entries[allocation.uid] = entry
            self._schedule(entry, allocation.uid)
        log.debug(
            "ResourceClaim %s: %d device(s) wait for binding conditions; writing in %.1f s",
            allocation.key,
            len(allocation.waiting),
            self.attach_delay,
        )
        return allocation.uid

    def _schedule(self, entry: _Entry, uid: str) -> None:
        """Put ``entry`` on the heap (caller holds the lock)."""
        entry.state = _WAITING
        first = not self._heap or entry.due < self._heap[0][0]
        heapq.heappush(self._heap, (entry.due, entry.seq, uid))
        if first:
            self._cond.notify_all()  # the timer sleeps until the earliest deadline

    # --- timer and writers -----------------------------------------------------------------------
    def _run_timer(self) -> None:
        with self._cond:
            while not self._stopping:
                now = self._clock()
                while self._heap and self._heap[0][0] <= now:
                    _, seq, uid = heapq.heappop(self._heap)
                    entry = self._entries.get(uid)
                    if entry is None or entry.seq != seq or entry.state != _WAITING:
                        continue  # dropped, replaced by a newer allocation, or already handed over
                    entry.state = _QUEUED
                    self._work.put(uid)
                self._cond.wait(self._heap[0][0] - now if self._heap else None)

    def _run_writer(self) -> None:
        while True:
            uid = self._work.get()
            if uid is None:
                return
            with self._cond:
                entry = self._entries.get(uid)
                if entry is None or entry.state != _QUEUED:
                    continue
                entry.state = _WRITING
                allocation, seq, seen_wall = entry.allocation, entry.seq, entry.seen_wall
            try:
                result = self._write(allocation, seen_wall)
            except Exception:  # a bug here must not stop the writer; the claim is retried
                log.exception("ResourceClaim %s: writing its binding conditions failed", allocation.key)
                result = None
            with self._cond:
                entry = self._entries.get(uid)
                if entry is None or entry.seq != seq:
                    continue  # dropped or allocated anew meanwhile: that has its own deadline
                if result is True:
                    entry.state = _WRITTEN
                elif result is False:
                    del self._entries[uid]
                else:
                    entry.attempts += 1
                    low, high = self.retry_backoff
                    entry.due = self._clock() + min(high, low * 2 ** (entry.attempts - 1))
                    self._schedule(entry, uid)

    # --- the write -------------------------------------------------------------------------------
    def _write(self, allocation: Allocation, seen_wall: float) -> bool | None:
        """Set the conditions of the allocation's waiting devices: True when written, False when
        it cannot be (drop the entry), None to retry."""
        now = self._wall_clock()
        outcomes: dict[DeviceKey, str] = {}
        written: dict[DeviceKey, list[dict[str, Any]]] = {}
        for target in allocation.waiting:
            result = outcome(allocation, target, self.failure_fraction)
            outcomes[target.key] = result
            written[target.key] = new_conditions(
                target, result, now=now, generation=allocation.generation, message=self._message(result)
            )
        failed = [str(k) for k, v in outcomes.items() if v == FAILED]
        attributes: dict[str, Any] = {
            K8S_NAMESPACE: allocation.namespace,
            CLAIM_NAME: allocation.name,
            CLAIM_UID: allocation.uid,
            DRIVER: self.driver,
            DEVICES: [str(k) for k in outcomes],
            OUTCOME: FAILED if failed else ATTACHED,
        }
        if failed:
            attributes[FAILED_DEVICES] = failed
        trace_id = trace_id_of(allocation.uid) if self.spans.enabled else None
        context = self.spans.derived_parent(trace_id, SPAN_NAME) if trace_id is not None else None
        path = STATUS_PATH_TEMPLATE.format(namespace=quote(allocation.namespace), name=quote(allocation.name))
        query = {"fieldManager": FIELD_MANAGER, "force": "true"}
        body = json.dumps(apply_body(allocation, written)).encode()
        with self.spans.start(SPAN_NAME, attributes=attributes, context=context, record_exceptions=False) as span:
            http_attributes: dict[str, Any] = {
                HTTP_METHOD: "PATCH",
                URL_FULL: f"{self.client.host}{path}?fieldManager={FIELD_MANAGER}&force=true",
                URL_TEMPLATE: STATUS_PATH_TEMPLATE,
                SERVER_ADDRESS: self._api_address,
                SERVER_PORT: self._api_port,
                K8S_NAMESPACE: allocation.namespace,
            }
            with span.child(f"PATCH {STATUS_PATH_TEMPLATE}", kind=SpanKind.CLIENT, attributes=http_attributes) as http:
                headers: dict[str, str] = {}
                http.inject(headers)  # the API server joins the trace when it traces
                try:
                    self.client.request(
                        "PATCH",
                        path,
                        query=query,
                        body=body,
                        content_type=APPLY_CONTENT_TYPE,
                        headers=headers,
                        timeout=self.write_timeout,
                    )
                except ApiError as exc:
                    if exc.status:
                        http.set_attribute(HTTP_STATUS, exc.status)
                    error = str(exc.status) if exc.status else "no_answer"
                    http.set_attribute(ERROR_TYPE, error)
                    http.set_status(Status(StatusCode.ERROR, exc.message))
                    span.set_attribute(ERROR_TYPE, error)
                    span.set_status(Status(StatusCode.ERROR, exc.message))
                    return self._failed_write(allocation, exc)
                http.set_attribute(HTTP_STATUS, 200)
            exemplar = parent_context(span.span_context()) if self.spans.enabled else None
        seconds = seconds_since_allocation(allocation, seen_wall, now)
        for key, result in outcomes.items():
            self.metrics.condition_set(result, seconds, exemplar)
            log.info(
                "ResourceClaim %s: %s %s, %.1f s after its allocation",
                allocation.key,
                key,
                "attachment failed (simulated)" if result == FAILED else "attached",
                seconds,
            )
        return True

    def _failed_write(self, allocation: Allocation, exc: ApiError) -> bool | None:
        self.metrics.write_error(exc.status)
        if exc.status in _PERMANENT:
            log.warning(
                "ResourceClaim %s: not writing its binding conditions, the claim changed or is gone: %s",
                allocation.key,
                exc,
            )
            return False
        if exc.status == 403:
            log.error(
                "ResourceClaim %s: forbidden to write its status (%s): the controller needs patch on "
                "resourceclaims/status and, where DRAResourceClaimGranularStatusAuthorization is on (1.36+), "
                "arbitrary-node:patch on resourceclaims/driver for %s; retrying",
                allocation.key,
                exc.message,
                self.driver,
            )
        else:
            log.warning("ResourceClaim %s: writing its binding conditions failed, retrying: %s", allocation.key, exc)
        return None

    def _message(self, result: str) -> str:
        if result == FAILED:
            return (
                f"simulated attachment failure: {FIELD_MANAGER} fails a fraction {self.failure_fraction:g} "
                "of attachments (--failure-fraction)"
            )
        return f"attached (simulated) by {FIELD_MANAGER}, {self.attach_delay:g} s after it saw the allocation"


def _describe(obj: Any) -> str:
    """namespace/name of a claim, as far as its metadata tells."""
    meta = obj.get("metadata") if isinstance(obj, dict) else None
    if not isinstance(meta, dict):
        return "(no metadata)"
    return f"{meta.get('namespace', '?')}/{meta.get('name', '?')}"
