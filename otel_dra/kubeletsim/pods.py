"""Pod lifecycle on emulated nodes: prepare claims before a pod "starts", unprepare after it ends.

What the kubelet does for DRA, in the order it does it:

1. A pod is bound to the node. Its claims are the ``resourceClaimName`` entries of
   ``spec.resourceClaims`` and, for templates, the names the claim controller recorded in
   ``status.resourceClaimStatuses``. Each claim must be allocated and reserved for the pod.
2. For each driver named in the claims' allocation results, one NodePrepareResources call with the
   pod's claims for that driver that are not prepared on the node yet: a claim shared with a pod
   that already runs there, or one that succeeded in an earlier, partly failed attempt, is not sent
   again (the kubelet's claim info cache, pkg/kubelet/cm/dra/manager.go: "Resources already
   prepared"). Any per-claim error leaves the pod Pending and is retried with backoff. Once all
   succeed the pod is reported Running.
3. When the pod is being deleted: NodeUnprepareResources for its claims (a claim shared with another
   pod on the node stays prepared), the pod is removed from each claim's ``reservedFor``, and the
   deletion is finished (grace period 0), as a kubelet does once the containers are gone.

Prepare and unprepare are idempotent on the plugin side, so after a restart of this emulator pods
already Running are prepared once more to rebuild what is prepared.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import grpc

from otel_dra._generated.dra.v1 import api_pb2 as dra_pb2
from otel_dra.kube.client import ApiError, KubeClient
from otel_dra.kube.reflector import Reflector, ResourceType
from otel_dra.kube.timestamps import format_time
from otel_dra.kubeletsim.registry import PluginWatcher

log = logging.getLogger(__name__)

PODS = ResourceType("pods", "v1")
_CLAIMS = "/apis/resource.k8s.io/v1/namespaces/{ns}/resourceclaims/{name}"
# The gRPC package of the kubelet's DRA service (k8s.io/kubelet/pkg/apis/dra/<version>/api.proto).
_DRA_PACKAGE = "k8s.io.kubelet.pkg.apis.dra"


class Retry(Exception):
    """The pod cannot progress yet (claim not allocated, driver not registered, prepare failed)."""


@dataclass(frozen=True)
class ClaimRef:
    namespace: str
    name: str
    uid: str
    drivers: tuple[str, ...]


@dataclass
class _Prepared:
    node: str
    claims: list[ClaimRef] = field(default_factory=list)


class _NodePods:
    """Reflector handler for the pods of one node; hands every change to the work queue."""

    def __init__(self, sync: PodSync, node: str) -> None:
        self._sync = sync
        self._node = node
        self._uids: set[str] = set()

    def replace(self, objects: Iterable[dict[str, Any]]) -> None:
        seen: set[str] = set()
        for obj in objects:
            uid = self._sync._store(obj)
            if uid:
                seen.add(uid)
        for uid in self._uids - seen:
            self._sync._forget(uid)
        self._uids = seen

    def upsert(self, obj: dict[str, Any]) -> None:
        uid = self._sync._store(obj)
        if uid:
            self._uids.add(uid)

    def delete(self, obj: dict[str, Any]) -> None:
        uid = str((obj.get("metadata") or {}).get("uid") or "")
        self._uids.discard(uid)
        self._sync._forget(uid)


class PodSync:
    """Runs the pods of the nodes in ``watchers`` (node name -> its plugin watcher)."""

    def __init__(
        self,
        client: KubeClient,
        watchers: Mapping[str, PluginWatcher],
        *,
        workers: int = 4,
        rpc_timeout: float = 30.0,
        tracer: Any = None,
        on_rpc: Callable[[str, int, float], None] | None = None,
    ) -> None:
        self.client = client
        self._on_rpc = on_rpc  # (method, number of claims, seconds): for benchmarks
        self.watchers = dict(watchers)
        self.rpc_timeout = rpc_timeout
        self._tracer = tracer  # an OTel Tracer: kubelet-side CLIENT spans, propagated to the plugin
        self._lock = threading.Lock()
        self._pods: dict[str, dict[str, Any]] = {}
        self._prepared: dict[str, _Prepared] = {}
        # Pod UID -> the claims it references, recorded before they are prepared (the kubelet adds
        # the pod to its claim info first): a claim stays prepared while any pod references it, and
        # a pod deleted before its prepare succeeded still gets what it did prepare unprepared.
        self._refs: dict[str, _Prepared] = {}
        # Node -> UIDs of the claims prepared there (answered without error, not unprepared since).
        self._ready: dict[str, set[str]] = {node: set() for node in self.watchers}
        self._finished: set[str] = set()  # pods whose deletion we completed; events may still come
        self._queue: queue.Queue[str | None] = queue.Queue()
        self._queued: set[str] = set()
        self._active: set[str] = set()
        self._again: set[str] = set()
        self._failures: dict[str, int] = {}
        self._last_error: dict[str, str] = {}
        self._stop = threading.Event()
        self._timers: set[threading.Timer] = set()  # retries waiting (cancelled by stop)
        self._reflectors = [
            Reflector(client, PODS, _NodePods(self, node), field_selector=f"spec.nodeName={node}")
            for node in self.watchers
        ]
        self._workers = [
            threading.Thread(target=self._work, name=f"kubelet-sim-worker-{i}", daemon=True) for i in range(workers)
        ]

    # --- lifecycle -----------------------------------------------------------------------------
    def start(self) -> PodSync:
        for worker in self._workers:
            worker.start()
        for reflector in self._reflectors:
            reflector.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        for reflector in self._reflectors:
            reflector.request_stop()
        for reflector in self._reflectors:
            reflector.stop()
        for _ in self._workers:
            self._queue.put(None)
        for worker in self._workers:
            worker.join(timeout=self.rpc_timeout + 5)
        with self._lock:
            timers, self._timers = self._timers, set()
        for timer in timers:
            timer.cancel()
        for timer in timers:
            timer.join(timeout=1)

    def synced(self) -> bool:
        return all(r.state().synced for r in self._reflectors)

    def prepared_pods(self) -> dict[str, list[ClaimRef]]:
        """Pod UID -> claims prepared for it (for tests and the demo's summary)."""
        with self._lock:
            return {uid: list(p.claims) for uid, p in self._prepared.items()}

    # --- cache and queue (client-go workqueue semantics: one worker per key at a time) ----------
    def _store(self, obj: dict[str, Any]) -> str:
        uid = str((obj.get("metadata") or {}).get("uid") or "")
        if uid:
            with self._lock:
                self._pods[uid] = obj
            self._enqueue(uid)
        return uid

    def _forget(self, uid: str) -> None:
        with self._lock:
            self._pods.pop(uid, None)
            self._finished.discard(uid)
        self._enqueue(uid)

    def _enqueue(self, uid: str) -> None:
        with self._lock:
            if uid in self._active:
                self._again.add(uid)
                return
            if uid in self._queued:
                return
            self._queued.add(uid)
        self._queue.put(uid)

    def _retry_later(self, uid: str) -> None:
        with self._lock:
            n = self._failures.get(uid, 0) + 1
            self._failures[uid] = n
        delay = min(0.2 * 2 ** (n - 1), 10.0)
        timer = threading.Timer(delay, self._enqueue, (uid,))
        timer.daemon, timer.name = True, f"kubelet-sim-retry-{uid}"
        with self._lock:
            if self._stop.is_set():
                return
            # Started under the lock, so that stop() joins only started timers.
            self._timers = {t for t in self._timers if not t.finished.is_set()}
            self._timers.add(timer)
            timer.start()

    def _work(self) -> None:
        while True:
            uid = self._queue.get()
            if uid is None or self._stop.is_set():
                return
            with self._lock:
                self._queued.discard(uid)
                self._active.add(uid)
            try:
                self._sync(uid)
                with self._lock:
                    self._failures.pop(uid, None)
                    self._last_error.pop(uid, None)
            except Retry as exc:
                self._note(uid, str(exc))
                self._retry_later(uid)
            except (ApiError, grpc.RpcError) as exc:
                self._note(uid, f"{type(exc).__name__}: {exc}")
                self._retry_later(uid)
            except Exception:  # a bug with one pod must not stop the others
                log.exception("pod %s: unexpected error", uid)
                self._retry_later(uid)
            finally:
                with self._lock:
                    self._active.discard(uid)
                    again = uid in self._again
                    self._again.discard(uid)
                if again:
                    self._enqueue(uid)

    def _note(self, uid: str, error: str) -> None:
        """Log each distinct error of a pod once, not on every retry."""
        with self._lock:
            pod = self._pods.get(uid)
            first = self._last_error.get(uid) != error
            self._last_error[uid] = error
        if first:
            meta = (pod or {}).get("metadata") or {}
            log.warning("pod %s/%s: %s (retrying)", meta.get("namespace", "?"), meta.get("name", uid), error)

    # --- the kubelet's part --------------------------------------------------------------------
    def _sync(self, uid: str) -> None:
        with self._lock:
            pod = self._pods.get(uid)
            prepared = self._prepared.get(uid)
            referenced = self._refs.get(uid)
            if uid in self._finished:
                return  # an event that was already queued when we finished the deletion
        if pod is None:  # gone from the API (deleted by someone else): clean up what we prepared
            if referenced is not None:
                self._unprepare(uid, referenced)
                self._done(uid)
            return
        meta, spec, status = pod["metadata"], pod.get("spec") or {}, pod.get("status") or {}
        node = spec.get("nodeName") or ""
        if node not in self.watchers:
            return
        if meta.get("deletionTimestamp"):
            if referenced is None and status.get("phase") == "Running":
                # Started before this emulator (re)started: find what to clean up from the API.
                referenced = _Prepared(node, self._claims(pod, strict=False))
            if referenced is not None:
                self._unprepare(uid, referenced)
            for ref in referenced.claims if referenced else ():
                self._unreserve(ref, uid)
            self._finish_deletion(meta)
            self._done(uid, finished=True)
            return
        phase = status.get("phase")
        if phase in ("Succeeded", "Failed"):
            if referenced is not None:
                self._unprepare(uid, referenced)
                self._done(uid)
            return
        if prepared is not None and phase == "Running":
            return
        claims = self._claims(pod)
        with self._lock:
            self._refs[uid] = _Prepared(node, claims)
        self._prepare(node, pod, claims)
        with self._lock:
            self._prepared[uid] = _Prepared(node, claims)
        if phase != "Running":
            self._report_running(pod)

    def _done(self, uid: str, finished: bool = False) -> None:
        """Everything prepared for the pod is unprepared (only now: a failed step is retried)."""
        with self._lock:
            self._prepared.pop(uid, None)
            self._refs.pop(uid, None)
            if finished:
                self._finished.add(uid)

    def _claims(self, pod: dict[str, Any], strict: bool = True) -> list[ClaimRef]:
        """The pod's claims; ``strict``: each must exist and be reserved for the pod (else Retry)."""
        meta, spec, status = pod["metadata"], pod.get("spec") or {}, pod.get("status") or {}
        ns, uid = meta["namespace"], meta["uid"]
        generated = {s.get("name"): s.get("resourceClaimName") for s in status.get("resourceClaimStatuses") or ()}
        refs = []
        for entry in spec.get("resourceClaims") or ():
            name = entry.get("resourceClaimName")
            if not name and entry.get("resourceClaimTemplateName"):
                name = generated.get(entry.get("name"))
                if not name and strict:
                    raise Retry(f"claim {entry.get('name')!r} from a template is not created yet")
            if not name:
                continue
            try:
                claim = self.client.get_json(_CLAIMS.format(ns=ns, name=name))
            except ApiError as exc:
                if exc.status != 404:
                    raise
                if strict:
                    raise Retry(f"resource claim {name} not found") from exc
                continue
            claim_status = claim.get("status") or {}
            reserved = any(r.get("uid") == uid for r in claim_status.get("reservedFor") or ())
            if not reserved and strict:
                raise Retry(f"resource claim {name} is not reserved for this pod yet")
            results = ((claim_status.get("allocation") or {}).get("devices") or {}).get("results") or ()
            drivers = tuple(sorted({str(r.get("driver")) for r in results if r.get("driver")}))
            refs.append(ClaimRef(ns, name, claim["metadata"]["uid"], drivers))
        return refs

    def _by_driver(self, claims: Iterable[ClaimRef]) -> dict[str, list[ClaimRef]]:
        groups: dict[str, list[ClaimRef]] = {}
        for ref in claims:
            for driver in ref.drivers:
                groups.setdefault(driver, []).append(ref)
        return groups

    def _call(self, node: str, driver: str, method: str, claims: list[ClaimRef]) -> dict[str, str]:
        """One Node(Un)PrepareResources call; returns claim UID -> error for the claims that failed."""
        plugin = self.watchers[node].plugin(driver)
        if plugin is None:
            raise Retry(f"DRA driver {driver} is not registered on node {node}")
        request_type = (
            dra_pb2.NodePrepareResourcesRequest
            if method == "NodePrepareResources"
            else dra_pb2.NodeUnprepareResourcesRequest
        )
        request = request_type(claims=[dra_pb2.Claim(namespace=c.namespace, uid=c.uid, name=c.name) for c in claims])
        rpc = getattr(plugin.stub, method)
        start = time.perf_counter()
        if self._tracer is None:
            response = rpc(request, timeout=self.rpc_timeout)
        else:
            from opentelemetry.propagate import inject
            from opentelemetry.trace import SpanKind

            with self._tracer.start_as_current_span(
                f"kubelet {method}",
                kind=SpanKind.CLIENT,
                attributes={
                    # The RPC conventions the plugin's server spans follow (rpc.method fully qualified).
                    "rpc.system.name": "grpc",
                    "rpc.method": f"{_DRA_PACKAGE}.{plugin.version}/{method}",
                    "k8s.node.name": node,
                    "otel_dra.driver": driver,
                },
            ):
                carrier: dict[str, str] = {}
                inject(carrier)
                response = rpc(request, timeout=self.rpc_timeout, metadata=tuple(carrier.items()))
        if self._on_rpc is not None:
            self._on_rpc(method, len(claims), time.perf_counter() - start)
        errors = {}
        for ref in claims:
            if ref.uid not in response.claims:
                errors[ref.uid] = "no answer for this claim"
            elif response.claims[ref.uid].error:
                errors[ref.uid] = response.claims[ref.uid].error
        return errors

    def _prepare(self, node: str, pod: dict[str, Any], claims: list[ClaimRef]) -> None:
        with self._lock:
            ready = set(self._ready[node])
        for driver, group in self._by_driver(c for c in claims if c.uid not in ready).items():
            errors = self._call(node, driver, "NodePrepareResources", group)
            with self._lock:
                self._ready[node].update(c.uid for c in group if c.uid not in errors)
            if errors:
                names = {c.uid: c.name for c in group}
                raise Retry("; ".join(f"prepare of claim {names[u]} failed: {e}" for u, e in errors.items()))

    def _unprepare(self, uid: str, prepared: _Prepared) -> None:
        with self._lock:
            in_use = {
                c.uid for other, p in self._refs.items() if other != uid and p.node == prepared.node for c in p.claims
            }
        claims = [c for c in prepared.claims if c.uid not in in_use]
        for driver, group in self._by_driver(claims).items():
            errors = self._call(prepared.node, driver, "NodeUnprepareResources", group)
            with self._lock:
                self._ready[prepared.node].difference_update(c.uid for c in group if c.uid not in errors)
            if errors:
                names = {c.uid: c.name for c in group}
                raise Retry("; ".join(f"unprepare of claim {names[u]} failed: {e}" for u, e in errors.items()))

    def _unreserve(self, ref: ClaimRef, pod_uid: str) -> None:
        path = _CLAIMS.format(ns=ref.namespace, name=ref.name)
        for _ in range(5):
            try:
                claim = self.client.get_json(path)
            except ApiError as exc:
                if exc.status == 404:
                    return
                raise
            if claim["metadata"]["uid"] != ref.uid:
                return  # a new claim of the same name: not ours
            status = claim.setdefault("status", {})
            reserved = status.get("reservedFor") or []
            keep = [r for r in reserved if r.get("uid") != pod_uid]
            if len(keep) == len(reserved):
                return
            if keep:
                status["reservedFor"] = keep
            else:
                status.pop("reservedFor", None)
            try:
                # The object's resourceVersion makes this a compare-and-swap: a concurrent writer
                # (the scheduler adding another pod) makes it fail with 409, and we read again.
                self.client.send_json("PUT", path + "/status", claim)
                return
            except ApiError as exc:
                if exc.status not in (409, 404):
                    raise
                if exc.status == 404:
                    return
        raise Retry(f"could not remove the reservation from claim {ref.name}: conflicting updates")

    def _finish_deletion(self, meta: dict[str, Any]) -> None:
        path = f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}"
        body = {
            "apiVersion": "v1",
            "kind": "DeleteOptions",
            "gracePeriodSeconds": 0,
            "preconditions": {"uid": meta["uid"]},
        }
        try:
            self.client.send_json("DELETE", path, body)
        except ApiError as exc:
            if exc.status not in (404, 409):  # already gone, or a different pod of that name now
                raise

    def _report_running(self, pod: dict[str, Any]) -> None:
        meta, spec = pod["metadata"], pod.get("spec") or {}
        now = format_time()
        conditions = [
            {"type": t, "status": "True", "lastTransitionTime": now}
            for t in ("Initialized", "PodReadyToStartContainers", "ContainersReady", "Ready")
        ]
        containers = [
            {
                "name": c.get("name", ""),
                "image": c.get("image", ""),
                "imageID": "",
                "ready": True,
                "started": True,
                "restartCount": 0,
                "state": {"running": {"startedAt": now}},
            }
            for c in spec.get("containers") or ()
        ]
        patch = {
            "metadata": {"uid": meta["uid"]},  # fails instead of patching a new pod of the same name
            "status": {
                "phase": "Running",
                "startTime": now,
                "hostIP": "127.0.0.1",
                "conditions": conditions,
                "containerStatuses": containers,
            },
        }
        path = f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}/status"
        self.client.send_json("PATCH", path, patch, "application/strategic-merge-patch+json")
