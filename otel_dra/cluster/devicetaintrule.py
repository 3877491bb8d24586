"""DeviceTaintRules (resource.k8s.io, cluster-scoped; alpha in Kubernetes 1.33-1.35).

Served only when the DRADeviceTaints feature gate and the API version are enabled, so the resource
is optional: it is found through API discovery (:func:`discover`) and the exporter works without it
(see :class:`otel_dra.kube.reflector.Reflector`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from otel_dra.cluster.families import Family, Sample, family
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
    has_selectors: bool = False  # CEL selectors, which the exporter does not evaluate

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
    selector = selector if isinstance(selector, dict) else {}
    selectors = selector.get("selectors")
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
    )


def _info(r: DeviceTaintRule) -> Iterable[Sample]:
    yield (r.name, r.key, r.value, r.effect, r.deviceclass_name, r.driver, r.pool, r.device), 1.0


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
)
