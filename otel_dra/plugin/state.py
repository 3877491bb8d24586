"""What preparing a claim means on this node, without I/O: the allocation results of the claim that
are this driver's, checked against this node's pool and devices, turned into prepared devices (what
the kubelet and the checkpoint get) and CDI edits (what the claim's CDI spec sets for each device).

As upstream's ``cmd/dra-example-kubeletplugin/state.go`` (kubernetes-sigs/dra-example-driver:
``DeviceState.prepareDevices`` and ``applyConfig``), minus what touches the world: reading the
claim, writing the spec and the checkpoint, spans and metrics are :mod:`otel_dra.plugin.driver`'s.
Everything here is a pure function of the claim (a parsed JSON object) and of what the driver is
(its name, its pool, the devices it publishes, the CDI ids it hands out), so it is tested without
gRPC, an API server or files. A claim that cannot be prepared raises :class:`ClaimError`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from otel_dra.plugin.checkpoint import PreparedClaim, PreparedDevice
from otel_dra.plugin.config import DEFAULT, ConfigError, GpuConfig, configs_by_request, device_env, refuse_configs
from otel_dra.records import record

# (device name, container environment): one CDI device of a claim's spec.
Edit = tuple[str, Sequence[str]]


@record(frozen=True)
class ClaimRef:
    """A claim as the kubelet names it."""

    namespace: str
    uid: str
    name: str

    def __str__(self) -> str:
        return f"{self.namespace}/{self.name} (uid {self.uid})"


class ClaimError(Exception):
    """Preparing or unpreparing one claim failed; ``kind`` is a short, bounded error type."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


@record(frozen=True)
class PreparedAllocation:
    """A claim's allocation, prepared: its devices in the order of the allocation results, and
    the CDI edits of its spec, one per device even if two requests got it."""

    devices: tuple[PreparedDevice, ...]
    edits: tuple[Edit, ...]


class DeviceState:
    """What this node's driver prepares. ``published``: the device of that name this node
    publishes, or None; ``device_ids``: the CDI device ids of (claim UID, CDI device name: the
    device's, or ``<device>-<shareID>`` for a share of it). ``env_prefix`` and ``gpu_config`` are the
    device profile's: the variables' prefix, and whether claims configure devices with a GpuConfig
    (the GPU profiles) or not at all (cpu, net: an opaque config of this driver is an error)."""

    def __init__(
        self,
        driver_name: str,
        pool_name: str,
        published: Callable[[str], object | None],
        device_ids: Callable[[str, str], Sequence[str]],
        *,
        env_prefix: str = "GPU",
        gpu_config: bool = True,
    ) -> None:
        self.driver_name = driver_name
        self.pool_name = pool_name
        self._published = published
        self._device_ids = device_ids
        self.env_prefix = env_prefix
        self.gpu_config = gpu_config

    def prepare(self, ref: ClaimRef, claim: Mapping[str, Any]) -> PreparedAllocation:
        """The prepared devices and CDI edits of ``claim``, the claim ``ref`` names."""
        results = self.results(ref, claim)
        allocation_config = claim["status"]["allocation"]["devices"].get("config")
        try:
            if self.gpu_config:
                configs: Mapping[str, GpuConfig | None] = configs_by_request(
                    allocation_config, self.driver_name, [r["request"] for r in results]
                )
            else:
                configs = dict.fromkeys((r["request"] for r in results), None)
                refuse_configs(allocation_config, self.driver_name)
        except ConfigError as exc:
            raise ClaimError("InvalidConfig", f"ResourceClaim {ref.namespace}/{ref.name}: {exc}") from exc
        # As upstream: admin access is the claim's (any result of any driver), for every device.
        admin = any(
            isinstance(r, dict) and r.get("adminAccess") is True
            for r in claim["status"]["allocation"]["devices"]["results"]
        )
        # One CDI device per device, or per share of a device, even if two requests got it.
        edits: dict[str, list[str]] = {}
        for r in results:
            device = self._published(r["device"])
            env = device_env(
                ref.uid,
                r["device"],
                admin,
                configs[r["request"]],
                r["consumed"],
                share_id=r["share_id"],
                static=getattr(device, "env", None),
                prefix=self.env_prefix,
            )
            edits.setdefault(cdi_name(r["device"], r["share_id"]), env)
        devices = tuple(
            PreparedDevice(
                request_names=(r["request"],),
                pool_name=r["pool"],
                device_name=r["device"],
                cdi_device_ids=tuple(self._device_ids(ref.uid, cdi_name(r["device"], r["share_id"]))),
                container_env=tuple(edits[cdi_name(r["device"], r["share_id"])]),
                share_id=r["share_id"],
            )
            for r in results
        )
        return PreparedAllocation(devices, tuple(edits.items()))

    def results(self, ref: ClaimRef, claim: Mapping[str, Any]) -> list[dict[str, Any]]:
        """The allocation results for this driver, checked to be devices of this node's pool."""
        metadata = claim.get("metadata") if isinstance(claim.get("metadata"), dict) else {}
        uid = metadata.get("uid") if isinstance(metadata, dict) else None
        if uid != ref.uid:
            raise ClaimError(
                "UIDMismatch",
                f"ResourceClaim {ref.namespace}/{ref.name} has UID {uid}, not {ref.uid} (deleted and re-created?)",
            )
        status = claim.get("status") or {}
        allocation = status.get("allocation") if isinstance(status, dict) else None
        if not allocation:
            raise ClaimError("NotAllocated", f"ResourceClaim {ref.namespace}/{ref.name} is not allocated")
        try:
            results = allocation["devices"]["results"]
            if not isinstance(results, list):
                raise TypeError("results is not a list")
            ours: list[dict[str, Any]] = []
            for r in results:
                if r["driver"] != self.driver_name:
                    continue
                share_id = r.get("shareID")
                if share_id is not None and not isinstance(share_id, str):
                    raise TypeError(f"shareID is not a string: {share_id!r}")
                ours.append(
                    {
                        "request": str(r["request"]),
                        "pool": str(r["pool"]),
                        "device": str(r["device"]),
                        "consumed": _quantities(r.get("consumedCapacity"), self.driver_name),
                        "share_id": share_id or "",
                    }
                )
        except (KeyError, TypeError) as exc:
            raise ClaimError("InvalidClaim", f"malformed status.allocation.devices.results: {exc!r}") from exc
        if not ours:
            raise ClaimError(
                "NoResultsForDriver",
                f"ResourceClaim {ref.namespace}/{ref.name} has no allocation results for driver {self.driver_name}",
            )
        for r in ours:
            if r["pool"] != self.pool_name:
                raise ClaimError(
                    "WrongPool", f"device {r['pool']}/{r['device']} is not in this node's pool {self.pool_name}"
                )
            if self._published(str(r["device"])) is None:
                raise ClaimError("UnknownDevice", f"device {r['device']} is not published by this node")
        return ours


