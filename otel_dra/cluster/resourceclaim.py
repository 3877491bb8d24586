"""ResourceClaims (resource.k8s.io/v1, namespaced): allocation, reservations, lifecycle, device status."""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass
from typing import Any

from otel_dra.cluster.families import Family, Sample, family
from otel_dra.cluster.fields import (
    capacity_name,
    condition_states,
    conditions,
    optional_time,
    parse_time,
    skipped_operations,
)
from otel_dra.kube.quantity import parse_quantity
from otel_dra.kube.reflector import ResourceType

# Listed as JSON, not protobuf (as pods are): a claim is small (1.3 KB as listed), and building the
# parser's dicts from protobuf messages cost more than json.loads (38.3 against 16.1 us per claim,
# docs/benchmarks-log.md "Initial list as protobuf").
RESOURCE = ResourceType("resourceclaims", "resource.k8s.io/v1")


@dataclass(frozen=True, slots=True)
class Result:
    """One entry of status.allocation.devices.results."""

    request: str  # "<request>" or, from a firstAvailable list, "<request>/<subrequest>"
    driver: str
    pool: str
    device: str
    admin: bool = False  # adminAccess: not consumption
    # consumedCapacity, each name as fields.capacity_name spells it (the driver's domain dropped:
    # since 1.38 "gpu.example.com/memory" and "memory" are the same capacity of that driver's device).
    consumed: tuple[tuple[str, float], ...] = ()
    share_id: str = ""  # shareID: one allocation of a device that allows several
    # skipNodeOperations (Kubernetes 1.37, DRAOptionalNodeOperations), "*" spelled out as
    # NODE_OPERATIONS: the kubelet calls the driver for an operation only if some device needs it.
    skips: tuple[str, ...] = ()


BINDING_STATES = ("waiting", "satisfied", "failed")


@dataclass(frozen=True, slots=True)
class Binding:
    """The binding state of an allocated device that has binding conditions (the scheduler waits
    in PreBind until they are all true, and gives the device up when a failure condition is)."""

    driver: str
    pool: str
    device: str
    share_id: str
    state: str  # one of BINDING_STATES
    # When the device entered that state (Unix seconds): the allocation time while waiting, else
    # the lastTransitionTime of the condition that decided it; None when unknown.
    since: float | None


@dataclass(frozen=True, slots=True)
class Claim:
    namespace: str
    name: str
    # (driver, pool, device) -> number of allocation results naming it (normally 1; a shareable
    # device can appear more than once, and identical label sets must become one series).
    allocated: tuple[tuple[tuple[str, str, str], int], ...]
    pods: tuple[tuple[str, str], ...]  # reserving pods: (name, uid)
    created: float | None = None  # metadata.creationTimestamp, Unix seconds
    has_allocation: bool = False
    allocation_time: float | None = None  # status.allocation.allocationTimestamp
    reserved: int = 0  # status.reservedFor entries of any kind
    results: tuple[Result, ...] = ()
    # Request name ("<request>" or "<request>/<subrequest>") -> deviceClassName.
    request_classes: tuple[tuple[str, str], ...] = ()
    # Only for claims allocated and reserved by nobody: Unix time of the newest status write
    # (metadata.managedFields of the status subresource); None when unknown.
    status_time: float | None = None
    # status.devices[].conditions[]: (driver, pool, device, share_id, type, status "true|false|unknown").
    conditions: tuple[tuple[str, str, str, str, str, str], ...] = ()
    source: str = ""  # one of SOURCES, from the annotations Kubernetes sets on claims it makes
    binding: tuple[Binding, ...] = ()  # results with bindingConditions, in result order
    # status.reservedFor of every kind: (consumer kind, name), see consumer_kind. Pods and, since
    # Kubernetes 1.38 (gang scheduling), PodGroups; in the claim's namespace, as the API has it.
    consumers: tuple[tuple[str, str], ...] = ()
    # For the claim's trace (otel_dra/cluster/lifecycle.py), kept only while tracing or its latency
    # histograms are on: the UID (the trace id), kube-scheduler's newest status write (the
    # allocation's time where allocationTimestamp is not set: it is only with the binding-condition
    # gates) and metadata.deletionTimestamp.
    uid: str = ""
    scheduler_write: float | None = None
    deleting: float | None = None

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"

    @property
    def phase(self) -> str:
        if not self.has_allocation:
            return "pending"
        return "reserved" if self.reserved else "allocated"


