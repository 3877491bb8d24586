"""Node objects for emulated kubelets."""

from __future__ import annotations

from collections.abc import Mapping

from otel_dra.kube.client import ApiError, KubeClient
from otel_dra.kube.timestamps import format_time


def ensure_node(client: KubeClient, name: str, labels: Mapping[str, str] | None = None) -> None:
    """Create the Node if missing and report it Ready with room for pods.

    Ready is what kube-scheduler filters on; nothing in an emulated cluster runs the node-lifecycle
    controller, so no heartbeats are needed to keep it Ready.
    """
    node_labels = {"kubernetes.io/hostname": name, "kubernetes.io/os": "linux", **(labels or {})}
    try:
        client.send_json(
            "POST",
            "/api/v1/nodes",
            {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "labels": node_labels}},
        )
    except ApiError as exc:
        if exc.status != 409:
            raise
    now = format_time()
    resources = {"cpu": "64", "memory": "256Gi", "pods": "110"}
    status = {
        "status": {
            "conditions": [
                {
                    "type": "Ready",
                    "status": "True",
                    "reason": "KubeletReady",
                    "message": "otel-dra kubelet-sim is posting ready status",
                    "lastHeartbeatTime": now,
                    "lastTransitionTime": now,
                }
            ],
            "capacity": resources,
            "allocatable": resources,
            "nodeInfo": {"kubeletVersion": "otel-dra-kubelet-sim", "operatingSystem": "linux", "architecture": "amd64"},
        }
    }
    client.send_json("PATCH", f"/api/v1/nodes/{name}/status", status, "application/merge-patch+json")
