"""Device health end to end on the real node (issue 14, "done when"): the kubelet reads the
plugin's DRAResourceHealth stream and writes it into the pod's allocatedResourcesStatus; a sick
device is tainted in the ResourceSlice, the real scheduler stops allocating it, the exporter
reports the taint and the pod's device health; all of it recovers; the kubelet logs no
health-related error for our plugin.

The simulated devices are made sick the documented way: a file ``<plugins>/<driver>/health/<device>``.
Marked ``node``; run it under ``flock /tmp/otel-dra-node.flock``.
"""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

import pytest

from otel_dra.kube.client import KubeClient, load_credentials
from otel_dra.testbed import Testbed
from otel_dra.testbed.node import Node, restart_kubelet
from tests.helpers import parse_samples, scrape, wait_until
from tests.integration import test_node
from tests.integration.nodes import HostPlugin, kubelet_log_size, node_slices, start_plugin, wait_running
from tests.integration.test_node import (
    DRIVER,
    NAMESPACE,
    _claim_pod,
    _delete_and_check_unprepared,
    _generated_claim,
)

# test_node's fixtures, for this module: its own node testbed (module scope), the plugins it starts.
node_support = test_node.node_support
node_testbed = test_node.node_testbed
host_plugin = test_node.host_plugin

pytestmark = [
    pytest.mark.node,
    pytest.mark.testbed,
    pytest.mark.kubernetes(min="1.36", reason="ResourceHealthStatus is beta and on from 1.36"),
]

TAINT_KEY = f"{DRIVER}/unhealthy"
SICK = "unhealthy: XID 79 (simulated): GPU has fallen off the bus"
# What the kubelet logs at error level (klog "E<mmdd>") about health streams and its health cache.
# The messages of pkg/kubelet/cm/dra (manager.go, healthinfo.go, plugin/) in v1.37.2; not just
# "health": pod names like health-b are in unrelated errors (cgroup reads of a starting pod).
_HEALTH_ERROR = re.compile(
    r"^E\d{4} .*(WatchResources|health info|health checkpoint|health update|[Hh]ealth stream|dra-healthinfo)", re.M
)


def _resources_status(client: KubeClient, pod: str, container: str = "with-gpu") -> list[dict[str, Any]]:
    status = client.get_json(f"/api/v1/namespaces/{NAMESPACE}/pods/{pod}")["status"]
    for c in status.get("containerStatuses") or []:
        if c["name"] == container:
            return list(c.get("allocatedResourcesStatus") or [])
    return []


def _device_health(client: KubeClient, pod: str) -> tuple[str, str] | None:
    """(health, message) of the one device of the pod's claim "gpu", as the kubelet wrote it."""
    entries = [e for e in _resources_status(client, pod) if e["name"] == "claim:gpu"]
    if len(entries) != 1 or len(entries[0].get("resources") or []) != 1:
        return None
    [resource] = entries[0]["resources"]
    return resource["health"], resource.get("message", "")


def _taints(client: KubeClient, node: Node) -> dict[str, list[tuple[str, str, str]]]:
    out: dict[str, list[tuple[str, str, str]]] = {}
    for s in node_slices(client, node):
        for d in s["spec"].get("devices") or []:
            if d.get("taints"):
                out[d["name"]] = [(t["key"], t.get("value", ""), t["effect"]) for t in d["taints"]]
    return out


# What the kubelet logs (-v=2; 1.34 to 1.38) when a plugin's health stream ends
# (pkg/kubelet/cm/dra/plugin, V(2)) and when it starts unregistering a plugin whose registration
# socket is gone (pkg/kubelet/pluginmanager/reconciler, V(1)): from then on no retry of the stream.
_STREAM_ENDED = '"WatchResources health stream has ended"'
_UNREGISTER_STARTED = '"OperationExecutor.UnregisterPlugin started"'


def _kubelet_log_since(node: Node, offset: int) -> str:
    with node.kubelet_log.open("rb") as log:
        log.seek(offset)
        return log.read().decode(errors="replace")


def _health_file(node: Node, device: str) -> Path:
    return node.plugins_dir / DRIVER / "health" / device


def _series(port: int, name: str) -> list[dict[str, str]]:
    code, text = scrape(port)
    assert code == 200
    return [labels for n, labels, value in parse_samples(text) if n == name and value == 1]


