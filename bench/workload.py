"""Synthetic DRA cluster state for benchmarks, loaded into a real API server with concurrent creates.

Shape (per N claims): N/10 ResourceSlices of 8 NVIDIA-shaped GPUs (type, uuid, productName,
architecture; capacity memory, multiprocessors, decoders), `classes` DeviceClasses with an
hourly-cost annotation, and N ResourceClaims spread over `namespaces` namespaces, each allocated
one device and reserved by one pod (a status.reservedFor entry; the exporter never reads Pods, so
Pod objects are not created).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from otel_dra.fixtures import collection_path, create
from otel_dra.kube.client import ApiError, KubeClient

DRIVER = "gpu.nvidia.com"


@dataclass(frozen=True)
class Workload:
    claims: int
    namespaces: int = 10
    classes: int = 20
    devices_per_slice: int = 8

    @property
    def slices(self) -> int:
        return max(1, self.claims // 10)

    @property
    def devices(self) -> int:
        return self.slices * self.devices_per_slice

    def expected_series(self) -> int:
        """Samples of the seven seed families this workload produces."""
        # allocated_device + reserved_for_pod + reserved_total per claim; 3 capacities per device.
        return 3 * self.claims + 3 * self.devices + self.classes


def namespace(i: int) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": f"bench-{i:03d}"}}


def device_class(i: int) -> dict[str, Any]:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "DeviceClass",
        "metadata": {"name": f"gpu-{i:02d}.bench.example.com", "annotations": {"hourly-cost": f"{1 + i / 4:.2f}"}},
        "spec": {"selectors": [{"cel": {"expression": f"device.driver == '{DRIVER}'"}}]},
    }


def resource_slice(i: int, w: Workload) -> dict[str, Any]:
    node = f"node-{i:05d}"
    devices = []
    for d in range(w.devices_per_slice):
        devices.append(
            {
                "name": f"gpu-{d}",
                "attributes": {
                    "type": {"string": "gpu"},
                    "uuid": {"string": f"GPU-{uuid.UUID(int=i * 64 + d)}"},
                    "productName": {"string": "NVIDIA H200"},
                    "architecture": {"string": "Hopper"},
                    "cudaComputeCapability": {"version": "9.0.0"},
                    "driverVersion": {"version": "580.159.4"},
                },
                "capacity": {
                    "memory": {"value": "150754820096"},
                    "multiprocessors": {"value": "132"},
                    "decoders": {"value": "7"},
                },
            }
        )
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": f"{node}-{DRIVER}"},
        "spec": {
            "driver": DRIVER,
            "nodeName": node,
            "pool": {"name": node, "generation": 1, "resourceSliceCount": 1},
            "devices": devices,
        },
    }


def claim(j: int, w: Workload, generation: int = 0) -> dict[str, Any]:
    slice_index = j % w.slices
    device = (j // w.slices) % w.devices_per_slice
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": f"claim-{j:06d}", "namespace": f"bench-{j % w.namespaces:03d}"},
        "spec": {
            "devices": {
                "requests": [
                    {"name": "gpu", "exactly": {"deviceClassName": f"gpu-{j % w.classes:02d}.bench.example.com"}}
                ]
            }
        },
        "status": {
            "allocation": {
                # Set by the scheduler when the DRADeviceBindingConditions feature is on.
                "allocationTimestamp": "2026-11-01T00:00:00Z",
                "devices": {
                    "results": [
                        {
                            "request": "gpu",
                            "driver": DRIVER,
                            "pool": f"node-{slice_index:05d}",
                            "device": f"gpu-{device}",
                        }
                    ]
                },
            },
            "reservedFor": [
                {
                    "resource": "pods",
                    "name": f"pod-{j:06d}-{generation}",
                    "uid": str(uuid.UUID(int=j * 1000 + generation)),
                }
            ],
        },
    }


def objects(w: Workload) -> Iterator[dict[str, Any]]:
    yield from (namespace(i) for i in range(w.namespaces))
    yield from (device_class(i) for i in range(w.classes))
    yield from (resource_slice(i, w) for i in range(w.slices))
    yield from (claim(j, w) for j in range(w.claims))


def load(client: KubeClient, w: Workload, concurrency: int = 16) -> float:
    """Create the workload; returns seconds taken. Namespaces and classes go first, in order."""
    start = time.monotonic()
    items = list(objects(w))
    ordered = [o for o in items if o["kind"] == "Namespace"]
    for obj in ordered:
        _create_ok(client, obj)
    rest = [o for o in items if o["kind"] != "Namespace"]
    with ThreadPoolExecutor(concurrency) as pool:
        for _ in pool.map(lambda o: _create_ok(client, o), rest, chunksize=64):
            pass
    return time.monotonic() - start


def _create_ok(client: KubeClient, obj: dict[str, Any]) -> None:
    for attempt in range(5):
        try:
            create(client, obj)
            return
        except ApiError as exc:
            if exc.status == 409:
                return
            if exc.status in (0, 429, 500, 503, 504) and attempt < 4:
                time.sleep(0.2 * 2**attempt)
                continue
            raise RuntimeError(f"creating {collection_path(obj)}/{obj['metadata']['name']}: {exc}") from exc
