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

Which devices a rule without ``spec.deviceSelector`` matches depends on the release: every device
before Kubernetes v1.37.1 (1.34, 1.35, 1.36.x, 1.37.0), none since (v1.37.1 and 1.38, its
pre-releases included). An explicit empty selector ``{}`` matches every device on all of them. So
the parser keeps whether the selector was there (:attr:`DeviceTaintRule.selector_present`), and
:class:`ServerVersion` reads the API server's version for the joins, which decide with
:func:`absent_selector_matches_all`.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from otel_dra.cluster.families import Family, Sample, family
from otel_dra.cluster.fields import condition_states, conditions, optional_time
from otel_dra.kube.client import ApiError, KubeClient
from otel_dra.kube.reflector import ResourceType
from otel_dra.kube.version import KubeVersion, read_server_version

log = logging.getLogger(__name__)

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
    # Whether spec.deviceSelector is there at all: a rule without one matches every device before
    # v1.37.1 and none since (absent_selector_matches_all), unlike an empty one ({}: every device).
    selector_present: bool = True
    time_added: float | None = None  # spec.taint.timeAdded, Unix seconds
    conditions: tuple[tuple[str, str], ...] = ()  # status.conditions: (type, "true|false|unknown")

    @property
    def evaluable(self) -> bool:
        """Whether the exporter can tell exactly which devices the rule taints: only a selector by
        driver, pool and device (a DeviceClass or CEL selectors would need CEL)."""
        return not self.deviceclass_name and not self.has_selectors


# The first release in which a rule without spec.deviceSelector matches no device (the change is in
# v1.37.1 and 1.38, not in 1.36: as far as their notes go, v1.36.6 still matches every device).
ABSENT_SELECTOR_MATCHES_NONE_SINCE = KubeVersion(1, 37, 1)


def absent_selector_matches_all(version: KubeVersion | None) -> bool:
    """Whether a rule without spec.deviceSelector matches every device on an API server of
    ``version`` (else it matches none). An unknown version (None: /version could not be read)
    gets the newest releases' semantics, none: the exporter is most likely to be behind a new
    release, and a rule taken to match nothing can only over-report free devices, never report a
    pool full that the scheduler keeps allocating from."""
    return version is not None and version < ABSENT_SELECTOR_MATCHES_NONE_SINCE


class ServerVersion:
    """The API server's version, read when the DeviceTaintRule reflector connects (before its
    first list, and again once a list or watch succeeds after a failure: an upgrade restarts the
    API server, which breaks the watch); ``on_change`` hears every new value (None: unknown).

    Only a read that fails before any succeeded leaves the version unknown: a failed re-read keeps
    the last one (a server that answered before and fails now is in an outage, not a downgrade).
    An unreadable /version (403 where the default role granting it, system:public-info-viewer,
    was taken away; an answer that is not a version) is logged once as a warning; a server that
    does not answer yet (0, 5xx) only at INFO, since the reflector reports the outage and the
    version is read again when the connection is back.
    """

    def __init__(self, client: KubeClient, on_change: Callable[[KubeVersion | None], None]) -> None:
        self._client = client
        self._on_change = on_change
        self._lock = threading.Lock()  # one reflector thread calls refresh; tests read .version
        self._version: KubeVersion | None = None
        self._reported: set[bool] = set()  # the kinds of failure logged (transient or not)

    @property
    def version(self) -> KubeVersion | None:
        with self._lock:
            return self._version

    def refresh(self) -> None:
        """Read the version again; never raises (a failure is logged and keeps what was known)."""
        try:
            version = read_server_version(self._client)
        except (ApiError, ValueError) as exc:
            self._failed(exc)
            return
        with self._lock:
            changed = version != self._version
            self._version = version
            self._reported.clear()
        if changed:
            log.info(
                "API server %s: DeviceTaintRules without spec.deviceSelector match %s",
                version,
                "every device" if absent_selector_matches_all(version) else "no device",
            )
            self._on_change(version)

    def _failed(self, exc: Exception) -> None:
        transient = isinstance(exc, ApiError) and (exc.status == 0 or exc.status >= 500)
        with self._lock:
            known = self._version
            first = transient not in self._reported
            self._reported.add(transient)
        if known is not None:
            log.info("cannot read the API server's version again (%s); keeping %s", exc, known)
            return
        if not first:
            return
        log.log(
            logging.INFO if transient else logging.WARNING,
            "cannot read the API server's version (GET /version: %s)%s; until it is read, DeviceTaintRules "
            "without spec.deviceSelector are taken to match no device, as Kubernetes does since v1.37.1 "
            "(before, they matched every device)",
            exc,
            ", reading it again when the connection is back"
            if transient
            else " -- allow get on the non-resource URL /version (the default role system:public-info-viewer does)",
        )


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
    # JSON null is how an absent optional field may be written too (the API server drops it).
    selector_present = selector is not None
    if selector is not None and not isinstance(selector, dict):
        # The API server refuses such a rule; one that has it anyway is read as {} (as before the
        # absent/empty distinction), and counted.
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
        selector_present=selector_present,
        time_added=optional_time(taint.get("timeAdded"), "spec.taint.timeAdded", report),
        conditions=conditions(status.get("conditions"), "status.conditions", report),
    )


def _info(r: DeviceTaintRule) -> Iterable[Sample]:
    yield (r.name, r.key, r.value, r.effect, r.deviceclass_name, r.driver, r.pool, r.device), 1.0


def _selector_absent(r: DeviceTaintRule) -> Iterable[Sample]:
    yield (r.name,), 0.0 if r.selector_present else 1.0


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
        "kube_devicetaintrule_device_selector_absent",
        "",
        "1 when the rule has no spec.deviceSelector (no device since Kubernetes v1.37.1, every device before), "
        "0 when it has one ({} included: every device).",
        ("devicetaintrule_name",),
        _selector_absent,
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