def test_device_health_reaches_the_pod_taints_the_slice_and_recovers(
    node_testbed: tuple[Testbed, Node], host_plugin: list[HostPlugin], tmp_path: Path, start_exporter_app: Any
) -> None:
    testbed, node = node_testbed
    client = KubeClient(load_credentials(str(testbed.kubeconfig)))
    offset = kubelet_log_size(node)
    plugin = start_plugin(testbed, node, host_plugin, tmp_path / "plugin.log")
    exporter = start_exporter_app(str(testbed.kubeconfig))
    started = time.monotonic()

    _claim_pod(client, "health-a")
    wait_running(client, "health-a", node)
    claim = _generated_claim(client, "health-a")
    [result] = claim["status"]["allocation"]["devices"]["results"]
    used = result["device"]
    [free] = {"gpu-0", "gpu-1"} - {used}
    wait_until(lambda: _device_health(client, "health-a") == ("Healthy", ""), timeout=60, what="Healthy in pod status")
    [entry] = [e for e in _resources_status(client, "health-a") if e["name"] == "claim:gpu"]
    # The kubelet names the device by its first CDI ID: the claim's own one for that device.
    assert entry["resources"][0]["resourceID"] == f"k8s.{DRIVER}/gpu={claim['metadata']['uid']}-{used}"
    healthy_after = time.monotonic() - started

    # Both devices sick: the one in use, and the free one.
    sick_at = time.monotonic()
    _health_file(node, used).write_text(SICK + "\n")
    _health_file(node, free).write_text("")
    message = SICK.removeprefix("unhealthy: ")
    wait_until(
        lambda: _device_health(client, "health-a") == ("Unhealthy", message), timeout=30, what="Unhealthy in pod status"
    )
    unhealthy_after = time.monotonic() - sick_at
    wait_until(
        lambda: (
            _taints(client, node)
            == {used: [(TAINT_KEY, "simulated", "NoSchedule")], free: [(TAINT_KEY, "simulated", "NoSchedule")]}
        ),
        timeout=30,
        what="both devices tainted",
    )
    wait_until(
        lambda: (
            {
                (s["device_name"], s["key"], s["effect"])
                for s in _series(exporter.port, "kube_resourceslice_device_taint")
            }
            >= {(used, TAINT_KEY, "NoSchedule"), (free, TAINT_KEY, "NoSchedule")}
        ),
        timeout=30,
        what="the exporter's kube_resourceslice_device_taint",
    )
    # The kubelet's view, as the exporter reads it from pod status: named by the CDI ID, joined by claim.
    cdi_id = f"k8s.{DRIVER}/gpu={claim['metadata']['uid']}-{used}"
    wait_until(
        lambda: (
            [
                (s["resourceclaim_name"], s["resource_id"], s["health"], s["device_name"])
                for s in _series(exporter.port, "kube_pod_resourceclaim_device_health")
                if s["pod"] == "health-a"
            ]
            == [(claim["metadata"]["name"], cdi_id, "Unhealthy", "")]
        ),
        timeout=30,
        what="the exporter's kube_pod_resourceclaim_device_health Unhealthy",
    )

    # A new claim: the only free device is tainted, so the real scheduler allocates nothing. It says
    # so once it has tried (PodScheduled False, reason Unschedulable), which it does only once the
    # claim controller has made the pod's claim (named in the pod's status).
    _claim_pod(client, "health-b")

    def scheduler_refused() -> dict[str, Any] | None:
        pod = client.get_json(f"/api/v1/namespaces/{NAMESPACE}/pods/health-b")
        conditions = {c["type"]: c for c in pod["status"].get("conditions") or []}
        tried = conditions.get("PodScheduled", {}).get("reason") == "Unschedulable"
        return pod if tried and pod["status"].get("resourceClaimStatuses") else None

    pod_b = wait_until(scheduler_refused, timeout=30, what="the scheduler to refuse health-b")
    assert pod_b["status"].get("phase") == "Pending"
    scheduled = {c["type"]: c for c in pod_b["status"].get("conditions") or []}.get("PodScheduled", {})
    assert scheduled.get("status") == "False" and scheduled.get("reason") == "Unschedulable", pod_b["status"]
    claims_b = client.get_json(f"/apis/resource.k8s.io/v1/namespaces/{NAMESPACE}/resourceclaims")["items"]
    [claim_b] = [c for c in claims_b if c["metadata"]["name"].startswith("health-b")]
    assert not (claim_b.get("status") or {}).get("allocation")

    # Recovery: the files go, the pod reads Healthy again, the taints go, the waiting pod gets the device.
    recover_at = time.monotonic()
    _health_file(node, used).unlink()
    _health_file(node, free).unlink()
    wait_until(lambda: _device_health(client, "health-a") == ("Healthy", ""), timeout=30, what="Healthy again")
    recovered_after = time.monotonic() - recover_at
    wait_until(lambda: _taints(client, node) == {}, timeout=30, what="taints removed")
    wait_running(client, "health-b", node)
    assert _generated_claim(client, "health-b")["status"]["allocation"]["devices"]["results"][0]["device"] == free
    wait_until(lambda: _device_health(client, "health-b") == ("Healthy", ""), timeout=60, what="health-b Healthy")
    wait_until(
        lambda: not [s for s in _series(exporter.port, "kube_resourceslice_device_taint") if s["key"] == TAINT_KEY],
        timeout=30,
        what="the exporter's taint series gone",
    )

    for pod in ("health-a", "health-b"):
        _delete_and_check_unprepared(client, node, pod, _generated_claim(client, pod))
    stopped_at = kubelet_log_size(node)
    plugin.kill()  # a clean stop: the plugin unregisters, then ends the stream with EOF
    # An error about the stream's end would be logged with its end; a retry (the kubelet's comes
    # 5 s after a stream ended) only while the plugin is registered. Both are settled once the
    # kubelet has logged the stream's end and the plugin's unregistration.
    wait_until(
        lambda: all(line in _kubelet_log_since(node, stopped_at) for line in (_STREAM_ENDED, _UNREGISTER_STARTED)),
        timeout=30,
        what="the kubelet to log the stream's end and the plugin's unregistration",
    )
    kubelet_log = _kubelet_log_since(node, offset)
    assert "Successfully started WatchResources health stream" in kubelet_log  # -v=2
    errors = _HEALTH_ERROR.findall(kubelet_log)
    assert not errors, "\n".join(line for line in kubelet_log.splitlines() if _HEALTH_ERROR.match(line))
    print(
        f"\nHealthy in pod status {healthy_after:.1f}s after the pod's creation; Unhealthy {unhealthy_after:.1f}s "
        f"after the file was written; Healthy again {recovered_after:.1f}s after it was removed"
    )


