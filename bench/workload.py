"""Synthetic DRA cluster state for benchmarks, loaded into a real API server with concurrent creates.

Shape (per N claims): N/10 ResourceSlices of 8 NVIDIA-shaped GPUs (type, uuid, productName,
architecture; capacity memory, multiprocessors, decoders), `classes` DeviceClasses with an
hourly-cost annotation, and N ResourceClaims spread over `namespaces` namespaces, each allocated
one device and reserved by one pod (a status.reservedFor entry).

With ``pods`` (issue 13: the exporter watches pods by default) that pod exists too: one Pod per
claim, bound to the node of the claim's device (spec.nodeName; the bench testbed runs no scheduler
and no kubelet), with a container the size of a real one (image, command, env, resources, probes,
a projected service-account volume) whose resources.claims name the claim entry, and a Running
status written through pods/status whose allocatedResourcesStatus reports the device Healthy as
the kubelet does from 1.36 on. Every TEMPLATE_EVERY-th pod refers to its claim through a
ResourceClaimTemplate (status.resourceClaimStatuses names the claim, which then carries the
annotation and controller owner reference the resourceclaim controller sets); the others name it
with resourceClaimName. Pods are created first, so that each claim's reservedFor carries its pod's
real uid. Without ``pods`` the objects are those of the earlier runs, byte for byte.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from otel_dra.fixtures import collection_path, create, object_path
from otel_dra.kube.client import ApiError, KubeClient

DRIVER = "gpu.nvidia.com"


@dataclass(frozen=True)
class Workload:
    claims: int
    namespaces: int = 10
    classes: int = 20
    devices_per_slice: int = 8
    pods: bool = False

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

    def expected_pod_series(self) -> int:
        """Samples of the two pod families: one claim entry and one device health per pod."""
        return 2 * self.claims if self.pods else 0


# Every TEMPLATE_EVERY-th pod (j % TEMPLATE_EVERY == 0) gets its claim from a ResourceClaimTemplate.
TEMPLATE_EVERY = 4
POD_CLAIM_ANNOTATION = "resource.kubernetes.io/pod-claim-name"


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


def placement(j: int, w: Workload) -> tuple[str, str]:
    """(pool, device) of claim ``j``'s allocation; the pool is the node's name."""
    return f"node-{j % w.slices:05d}", f"gpu-{(j // w.slices) % w.devices_per_slice}"


def templated(j: int) -> bool:
    return j % TEMPLATE_EVERY == 0


def pod_name(j: int, generation: int = 0) -> str:
    return f"pod-{j:06d}-{generation}"


def claim(j: int, w: Workload, generation: int = 0, pod_uid: str | None = None) -> dict[str, Any]:
    """Claim ``j``, reserved by pod ``j``; ``pod_uid``: that pod exists with this uid (``--pods``),
    and a templated claim carries what the resourceclaim controller sets on the claims it makes."""
    slice_index = j % w.slices
    device = (j // w.slices) % w.devices_per_slice
    metadata: dict[str, Any] = {"name": f"claim-{j:06d}", "namespace": f"bench-{j % w.namespaces:03d}"}
    if pod_uid is not None and templated(j):
        metadata["annotations"] = {POD_CLAIM_ANNOTATION: "gpu"}
        metadata["ownerReferences"] = [
            {
                "apiVersion": "v1",
                "kind": "Pod",
                "name": pod_name(j, generation),
                "uid": pod_uid,
                "controller": True,
                "blockOwnerDeletion": True,
            }
        ]
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": metadata,
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
                    "name": pod_name(j, generation),
                    "uid": pod_uid or str(uuid.UUID(int=j * 1000 + generation)),
                }
            ],
        },
    }


def pod(j: int, w: Workload) -> dict[str, Any]:
    """Pod ``j``: bound to the node of claim ``j``'s device, running, its device reported Healthy.

    The body is about what a real training pod carries (the API server adds managedFields and
    the defaults); status is written separately, through pods/status."""
    pool, device = placement(j, w)
    name, ns = pod_name(j), f"bench-{j % w.namespaces:03d}"
    entry: dict[str, Any] = {"name": "gpu"}
    if templated(j):
        entry["resourceClaimTemplateName"] = "one-gpu"
    else:
        entry["resourceClaimName"] = f"claim-{j:06d}"
    job = f"train-{j // 8:05d}"
    image = "nvcr.io/nvidia/pytorch:25.10-py3"
    resources = {"cpu": "8", "memory": "64Gi"}
    spec: dict[str, Any] = {
        "nodeName": pool,
        "restartPolicy": "Never",
        "terminationGracePeriodSeconds": 30,
        "serviceAccountName": "default",
        "priorityClassName": "",
        "tolerations": [
            {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},
            {
                "key": "node.kubernetes.io/not-ready",
                "operator": "Exists",
                "effect": "NoExecute",
                "tolerationSeconds": 300,
            },
        ],
        "resourceClaims": [entry],
        "containers": [
            {
                "name": "trainer",
                "image": image,
                "command": ["torchrun"],
                "args": ["--nproc-per-node=1", "/workspace/train.py", "--config=/workspace/configs/base.yaml"],
                "env": [
                    {"name": "JOB_NAME", "value": job},
                    {"name": "NCCL_DEBUG", "value": "WARN"},
                    {"name": "OMP_NUM_THREADS", "value": "8"},
                    {"name": "CHECKPOINT_DIR", "value": f"/checkpoints/{job}"},
                    {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
                ],
                "ports": [{"name": "metrics", "containerPort": 9400, "protocol": "TCP"}],
                "resources": {
                    "requests": resources,
                    "limits": resources,
                    "claims": [{"name": "gpu", "request": "gpu"}],
                },
                "readinessProbe": {"httpGet": {"path": "/healthz", "port": 9400}, "periodSeconds": 10},
                "volumeMounts": [
                    {"name": "checkpoints", "mountPath": "/checkpoints"},
                    {
                        "name": "kube-api-access",
                        "mountPath": "/var/run/secrets/kubernetes.io/serviceaccount",
                        "readOnly": True,
                    },
                ],
            }
        ],
        "volumes": [
            {"name": "checkpoints", "emptyDir": {}},
            {
                "name": "kube-api-access",
                "projected": {
                    "defaultMode": 420,
                    "sources": [
                        {"serviceAccountToken": {"expirationSeconds": 3607, "path": "token"}},
                        {"configMap": {"name": "kube-root-ca.crt", "items": [{"key": "ca.crt", "path": "ca.crt"}]}},
                        {
                            "downwardAPI": {
                                "items": [
                                    {
                                        "path": "namespace",
                                        "fieldRef": {"apiVersion": "v1", "fieldPath": "metadata.namespace"},
                                    }
                                ]
                            }
                        },
                    ],
                },
            },
        ],
    }
    started = "2026-11-01T00:00:05Z"
    status: dict[str, Any] = {
        "phase": "Running",
        "qosClass": "Guaranteed",
        "hostIP": f"10.0.{j % w.slices // 250}.{j % w.slices % 250 + 1}",
        "podIP": f"10.{64 + j // 65536}.{j // 256 % 256}.{j % 256}",
        "startTime": "2026-11-01T00:00:01Z",
        "conditions": [
            {"type": t, "status": "True", "lastTransitionTime": started}
            for t in ("PodReadyToStartContainers", "Initialized", "Ready", "ContainersReady", "PodScheduled")
        ],
        "containerStatuses": [
            {
                "name": "trainer",
                "image": image,
                "imageID": "nvcr.io/nvidia/pytorch@sha256:" + f"{j:064x}",
                "containerID": "containerd://" + uuid.UUID(int=j).hex * 2,
                "ready": True,
                "started": True,
                "restartCount": 0,
                "state": {"running": {"startedAt": started}},
                "allocatedResourcesStatus": [
                    {
                        "name": "claim:gpu/gpu",
                        "resources": [{"resourceID": f"{DRIVER}/{pool}/{device}", "health": "Healthy"}],
                    }
                ],
            }
        ],
    }
    if templated(j):
        status["resourceClaimStatuses"] = [{"name": "gpu", "resourceClaimName": f"claim-{j:06d}"}]
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": ns,
            "labels": {"app.kubernetes.io/name": "trainer", "job-name": job, "team": f"team-{j % 7}"},
            "annotations": {"prometheus.io/scrape": "true", "prometheus.io/port": "9400"},
        },
        "spec": spec,
        "status": status,
    }


def objects(w: Workload) -> Iterator[dict[str, Any]]:
    yield from (namespace(i) for i in range(w.namespaces))
    yield from (device_class(i) for i in range(w.classes))
    yield from (resource_slice(i, w) for i in range(w.slices))
    yield from (claim(j, w) for j in range(w.claims))
    if w.pods:
        yield from (pod(j, w) for j in range(w.claims))


def load(client: KubeClient, w: Workload, concurrency: int = 16, times: dict[str, float] | None = None) -> float:
    """Create the workload; returns seconds taken. Namespaces go first, in order. With ``w.pods``
    the pods go before the claims (a claim's reservedFor names its pod's uid); ``times`` gets the
    seconds each step took (``pods_s``, ``claims_s``; ``other_s``: classes and slices)."""
    times = {} if times is None else times
    start = time.monotonic()
    if not w.pods:
        items = list(objects(w))
        for obj in (o for o in items if o["kind"] == "Namespace"):
            _create_ok(client, obj)
        rest = [o for o in items if o["kind"] != "Namespace"]
        with ThreadPoolExecutor(concurrency) as pool:
            for _ in pool.map(lambda o: _create_ok(client, o), rest, chunksize=64):
                pass
        return time.monotonic() - start
    for i in range(w.namespaces):
        _create_ok(client, namespace(i))
    others = [*(device_class(i) for i in range(w.classes)), *(resource_slice(i, w) for i in range(w.slices))]
    with ThreadPoolExecutor(concurrency) as pool:
        for _ in pool.map(lambda o: _create_ok(client, o), others, chunksize=64):
            pass
        mark = time.monotonic()
        times["other_s"] = mark - start
        uids = list(pool.map(lambda j: _create_ok(client, pod(j, w)), range(w.claims), chunksize=64))
        times["pods_s"] = time.monotonic() - mark
        mark = time.monotonic()
        claims = (claim(j, w, pod_uid=uids[j]) for j in range(w.claims))
        for _ in pool.map(lambda o: _create_ok(client, o), claims, chunksize=64):
            pass
        times["claims_s"] = time.monotonic() - mark
    return time.monotonic() - start


def _create_ok(client: KubeClient, obj: dict[str, Any]) -> str:
    """Create ``obj`` (retrying transient errors); returns its uid (that of the existing object on 409)."""
    for attempt in range(5):
        try:
            return str(create(client, obj)["metadata"]["uid"])
        except ApiError as exc:
            if exc.status == 409:
                if obj["kind"] != "Pod":
                    return ""
                return str(client.get_json(object_path(obj))["metadata"]["uid"])
            if exc.status in (0, 429, 500, 503, 504) and attempt < 4:
                time.sleep(0.2 * 2**attempt)
                continue
            raise RuntimeError(f"creating {collection_path(obj)}/{obj['metadata']['name']}: {exc}") from exc
