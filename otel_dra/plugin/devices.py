"""Devices as the plugin publishes them in its ResourceSlices, and the simulated GPU profile.

A device is kept in the JSON shape of ``resource.k8s.io/v1`` (``attributes{name: {string|int|bool|
version}}``, ``capacity{name: {value}}``) so that what is published is exactly what is compared
when deciding whether to publish again.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from dataclasses import field
from typing import Any

from otel_dra.records import record

# Limits of resource.k8s.io/v1 (v0.34.0) that a device source must respect.
MAX_ATTRIBUTES_AND_CAPACITIES = 32
MAX_STRING_ATTRIBUTE = 64

SIMULATED_MODEL = "LATEST-GPU-MODEL"
SIMULATED_DRIVER_VERSION = "1.0.0"
SIMULATED_MEMORY = "80Gi"
SIMULATED_COMPUTE = "100"
# Fixed namespace so that the simulated UUIDs are the same on every start for the same node.
_UUID_NAMESPACE = uuid.UUID("6f1b9c1e-3a52-4c1e-9b0e-6d1e0a7f5c21")


@record(frozen=True)
class Device:
    """One allocatable device: its name in the pool, attributes and capacity (API JSON shape)."""

    name: str
    attributes: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    capacity: Mapping[str, str] = field(default_factory=dict)  # name -> Kubernetes quantity

    def __post_init__(self) -> None:
        if len(self.attributes) + len(self.capacity) > MAX_ATTRIBUTES_AND_CAPACITIES:
            raise ValueError(f"device {self.name}: more than {MAX_ATTRIBUTES_AND_CAPACITIES} attributes+capacities")
        for key, value in self.attributes.items():
            text = value.get("string")
            if isinstance(text, str) and len(text) > MAX_STRING_ATTRIBUTE:
                raise ValueError(f"device {self.name}: attribute {key} is longer than {MAX_STRING_ATTRIBUTE}")

    def to_api(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name}
        if self.attributes:
            out["attributes"] = {k: dict(v) for k, v in self.attributes.items()}
        if self.capacity:
            out["capacity"] = {k: {"value": v} for k, v in self.capacity.items()}
        return out


def string(value: str) -> dict[str, Any]:
    return {"string": value}


def integer(value: int) -> dict[str, Any]:
    return {"int": value}


def boolean(value: bool) -> dict[str, Any]:
    return {"bool": value}


def version(value: str) -> dict[str, Any]:
    return {"version": value}


def semver(text: str) -> str:
    """A dotted version as strict semver: ``580.159.04`` -> ``580.159.4``, ``9.0`` -> ``9.0.0``.

    The API server rejects version attributes that are not semver 2.0, and NVIDIA driver versions
    have leading zeros.
    """
    parts = [p for p in text.strip().split(".") if p != ""]
    if not parts or len(parts) > 3 or not all(p.isdigit() for p in parts):
        raise ValueError(f"not a dotted numeric version: {text!r}")
    numbers = [str(int(p)) for p in parts] + ["0"] * (3 - len(parts))
    return ".".join(numbers)


def simulated_uuid(node_name: str, index: int) -> str:
    """Deterministic per node and index, like the example driver's generated GPU UUIDs."""
    return f"gpu-{uuid.uuid5(_UUID_NAMESPACE, f'{node_name}/{index}')}"


def simulated_devices(node_name: str, count: int) -> list[Device]:
    """The dra-example-driver profile: ``gpu-<i>`` with index, uuid, model and driverVersion
    attributes and 80Gi of memory and 100 compute units each."""
    return [
        Device(
            name=f"gpu-{i}",
            attributes={
                "index": integer(i),
                "uuid": string(simulated_uuid(node_name, i)),
                "model": string(SIMULATED_MODEL),
                "driverVersion": version(SIMULATED_DRIVER_VERSION),
            },
            capacity={"memory": SIMULATED_MEMORY, "compute": SIMULATED_COMPUTE},
        )
        for i in range(count)
    ]
