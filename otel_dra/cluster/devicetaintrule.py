"""DeviceTaintRules (resource.k8s.io, cluster-scoped).

Where Kubernetes serves them:

| Kubernetes | version | by default |
|---|---|---|
| 1.33-1.35 | ``v1alpha3`` | no: the DRADeviceTaints (1.35: DRADeviceTaintRules) gate and the API version |
| 1.36 | ``v1beta2`` | no: the DRADeviceTaintRules gate (beta, off) and the API version |
| 1.37 | ``v1`` (GA; ``v1alpha3`` deprecated) | yes |

So the resource is optional: the newest version served is found through API discovery
(:func:`discover`) and the exporter works without it (see
:class:`otel_dra.kube.reflector.Reflector`). One parser reads every version's shape: 1.35 removed
``deviceSelector.deviceClassName`` and ``deviceSelector.selectors`` (read when present, "" and none
otherwise) and added ``status.conditions`` (``EvictionInProgress``, written by kube-controller-manager's
device-taint-eviction controller); ``spec.taint.timeAdded`` exists in every version (defaulted by the
API server).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from otel_dra.cluster.families import Family, Sample, family
from otel_dra.cluster.fields import condition_states, conditions, optional_time
from otel_dra.kube.client import ApiError, KubeClient
from otel_dra.kube.reflector import ResourceType

GROUP = "resource.k8s.io"
PLURAL = "devicetaintrules"
# Preferred first: where a newer Kubernetes serves it, the older alpha version may be gone (or,
# as v1alpha3 in 1.37, deprecated). v1beta1 never served DeviceTaintRules.
VERSIONS = ("v1", "v1beta2", "v1alpha3")
# Until discovery has found where it is served.
RESOURCE = ResourceType(PLURAL, f"{GROUP}/v1")


def discover(client: KubeClient) -> ResourceType | None:
    """Where the API server serves DeviceTaintRules, or None when it does not."""
    group = client.get_json(f"/apis/{GROUP}")
    served = {v.get("version") for v in group.get("versions") or [] if isinstance(v, dict)}
    for version in VERSIONS:
        if version not in served:
            continue
        try:
            resources = client.get_json(f"/apis/{GROUP}/{version}")
        except ApiError as exc:
            if exc.status == 404:  # listed a moment ago, gone now (an API server upgrade)
                continue
            raise
        if any(isinstance(r, dict) and r.get("name") == PLURAL for r in resources.get("resources") or []):
            return ResourceType(PLURAL, f"{GROUP}/{version}")
    return None


@dataclass(frozen=True, slots=True)
class DeviceTaintRule:
    name: str
    key: str
    value: str
    effect: str
    deviceclass_name: str
    driver: str
    pool: str
    device: str
    has_selectors: bool = False  # CEL selectors (until 1.34), which the exporter does not evaluate
    time_added: float | None = None  # spec.taint.timeAdded, Unix seconds
    conditions: tuple[tuple[str, str], ...] = ()  # status.conditions: (type, "true|false|unknown")

    @property
    def evaluable(self) -> bool:
        """Whether the exporter can tell exactly which devices the rule taints: only a selector by
        driver, pool and device (a DeviceClass or CEL selectors would need CEL)."""
        return not self.deviceclass_name and not self.has_selectors


def _text(d: dict[str, Any], key: str) -> str:
    value = d.get(key)
    return value if isinstance(value, str) else ""


def parse(obj: dict[str, Any], report: Callable[[str], None]) -> DeviceTaintRule:
    meta = obj.get("metadata") or {}
    spec = obj.get("spec")
    if not isinstance(spec, dict):
        raise ValueError("spec is missing or not an object")
    taint = spec.get("taint")
    if not isinstance(taint, dict):
        report("spec.taint is missing or not an object")
        taint = {}
    selector = spec.get("deviceSelector")
    if selector is not None and not isinstance(selector, dict):
        report("spec.deviceSelector is not an object")
    selector = selector if isinstance(selector, dict) else {}
    selectors = selector.get("selectors")
    status = obj.get("status")
    if status is not None and not isinstance(status, dict):
        report("status is not an object")
    status = status if isinstance(status, dict) else {}
    return DeviceTaintRule(
        name=str(meta.get("name", "")),
        key=_text(taint, "key"),
        value=_text(taint, "value"),
        effect=_text(taint, "effect"),
        deviceclass_name=_text(selector, "deviceClassName"),
        driver=_text(selector, "driver"),
        pool=_text(selector, "pool"),
        device=_text(selector, "device"),
        has_selectors=isinstance(selectors, list) and bool(selectors),
        time_added=optional_time(taint.get("timeAdded"), "spec.taint.timeAdded", report),
        conditions=conditions(status.get("conditions"), "status.conditions", report),
    )


def _info(r: DeviceTaintRule) -> Iterable[Sample]:
    yield (r.name, r.key, r.value, r.effect, r.deviceclass_name, r.driver, r.pool, r.device), 1.0


def _time_added(r: DeviceTaintRule) -> Iterable[Sample]:
    if r.time_added is not None:
        yield (r.name,), r.time_added


def _conditions(r: DeviceTaintRule) -> Iterable[Sample]:
    for condition, status in r.conditions:
        for state, value in condition_states(status):
            yield (r.name, condition, state), value


FAMILIES: tuple[Family[DeviceTaintRule], ...] = ()

STATE_FAMILIES: tuple[Family[DeviceTaintRule], ...] = (
    family(
        "kube_devicetaintrule_info",
        "",
        "DeviceTaintRules (1 per rule): the taint and the device selector's fields.",
        (
            "devicetaintrule_name",
            "key",
            "value",
            "effect",
            "deviceclass_name",
            "driver",
            "pool",
            "device_name",
        ),
        _info,
        stability="experimental",
    ),
    family(
        "kube_devicetaintrule_taint_added_timestamp",
        "s",
        "Unix time the rule's taint was added or its effect last changed (spec.taint.timeAdded).",
        ("devicetaintrule_name",),
        _time_added,
        stability="experimental",
        kubernetes="1.34",
    ),
    family(
        "kube_devicetaintrule_status_condition",
        "",
        "Conditions of the DeviceTaintRule (status.conditions, e.g. EvictionInProgress), as a state set over status.",
        ("devicetaintrule_name", "condition", "status"),
        _conditions,
        stability="experimental",
        kubernetes="1.35",
    ),
)