PHASES = ("pending", "allocated", "reserved")

# Who made the claim. The resourceclaim controller marks the claims it generates from a pod's
# ResourceClaimTemplate with the pod's claim name; kube-scheduler marks the claims it makes for a
# pod's extended-resource requests (DRAExtendedResource) with "true". Both since Kubernetes 1.34.
POD_CLAIM_ANNOTATION = "resource.kubernetes.io/pod-claim-name"
EXTENDED_RESOURCE_ANNOTATION = "resource.kubernetes.io/extended-resource-claim"
SOURCES = ("direct", "template", "extended_resource")


def _source(meta: dict[str, Any]) -> str:
    annotations = meta.get("annotations")
    annotations = annotations if isinstance(annotations, dict) else {}
    if annotations.get(EXTENDED_RESOURCE_ANNOTATION) == "true":
        return "extended_resource"
    return "template" if POD_CLAIM_ANNOTATION in annotations else "direct"


def _str(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def _status_time(meta: dict[str, Any], manager: str | None = None) -> float | None:
    """The newest status write's time (of ``manager`` only, when given)."""
    newest: float | None = None
    fields = meta.get("managedFields") or []
    for entry in fields if isinstance(fields, list) else []:
        if (
            isinstance(entry, dict)
            and entry.get("subresource") == "status"
            and (manager is None or entry.get("manager") == manager)
        ):
            try:
                t = parse_time(entry.get("time"))
            except ValueError:
                continue
            newest = t if newest is None else max(newest, t)
    return newest


def _request_classes(spec: Any) -> tuple[tuple[str, str], ...]:
    devices = spec.get("devices") if isinstance(spec, dict) else None
    requests = devices.get("requests") if isinstance(devices, dict) else None
    out: list[tuple[str, str]] = []
    for request in requests if isinstance(requests, list) else []:
        if not isinstance(request, dict) or not isinstance(request.get("name"), str):
            continue
        name = request["name"]
        exactly = request.get("exactly")
        if isinstance(exactly, dict) and isinstance(exactly.get("deviceClassName"), str):
            out.append((name, exactly["deviceClassName"]))
        subrequests = request.get("firstAvailable")
        for sub in subrequests if isinstance(subrequests, list) else []:
            if (
                isinstance(sub, dict)
                and isinstance(sub.get("name"), str)
                and isinstance(sub.get("deviceClassName"), str)
            ):
                out.append((f"{name}/{sub['name']}", sub["deviceClassName"]))
    return tuple(out)


def _consumed(raw: Any, driver: str, report: Callable[[str], None]) -> tuple[tuple[str, float], ...]:
    if not isinstance(raw, dict):
        return ()
    out: dict[str, float] = {}
    for name, value in raw.items():
        try:
            amount = parse_quantity(value)
        except ValueError as exc:
            report(f"consumedCapacity {name}: {exc}; ignored")
            continue
        # Both spellings of one capacity in one result (which the API should not let through) are
        # one capacity: summed, as two results naming it would be.
        key = capacity_name(str(name), driver)
        out[key] = out.get(key, 0.0) + amount
    return tuple(out.items())


# Consumer kinds (the consumer_kind label) of the status.reservedFor entries Kubernetes writes:
# pods (apiGroup "", resource pods) and PodGroups (scheduling.k8s.io, gang scheduling, 1.38).
POD, PODGROUP = "pod", "podgroup"
_KINDS = {("", "pods"): POD, ("scheduling.k8s.io", "podgroups"): PODGROUP}


def consumer_kind(consumer: dict[str, Any]) -> str:
    """A reservedFor entry's kind: ``pod``, ``podgroup``, or for any other resource its name as
    kubectl spells it, ``<resource>.<apiGroup>`` (``<resource>`` in the core group; "" when the
    entry names none). Bounded by the resource types a cluster has."""
    group, resource = consumer.get("apiGroup") or "", consumer.get("resource") or ""
    if not isinstance(group, str) or not isinstance(resource, str):
        return ""  # not what the API server writes; the entry still counts as a consumer
    known = _KINDS.get((group, resource))
    if known is not None:
        return known
    return f"{resource}.{group}" if resource and group else resource


Condition = tuple[str, str, str, str, str, str]  # driver, pool, device, share_id, type, status
DeviceStatusKey = tuple[str, str, str, str]  # driver, pool, device, share_id: how status.devices is keyed


def _strings(value: Any) -> tuple[str, ...]:
    return tuple(v for v in value if isinstance(v, str)) if isinstance(value, list) else ()


def _conditions(status: dict[str, Any], report: Callable[[str], None]) -> tuple[Condition, ...]:
    out: dict[tuple[str, str, str, str, str], str] = {}
    devices = status.get("devices") or []
    for i, entry in enumerate(devices if isinstance(devices, list) else []):
        if not isinstance(entry, dict):
            continue
        driver, pool, device, share_id = (str(entry.get(k) or "") for k in ("driver", "pool", "device", "shareID"))
        for condition, state in conditions(entry.get("conditions"), f"status.devices[{i}].conditions", report):
            out[(driver, pool, device, share_id, condition)] = state
    return tuple((*key, state) for key, state in out.items())


def _device_status(status: dict[str, Any]) -> dict[DeviceStatusKey, dict[str, tuple[bool, float | None]]]:
    """status.devices as (driver, pool, device, share_id) -> condition type -> (status is True,
    lastTransitionTime); malformed entries and times count as absent (the condition families
    report them)."""
    out: dict[DeviceStatusKey, dict[str, tuple[bool, float | None]]] = {}
    devices = status.get("devices")
    for entry in devices if isinstance(devices, list) else ():
        if not isinstance(entry, dict):
            continue
        key = (
            _str(entry.get("driver")) or "",
            _str(entry.get("pool")) or "",
            _str(entry.get("device")) or "",
            _str(entry.get("shareID")) or "",
        )
        found = out.setdefault(key, {})
        raw = entry.get("conditions")
        for condition in raw if isinstance(raw, list) else ():
            if isinstance(condition, dict) and isinstance(condition.get("type"), str):
                try:
                    since: float | None = parse_time(condition.get("lastTransitionTime"))
                except ValueError:
                    since = None
                found[condition["type"]] = (condition.get("status") == "True", since)
    return out


def _binding(
    results: list[Any],
    status: dict[str, Any],
    allocated_at: float | None,
) -> tuple[Binding, ...]:
    """The binding state of each allocation result that names bindingConditions, decided as
    kube-scheduler decides it (isClaimReadyForBinding): failed when a bindingFailureConditions
    entry is True in the device's status.devices entry, satisfied when every bindingConditions
    entry is True, else waiting."""
    found: dict[DeviceStatusKey, dict[str, tuple[bool, float | None]]] | None = None
    # Keyed as status.devices is: results naming the same device and share (which the API does
    # not allow) must still become one series each.
    out: dict[DeviceStatusKey, Binding] = {}
    for result in results:
        if not isinstance(result, dict):
            continue
        wanted = _strings(result.get("bindingConditions"))
        if not wanted:
            continue
        if found is None:
            found = _device_status(status)
        driver, pool, device = (_str(result.get(k)) or "" for k in ("driver", "pool", "device"))
        share_id = _str(result.get("shareID")) or ""
        conditions = found.get((driver, pool, device, share_id), {})
        failures = [
            conditions[c][1] for c in _strings(result.get("bindingFailureConditions")) if conditions.get(c, (False,))[0]
        ]
        if failures:
            known = [t for t in failures if t is not None]
            state, since = "failed", (min(known) if known else None)
        elif all(conditions.get(c, (False,))[0] for c in wanted):
            times = [conditions[c][1] for c in wanted]
            state, since = "satisfied", (None if None in times else max(t for t in times if t is not None))
        else:
            state, since = "waiting", allocated_at
        out[(driver, pool, device, share_id)] = Binding(driver, pool, device, share_id, state, since)
    return tuple(out.values())


# The fields of Claim that only some families read (Family.fields); a parser made for a set of
# them leaves the others at their defaults (memory: a family that is off keeps nothing).
# The field manager kube-scheduler writes a claim's allocation and reservations as.
SCHEDULER = "kube-scheduler"
# What the claim's trace reads beyond the families' fields (otel_dra/cluster/lifecycle.py).
LIFECYCLE_FIELDS = frozenset(
    {
        "uid",
        "created",
        "allocation_time",
        "scheduler_write",
        "deleting",
        "results",
        "request_classes",
        "binding",
        "consumers",
    }
)
FIELDS = frozenset(
    {
        "allocated",
        "pods",
        "created",
        "allocation_time",
        "results",
        "request_classes",
        "status_time",
        "conditions",
        "source",
        "binding",
        "consumers",
    }
)


def make_parser(keep: Collection[str] = FIELDS) -> Callable[[dict[str, Any], Callable[[str], None]], Claim]:
    """A parser that fills only the optional fields in ``keep`` (names of other types ignored)."""
    wanted = (FIELDS | LIFECYCLE_FIELDS).intersection(keep)

    def parse(obj: dict[str, Any], report: Callable[[str], None]) -> Claim:
        return _parse(obj, report, wanted)

    return parse


def _parse(obj: dict[str, Any], report: Callable[[str], None], keep: frozenset[str]) -> Claim:
    meta = obj.get("metadata") or {}
    status = obj.get("status") or {}
    if not isinstance(status, dict):
        report("status is not an object")
        status = {}
    counts: dict[tuple[str, str, str], int] = {}
    allocation = status.get("allocation")
    has_allocation = isinstance(allocation, dict)
    allocation = allocation if isinstance(allocation, dict) else {}
    parsed: list[Result] = []
    devices = allocation.get("devices")
    results = (devices.get("results") if isinstance(devices, dict) else None) or []
    if not isinstance(results, list):
        report("status.allocation.devices.results is not a list")
        results = []
    if "allocated" in keep or "results" in keep:
        for i, result in enumerate(results):
            if not isinstance(result, dict):
                result = {}
            driver, pool, device = (_str(result.get(k)) for k in ("driver", "pool", "device"))
            if driver is None or pool is None or device is None:
                report(f"status.allocation.devices.results[{i}] lacks driver/pool/device; skipped")
                continue
            key = (driver, pool, device)
            counts[key] = counts.get(key, 0) + 1
            if "results" in keep:
                parsed.append(
                    Result(
                        request=str(result.get("request") or ""),
                        driver=driver,
                        pool=pool,
                        device=device,
                        admin=result.get("adminAccess") is True,
                        consumed=_consumed(result.get("consumedCapacity"), driver, report),
                        share_id=_str(result.get("shareID")) or "",
                        skips=skipped_operations(result.get("skipNodeOperations")),
                    )
                )
    pods: list[tuple[str, str]] = []
    consumers: list[tuple[str, str]] = []
    reserved = status.get("reservedFor") or []
    if not isinstance(reserved, list):
        report("status.reservedFor is not a list")
        reserved = []
    want_pods, want_consumers = "pods" in keep, "consumers" in keep
    for consumer in reserved if want_pods or want_consumers else ():
        if not isinstance(consumer, dict):
            continue
        kind = consumer_kind(consumer)
        if want_pods and kind == POD:
            pods.append((str(consumer.get("name", "")), str(consumer.get("uid", ""))))
        if want_consumers:
            consumers.append((kind, str(consumer.get("name", ""))))
    unreserved = has_allocation and not reserved
    allocated_at: float | None = None
    if "allocation_time" in keep or "binding" in keep:
        allocated_at = optional_time(allocation.get("allocationTimestamp"), "allocationTimestamp", report)
    return Claim(
        namespace=str(meta.get("namespace", "")),
        name=str(meta.get("name", "")),
        allocated=tuple(counts.items()) if "allocated" in keep else (),
        pods=tuple(pods),
        created=optional_time(meta.get("creationTimestamp"), "metadata.creationTimestamp", report)
        if "created" in keep
        else None,
        has_allocation=has_allocation,
        allocation_time=allocated_at if "allocation_time" in keep else None,
        reserved=len(reserved),
        results=tuple(parsed),
        request_classes=_request_classes(obj.get("spec")) if "request_classes" in keep else (),
        status_time=_status_time(meta) if unreserved and "status_time" in keep else None,
        conditions=_conditions(status, report) if "conditions" in keep else (),
        source=_source(meta) if "source" in keep else "",
        binding=_binding(results, status, allocated_at) if "binding" in keep else (),
        consumers=tuple(consumers),
        uid=str(meta.get("uid") or "") if "uid" in keep else "",
        scheduler_write=_status_time(meta, SCHEDULER) if "scheduler_write" in keep and has_allocation else None,
        deleting=optional_time(meta.get("deletionTimestamp"), "metadata.deletionTimestamp", report)
        if "deleting" in keep
        else None,
    )


parse = make_parser()


def _allocated(c: Claim) -> Iterable[Sample]:
    for (driver, pool, device), count in c.allocated:
        yield (c.name, c.namespace, pool, device, driver), float(count)


def _reserved_for_pod(c: Claim) -> Iterable[Sample]:
    for pod, uid in c.pods:
        yield (c.name, c.namespace, pod, uid), 1.0


def _reserved_total(c: Claim) -> Iterable[Sample]:
    yield (c.name, c.namespace), float(len(c.pods))


def _consumers(c: Claim) -> Iterable[Sample]:
    # The API keys reservedFor by uid; two entries of one kind and name (a consumer recreated
    # under its name before the old one was removed) are one series of value 2.
    counts: dict[tuple[str, str], int] = {}
    for consumer in c.consumers:
        counts[consumer] = counts.get(consumer, 0) + 1
    for (kind, name), count in counts.items():
        yield (c.name, c.namespace, kind, name), float(count)


# The seed's compatibility families: names, labels and values kept byte for byte.
FAMILIES: tuple[Family[Claim], ...] = (
    family(
        "kube_resourceclaim_status_allocated_device",
        "{device}",
        "Devices allocated to the ResourceClaim: 1 per allocation result (driver, pool, device).",
        ("resourceclaim_name", "namespace", "pool", "device_name", "driver"),
        _allocated,
        fields=("allocated",),
    ),
    family(
        "kube_resourceclaim_status_reserved_for_pod",
        "{pod}",
        "Pods reserving the ResourceClaim: 1 per status.reservedFor entry that is a pod.",
        ("resourceclaim_name", "namespace", "pod_name", "uid"),
        _reserved_for_pod,
        fields=("pods",),
    ),
    family(
        "kube_resourceclaim_status_reserved_total",
        "{pod}",
        "Number of pods reserving the ResourceClaim (0 included).",
        ("resourceclaim_name", "namespace"),
        _reserved_total,
        fields=("pods",),
    ),
)


def _phase(c: Claim) -> Iterable[Sample]:
    current = c.phase
    for phase in PHASES:
        yield (c.name, c.namespace, phase), 1.0 if phase == current else 0.0


def _created(c: Claim) -> Iterable[Sample]:
    if c.created is not None:
        yield (c.name, c.namespace), c.created


def _allocation_time(c: Claim) -> Iterable[Sample]:
    if c.has_allocation and c.allocation_time is not None:
        yield (c.name, c.namespace), c.allocation_time


def _admin_access(c: Claim) -> Iterable[Sample]:
    counts: dict[tuple[str, str, str], int] = {}
    for r in c.results:
        if r.admin:
            counts[(r.driver, r.pool, r.device)] = counts.get((r.driver, r.pool, r.device), 0) + 1
    for (driver, pool, device), count in counts.items():
        yield (c.name, c.namespace, pool, device, driver), float(count)


DEVICE_SHARE_LABELS = ("resourceclaim_name", "namespace", "driver", "pool", "device_name", "share_id")


def _device_conditions(c: Claim) -> Iterable[Sample]:
    for driver, pool, device, share_id, condition, status in c.conditions:
        for state, value in condition_states(status):
            yield (c.name, c.namespace, driver, pool, device, share_id, condition, state), value


def _claim_source(c: Claim) -> Iterable[Sample]:
    yield (c.name, c.namespace, c.source), 1.0


def _binding_state(c: Claim) -> Iterable[Sample]:
    for b in c.binding:
        for state in BINDING_STATES:
            yield (c.name, c.namespace, b.driver, b.pool, b.device, b.share_id, state), 1.0 if state == b.state else 0.0


def _binding_since(c: Claim) -> Iterable[Sample]:
    for b in c.binding:
        if b.since is not None:
            yield (c.name, c.namespace, b.driver, b.pool, b.device, b.share_id), b.since


def _consumed_capacity(c: Claim) -> Iterable[Sample]:
    # A device appears once per share; results without a shareID that name the same device (not
    # expected: consumedCapacity is only set for multi-allocatable devices) are summed into one series.
    sums: dict[tuple[str, ...], float] = {}
    for r in c.results:
        if r.admin:
            continue
        for cap, value in r.consumed:
            key = (c.name, c.namespace, r.driver, r.pool, r.device, r.share_id, cap)
            sums[key] = sums.get(key, 0.0) + value
    yield from sums.items()


def _skipped(c: Claim) -> Iterable[Sample]:
    seen: dict[tuple[str, ...], None] = {}
    for r in c.results:
        for operation in r.skips:
            seen[(c.name, c.namespace, r.driver, r.pool, r.device, operation)] = None
    for labels in seen:
        yield labels, 1.0


STATE_FAMILIES: tuple[Family[Claim], ...] = (
    family(
        "kube_resourceclaim_source",
        "",
        "Who made the ResourceClaim: direct (a user or controller), template (the resourceclaim "
        "controller, from a pod's ResourceClaimTemplate) or extended_resource (kube-scheduler, for a "
        "pod's extended-resource request).",
        ("resourceclaim_name", "namespace", "source"),
        _claim_source,
        stability="experimental",
        fields=("source",),
    ),
    family(
        "kube_resourceclaim_status_phase",
        "",
        "The ResourceClaim's phase: pending (not allocated), allocated (reserved by nobody) or reserved.",
        ("resourceclaim_name", "namespace", "phase"),
        _phase,
        stability="experimental",
    ),
    family(
        "kube_resourceclaim_status_reserved_for_consumer",
        "{consumer}",
        "Consumers reserving the ResourceClaim (status.reservedFor), of every kind: pod, podgroup, or the resource.",
        ("resourceclaim_name", "namespace", "consumer_kind", "consumer_name"),
        _consumers,
        stability="experimental",
        fields=("consumers",),
    ),
    family(
        "kube_resourceclaim_created_timestamp",
        "s",
        "Unix creation time of the ResourceClaim.",
        ("resourceclaim_name", "namespace"),
        _created,
        stability="experimental",
        fields=("created",),
    ),
    family(
        "kube_resourceclaim_allocation_timestamp",
        "s",
        "Unix time of the ResourceClaim's allocation (status.allocation.allocationTimestamp), when set.",
        ("resourceclaim_name", "namespace"),
        _allocation_time,
        stability="experimental",
        fields=("allocation_time",),
    ),
    family(
        "kube_resourceclaim_status_admin_access_device",
        "{device}",
        "Devices allocated to the ResourceClaim with adminAccess (not counted as consumption).",
        ("resourceclaim_name", "namespace", "pool", "device_name", "driver"),
        _admin_access,
        stability="experimental",
        fields=("results",),
    ),
    family(
        "kube_resourceclaim_status_device_condition",
        "",
        "Conditions of the claim's devices (status.devices[].conditions), as a state set over status.",
        ("resourceclaim_name", "namespace", "driver", "pool", "device_name", "share_id", "condition", "status"),
        _device_conditions,
        stability="experimental",
        fields=("conditions",),
    ),
    family(
        "kube_resourceclaim_device_binding_state",
        "",
        "Binding state of each allocated device with binding conditions: waiting, satisfied or failed.",
        (*DEVICE_SHARE_LABELS, "state"),
        _binding_state,
        stability="experimental",
        fields=("binding",),
    ),
    family(
        "kube_resourceclaim_device_binding_state_timestamp",
        "s",
        "Unix time an allocated device with binding conditions entered its binding state.",
        DEVICE_SHARE_LABELS,
        _binding_since,
        stability="experimental",
        fields=("binding",),
    ),
    family(
        "kube_resourceclaim_device_consumed_capacity",
        "",
        "Capacity of a multi-allocatable device that one allocation (share) of the claim consumes.",
        (*DEVICE_SHARE_LABELS, "capacity"),
        _consumed_capacity,
        stability="experimental",
        fields=("results",),
    ),
    family(
        "kube_resourceclaim_device_skip_node_operation",
        "",
        "Node operations (kubelet gRPC calls to the driver) an allocated device skips.",
        ("resourceclaim_name", "namespace", "driver", "pool", "device_name", "operation"),
        _skipped,
        stability="experimental",
        kubernetes="1.37",
        fields=("results",),
    ),
)
