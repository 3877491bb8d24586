"""The opaque device configuration of a claim: dra-example-driver's ``GpuConfig``, and the container
environment that each prepared device gets from it.

Upstream (kubernetes-sigs/dra-example-driver, ``api/example.com/resource/gpu/v1alpha1`` and the gpu
profile's ``ApplyConfig``) reads ``status.allocation.devices.config``: the configs of the DeviceClass
(``FromClass``) and then the claim's own (``FromClaim``), later ones taking precedence; entries for
other drivers are skipped; an entry that is not ``opaque`` is an error (a future API extension the
driver does not know). Each allocation result takes the last config whose ``requests`` is empty or
names its request, and a default ``GpuConfig`` (time-slicing, interval ``Default``) comes first with
the lowest precedence, so every device has one. The config is normalized (implied defaults) and
validated; any problem fails the prepare of that claim alone, with the reason.

The environment matches upstream's names and values exactly (its e2e tests read them), e.g. for
device ``gpu-0`` of claim ``U`` without a config::

    GPU_DEVICE_GPU_0_RESOURCE_CLAIM=U
    DRA_ADMIN_ACCESS=false
    GPU_DEVICE_0=gpu-0
    GPU_DEVICE_0_SHARING_STRATEGY=TimeSlicing
    GPU_DEVICE_0_TIMESLICE_INTERVAL=Default

(``GPU_DEVICE_<n>_PARTITION_COUNT`` instead of the interval for ``SpacePartitioning``, and
``GPU_DEVICE_<n>_MEMORY`` / ``_COMPUTE`` when the allocation consumed that capacity). Beyond
upstream: a share of a device (``shareID``) gets ``_SHARE_ID`` and the share in ``<n>``, and the
device profile's own variables (a partition's ``_PARENT``, a NUMA node's ``_CPUSET``, a NIC's
``_INTERFACE``; :mod:`otel_dra.plugin.profiles`). Upstream
(v0.4.0, cmd/dra-example-kubeletplugin/cdi.go and internal/profiles/gpu/gpu.go) really spells the
claim variable with the whole device name (``GPU_0``) and the others with the name after ``gpu-``,
and ``DRA_ADMIN_ACCESS`` is the claim's: true on every device once any result has admin access.

One deliberate difference: upstream's decoder drops unknown fields silently (its "strict" option
only rejects duplicate keys), so a misspelt ``timeSlicingConfig`` quietly gives the default; here an
unknown field fails the prepare and names the field.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from otel_dra.records import record

GROUP = "gpu.resource.example.com"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "GpuConfig"

TIME_SLICING = "TimeSlicing"
SPACE_PARTITIONING = "SpacePartitioning"
STRATEGIES = (TIME_SLICING, SPACE_PARTITIONING)
INTERVALS = ("Default", "Short", "Medium", "Long")
DEFAULT_INTERVAL = "Default"
DEFAULT_PARTITION_COUNT = 1

SOURCES = ("FromClass", "FromClaim")

_NON_WORD = re.compile(r"[^a-zA-Z0-9]+")  # upstream's nonWord (cdi.go)


class ConfigError(ValueError):
    """A device configuration of the claim cannot be used; the message says which and why."""


@record(frozen=True)
class GpuConfig:
    """A normalized, validated GpuConfig: the strategy and its one setting."""

    strategy: str = TIME_SLICING
    interval: str = DEFAULT_INTERVAL  # TimeSlicing
    partition_count: int = DEFAULT_PARTITION_COUNT  # SpacePartitioning

    def env(self, device_name: str, consumed: Mapping[str, str] | None = None, n: str | None = None) -> list[str]:
        """Upstream's per-device variables (applyGpuConfig): the device, its strategy and setting,
        and the capacity the allocation consumed (``consumedCapacity``, quantities as the API
        server wrote them: its canonical form, as Go's Quantity.String()). ``n``: the variables'
        id, when not the device's own (a share of it)."""
        n = env_id(device_name) if n is None else n
        env = [f"GPU_DEVICE_{n}={device_name}", f"GPU_DEVICE_{n}_SHARING_STRATEGY={self.strategy}"]
        if self.strategy == TIME_SLICING:
            env.append(f"GPU_DEVICE_{n}_TIMESLICE_INTERVAL={self.interval}")
        else:
            env.append(f"GPU_DEVICE_{n}_PARTITION_COUNT={self.partition_count}")
        for key in ("memory", "compute"):
            if consumed and key in consumed:
                env.append(f"GPU_DEVICE_{n}_{key.upper()}={consumed[key]}")
        return env


DEFAULT = GpuConfig()


def env_id(device_name: str) -> str:
    """``gpu-3`` -> ``3``, ``gpu-0-mig-1`` -> ``0_MIG_1``: upstream's envVarSafeID of the name after
    ``gpu-`` (dashes to underscores, upper case)."""
    return device_name.removeprefix("gpu-").replace("-", "_").upper()


def device_env(
    claim_uid: str,
    device_name: str,
    admin_access: bool,
    config: GpuConfig | None,
    consumed: Mapping[str, str] | None = None,
    *,
    share_id: str = "",
    static: Mapping[str, str] | None = None,
    prefix: str = "GPU",
) -> list[str]:
    """All variables of one prepared device, in upstream's order (CreateClaimSpecFile, then the
    config's), then ours: the share (``<PREFIX>_DEVICE_<n>_SHARE_ID``; a share's variables carry its
    id in ``<n>``, so two shares of one device in one container do not collide) and what the device
    profile sets for every prepare of the device (``static``: its CPU set, its interface, its parent
    GPU). ``config`` is None for profiles without opaque configuration (cpu, net): their variables
    are the device and every consumed capacity."""
    share = "_" + _NON_WORD.sub("_", share_id).upper() if share_id else ""
    key = _NON_WORD.sub("_", device_name).upper() + share
    n = env_id(device_name) + share
    env = [
        f"{prefix}_DEVICE_{key}_RESOURCE_CLAIM={claim_uid}",
        f"DRA_ADMIN_ACCESS={'true' if admin_access else 'false'}",
    ]
    if config is not None:
        env.extend(config.env(device_name, consumed, n))
    else:
        env.append(f"{prefix}_DEVICE_{n}={device_name}")
        env.extend(
            f"{prefix}_DEVICE_{n}_{_NON_WORD.sub('_', k).upper()}={v}" for k, v in sorted((consumed or {}).items())
        )
    if share_id:
        env.append(f"{prefix}_DEVICE_{n}_SHARE_ID={share_id}")
    env.extend(f"{prefix}_DEVICE_{n}_{k}={v}" for k, v in (static or {}).items())
    return env


def parse_gpu_config(parameters: Any) -> GpuConfig:
    """Decode, normalize and validate opaque parameters (upstream's strict decoder: unknown fields
    are errors, as are a missing or other apiVersion/kind)."""
    if not isinstance(parameters, Mapping):
        raise ConfigError(f"parameters must be a JSON object, not {type(parameters).__name__}")
    api_version, kind = parameters.get("apiVersion"), parameters.get("kind")
    if api_version != API_VERSION or kind != KIND:
        raise ConfigError(f"parameters are {api_version!r}/{kind!r}, this driver decodes only {API_VERSION}/{KIND}")
    _only(parameters, {"apiVersion", "kind", "sharing"}, "GpuConfig")
    sharing = parameters.get("sharing")
    if sharing is None:
        return DEFAULT  # Normalize: no sharing means time-slicing with the default interval
    if not isinstance(sharing, Mapping):
        raise ConfigError("sharing must be an object")
    _only(sharing, {"strategy", "timeSlicingConfig", "spacePartitioningConfig"}, "sharing")
    strategy = sharing.get("strategy")
    if strategy not in STRATEGIES:
        raise ConfigError(f"unknown GPU sharing strategy: {strategy!r} (one of {', '.join(STRATEGIES)})")
    time_slicing, partitioning = sharing.get("timeSlicingConfig"), sharing.get("spacePartitioningConfig")
    if strategy == TIME_SLICING:
        if partitioning is not None:
            raise ConfigError(f"cannot use spacePartitioningConfig with the '{TIME_SLICING}' strategy")
        if time_slicing is None:
            return GpuConfig(TIME_SLICING, DEFAULT_INTERVAL)
        if not isinstance(time_slicing, Mapping):
            raise ConfigError("timeSlicingConfig must be an object")
        _only(time_slicing, {"interval"}, "timeSlicingConfig")
        interval = time_slicing.get("interval", "")
        if interval not in INTERVALS:
            raise ConfigError(f"unknown time-slice interval: {interval!r} (one of {', '.join(INTERVALS)})")
        return GpuConfig(TIME_SLICING, str(interval))
    if time_slicing is not None:
        raise ConfigError(f"cannot use timeSlicingConfig with the '{SPACE_PARTITIONING}' strategy")
    if partitioning is None:
        return GpuConfig(SPACE_PARTITIONING, partition_count=DEFAULT_PARTITION_COUNT)
    if not isinstance(partitioning, Mapping):
        raise ConfigError("spacePartitioningConfig must be an object")
    _only(partitioning, {"partitionCount"}, "spacePartitioningConfig")
    count = partitioning.get("partitionCount", 0)  # omitempty: absent is 0, as upstream
    if isinstance(count, bool) or not isinstance(count, int):
        raise ConfigError(f"partitionCount must be an integer, not {count!r}")
    if count < 0:
        raise ConfigError(f"invalid partition count: {count}")
    return GpuConfig(SPACE_PARTITIONING, partition_count=count)


def _only(obj: Mapping[str, Any], allowed: set[str], what: str) -> None:
    unknown = sorted(set(obj) - allowed)
    if unknown:
        raise ConfigError(f"unknown field(s) in {what}: {', '.join(unknown)}")


def refuse_configs(allocation_config: Any, driver_name: str) -> None:
    """For device profiles that take no opaque configuration: an entry of this driver is an error
    (rather than silently ignored: the user meant it to do something)."""
    for i, entry in enumerate(allocation_config if isinstance(allocation_config, list) else []):
        opaque = entry.get("opaque") if isinstance(entry, Mapping) else None
        if isinstance(opaque, Mapping) and opaque.get("driver") == driver_name:
            raise ConfigError(f"config[{i}]: this driver's device profile takes no opaque parameters")


@record(frozen=True)
class _Entry:
    requests: tuple[str, ...]
    config: GpuConfig


def configs_by_request(allocation_config: Any, driver_name: str, requests: Sequence[str]) -> dict[str, GpuConfig]:
    """The config each request's devices get (upstream's GetOpaqueDeviceConfigs and the lookup in
    prepareDevices). Raises ConfigError for an unusable entry of this driver."""
    if allocation_config is None:
        allocation_config = []
    if not isinstance(allocation_config, list):
        raise ConfigError("status.allocation.devices.config is not a list")
    by_source: dict[str, list[Any]] = {source: [] for source in SOURCES}
    for i, entry in enumerate(allocation_config):
        if not isinstance(entry, Mapping):
            raise ConfigError(f"config[{i}] is not an object")
        source = entry.get("source")
        if not isinstance(source, str) or source not in by_source:  # found by the property test
            raise ConfigError(f"config[{i}]: invalid config source: {source!r}")
        by_source[source].append((i, entry))
    entries = [_Entry((), DEFAULT)]  # lowest precedence: every device has a config
    for i, entry in [*by_source["FromClass"], *by_source["FromClaim"]]:
        opaque = entry.get("opaque")
        if not isinstance(opaque, Mapping):
            raise ConfigError(f"config[{i}]: only opaque parameters are supported by this driver")
        if opaque.get("driver") != driver_name:
            continue  # another driver's: a request may be satisfiable by several drivers
        names = entry.get("requests") or []
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise ConfigError(f"config[{i}]: requests must be a list of names")
        try:
            config = parse_gpu_config(opaque.get("parameters"))
        except ConfigError as exc:
            raise ConfigError(f"config[{i}] ({entry['source']}): {exc}") from None
        entries.append(_Entry(tuple(names), config))
    out = {}
    for request in requests:
        for entry in reversed(entries):
            if not entry.requests or request in entry.requests:
                out[request] = entry.config
                break
    return out
