"""ResourceSlice publishing: this node's devices, as one pool named after the node.

The publisher owns the slices with ``spec.nodeName=<node>`` and ``spec.driver=<driver>``. A
reconcile lists them (one field-selected request), compares the devices they carry with the
devices to publish, and only when they differ writes every slice with the pool generation
incremented, then deletes slices it no longer needs. A background thread rediscovers devices and
reconciles every ``resync`` seconds, which also repairs slices that someone else changed or deleted.

Unchanged devices cost one metadata-only list per resync and no writes: once the slices are known
to match (compared in full, or written), the publisher keeps what it published and the
``resourceVersion`` of each slice; while the devices to publish, the owner and the names and
versions on the API server all stay the same, nothing can differ, and the full list (every device
of every slice, decoded and compared) is skipped. Any change there, ours or someone else's, takes
the full path. Why: the kubelet's registration brings five re-checks within 20 s (recheck_soon),
and a re-check of a 64-device pool cost about 5 ms of CPU with the full list, 1.5 ms without it
(docs/benchmarks-log.md, issue 29).

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
from otel_dra.plugin.devices import (
    BINDING,
    CONSUMABLE,
    FEATURES,
    NODE_ALLOCATABLE,
    PARTITION_TYPE,
    PARTITIONABLE,
    Device,
    Pool,
    without,
)
from otel_dra.plugin.registration import go_to_lower

log = logging.getLogger(__name__)

SLICES_PATH = "/apis/resource.k8s.io/v1/resourceslices"
# A list of the objects' metadata alone (PartialObjectMetadataList; the API server converts, with
# the same selectors): the names and resourceVersions of the node's slices, without their devices.
METADATA_LIST = "application/json;as=PartialObjectMetadataList;g=meta.k8s.io;v=v1,application/json"
MAX_DEVICES_PER_SLICE = 128
# With taints or consumed counters on any device of a slice (resource.k8s.io/v1, 1.35 and later).
MAX_DEVICES_PER_SLICE_WITH_EXTRAS = 64
MAX_COUNTER_SETS_PER_SLICE = 8
# Until 1.34 a device consumed counter sets of its own slice; since 1.35 counter sets are in slices
# of their own ("only one of sharedCounters or devices is allowed") that devices refer to by name.
SEPARATE_COUNTER_SLICES_SINCE = (1, 35)
# The fields a feature adds, as the API server names them in a rejection (422) and in what it wrote.
FEATURE_FIELDS = {
    PARTITIONABLE: ("sharedCounters", "consumesCounters"),
    PARTITION_TYPE: ("partitionTypeAttribute",),
    CONSUMABLE: ("allowMultipleAllocations", "requestPolicy"),
    BINDING: ("bindingConditions", "bindingFailureConditions", "bindsToNode"),
    NODE_ALLOCATABLE: ("nodeAllocatableResources",),
}
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


def _number(value: Any) -> float | None:
    try:
        return parse_quantity(value)
    except (ValueError, TypeError):
        return None


def _quantities(value: Any) -> Any:
    """Quantities anywhere in a policy or mapping as numbers (the server writes them canonically:
    ``10240Mi`` comes back as ``10Gi``); other values as they are."""
    if isinstance(value, dict):
        return {k: _quantities(v) for k, v in sorted(value.items())}
    if isinstance(value, list):
        return [_quantities(v) for v in value]
    if isinstance(value, str):
        number = _number(value)
        return value if number is None else number
    return value


def _counters(counters: Any) -> dict[str, float | None]:
    return {str(k): _number(v.get("value") if isinstance(v, dict) else None) for k, v in (counters or {}).items()}


def _comparable(devices: Sequence[Any]) -> list[Any]:
    """Devices reduced to what we publish, with quantities as numbers (``80Gi`` == 85899345920)."""
    out = []
    for d in devices:
        if not isinstance(d, dict):
            return [None]  # something we did not write: never equal
        capacity: dict[str, Any] = {}
        for key, value in (d.get("capacity") or {}).items():
            entry = value if isinstance(value, dict) else {}
            capacity[key] = (_number(entry.get("value")), _quantities(entry.get("requestPolicy")))
        # Taints without timeAdded: ours carry it, and what the server wrote back may spell it otherwise.
        taints = [(t.get("key"), t.get("value"), t.get("effect")) for t in d.get("taints") or [] if isinstance(t, dict)]
        consumes = [
            (c.get("counterSet"), _counters(c.get("counters")))
            for c in d.get("consumesCounters") or []
            if isinstance(c, dict)
        ]
        extras = (
            d.get("allowMultipleAllocations") is True,
            d.get("bindsToNode") is True,
            list(d.get("bindingConditions") or []),
            list(d.get("bindingFailureConditions") or []),
            _quantities(d.get("nodeAllocatableResources") or {}),
        )
        out.append((d.get("name"), d.get("attributes") or {}, capacity, taints, consumes, extras))
    return out


def _comparable_spec(spec: Mapping[str, Any]) -> Any:
    shared = [
        (c.get("name"), _counters(c.get("counters"))) for c in spec.get("sharedCounters") or [] if isinstance(c, dict)
    ]
    return (_comparable(spec.get("devices") or []), shared, spec.get("partitionTypeAttribute") or "")


def dropped_features(sent: Mapping[str, Any], kept: Any) -> set[str]:
    """The features whose fields we sent in a slice's spec and the API server did not keep (it
    drops the fields of a feature gate that is off, without an error)."""
    kept_spec = kept.get("spec") if isinstance(kept, dict) else None
    if not isinstance(kept_spec, dict):
        return set()

    def used(spec: Mapping[str, Any], names: Sequence[str]) -> bool:
        if any(spec.get(n) for n in names):
            return True
        for d in spec.get("devices") or []:
            if not isinstance(d, dict):
                continue
            if any(d.get(n) for n in names):
                return True
            if "requestPolicy" in names and any(
                isinstance(c, dict) and c.get("requestPolicy") for c in (d.get("capacity") or {}).values()
            ):
                return True
        return False

    return {f for f, names in FEATURE_FIELDS.items() if used(sent, names) and not used(kept_spec, names)}


def rejected_features(message: str) -> set[str]:
    """The features whose fields or gate a rejection names: a gate that is off can forbid a field
    (422), and the API server's admission refuses node-allocatable resources for a node that does
    not declare the feature (403 ``node "n" does not support DRANodeAllocatableResources feature``)."""
    text = message.lower()
    return {
        f for f, names in FEATURE_FIELDS.items() if any(n.lower() in text for n in names) or FEATURES[f].lower() in text
    }


def _versions(slices: Any) -> dict[str, str]:
    """{name: resourceVersion} of slices as the API server answered them."""
    out = {}
    for s in slices:
        metadata = s.get("metadata") if isinstance(s, dict) else None
        if isinstance(metadata, dict):
            out[str(metadata.get("name", ""))] = str(metadata.get("resourceVersion", ""))
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
        discover: Callable[[], Pool | list[Device]],
        on_devices: Callable[[list[Device]], None] | None = None,
        on_fatal: Callable[[BaseException], None] | None = None,
        resync: float = 30.0,
        device_taints: Callable[[], Mapping[str, list[dict[str, str]]]] | None = None,
        separate_counter_slices: bool | None = None,
    ) -> None:
        """``device_taints`` gives the taints to publish per device name (health.DeviceTaints);
        ``separate_counter_slices``: whether counter sets go in slices of their own (None: as the
        API server's version says, read when the first pool with counter sets is published)."""
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
        self.full_checks = 0  # reconciles that read and compared every slice in full (tests)
        self._owner: dict[str, Any] | None = None  # the Node's owner reference, once read
        # What the API server was last seen or made to hold: (slices as published, owner,
        # {name: resourceVersion}); None until then, and after a failed or partial write.
        self._known: tuple[dict[str, dict[str, Any]], dict[str, Any] | None, dict[str, str]] | None = None
        self._warned_no_node = False
        # Features (devices.FEATURES) this API server does not take, found when publishing.
        self.features_off: set[str] = set()
        self._separate_counters = separate_counter_slices

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
        items = self.client.get_json(SLICES_PATH, {"fieldSelector": self._selector()}).get("items") or []
        return [s for s in items if isinstance(s, dict)]

    def _selector(self) -> str:
        return f"spec.nodeName={self.node_name},spec.driver={self.driver_name}"

    def _own_versions(self) -> dict[str, str] | None:
        """The name and resourceVersion of each slice of this node and driver, from a metadata-only
        list; None when the answer is not such a list (then the full path decides)."""
        answer = self.client.get_json(
            SLICES_PATH, {"fieldSelector": self._selector()}, headers={"Accept": METADATA_LIST}
        )
        items = answer.get("items") if isinstance(answer, dict) else None
        if not isinstance(items, list) or not all(
            isinstance(i, dict) and isinstance(i.get("metadata"), dict) for i in items
        ):
            return None
        return _versions(items)

    def _unchanged(self, desired: dict[str, dict[str, Any]], owner: dict[str, Any] | None) -> bool:
        """Whether the API server still holds exactly what it was last seen or made to hold, and
        that is ``desired`` owned by ``owner``: asked with one metadata-only list."""
        known = self._known
        if known is None or known[0] != desired or known[1] != owner:
            return False
        return self._own_versions() == known[2]

    def publish(self, pool: Pool | Sequence[Device]) -> bool:
        """Make the API server hold exactly ``pool`` (less the features it does not take, see
        :meth:`sync`); True when something was written."""
        if not isinstance(pool, Pool):
            pool = Pool(tuple(pool))
        pool = without(pool, self.features_off)
        taints = self._device_taints() if self._device_taints is not None and not self._taints_dropped else {}
        desired = self.layout(pool, taints)
        known_owner = self.node_owner(refresh=False)
        if self._unchanged(desired, known_owner):
            return False
        self._known = None
        self.full_checks += 1
        existing = {s.get("metadata", {}).get("name", ""): s for s in self.list_own()}
        generations = [int((s.get("spec", {}).get("pool") or {}).get("generation") or 0) for s in existing.values()]
        if self._up_to_date(existing, desired, known_owner):
            self.generation = max(generations, default=0)
            self._known = (desired, known_owner, _versions(existing.values()))
            return False
        owner = self.node_owner(refresh=True)  # the Node may have been re-created: its UID now
        generation = max(generations, default=0) + 1
        written: list[Any] = []
        for name, part in desired.items():
            body = self._slice(name, part, generation, len(desired), owner)
            current = existing.get(name)
            if current is None:
                answer = self.client.send_json("POST", SLICES_PATH, body)
            else:
                body["metadata"]["resourceVersion"] = current["metadata"]["resourceVersion"]
                answer = self.client.send_json("PUT", f"{SLICES_PATH}/{name}", body)
            written.append(answer)
            self._check_taints_kept(body, answer)
            dropped = dropped_features(body["spec"], answer) - self.features_off
            if dropped:
                self._turn_off(dropped, f"dropped by the API server from ResourceSlice {name}")
        for name in existing.keys() - desired.keys():
            self._delete(name)
        # As written, with the versions the API server answered: unchanged until someone writes.
        # A feature it dropped or a taint it did not keep changes what is desired next time, so a
        # written slice that differs from it is never taken for up to date.
        self._known = (desired, owner, _versions(written))
        self.generation = generation
        self.publishes += 1
        log.info(
            "published %d device(s) in %d ResourceSlice(s) for pool %s, generation %d",
            len(pool.devices),
            len(desired),
            self.pool_name,
            generation,
        )
        return True

    def _turn_off(self, features: set[str], why: str) -> None:
        """Leave ``features`` out of this pool from now on, said once in the log."""
        self.features_off |= features
        for feature in sorted(features):
            log.warning(
                "the API server does not take %s (%s; feature gate %s off, or a release without it): %s; "
                "this node publishes without them from now on",
                "/".join(FEATURE_FIELDS[feature]),
                why,
                FEATURES[feature],
                {
                    PARTITIONABLE: "partitions are left out, whole devices consume no counters",
                    PARTITION_TYPE: "no partition type attribute on the slices",
                    CONSUMABLE: "each device is allocated whole, to one claim at a time",
                    BINDING: "pods bind without waiting for device attachment",
                    NODE_ALLOCATABLE: "allocations do not count against the node's allocatable resources",
                }[feature],
            )

    def separate_counter_slices(self) -> bool:
        """Whether this API server wants counter sets in slices of their own (1.35 on), read once."""
        if self._separate_counters is None:
            # Imported here: the version's ordered dataclass is start-up cost for every other profile.
            from otel_dra.kube.version import read_server_version

            server = read_server_version(self.client)
            self._separate_counters = (server.major, server.minor) >= SEPARATE_COUNTER_SLICES_SINCE
        return self._separate_counters

    def layout(self, pool: Pool, taints: Mapping[str, list[dict[str, str]]]) -> dict[str, dict[str, Any]]:
        """Slice name -> the pool-independent part of its spec (devices, sharedCounters,
        partitionTypeAttribute)."""
        devices = [_with_taints(d, taints) for d in pool.devices]
        counter_sets = [c.to_api() for c in pool.counter_sets]
        extras = any(d.get("taints") or d.get("consumesCounters") for d in devices)
        per_slice = MAX_DEVICES_PER_SLICE_WITH_EXTRAS if extras else MAX_DEVICES_PER_SLICE
        parts: list[dict[str, Any]] = []
        if counter_sets and not self.separate_counter_slices():
            # 1.34: each slice holds the counter sets its devices consume, whole groups per slice.
            groups: dict[str, list[dict[str, Any]]] = {c["name"]: [] for c in counter_sets}
            loose: list[dict[str, Any]] = []
            for d in devices:
                consumed = [c.get("counterSet") for c in d.get("consumesCounters") or []]
                (groups[consumed[0]] if consumed and consumed[0] in groups else loose).append(d)
            part: dict[str, Any] = {"devices": [], "sharedCounters": []}
            for c in counter_sets:
                group = groups[c["name"]]
                full = len(part["sharedCounters"]) >= MAX_COUNTER_SETS_PER_SLICE
                if part["devices"] and (full or len(part["devices"]) + len(group) > per_slice):
                    parts.append(part)
                    part = {"devices": [], "sharedCounters": []}
                part["sharedCounters"].append(c)
                part["devices"].extend(group)
            parts.append(part)
            devices, counter_sets = loose, []
        for i in range(0, len(counter_sets), MAX_COUNTER_SETS_PER_SLICE):
            parts.append({"sharedCounters": counter_sets[i : i + MAX_COUNTER_SETS_PER_SLICE]})
        parts.extend({"devices": devices[i : i + per_slice]} for i in range(0, len(devices), per_slice))
        if not any(p.get("devices") for p in parts):
            parts.append({"devices": []})  # an empty pool is still published: consumers see the node has none
        if pool.partition_type_attribute:
            for p in parts:
                if p.get("devices"):
                    p["partitionTypeAttribute"] = pool.partition_type_attribute
        return {slice_name(self.node_name, self.driver_name, i): p for i, p in enumerate(parts)}

    def _check_taints_kept(self, sent: dict[str, Any], answer: Any) -> None:
        """An API server without device taints (DRADeviceTaints off: alpha in 1.33/1.34) drops them
        silently; comparing with them would then rewrite the slices at every resync, for nothing."""
        if self._taints_dropped or not any("taints" in d for d in sent["spec"].get("devices") or []):
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
        self, existing: dict[str, dict[str, Any]], desired: dict[str, dict[str, Any]], owner: dict[str, Any] | None
    ) -> bool:
        if set(existing) != set(desired):
            return False
        generations = set()
        for name, part in desired.items():
            if (existing[name].get("metadata") or {}).get("ownerReferences", []) != ([owner] if owner else []):
                return False
            spec = existing[name].get("spec") or {}
            pool = spec.get("pool") or {}
            if pool.get("name") != self.pool_name or pool.get("resourceSliceCount") != len(desired):
                return False
            generations.add(pool.get("generation"))
            if _comparable_spec(spec) != _comparable_spec(part):
                return False
        return len(generations) == 1

    def _slice(
        self, name: str, part: dict[str, Any], generation: int, count: int, owner: dict[str, Any] | None
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
                **part,
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
        self._known = None
        names = [s.get("metadata", {}).get("name", "") for s in self.list_own()]
        for name in names:
            self._delete(name)
        if names:
            log.info("deleted %d ResourceSlice(s) of pool %s", len(names), self.pool_name)
        return len(names)

    # --- background loop -----------------------------------------------------------------------
    def sync(self) -> bool:
        """Rediscover and publish once. Raises on failure (see :meth:`start` for the policy).

        What the API server does not take is found by writing: it drops the fields of a feature
        gate that is off (seen in what it wrote back) or, for some, rejects them (a 422 naming the
        field, or the admission's 403 naming the feature). Either turns the feature off for this
        pool (said once in the log) and the pool is published again without it, so the slices are
        the same at the next resync. Other 403s (RBAC) are retried as any API error."""
        found = self._discover()
        pool = found if isinstance(found, Pool) else Pool(tuple(found))
        written = False
        for _ in range(len(FEATURE_FIELDS) + 1):
            off = set(self.features_off)
            if self._on_devices is not None:
                self._on_devices(list(without(pool, off).devices))
            try:
                written = self.publish(pool) or written
            except ApiError as exc:
                if exc.status not in (*FATAL_STATUSES, 403):
                    raise
                rejected = rejected_features(str(exc)) & pool.features() - self.features_off
                if not rejected:
                    if exc.status == 403:
                        raise  # RBAC: retried, it may be granted
                    raise FatalPublishError(f"the API server rejects this node's ResourceSlices: {exc}") from exc
                self._turn_off(rejected, f"rejected: {exc}")
                continue
            if self.features_off == off:
                return written
        # Not reached: each pass that does not return turns one more feature off.
        raise FatalPublishError("the pool kept changing while features were turned off")

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
