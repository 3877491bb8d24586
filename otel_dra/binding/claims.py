"""What the binding-condition controller decides, without I/O: which allocation results of a claim
wait for their binding conditions, which outcome each gets, and the server-side apply body that
sets them.

A result *waits* when it names ``bindingConditions`` and, in the claim's ``status.devices`` entry
for its device (matched by driver, pool, device and ``shareID``), neither is every binding
condition True nor any binding failure condition True: kube-scheduler's own test
(isClaimReadyForBinding in pkg/scheduler/framework/plugins/dynamicresources, v1.37.2), except that
it matches the entry without the ``shareID`` (the first entry of the device). Where the two differ
(several shares of one device) this controller still writes each share's own entry.

The outcome of a waiting result is decided by a hash of the claim's UID and the result's device
key, so the same allocation fails or attaches in every run, and a restarted controller agrees
with the one before it (:func:`fails`). A result with no ``bindingFailureConditions`` cannot fail,
and attaches.

The write is a server-side apply of ``status.devices`` (a list-map keyed by driver, device, pool
and shareID, whose ``conditions`` are a list-map keyed by type), so other writers' fields of the
same entries (the plugin's ``Ready`` condition and data) are merged, not replaced. Server-side
apply removes what a field manager applied before and leaves out now, so every write names every
binding result of the driver in the allocation: the waiting ones with their new conditions, the
decided ones with their current binding conditions as they are (:func:`apply_body`).
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterable, Mapping
from typing import Any

from otel_dra.kube.timestamps import format_time, time_or_none
from otel_dra.records import record

FIELD_MANAGER = "otel-dra-binding-controller"
API_VERSION = "resource.k8s.io/v1"
STATUS_PATH_TEMPLATE = "/apis/resource.k8s.io/v1/namespaces/{namespace}/resourceclaims/{name}/status"

ATTACHED = "attached"
FAILED = "failed"
OUTCOMES = (ATTACHED, FAILED)

# The reasons of the conditions written (metav1.Condition: CamelCase).
ATTACHED_REASON = "SimulatedAttach"
FAILED_REASON = "SimulatedAttachFailure"
# metav1.Condition's limits.
MAX_MESSAGE = 32768
MAX_CONDITIONS_PER_DEVICE = 8  # resource.AllocatedDeviceStatusMaxConditions

# 2^64: fails() compares the first 8 bytes of a SHA-256 with fraction * 2^64.
_SCALE = float(1 << 64)


class MalformedClaim(ValueError):
    """A ResourceClaim whose fields have the wrong shape; the message says which."""


@record(frozen=True)
class DeviceKey:
    """An allocated device (share): the key of both ``status.allocation.devices.results`` and
    ``status.devices``."""

    driver: str
    pool: str
    device: str
    share_id: str | None = None

    def __str__(self) -> str:
        base = f"{self.driver}/{self.pool}/{self.device}"
        return f"{base} (share {self.share_id})" if self.share_id else base


@record(frozen=True)
class Target:
    """An allocation result of the driver that names binding conditions."""

    key: DeviceKey
    request: str
    conditions: tuple[str, ...]  # bindingConditions
    failure_conditions: tuple[str, ...]  # bindingFailureConditions
    # The device's status.devices conditions now, of the types above (as the API has them).
    current: Mapping[str, Mapping[str, Any]]
    waiting: bool


@record(frozen=True)
class Allocation:
    """What a claim's current allocation asks of the controller."""

    namespace: str
    name: str
    uid: str
    generation: int | None
    # Tells one allocation from the next of the same claim (deallocated and allocated again): the
    # results and allocationTimestamp.
    identity: tuple[Any, ...]
    allocated_at: float | None  # allocationTimestamp, Unix seconds (whole seconds), when set
    targets: tuple[Target, ...]

    @property
    def waiting(self) -> tuple[Target, ...]:
        return tuple(t for t in self.targets if t.waiting)

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"


