"""ResourceSlice publishing: this node's devices, as one pool named after the node.

The publisher owns the slices with ``spec.nodeName=<node>`` and ``spec.driver=<driver>``. A
reconcile lists them (one field-selected request), compares the devices they carry with the
devices to publish, and only when they differ writes every slice with the pool generation
incremented, then deletes slices it no longer needs. Unchanged devices cost one list request per
resync and no writes. A background thread rediscovers devices and reconciles every ``resync``
seconds, which also repairs slices that someone else changed or deleted.

Every slice is owned by the node's Node object (``ownerReferences``: v1 Node, its name and UID,
``controller: true``, as the kubelet-plugin helper's ResourceSlice controller writes it), so the
garbage collector deletes the slices when the Node is deleted. The Node's UID is read when a slice
is written (one GET; not at unchanged resyncs). Where the Node does not exist (yet) the slices are
published without an owner, with a warning, and the lookup is repeated at every reconcile until it
appears; then the slices are rewritten with it. Upstream refuses to publish without the Node
instead; publishing keeps a plugin started before its kubelet registered the Node, or a setup without
Node objects, usable. If the Node is deleted while the plugin runs on, the collector deletes the
slices and the next reconcile publishes them again: owned by the new Node once the kubelet has
registered it again, without owner until then.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any
from urllib.parse import quote

from otel_dra.kube.client import ApiError, KubeClient
from otel_dra.kube.quantity import parse_quantity
from otel_dra.plugin.devices import Device
from otel_dra.plugin.registration import go_to_lower

log = logging.getLogger(__name__)

SLICES_PATH = "/apis/resource.k8s.io/v1/resourceslices"
MAX_DEVICES_PER_SLICE = 128
# Seconds after a (re)registration at which the slices are checked again (see recheck_soon): a few
# LISTs of the node's own slices per registration.
RECHECK_AFTER_REGISTRATION = (0.0, 1.0, 2.0, 5.0, 10.0, 20.0)
_MAX_NAME = 253

# Answers that no retry will change: our own slice is invalid, or the request is.
FATAL_STATUSES = frozenset({400, 422})


class FatalPublishError(RuntimeError):
    """Publishing can never succeed as configured (e.g. the API server rejects our slices)."""


def slice_name(node_name: str, driver_name: str, index: int) -> str:
    """Deterministic, so a restarted plugin finds and updates its slices instead of adding more."""
    name = f"{node_name}-{driver_name}-{index}"
    # The digest of both names stands in when the name is too long, and for a driver name with
    # upper case (the kubelet takes it, an object name may not have it, and lowering it would give
    # "GPU.x" and "gpu.x", two drivers, the same slices).
    if len(name) <= _MAX_NAME and go_to_lower(driver_name) == driver_name:
        return name
    digest = hashlib.sha256(f"{node_name}/{driver_name}".encode()).hexdigest()[:16]
    prefix = node_name[: _MAX_NAME - len(digest) - 12].rstrip(".-")  # a label may not end in . or -
    return f"{prefix}-{digest}-{index}"


def _comparable(devices: Sequence[Any]) -> list[Any]:
    """Devices reduced to what we publish, with quantities as numbers (``80Gi`` == 85899345920)."""
    out = []
    for d in devices:
        if not isinstance(d, dict):
            return [None]  # something we did not write: never equal
        capacity: dict[str, float | None] = {}
        for key, value in (d.get("capacity") or {}).items():
            try:
                capacity[key] = parse_quantity(value.get("value") if isinstance(value, dict) else None)
            except ValueError:
                capacity[key] = None
        # Taints without timeAdded: ours carry it, and what the server wrote back may spell it otherwise.
        taints = [(t.get("key"), t.get("value"), t.get("effect")) for t in d.get("taints") or [] if isinstance(t, dict)]
        out.append((d.get("name"), d.get("attributes") or {}, capacity, taints))
    return out


def _with_taints(device: Device, taints: Mapping[str, list[dict[str, str]]]) -> dict[str, Any]:
    body = device.to_api()
    if taints.get(device.name):
        body["taints"] = taints[device.name]
    return body


class SlicePublisher:
    def __init__(
        self,
        client: KubeClient,
        *,
        driver_name: str,
        node_name: str,
        discover: Callable[[], list[Device]],
        on_devices: Callable[[list[Device]], None] | None = None,
        on_fatal: Callable[[BaseException], None] | None = None,
        resync: float = 30.0,
        device_taints: Callable[[], Mapping[str, list[dict[str, str]]]] | None = None,
    ) -> None:
        """``device_taints`` gives the taints to publish per device name (health.DeviceTaints)."""
        self.client = client
        self._device_taints = device_taints
        self._taints_dropped = False
        self.driver_name = driver_name
        self.node_name = node_name
        self.pool_name = node_name
        self._discover = discover
        self._on_devices = on_devices
        self._on_fatal = on_fatal
        self._resync = resync
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._soon: list[float] = []  # monotonic times of extra reconciles (recheck_soon)
        self._soon_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self.generation = 0
        self.publishes = 0  # reconciles that wrote something (tests and logs)
        self._owner: dict[str, Any] | None = None  # the Node's owner reference, once read
        self._warned_no_node = False

    # --- the owner: this node's Node object ----------------------------------------------------
    def node_owner(self, *, refresh: bool) -> dict[str, Any] | None:
        """The owner reference to this node's Node, None while there is no such Node. Read from the
        API server when ``refresh`` or not known yet; other API errors propagate (retried)."""
        if self._owner is not None and not refresh:
            return self._owner
        try:
            node = self.client.get_json(f"/api/v1/nodes/{quote(self.node_name)}")
        except ApiError as exc:
            if exc.status != 404:
                raise
            if not self._warned_no_node:
                log.warning(
                    "Node %s does not exist: its ResourceSlices are published without an owner reference "
                    "(the garbage collector will not delete them with the Node) until it does",
                    self.node_name,
                )
                self._warned_no_node = True
            self._owner = None
            return None
        uid = (node.get("metadata") or {}).get("uid") if isinstance(node, dict) else None
        if not isinstance(uid, str) or not uid:
            raise ApiError(0, f"Node {self.node_name} has no metadata.uid")
        self._owner = {"apiVersion": "v1", "kind": "Node", "name": self.node_name, "uid": uid, "controller": True}
        self._warned_no_node = False
        return self._owner

    # --- one reconcile -------------------------------------------------------------------------
    def list_own(self) -> list[dict[str, Any]]:
        selector = f"spec.nodeName={self.node_name},spec.driver={self.driver_name}"
        items = self.client.get_json(SLICES_PATH, {"fieldSelector": selector}).get("items") or []
        return [s for s in items if isinstance(s, dict)]

    def publish(self, devices: Sequence[Device]) -> bool:
        """Make the API server hold exactly ``devices``; True when something was written."""
        chunks = [list(devices[i : i + MAX_DEVICES_PER_SLICE]) for i in range(0, len(devices), MAX_DEVICES_PER_SLICE)]
        chunks = chunks or [[]]  # an empty pool is still published, so consumers see the node has none
        desired = {slice_name(self.node_name, self.driver_name, i): chunk for i, chunk in enumerate(chunks)}
        taints = self._device_taints() if self._device_taints is not None and not self._taints_dropped else {}
        existing = {s.get("metadata", {}).get("name", ""): s for s in self.list_own()}
        generations = [int((s.get("spec", {}).get("pool") or {}).get("generation") or 0) for s in existing.values()]
        if self._up_to_date(existing, desired, taints, self.node_owner(refresh=False)):
            self.generation = max(generations, default=0)
            return False
        owner = self.node_owner(refresh=True)  # the Node may have been re-created: its UID now
        generation = max(generations, default=0) + 1
        for name, chunk in desired.items():
            body = self._slice(name, chunk, generation, len(desired), taints, owner)
            current = existing.get(name)
            if current is None:
                answer = self.client.send_json("POST", SLICES_PATH, body)
            else:
                body["metadata"]["resourceVersion"] = current["metadata"]["resourceVersion"]
                answer = self.client.send_json("PUT", f"{SLICES_PATH}/{name}", body)
            self._check_taints_kept(body, answer)
        for name in existing.keys() - desired.keys():
            self._delete(name)
        self.generation = generation
        self.publishes += 1
        log.info(
            "published %d device(s) in %d ResourceSlice(s) for pool %s, generation %d",
            len(devices),
            len(desired),
            self.pool_name,
            generation,
        )
        return True

    def _check_taints_kept(self, sent: dict[str, Any], answer: Any) -> None:
        """An API server without device taints (DRADeviceTaints off: alpha in 1.33/1.34) drops them
        silently; comparing with them would then rewrite the slices at every resync, for nothing."""
        if self._taints_dropped or not any("taints" in d for d in sent["spec"]["devices"]):
            return
        kept = answer.get("spec", {}).get("devices") if isinstance(answer, dict) else None
        if isinstance(kept, list) and not any(isinstance(d, dict) and d.get("taints") for d in kept):
            self._taints_dropped = True
            log.warning(
                "the API server dropped the device taints of ResourceSlice %s (feature gate DRADeviceTaints "
                "off?): unhealthy devices stay schedulable; taints are no longer compared",
                sent["metadata"]["name"],
            )

    def _up_to_date(
        self,
        existing: dict[str, dict[str, Any]],
        desired: dict[str, list[Device]],
        taints: Mapping[str, list[dict[str, str]]],
        owner: dict[str, Any] | None,
    ) -> bool:
        if set(existing) != set(desired):
            return False
        generations = set()
        for name, chunk in desired.items():
            if (existing[name].get("metadata") or {}).get("ownerReferences", []) != ([owner] if owner else []):
                return False
            spec = existing[name].get("spec") or {}
            pool = spec.get("pool") or {}
            if pool.get("name") != self.pool_name or pool.get("resourceSliceCount") != len(desired):
                return False
            generations.add(pool.get("generation"))
            if _comparable(spec.get("devices") or []) != _comparable([_with_taints(d, taints) for d in chunk]):
                return False
        return len(generations) == 1

    def _slice(
        self,
        name: str,
        devices: list[Device],
        generation: int,
        count: int,
        taints: Mapping[str, list[dict[str, str]]],
        owner: dict[str, Any] | None,
    ) -> dict[str, Any]:
        metadata: dict[str, Any] = {"name": name, "labels": {"app.kubernetes.io/managed-by": "otel-dra-plugin"}}
        if owner is not None:
            metadata["ownerReferences"] = [owner]
        return {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceSlice",
            "metadata": metadata,
            "spec": {
                "driver": self.driver_name,
                "nodeName": self.node_name,
                "pool": {"name": self.pool_name, "generation": generation, "resourceSliceCount": count},
                "devices": [_with_taints(d, taints) for d in devices],
            },
        }

    def _delete(self, name: str) -> None:
        try:
            self.client.request("DELETE", f"{SLICES_PATH}/{name}")
        except ApiError as exc:
            if exc.status != 404:
                raise

    def delete_all(self) -> int:
        """Remove every slice of this node and driver (on request, or at a clean shutdown)."""
        names = [s.get("metadata", {}).get("name", "") for s in self.list_own()]
        for name in names:
            self._delete(name)
        if names:
            log.info("deleted %d ResourceSlice(s) of pool %s", len(names), self.pool_name)
        return len(names)

    # --- background loop -----------------------------------------------------------------------
    def sync(self) -> bool:
        """Rediscover and publish once. Raises on failure (see :meth:`start` for the policy)."""
        devices = self._discover()
        if self._on_devices is not None:
            self._on_devices(devices)
        try:
            return self.publish(devices)
        except ApiError as exc:
            if exc.status in FATAL_STATUSES:
                raise FatalPublishError(f"the API server rejects this node's ResourceSlices: {exc}") from exc
            raise

    def start(self) -> SlicePublisher:
        self._thread = threading.Thread(target=self._run, name="slice-publisher", daemon=True)
        self._thread.start()
        return self

    def trigger(self) -> None:
        """Reconcile now instead of at the next resync."""
        self._wake.set()

    def recheck_soon(self, delays: Sequence[float] = RECHECK_AFTER_REGISTRATION) -> None:
        """Reconcile now and again after each of ``delays`` seconds. Called when the kubelet
        (re)registers the plugin: a starting kubelet deletes all ResourceSlices of its node in the
        background (DRAPluginManager.wipeResourceSlices, retried with a 1 s, 2 s, ... backoff until
        it can read its Node), so the delete can land just before or a few seconds after the
        registration; without the re-checks the node had no devices for the scheduler until the
        next resync (29 s measured with a real kubelet 1.37)."""
        now = time.monotonic()
        with self._soon_lock:
            self._soon = sorted({*self._soon, *(now + d for d in delays)})
        self._wake.set()

    def _next_wait(self, wait: float) -> float:
        now = time.monotonic()
        with self._soon_lock:
            self._soon = [t for t in self._soon if t > now]
            return min([wait, *(t - now for t in self._soon)])

    def _run(self) -> None:
        failures = 0
        while not self._stop.is_set():
            try:
                self.sync()
                failures = 0
                wait = self._resync
            except ApiError as exc:
                # API trouble (unreachable, 5xx, 403 until RBAC is fixed, conflicts): retry with backoff.
                failures += 1
                wait = min(0.5 * 2 ** min(failures - 1, 6), self._resync)
                log.warning("publishing ResourceSlices failed (retrying in %.1fs): %s", wait, exc)
            except Exception as exc:
                # Discovery failed or the API server rejects our slices: no retry will fix that.
                log.error("fatal: %s", exc)
                if self._on_fatal is not None:
                    self._on_fatal(exc)
                return
            self._wake.wait(self._next_wait(wait))
            self._wake.clear()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
