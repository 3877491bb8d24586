"""DeviceClasses (resource.k8s.io/v1, cluster-scoped): the ``hourly-cost`` annotation and class info."""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from otel_dra.cluster.families import Family, Sample, family
from otel_dra.kube.reflector import ResourceType

RESOURCE = ResourceType("deviceclasses", "resource.k8s.io/v1")

COST_ANNOTATION = "hourly-cost"
# Strict on purpose: "1,234", "1e3", ".5", "1.", "+2", "-1", "NaN", "Inf" are all rejected, so a
# typo never turns into a plausible-looking cost.
_COST = re.compile(r"[0-9]+(\.[0-9]+)?", re.ASCII)


# Why a class has no usable cost (the ``reason`` of kube_resourceclaim_unpriced_devices).
NO_COST = "no_cost"
INVALID_COST = "invalid_cost"


@dataclass(frozen=True, slots=True)
class DeviceClass:
    name: str
    hourly_cost: float | None
    cost_problem: str | None = None  # NO_COST or INVALID_COST when hourly_cost is None
    extended_resource_name: str = ""


def parse_cost(raw: str) -> float:
    text = raw.strip()
    if not _COST.fullmatch(text):
        raise ValueError(f"invalid {COST_ANNOTATION} annotation {raw!r}: expected a non-negative decimal like 2.50")
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"invalid {COST_ANNOTATION} annotation {raw!r}: out of range")
    return value


def parse(obj: dict[str, Any], report: Callable[[str], None]) -> DeviceClass:
    meta = obj.get("metadata") or {}
    annotations = meta.get("annotations") or {}
    cost: float | None = None
    problem: str | None = NO_COST
    raw = annotations.get(COST_ANNOTATION) if isinstance(annotations, dict) else None
    if raw is not None:
        try:
            cost = parse_cost(str(raw))
            problem = None
        except ValueError as exc:
            report(f"{exc}; series omitted")
            problem = INVALID_COST
    spec = obj.get("spec")
    extended = spec.get("extendedResourceName") if isinstance(spec, dict) else None
    return DeviceClass(
        name=str(meta.get("name", "")),
        hourly_cost=cost,
        cost_problem=problem,
        extended_resource_name=extended if isinstance(extended, str) else "",
    )


def _cost(c: DeviceClass) -> Iterable[Sample]:
    if c.hourly_cost is not None:
        yield (c.name,), c.hourly_cost


# The seed's compatibility family: name, labels and values kept byte for byte.
FAMILIES: tuple[Family[DeviceClass], ...] = (
    family(
        "kube_deviceclass_hourly_cost",
        "{cost}",
        "Hourly cost of one device of this DeviceClass, from its hourly-cost annotation.",
        ("deviceclass_name",),
        _cost,
    ),
)


def _info(c: DeviceClass) -> Iterable[Sample]:
    yield (c.name, c.extended_resource_name), 1.0


STATE_FAMILIES: tuple[Family[DeviceClass], ...] = (
    family(
        "kube_deviceclass_info",
        "",
        "DeviceClasses (1 per class), with spec.extendedResourceName.",
        ("deviceclass_name", "extended_resource_name"),
        _info,
        stability="experimental",
    ),
)
