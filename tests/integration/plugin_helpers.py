"""Helpers for the plugin tests: a stand-in for the kubelet's side of the plugin sockets (the
generated client stubs over the real unix sockets), claims written as the scheduler would, and
metric/span readers."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from otel_dra._generated.dra.v1 import api_pb2 as dra_v1
from otel_dra._generated.dra.v1 import api_pb2_grpc as dra_v1_grpc
from otel_dra._generated.dra.v1beta1 import api_pb2 as dra_v1beta1
from otel_dra._generated.dra.v1beta1 import api_pb2_grpc as dra_v1beta1_grpc
from otel_dra._generated.pluginregistration import api_pb2 as reg_pb2
from otel_dra._generated.pluginregistration import api_pb2_grpc as reg_grpc
from otel_dra.kube.client import ApiError, KubeClient
from tests.helpers import parse_samples, scrape, wait_until

DRIVER = "gpu.example.com"
CLAIMS = "/apis/resource.k8s.io/v1/namespaces/{ns}/resourceclaims"
SLICES = "/apis/resource.k8s.io/v1/resourceslices"


@dataclass(frozen=True)
class Dirs:
    root: Path

    @property
    def plugins(self) -> Path:
        return self.root / "plugins"

    @property
    def registry(self) -> Path:
        return self.root / "registry"

    @property
    def cdi(self) -> Path:
        return self.root / "cdi"

    @property
    def dra_socket(self) -> Path:
        return self.plugins / DRIVER / "dra.sock"

    @property
    def registration_socket(self) -> Path:
        return self.registry / f"{DRIVER}-reg.sock"

    @property
    def checkpoint(self) -> Path:
        return self.plugins / DRIVER / "checkpoint.json"

    def cdi_spec(self, uid: str) -> Path:
        return self.cdi / f"k8s.{DRIVER}-gpu_{uid}.json"


class Kubelet:
    """The kubelet's calls to a plugin, over its real sockets."""

    def __init__(self, dirs: Dirs) -> None:
        self._reg_channel = grpc.insecure_channel(f"unix://{dirs.registration_socket}")
        self._dra_channel = grpc.insecure_channel(f"unix://{dirs.dra_socket}")
        self.registration = reg_grpc.RegistrationStub(self._reg_channel)
        self.v1 = dra_v1_grpc.DRAPluginStub(self._dra_channel)
        self.v1beta1 = dra_v1beta1_grpc.DRAPluginStub(self._dra_channel)

    def get_info(self) -> reg_pb2.PluginInfo:
        return self.registration.GetInfo(reg_pb2.InfoRequest(), timeout=10)

    def notify(self, registered: bool, error: str = "") -> None:
        self.registration.NotifyRegistrationStatus(
            reg_pb2.RegistrationStatus(plugin_registered=registered, error=error), timeout=10
        )

    def prepare(self, claims: list[tuple[str, str, str]], *, version: str = "v1", traceparent: str = "") -> Any:
        pb2, stub = (dra_v1, self.v1) if version == "v1" else (dra_v1beta1, self.v1beta1)
        request = pb2.NodePrepareResourcesRequest(
            claims=[pb2.Claim(namespace=ns, uid=uid, name=name) for ns, uid, name in claims]
        )
        metadata = [("traceparent", traceparent)] if traceparent else None
        return stub.NodePrepareResources(request, timeout=30, metadata=metadata)

    def unprepare(self, claims: list[tuple[str, str, str]], *, version: str = "v1") -> Any:
        pb2, stub = (dra_v1, self.v1) if version == "v1" else (dra_v1beta1, self.v1beta1)
        request = pb2.NodeUnprepareResourcesRequest(
            claims=[pb2.Claim(namespace=ns, uid=uid, name=name) for ns, uid, name in claims]
        )
        return stub.NodeUnprepareResources(request, timeout=30)

    def close(self) -> None:
        self._reg_channel.close()
        self._dra_channel.close()


def ensure_namespace(admin: KubeClient, name: str, labels: dict[str, str] | None = None) -> None:
    try:
        admin.send_json("POST", "/api/v1/namespaces", {"metadata": {"name": name, "labels": labels or {}}})
    except ApiError as exc:
        if exc.status != 409:
            raise


def make_claim(
    admin: KubeClient,
    namespace: str,
    name: str,
    results: list[dict[str, Any]] | None = None,
    config: list[dict[str, Any]] | None = None,
    requests: list[dict[str, Any]] | None = None,
    node: str | None = None,
) -> dict[str, Any]:
    """A ResourceClaim, allocated to ``results`` (with the device ``config`` entries, if any)
    through the status subresource (what the scheduler writes) unless None; ``node``: the
    allocation's node selector names that node, as the scheduler's for node-local devices."""
    body = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"devices": {"requests": requests or [{"name": "gpu", "exactly": {"deviceClassName": DRIVER}}]}},
    }
    obj: dict[str, Any] = admin.send_json("POST", CLAIMS.format(ns=namespace), body)
    if results is not None:
        devices: dict[str, Any] = {"results": results}
        if config is not None:
            devices["config"] = config
        obj["status"] = {"allocation": {"devices": devices}}
        if node is not None:
            term = {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [node]}]}
            obj["status"]["allocation"]["nodeSelector"] = {"nodeSelectorTerms": [term]}
        obj = admin.send_json("PUT", f"{CLAIMS.format(ns=namespace)}/{name}/status", obj)

        # As a kubelet, which calls prepare only once it has seen the claim allocated: the plugin
        # reads the claim from the watch cache first (a lagging cache costs it a second read,
        # which would make the tests' GET counts and spans depend on timing).
        def cached() -> bool:
            try:
                seen = admin.get_json(f"{CLAIMS.format(ns=namespace)}/{name}", {"resourceVersion": "0"})
            except ApiError:
                return False
            return seen["metadata"]["uid"] == obj["metadata"]["uid"] and bool(
                (seen.get("status") or {}).get("allocation")
            )

        wait_until(cached, timeout=10, interval=0.01, what=f"claim {name} allocated in the watch cache")
    return obj


def result(node: str, device: str, driver: str = DRIVER, request: str = "gpu") -> dict[str, str]:
    return {"request": request, "driver": driver, "pool": node, "device": device}


def ref(claim: dict[str, Any]) -> tuple[str, str, str]:
    meta = claim["metadata"]
    return (meta["namespace"], meta["uid"], meta["name"])


def own_slices(admin: KubeClient, node: str, driver: str = DRIVER) -> list[dict[str, Any]]:
    selector = f"spec.nodeName={node},spec.driver={driver}"
    items = admin.get_json(SLICES, {"fieldSelector": selector})["items"]
    return sorted(items, key=lambda s: s["metadata"]["name"])


def metric(port: int, name: str, **labels: str) -> float | None:
    """One sample's value (None when absent)."""
    code, text = scrape(port)
    assert code == 200, text
    for n, lab, value in parse_samples(text):
        if n == name and all(lab.get(k) == v for k, v in labels.items()):
            return value
    return None


def read_checkpoint(dirs: Dirs) -> dict[str, Any]:
    return json.loads(dirs.checkpoint.read_text())["claims"]