def check_prepared(ref: ClaimRef, prepared: PreparedClaim) -> None:
    """A claim prepared before answers only under the name it was prepared with: without this the
    checkpoint answered for a UID under any name (the API read, skipped on a hit, is what checks
    name and UID otherwise; found by tests/fuzz)."""
    if (prepared.namespace, prepared.name) != (ref.namespace, ref.name):
        raise ClaimError(
            "UIDMismatch",
            f"claim UID {ref.uid} was prepared as {prepared.namespace}/{prepared.name}, not {ref.namespace}/{ref.name}",
        )


def prepared_edits(claim_uid: str, prepared: PreparedClaim) -> list[Edit]:
    """The CDI edits of a claim prepared before, from its checkpoint entry (the defaults for an
    entry of an older plugin version, which kept no environment)."""
    known = {
        cdi_name(d.device_name, d.share_id): list(d.container_env)
        or device_env(claim_uid, d.device_name, False, DEFAULT)
        for d in prepared.devices
    }
    return list(known.items())


def allocated_as(ref: ClaimRef, claim: Mapping[str, Any]) -> bool:
    """Whether ``claim`` is the claim ``ref`` names (its UID) and carries an allocation."""
    metadata = claim.get("metadata")
    status = claim.get("status")
    return (
        isinstance(metadata, dict)
        and metadata.get("uid") == ref.uid
        and isinstance(status, dict)
        and bool(status.get("allocation"))
    )


def node_local(claim: Mapping[str, Any], node_name: str) -> bool:
    """Whether the claim's allocation is for ``node_name`` alone: its node selector is the one
    kube-scheduler writes for devices of a node's own ResourceSlices (one term, one field
    requirement ``metadata.name In [node]``). Anything else (other nodes, labels, none) is not."""
    status = claim.get("status")
    allocation = status.get("allocation") if isinstance(status, dict) else None
    selector = allocation.get("nodeSelector") if isinstance(allocation, dict) else None
    terms = selector.get("nodeSelectorTerms") if isinstance(selector, dict) else None
    if not isinstance(terms, list) or len(terms) != 1 or not isinstance(terms[0], dict):
        return False
    term = terms[0]
    if term.get("matchExpressions") or set(term) - {"matchExpressions", "matchFields"}:
        return False
    fields = term.get("matchFields")
    return (
        isinstance(fields, list)
        and len(fields) == 1
        and fields[0] == {"key": "metadata.name", "operator": "In", "values": [node_name]}
    )


def _quantities(value: Any, driver_name: str) -> dict[str, str]:
    """``consumedCapacity`` (name -> quantity) as strings; anything else is malformed. A name
    qualified with the driver's own domain (``gpu.example.com/memory``, which 1.38 also accepts for
    ``memory``) is the capacity's plain name."""
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(isinstance(v, (str, int, float)) for v in value.values()):
        raise TypeError(f"consumedCapacity is not a map of quantities: {value!r}")
    return {str(k).removeprefix(f"{driver_name}/"): str(v) for k, v in value.items()}


def cdi_name(device_name: str, share_id: str) -> str:
    """The name of a prepared device in the claim's CDI spec (after ``<claimUID>-``)."""
    return f"{device_name}-{share_id}" if share_id else device_name
