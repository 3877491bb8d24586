"""One pod scenario that the kubelet emulator and a real kubelet must drive the plugin through the
same way, and the record of what the plugin was called with.

The scenario: a ResourceClaim shared by two pods, each of which also has a claim of its own from a
ResourceClaimTemplate. Pod A starts, then pod B; A is deleted, then B. The kubelet prepares a claim
once per node however many pods use it (its claim info cache), and unprepares it with the last pod
that uses it, so the plugin sees four calls: prepare {a, shared}, prepare {b}, unprepare {a},
unprepare {b, shared}.

The record is the plugin's own traces, written by the plugin process with the console exporter
(``OTEL_TRACES_EXPORTER=console``): one SERVER span per RPC linked to the claims' spans, each
with the claim's UID and, for a prepare, the CDI device ids it returned (``dra.cdi.device_ids``).
Nothing between the kubelet (or the emulator) and the plugin is replaced.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from otel_dra.fixtures import create
from otel_dra.kube.client import ApiError, KubeClient

CLAIMS = "/apis/resource.k8s.io/v1/namespaces/{ns}/resourceclaims"

ROOT = Path(__file__).resolve().parents[2]

# (method, claim roles, normalized CDI ids) per RPC, in call order.
Call = tuple[str, tuple[str, ...], tuple[str, ...]]
# What every kubelet must make of the scenario (the CDI ids differ only in the devices allocated).
EXPECTED = [
    ("NodePrepareResources", ("a", "shared")),
    ("NodePrepareResources", ("b",)),
    ("NodeUnprepareResources", ("a",)),
    ("NodeUnprepareResources", ("b", "shared")),
]


class RecordingPlugin:
    """``otel-dra plugin`` as a process whose spans (console exporter, stdout) are the record."""

    def __init__(
        self,
        *,
        kubeconfig: Path | str,
        node: str,
        driver: str,
        cdi: Path,
        plugins: Path,
        registry: Path,
        out: Path,
        num_devices: int = 3,
    ) -> None:
        self.record, self.log = out / f"{node}-spans.json", out / f"{node}-plugin.log"
        env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
        env.update(
            PYTHONPATH=str(ROOT),
            OTEL_TRACES_EXPORTER="console",
            OTEL_TRACES_SAMPLER="always_on",
            OTEL_BSP_SCHEDULE_DELAY="100",
        )
        with self.record.open("wb") as stdout, self.log.open("wb") as stderr:
            self.proc = subprocess.Popen(
                [
                    sys.executable, "-m", "otel_dra", "plugin",
                    f"--node-name={node}", f"--driver-name={driver}", f"--kubeconfig={kubeconfig}",
                    f"--cdi-root={cdi}", f"--kubelet-plugins-directory-path={plugins}",
                    f"--kubelet-registrar-directory-path={registry}", f"--num-devices={num_devices}",
                ],
                stdin=subprocess.DEVNULL, stdout=stdout, stderr=stderr, env=env,
            )  # fmt: skip

    def stop(self) -> None:
        """SIGTERM: the plugin flushes its spans on the way out."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(timeout=30)


def _claim_spec(driver: str) -> dict[str, Any]:
    return {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": driver}}]}}


def _pod(name: str, namespace: str, node: str, own: str, shared: str, container: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "terminationGracePeriodSeconds": 1,
            # Placed by the scheduler (which allocates the claims), on this node only.
            "nodeSelector": {"kubernetes.io/hostname": node},
            "containers": [{**container, "resources": {"claims": [{"name": "own"}, {"name": "shared"}]}}],
            "resourceClaims": [
                {"name": "own", "resourceClaimTemplateName": own},
                {"name": "shared", "resourceClaimName": shared},
            ],
        },
    }


def _generated(client: KubeClient, namespace: str, pod: str) -> dict[str, Any]:
    status = client.get_json(f"/api/v1/namespaces/{namespace}/pods/{pod}")["status"]
    [own] = [s for s in status["resourceClaimStatuses"] if s["name"] == "own"]
    return client.get_json(f"{CLAIMS.format(ns=namespace)}/{own['resourceClaimName']}")