def _new_kubelet_log(node: Node, offset: int) -> str:
    """The log of the kubelet started after ``offset``: from its start banner on. The old kubelet's
    last lines come before it, and they rightly include its own stream ending on shutdown ("Error
    receiving from WatchResources stream ... context canceled"), which is not the new stream's error."""
    with node.kubelet_log.open("rb") as log:
        log.seek(offset)
        text = log.read().decode(errors="replace")
    start = text.find('"Kubelet version"')
    return text[start:] if start >= 0 else ""


def test_a_restarted_kubelet_watches_health_again(
    node_testbed: tuple[Testbed, Node], host_plugin: list[HostPlugin], tmp_path: Path
) -> None:
    """The plugin keeps its stream state across a kubelet restart: the new kubelet opens a new
    stream by itself, and a device made sick afterwards reaches the pod as before."""
    testbed, node = node_testbed
    client = KubeClient(load_credentials(str(testbed.kubeconfig)))
    plugin = start_plugin(testbed, node, host_plugin, tmp_path / "plugin.log")
    _claim_pod(client, "restart-a")
    wait_running(client, "restart-a", node)
    [result] = _generated_claim(client, "restart-a")["status"]["allocation"]["devices"]["results"]
    wait_until(lambda: _device_health(client, "restart-a") == ("Healthy", ""), timeout=60, what="Healthy")
    offset = kubelet_log_size(node)
    restart_kubelet(testbed, node.name, progress=lambda _: None)

    def stream_again() -> bool:
        return "Successfully started WatchResources health stream" in _new_kubelet_log(node, offset)

    wait_until(stream_again, timeout=60, what="the restarted kubelet's health stream")
    _health_file(node, result["device"]).write_text("unhealthy: after the restart\n")
    wait_until(
        lambda: _device_health(client, "restart-a") == ("Unhealthy", "after the restart"),
        timeout=30,
        what="Unhealthy after the kubelet restart",
    )
    _health_file(node, result["device"]).unlink()
    wait_until(lambda: _device_health(client, "restart-a") == ("Healthy", ""), timeout=30, what="Healthy again")
    _delete_and_check_unprepared(client, node, "restart-a", _generated_claim(client, "restart-a"))
    plugin.kill()
    kubelet_log = _new_kubelet_log(node, offset)
    assert not _HEALTH_ERROR.findall(kubelet_log), "\n".join(
        line for line in kubelet_log.splitlines() if _HEALTH_ERROR.match(line)
    )
