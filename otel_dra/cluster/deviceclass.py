"""DeviceClasses (resource.k8s.io/v1, cluster-scoped): the ``hourly-cost`` annotation."""

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


@dataclass(frozen=True, slots=True)
class DeviceClass:
    name: str
    hourly_cost: float | None


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
    raw = annotations.get(COST_ANNOTATION) if isinstance(annotations, dict) else None
    if raw is not None:
        try:
            cost = parse_cost(str(raw))
        except ValueError as exc:
            report(f"{exc}; series omitted")
    return DeviceClass(name=str(meta.get("name", "")), hourly_cost=cost)


def _cost(c: DeviceClass) -> Iterable[Sample]:
    if c.hourly_cost is not None:
        yield (c.name,), c.hourly_cost


FAMILIES: tuple[Family[DeviceClass], ...] = (
    family(
        "kube_deviceclass_hourly_cost",
        "{cost}",
        "Hourly cost of one device of this DeviceClass, from its hourly-cost annotation.",
        ("deviceclass_name",),
        _cost,
    ),
)
