"""Pods (core v1, namespaced): the DRA state a pod carries, joined to claims and devices.

Only what these families need is kept per pod (its claim references and the health of its
allocated devices); a pod without either keeps nothing but its name, so a large cluster's pods
cost little memory.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, replace
from typing import Any

from google.protobuf.message import DecodeError

from otel_dra._generated.k8s import core_pb2, meta_pb2
from otel_dra.cluster.families import Family, Sample, family
from otel_dra.cluster.fields import optional_time
from otel_dra.kube import protobuf
from otel_dra.kube.reflector import ResourceType


def from_protobuf(data: bytes) -> dict[str, Any]:
    """One Pod of a protobuf list, as the dict :func:`parse` reads: the fields of the JSON object
    that the parser looks at, and nothing else (proto/otel_dra/_generated/k8s/core.proto). A pod as
    the API server lists it is ~7 KB of JSON, mostly managedFields, containers and volumes; none
    of it is decoded here."""
    return _decode(data, True)


def _without_start_times(data: bytes) -> dict[str, Any]:
    """:func:`from_protobuf` less what only "start_times" reads (spec.nodeName, the PodScheduled
    condition, the containers' state): 30 against 41 us for a running bench pod."""
    return _decode(data, False)


def _decode(data: bytes, times: bool) -> dict[str, Any]:
    try:
        pod = core_pb2.Pod.FromString(data)
    except DecodeError as exc:
        raise ValueError(f"malformed protobuf Pod: {exc}") from exc
    out: dict[str, Any] = {"metadata": protobuf.object_meta(pod.metadata)}
    p_spec, p_status = pod.spec, pod.status
    spec: dict[str, Any] = {}
    if times and p_spec.HasField("nodeName"):
        spec["nodeName"] = p_spec.nodeName
    claims = [_present(c, ("name", "resourceClaimName", "resourceClaimTemplateName")) for c in p_spec.resourceClaims]
    if claims:
        spec["resourceClaims"] = claims
    if spec:
        out["spec"] = spec
    status: dict[str, Any] = {}
    # Of the conditions only the last PodScheduled is read (Pod.scheduled_at; the API keys them by
    # type): the others (four more on a running pod) are not built, and the kubelet writes
    # PodScheduled last, so the search from the end usually looks at one. type and status are
    # always written (not pointers in the Go type), lastTransitionTime too (empty when not set).
    for condition in reversed(p_status.conditions) if times else ():
        if condition.type == _SCHEDULED:
            status["conditions"] = [
                {
                    "type": _SCHEDULED,
                    "status": condition.status,
                    "lastTransitionTime": _time(condition.lastTransitionTime),
                }
            ]
            break
    for key, containers in (
        ("containerStatuses", p_status.containerStatuses),
        ("initContainerStatuses", p_status.initContainerStatuses),
    ):
        if containers:
            status[key] = [_container_status(c, times) for c in containers]
    if p_status.resourceClaimStatuses:
        status["resourceClaimStatuses"] = [
            _present(c, ("name", "resourceClaimName")) for c in p_status.resourceClaimStatuses
        ]
    if status:
        out["status"] = status
    return out


_SCHEDULED = "PodScheduled"


def _present(message: Any, names: tuple[str, ...]) -> dict[str, Any]:
    # proto2 keeps presence: a field the API server left out stays out, as in its JSON.
    return {name: getattr(message, name) for name in names if message.HasField(name)}


def _time(t: meta_pb2.Time) -> str | None:
    """A meta.v1.Time as its JSON: RFC 3339 in UTC at whole seconds (the nanos are dropped, as the
    API server's JSON drops them); null for a time not set (the API server writes an empty message)."""
    seconds = t.seconds
    if not seconds and not t.HasField("seconds"):
        return None
    # 0.8 against 2.4 us for time.strftime: the date of a day formatted once (the pods' times
    # fall on few days), the time of day from a table.
    day, rest = divmod(seconds, 86400)
    date = _DAYS.get(day)
    if date is None:
        try:
            date = time.strftime("%Y-%m-%dT", time.gmtime(day * 86400))
        except (OverflowError, OSError, ValueError):
            return str(seconds)  # out of range: the parser reports it as not a timestamp
        if len(_DAYS) >= 4096:
            _DAYS.clear()
        _DAYS[day] = date
    hour, rest = divmod(rest, 3600)
    minute, second = divmod(rest, 60)
    return f"{date}{_TWO_DIGITS[hour]}:{_TWO_DIGITS[minute]}:{_TWO_DIGITS[second]}Z"


_DAYS: dict[int, str] = {}
_TWO_DIGITS = tuple(f"{i:02d}" for i in range(60))


def _container_status(c: core_pb2.ContainerStatus, times: bool) -> dict[str, Any]:
    out = _present(c, ("name",))
    if times and c.HasField("state"):
        # Only running and terminated, with their startedAt: a waiting container has not started
        # (its state decodes to {}, which the parser reads as not started, as it does the JSON's).
        # startedAt is always written (an empty message when not set: null, as in the JSON).
        state = c.state
        out["state"] = (
            {"running": {"startedAt": _time(state.running.startedAt)}}
            if state.HasField("running")
            else {"terminated": {"startedAt": _time(state.terminated.startedAt)}}
            if state.HasField("terminated")
            else {}
        )
    if c.allocatedResourcesStatus:
        out["allocatedResourcesStatus"] = [
            {**_present(r, ("name",)), "resources": [_present(h, ("resourceID", "health")) for h in r.resources]}
            for r in c.allocatedResourcesStatus
        ]
    return out


RESOURCE = ResourceType("pods", "v1", protobuf=from_protobuf)


def resource(keep: Collection[str]) -> ResourceType:
    """RESOURCE for a parser made with ``keep``: its protobuf decoder leaves out what only
    "start_times" reads when ``keep`` does not name it (equal to RESOURCE either way)."""
    return RESOURCE if "start_times" in keep else replace(RESOURCE, protobuf=_without_start_times)


# status.containerStatuses[].allocatedResourcesStatus[].resources[].health (core/v1 ResourceHealthStatus).
HEALTH_STATES = ("Healthy", "Unhealthy", "Unknown")
# allocatedResourcesStatus names of DRA resources: "claim:<claim>" or "claim:<claim>/<request>".
_CLAIM_PREFIX = "claim:"


@dataclass(frozen=True, slots=True)
class ClaimRef:
    """One spec.resourceClaims entry, with the ResourceClaim it resolved to."""

    name: str  # the entry's name inside the pod
    resourceclaim: str  # resourceClaimName, or the generated claim of status.resourceClaimStatuses
    template: str  # resourceClaimTemplateName


@dataclass(frozen=True, slots=True)
class DeviceHealth:
    container: str
    resourceclaim: str
    request: str
    driver: str
    pool: str
    device: str
    health: str  # one of HEALTH_STATES
    # The kubelet's resourceID where it is a CDI device ID; "" where it is driver/pool/device (not
    # kept twice: a pod's strings are most of the exporter's memory at 10^5 pods).
    resource_id: str = ""


@dataclass(frozen=True, slots=True)
class Pod:
    namespace: str
    name: str
    uid: str
    claims: tuple[ClaimRef, ...] = ()
    health: tuple[DeviceHealth, ...] = ()
    # Kept only by a parser asked for "start_times" (START_FIELDS); else None, None and "".
    # Unix seconds of the PodScheduled condition's lastTransitionTime, while its status is "True".
    scheduled_at: float | None = None
    # Unix seconds at which the last of the pod's containers started (status.containerStatuses,
    # init containers not counted): the latest state.running.startedAt (state.terminated.startedAt
    # for one that ran and ended), once every container has one; None while any has not started,
    # and for a pod with no containerStatuses yet. Not the Ready condition: readiness is the
    # application's own probe (it may never pass, or pass long after the start, or flap), while
    # this is when the kubelet had the containers running, which is what the DRA path (scheduled,
    # claims prepared, containers created with their devices) delivers. A container restarted in
    # place counts from its current run's start (lastState is not read).
    started_at: float | None = None
    node: str = ""  # spec.nodeName: "" until the pod is bound


def _text(value: Any) -> str:
    return value if isinstance(value, str) else ""


def _dict(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


def _claim_refs(spec: dict[str, Any], status: dict[str, Any]) -> tuple[ClaimRef, ...]:
    generated = {
        _text(entry.get("name")): _text(entry.get("resourceClaimName"))
        for entry in _list(status.get("resourceClaimStatuses"))
        if isinstance(entry, dict)
    }
    refs = []
    for entry in _list(spec.get("resourceClaims")):
        if not isinstance(entry, dict) or not _text(entry.get("name")):
            continue
        name = _text(entry["name"])
        direct = _text(entry.get("resourceClaimName"))
        refs.append(ClaimRef(name, direct or generated.get(name, ""), _text(entry.get("resourceClaimTemplateName"))))
    return tuple(refs)


def _device_of(resource_id: str) -> tuple[str, str, str] | None:
    """(driver, pool, device) of a kubelet resourceID; empty for a CDI device ID; None if neither.

    The kubelet (1.36+, pkg/kubelet/cm/dra buildResourceHealth) names a device by the first CDI
    device ID its driver returned for it, and only by ``<driver>/<pool>/<device>`` when the driver
    returned none. Most drivers (ours, NVIDIA's) return CDI IDs, and a CDI name says nothing
    certain about the device: such an entry keeps its claim and request (which join
    kube_resourceclaim_status_allocated_device) and the ID itself as ``resource_id``.
    """
    parts = resource_id.split("/")
    if len(parts) == 3 and all(parts):
        return parts[0], parts[1], parts[2]
    if len(parts) == 2 and parts[0]:
        kind, eq, cdi_name = parts[1].partition("=")
        if kind and eq and cdi_name:
            return "", "", ""
    return None


def _device_health(
    status: dict[str, Any], claims: tuple[ClaimRef, ...], report: Callable[[str], None]
) -> tuple[DeviceHealth, ...]:
    # A status names the pod's claim entry; extended-resource claims (made by the scheduler) are
    # named by the generated ResourceClaim itself.
    resolved = {ref.name: ref.resourceclaim or ref.name for ref in claims}
    out = []
    for container in (*_list(status.get("initContainerStatuses")), *_list(status.get("containerStatuses"))):
        if not isinstance(container, dict):
            continue
        for resource in _list(container.get("allocatedResourcesStatus")):
            name = _text(resource.get("name")) if isinstance(resource, dict) else ""
            if not name.startswith(_CLAIM_PREFIX):
                continue  # a device-plugin resource, not DRA
            claim, _, request = name.removeprefix(_CLAIM_PREFIX).partition("/")
            for item in _list(resource.get("resources")):
                resource_id = _text(item.get("resourceID")) if isinstance(item, dict) else ""
                parts = _device_of(resource_id)
                if parts is None:
                    report(
                        f"allocatedResourcesStatus {name}: resourceID {resource_id!r} is neither "
                        "<driver>/<pool>/<device> nor a CDI device ID <vendor>/<class>=<name>"
                    )
                    continue
                health = _text(item.get("health")) or "Unknown"
                if health not in HEALTH_STATES:
                    report(f"allocatedResourcesStatus {name}: unknown health {health!r}, reported as Unknown")
                    health = "Unknown"
                driver, pool, device = parts
                owner = _text(container.get("name"))
                out.append(
                    DeviceHealth(
                        owner,
                        resolved.get(claim, claim),
                        request,
                        driver,
                        pool,
                        device,
                        health,
                        "" if driver else resource_id,
                    )
                )
    return tuple(out)


def _scheduled_at(status: dict[str, Any], report: Callable[[str], None]) -> float | None:
    found: dict[str, Any] | None = None
    for condition in _list(status.get("conditions")):
        if isinstance(condition, dict) and condition.get("type") == _SCHEDULED:
            found = condition  # the API keys conditions by type: the last one counts
    if found is None or found.get("status") != "True":
        return None
    return optional_time(found.get("lastTransitionTime"), "status.conditions[PodScheduled].lastTransitionTime", report)


def _started_at(status: dict[str, Any], report: Callable[[str], None]) -> float | None:
    containers = _list(status.get("containerStatuses"))
    latest: float | None = None
    for i, container in enumerate(containers):
        state = _dict(_dict(container).get("state"))
        kind = "running" if _dict(state.get("running")) else "terminated"
        value = _dict(state.get(kind)).get("startedAt")
        if value is None:
            return None  # waiting, or ended without having run
        started = optional_time(value, f"status.containerStatuses[{i}].state.{kind}.startedAt", report)
        if started is None:
            return None
        latest = started if latest is None else max(latest, started)
    return latest


# The fields of Pod that only some families read (Family.fields); a parser made for a set of them
# leaves the others empty (memory: a family that is off keeps nothing).
FIELDS = frozenset({"claims", "health"})
# Fields no family reads by default, kept only when asked for by name: "start_times" keeps
# scheduled_at, started_at and node (3 more references per pod either way; None and "" are shared).
START_FIELDS = frozenset({"start_times"})
_KNOWN = FIELDS | START_FIELDS


def make_parser(keep: Collection[str] = FIELDS) -> Callable[[dict[str, Any], Callable[[str], None]], Pod]:
    """A parser that fills only the optional fields in ``keep`` (names of other types ignored)."""
    wanted = _KNOWN.intersection(keep)

    def parse(obj: dict[str, Any], report: Callable[[str], None]) -> Pod:
        return _parse(obj, report, wanted)

    return parse


def parse(obj: dict[str, Any], report: Callable[[str], None]) -> Pod:
    return _parse(obj, report, FIELDS)


def _parse(obj: dict[str, Any], report: Callable[[str], None], keep: frozenset[str]) -> Pod:
    meta = obj.get("metadata") or {}
    spec = _dict(obj.get("spec"))
    status = _dict(obj.get("status"))
    # The health entries name the pod's claim entries: resolved through its references.
    claims = _claim_refs(spec, status) if "claims" in keep or "health" in keep else ()
    times = "start_times" in keep
    return Pod(
        namespace=_text(meta.get("namespace")),
        name=_text(meta.get("name")),
        uid=_text(meta.get("uid")),
        claims=claims if "claims" in keep else (),
        health=_device_health(status, claims, report) if "health" in keep else (),
        scheduled_at=_scheduled_at(status, report) if times else None,
        started_at=_started_at(status, report) if times else None,
        node=_text(spec.get("nodeName")) if times else "",
    )


def _claim_info(p: Pod) -> Iterable[Sample]:
    for ref in p.claims:
        yield (p.namespace, p.name, p.uid, ref.name, ref.resourceclaim, ref.template), 1.0


def _health(p: Pod) -> Iterable[Sample]:
    # One series per device, labelled with its current health (kube-state-metrics does the same for
    # its reason families since 2.0): a state set of all three states would triple the pod
    # families' largest share of the exposition (3 x 270 bytes per device, ~55 MB at 100,000 pods)
    # for series that are 0. A device listed twice for one container is one series.
    seen: dict[tuple[str, ...], None] = {}
    for d in p.health:
        labels = (
            *(p.namespace, p.name, p.uid, d.container, d.resourceclaim, d.request),
            *(d.driver, d.pool, d.device, d.resource_id or f"{d.driver}/{d.pool}/{d.device}"),
        )
        if labels not in seen:
            seen[labels] = None
            yield (*labels, d.health), 1.0


STATE_FAMILIES: tuple[Family[Pod], ...] = (
    # Named and labelled as kube-state-metrics (2.20) names and labels it, so queries written for
    # one work with the other.
    family(
        "kube_pod_resourceclaim_info",
        "",
        "One per entry of the pod's spec.resourceClaims, with the ResourceClaim it refers to "
        "(resourceClaimName, or the claim generated from the template as status.resourceClaimStatuses names it).",
        ("namespace", "pod", "uid", "claim_name", "resourceclaim_name", "resourceclaim_template_name"),
        _claim_info,
        stability="experimental",
        fields=("claims",),
    ),
    family(
        "kube_pod_resourceclaim_device_health",
        "",
        "Health of each DRA device allocated to the pod's containers, as the kubelet reports it in "
        "status.containerStatuses[].allocatedResourcesStatus: 1, with the current state as the health label.",
        (
            "namespace",
            "pod",
            "uid",
            "container",
            "resourceclaim_name",
            "request",
            "driver",
            "pool",
            "device_name",
            "resource_id",
            "health",
        ),
        _health,
        stability="experimental",
        kubernetes="1.36",
        fields=("health",),
    ),
)