def read_claim(obj: Any, driver: str) -> Allocation | None:
    """The allocation of claim ``obj`` (the API's JSON) as far as binding conditions of ``driver``
    go; None when the claim is not allocated or no result of the driver names binding conditions.
    Raises :class:`MalformedClaim` for fields of the wrong shape."""
    if not isinstance(obj, Mapping):
        raise MalformedClaim("not a JSON object")
    meta = obj.get("metadata")
    if not isinstance(meta, Mapping):
        raise MalformedClaim("metadata is not an object")
    namespace, name, uid = (meta.get(k) for k in ("namespace", "name", "uid"))
    for field, value in (("namespace", namespace), ("name", name), ("uid", uid)):
        if not isinstance(value, str) or not value:
            raise MalformedClaim(f"metadata.{field} is missing or not a string")
    generation = meta.get("generation")
    if generation is not None and (not isinstance(generation, int) or isinstance(generation, bool) or generation < 0):
        raise MalformedClaim(f"metadata.generation {generation!r} is not a non-negative integer")
    status = obj.get("status")
    if status is None:
        return None
    if not isinstance(status, Mapping):
        raise MalformedClaim("status is not an object")
    allocation = status.get("allocation")
    if allocation is None:
        return None
    if not isinstance(allocation, Mapping):
        raise MalformedClaim("status.allocation is not an object")
    devices = allocation.get("devices")
    results = devices.get("results") if isinstance(devices, Mapping) else None
    if results is None:
        return None
    if not isinstance(results, list):
        raise MalformedClaim("status.allocation.devices.results is not a list")
    current = _device_status(status.get("devices"))
    identity: list[tuple[str, ...]] = []
    targets: list[Target] = []
    for i, result in enumerate(results):
        where = f"status.allocation.devices.results[{i}]"
        if not isinstance(result, Mapping):
            raise MalformedClaim(f"{where} is not an object")
        key = DeviceKey(
            _string(result, "driver", where),
            _string(result, "pool", where),
            _string(result, "device", where),
            _string(result, "shareID", where, required=False) or None,
        )
        request = _string(result, "request", where, required=False)
        identity.append((request, key.driver, key.pool, key.device, key.share_id or ""))
        if key.driver != driver:
            continue
        wanted = _strings(result.get("bindingConditions"), f"{where}.bindingConditions")
        if not wanted:
            continue
        failures = _strings(result.get("bindingFailureConditions"), f"{where}.bindingFailureConditions")
        found = current.get(key, {})
        kept = {t: c for t, c in found.items() if t in wanted or t in failures}
        satisfied = all(_true(found.get(t)) for t in wanted)
        failed = any(_true(found.get(t)) for t in failures)
        targets.append(Target(key, request, wanted, failures, kept, not (satisfied or failed)))
    if not targets:
        return None
    stamp = allocation.get("allocationTimestamp")
    return Allocation(
        namespace,  # type: ignore[arg-type]  # checked above
        name,  # type: ignore[arg-type]
        uid,  # type: ignore[arg-type]
        generation,
        (stamp if isinstance(stamp, str) else "", tuple(identity)),
        time_or_none(stamp),
        tuple(targets),
    )


def fails(uid: str, key: DeviceKey, fraction: float) -> bool:
    """Whether the attachment of ``key`` in claim ``uid`` fails: the first 8 bytes of
    SHA-256(``uid/driver/pool/device/shareID``) as a fraction of 2^64, below ``fraction``. The same
    answer in every run; over many claims, ``fraction`` of them fail."""
    if fraction <= 0.0:
        return False
    text = f"{uid}/{key.driver}/{key.pool}/{key.device}/{key.share_id or ''}"
    digest = hashlib.sha256(text.encode()).digest()
    return int.from_bytes(digest[:8], "big") / _SCALE < fraction


def outcome(allocation: Allocation, target: Target, fraction: float) -> str:
    """ATTACHED or FAILED for a waiting target (FAILED only where it has a failure condition)."""
    if target.failure_conditions and fails(allocation.uid, target.key, fraction):
        return FAILED
    return ATTACHED


def new_conditions(
    target: Target, result: str, *, now: float, generation: int | None, message: str
) -> list[dict[str, Any]]:
    """The conditions a waiting target gets: every binding condition True (those already True as
    they are, so their lastTransitionTime stays), or its first failure condition True."""
    if result == FAILED:
        kind = target.failure_conditions[0]
        existing = target.current.get(kind)
        if _true(existing):
            return [dict(existing)]  # type: ignore[arg-type]  # _true checked it is a mapping
        return [_condition(kind, FAILED_REASON, message, now, generation)]
    out = []
    for kind in target.conditions:
        existing = target.current.get(kind)
        out.append(dict(existing) if _true(existing) else _condition(kind, ATTACHED_REASON, message, now, generation))  # type: ignore[arg-type]
    return out


