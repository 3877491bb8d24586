"""ResourceClaims (resource.k8s.io/v1, namespaced): allocation results and pod reservations."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from otel_dra.cluster.families import Family, Sample, family
from otel_dra.kube.reflector import ResourceType

RESOURCE = ResourceType("resourceclaims", "resource.k8s.io/v1")


@dataclass(frozen=True, slots=True)
class Claim:
    namespace: str
    name: str
    # (driver, pool, device) -> number of allocation results naming it (normally 1; a shareable
    # device can appear more than once, and identical label sets must become one series).
    allocated: tuple[tuple[tuple[str, str, str], int], ...]
    pods: tuple[tuple[str, str], ...]  # reserving pods: (name, uid)


def _str(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def parse(obj: dict[str, Any], report: Callable[[str], None]) -> Claim:
    meta = obj.get("metadata") or {}
    status = obj.get("status") or {}
    if not isinstance(status, dict):
        report("status is not an object")
        status = {}
    counts: dict[tuple[str, str, str], int] = {}
    allocation = status.get("allocation") or {}
    results = ((allocation.get("devices") or {}) if isinstance(allocation, dict) else {}).get("results") or []
    if not isinstance(results, list):
        report("status.allocation.devices.results is not a list")
        results = []
    for i, result in enumerate(results):
        if not isinstance(result, dict):
            result = {}
        driver, pool, device = (_str(result.get(k)) for k in ("driver", "pool", "device"))
        if driver is None or pool is None or device is None:
            report(f"status.allocation.devices.results[{i}] lacks driver/pool/device; skipped")
            continue
        key = (driver, pool, device)
        counts[key] = counts.get(key, 0) + 1
    pods: list[tuple[str, str]] = []
    reserved = status.get("reservedFor") or []
    if not isinstance(reserved, list):
        report("status.reservedFor is not a list")
        reserved = []
    for consumer in reserved:
        if not isinstance(consumer, dict):
            continue
        if (consumer.get("apiGroup") or "") == "" and consumer.get("resource") == "pods":
            pods.append((str(consumer.get("name", "")), str(consumer.get("uid", ""))))
    return Claim(
        namespace=str(meta.get("namespace", "")),
        name=str(meta.get("name", "")),
        allocated=tuple(counts.items()),
        pods=tuple(pods),
    )


def _allocated(c: Claim) -> Iterable[Sample]:
    for (driver, pool, device), count in c.allocated:
        yield (c.name, c.namespace, pool, device, driver), float(count)


def _reserved_for_pod(c: Claim) -> Iterable[Sample]:
    for pod, uid in c.pods:
        yield (c.name, c.namespace, pod, uid), 1.0


def _reserved_total(c: Claim) -> Iterable[Sample]:
    yield (c.name, c.namespace), float(len(c.pods))


FAMILIES: tuple[Family[Claim], ...] = (
    family(
        "kube_resourceclaim_status_allocated_device",
        "{device}",
        "Devices allocated to the ResourceClaim: 1 per allocation result (driver, pool, device).",
        ("resourceclaim_name", "namespace", "pool", "device_name", "driver"),
        _allocated,
    ),
    family(
        "kube_resourceclaim_status_reserved_for_pod",
        "{pod}",
        "Pods reserving the ResourceClaim: 1 per status.reservedFor entry that is a pod.",
        ("resourceclaim_name", "namespace", "pod_name", "uid"),
        _reserved_for_pod,
    ),
    family(
        "kube_resourceclaim_status_reserved_total",
        "{pod}",
        "Number of pods reserving the ResourceClaim (0 included).",
        ("resourceclaim_name", "namespace"),
        _reserved_total,
    ),
)