def run(
    client: KubeClient,
    *,
    namespace: str,
    node: str,
    driver: str,
    container: dict[str, Any],
    wait_running: Callable[[str], object],
    wait_gone: Callable[[str], object],
) -> dict[str, str]:
    """Run the scenario on ``node``; returns claim UID -> role ("a", "b", "shared")."""
    shared = f"shared-{node}"
    claim = create(
        client,
        {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaim",
            "metadata": {"name": shared, "namespace": namespace},
            "spec": _claim_spec(driver),
        },
    )
    roles = {claim["metadata"]["uid"]: "shared"}
    for role in ("a", "b"):
        create(
            client,
            {
                "apiVersion": "resource.k8s.io/v1",
                "kind": "ResourceClaimTemplate",
                "metadata": {"name": f"{role}-{node}", "namespace": namespace},
                "spec": {"spec": _claim_spec(driver)},
            },
        )
    try:
        for role in ("a", "b"):  # B only once A runs: the shared claim is prepared by then
            pod = f"p{role}-{node}"
            create(client, _pod(pod, namespace, node, f"{role}-{node}", shared, container))
            wait_running(pod)
            roles[_generated(client, namespace, pod)["metadata"]["uid"]] = role
        for role in ("a", "b"):
            pod = f"p{role}-{node}"
            client.send_json("DELETE", f"/api/v1/namespaces/{namespace}/pods/{pod}", {})
            wait_gone(pod)
    finally:
        for path in (
            f"{CLAIMS.format(ns=namespace)}/{shared}",
            f"/apis/resource.k8s.io/v1/namespaces/{namespace}/resourceclaimtemplates/a-{node}",
            f"/apis/resource.k8s.io/v1/namespaces/{namespace}/resourceclaimtemplates/b-{node}",
        ):
            try:
                client.request("DELETE", path)
            except ApiError as exc:
                if exc.status != 404:
                    raise
    return roles


def spans(text: str) -> list[dict[str, Any]]:
    """The spans the console exporter wrote (one JSON object each, pretty-printed)."""
    decoder, out, i = json.JSONDecoder(), [], 0
    while True:
        start = text.find("{", i)
        if start < 0:
            return out
        obj, i = decoder.raw_decode(text, start)
        out.append(obj)


def calls(record: Path, roles: dict[str, str]) -> list[Call]:
    """The plugin's Node(Un)PrepareResources calls that named the scenario's claims, in order."""
    found = spans(record.read_text())
    children: dict[str, list[dict[str, Any]]] = {}
    by_id: dict[str, dict[str, Any]] = {}
    for span in found:
        by_id[span["context"]["span_id"]] = span
        if span.get("parent_id"):
            children.setdefault(span["parent_id"], []).append(span)
    out = []
    for rpc in sorted((s for s in found if s["kind"] == "SpanKind.SERVER"), key=lambda s: s["start_time"]):
        method = rpc["name"].rsplit("/", 1)[-1]
        # A claim's span is in the claim's own trace, linked from the RPC's (a UID that is not a
        # UUID: the RPC's child).
        linked = [by_id.get(link["context"]["span_id"]) for link in rpc.get("links") or ()]
        claims = [
            c
            for c in [*children.get(rpc["context"]["span_id"], ()), *linked]
            if c is not None and c["name"].endswith(" claim")
        ]
        uids = [c["attributes"]["dra.claim.uid"] for c in claims]
        if not any(uid in roles for uid in uids):
            continue  # another test's claims
        ids = []
        for c in claims:
            for cdi_id in c["attributes"].get("dra.cdi.device_ids", ()):
                for uid, role in roles.items():
                    cdi_id = cdi_id.replace(f"={uid}-", f"={role}-")
                ids.append(cdi_id)
        out.append((method, tuple(sorted(roles.get(u, u) for u in uids)), tuple(sorted(ids))))
    return out