def _condition(kind: str, reason: str, message: str, now: float, generation: int | None) -> dict[str, Any]:
    condition: dict[str, Any] = {
        "type": kind,
        "status": "True",
        "reason": reason,
        "message": message[:MAX_MESSAGE],
        "lastTransitionTime": format_time(now),
    }
    if generation is not None:
        condition["observedGeneration"] = generation
    return condition


def device_entry(key: DeviceKey, conditions: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """A ``status.devices`` entry with only its key and ``conditions``."""
    entry: dict[str, Any] = {"driver": key.driver, "pool": key.pool, "device": key.device}
    if key.share_id:
        entry["shareID"] = key.share_id
    entry["conditions"] = [dict(c) for c in conditions]
    return entry


def apply_body(allocation: Allocation, written: Mapping[DeviceKey, list[dict[str, Any]]]) -> dict[str, Any]:
    """The apply configuration for the claim's status: ``written`` (the waiting targets' new
    conditions) and, for the other targets, their binding conditions as they are (see the module
    notes). ``metadata.uid`` makes the API server refuse it (409) for another claim of the same name."""
    devices = []
    for target in allocation.targets:
        conditions = written.get(target.key)
        if conditions is None:
            conditions = [dict(c) for c in target.current.values()]
        devices.append(device_entry(target.key, conditions[:MAX_CONDITIONS_PER_DEVICE]))
    return {
        "apiVersion": API_VERSION,
        "kind": "ResourceClaim",
        "metadata": {"name": allocation.name, "namespace": allocation.namespace, "uid": allocation.uid},
        "status": {"devices": devices},
    }


def seconds_since_allocation(allocation: Allocation, seen_wall: float, now: float | None = None) -> float:
    """Seconds from the allocation (its allocationTimestamp, else when the controller saw it) to
    ``now``; never below 0 (the scheduler's clock is another machine's)."""
    since = allocation.allocated_at if allocation.allocated_at is not None else seen_wall
    return max(0.0, (time.time() if now is None else now) - since)


# --- fields -------------------------------------------------------------------------------------------


def _string(obj: Mapping[str, Any], field: str, where: str, *, required: bool = True) -> str:
    value = obj.get(field)
    if value is None and not required:
        return ""
    if not isinstance(value, str) or (required and not value):
        raise MalformedClaim(f"{where}.{field} is missing or not a string")
    return value


def _strings(value: Any, where: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise MalformedClaim(f"{where} is not a list of strings")
    return tuple(value)


def _true(condition: Any) -> bool:
    return isinstance(condition, Mapping) and condition.get("status") == "True"


def _device_status(raw: Any) -> dict[DeviceKey, dict[str, Mapping[str, Any]]]:
    """``status.devices`` as key -> condition type -> condition."""
    if raw is None:
        return {}
    if not isinstance(raw, list):
        raise MalformedClaim("status.devices is not a list")
    out: dict[DeviceKey, dict[str, Mapping[str, Any]]] = {}
    for i, entry in enumerate(raw):
        where = f"status.devices[{i}]"
        if not isinstance(entry, Mapping):
            raise MalformedClaim(f"{where} is not an object")
        key = DeviceKey(
            _string(entry, "driver", where),
            _string(entry, "pool", where),
            _string(entry, "device", where),
            _string(entry, "shareID", where, required=False) or None,
        )
        conditions = entry.get("conditions")
        if conditions is None:
            conditions = []
        if not isinstance(conditions, list):
            raise MalformedClaim(f"{where}.conditions is not a list")
        found = out.setdefault(key, {})
        for j, condition in enumerate(conditions):
            if not isinstance(condition, Mapping) or not isinstance(condition.get("type"), str):
                raise MalformedClaim(f"{where}.conditions[{j}] has no type")
            found[condition["type"]] = condition
    return out
