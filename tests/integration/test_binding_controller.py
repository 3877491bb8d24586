"""`otel-dra binding-controller` against the real API server and kube-scheduler (no kubelet).

Each test publishes a ResourceSlice of a driver of its own on a Node it creates, whose devices carry
the binding conditions the plugin publishes with --binding-conditions (Attached, AttachFailed,
bindsToNode), and a pod with a claim for one of them. The real scheduler allocates the device and
holds the pod in PreBind (polling the claim every 5 s) until the controller sets the condition:
then it binds the pod; or, when the controller sets the failure condition, it gives the device up
(deallocates the claim) and tries again, so the pod stays unbound.

Kubernetes 1.35 and newer (DRADeviceBindingConditions is alpha in 1.34-1.35, on by the testbed's gates, beta from 1.36). The command as a
process (flags from the environment, /readyz, /metrics, SIGTERM) runs on every release.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_ON

from otel_dra.binding.claims import ATTACHED_REASON, FAILED_REASON, FIELD_MANAGER
from otel_dra.cli.binding_controller import BindingControllerApp, start_binding_controller
from otel_dra.cli.plugin import start_plugin
from otel_dra.fixtures import create
from otel_dra.kube.client import KubeClient, load_credentials
from otel_dra.telemetry.spans import tracer_provider
from otel_dra.telemetry.traceids import root_span_id, trace_id_of
from tests.helpers import (
    claim_pod,
    device_claim,
    driver_class,
    free_port,
    http_get,
    node_slice,
    parse_samples,
    ready_node,
    scrape,
    wait_until,
)
from tests.integration.plugin_helpers import ensure_namespace

needs_binding_conditions = pytest.mark.kubernetes(
    min="1.35",
    reason="DRADeviceBindingConditions is alpha in 1.34-1.35 (beta and on from 1.36); tried from 1.35 with the testbed's gates",
)

NS = "binding-controller"
# kube-scheduler's PreBind polls the claim every 5 s; its binding timeout (10 min) is far off.
SCHEDULER_POLL = 5.0


def _device(name: str) -> dict[str, Any]:
    """A device as the plugin publishes it with --binding-conditions (otel_dra/plugin/devices.py)."""
    return {
        "name": name,
        "bindsToNode": True,
        "bindingConditions": ["Attached"],
        "bindingFailureConditions": ["AttachFailed"],
    }


class Cluster:
    """A driver, a Node with one ResourceSlice of it (``devices`` devices) and its DeviceClass."""

    def __init__(self, client: KubeClient, tag: str, devices: int = 2) -> None:
        self.client = client
        self.driver = f"{tag}.bind.example.com"
        self.node = f"bind-{tag}"
        ready_node(client, self.node)
        create(client, driver_class(self.driver))
        create(
            client, node_slice(self.node, self.driver, self.node, devices=[_device(f"gpu-{i}") for i in range(devices)])
        )

    def claim_and_pod(self, name: str) -> None:
        create(self.client, device_claim(name, NS, self.driver))
        create(self.client, claim_pod(name, NS, name, node=self.node))

    def claim(self, name: str) -> dict[str, Any]:
        found: dict[str, Any] = self.client.get_json(f"/apis/resource.k8s.io/v1/namespaces/{NS}/resourceclaims/{name}")
        return found

    def pod(self, name: str) -> dict[str, Any]:
        found: dict[str, Any] = self.client.get_json(f"/api/v1/namespaces/{NS}/pods/{name}")
        return found

    def events(self, pod: str) -> list[dict[str, Any]]:
        found = self.client.get_json(
            f"/api/v1/namespaces/{NS}/events", {"fieldSelector": f"involvedObject.name={pod},involvedObject.kind=Pod"}
        )
        return list(found["items"])


@pytest.fixture(scope="module")
def client(testbed_sched) -> KubeClient:
    admin = KubeClient(load_credentials(str(testbed_sched.kubeconfig)))
    ensure_namespace(admin, NS)
    return admin


@pytest.fixture
def cluster(client) -> Cluster:
    return Cluster(client, uuid.uuid4().hex[:8])


@pytest.fixture
def start(testbed_sched) -> Iterator[Callable[..., BindingControllerApp]]:
    """Start in-process controllers (metrics on a free port); each gets an in-memory span exporter
    (``.spans``) and is stopped after the test."""
    apps: list[BindingControllerApp] = []

    def run(driver: str, **kwargs: Any) -> BindingControllerApp:
        spans = InMemorySpanExporter()
        provider = tracer_provider(sampler=ALWAYS_ON)
        provider.add_span_processor(SimpleSpanProcessor(spans))
        kwargs.setdefault("metrics_port", 0)
        kwargs.setdefault("metrics_address", "127.0.0.1")
        app = start_binding_controller(
            kubeconfig=str(testbed_sched.kubeconfig), driver_name=driver, tracer_provider=provider, **kwargs
        )
        app.spans = spans  # type: ignore[attr-defined]
        apps.append(app)
        wait_until(lambda: app.controller.not_synced() is None, what="the controller's claims in sync")
        return app

    yield run
    for app in apps:
        app.stop()


def _allocated(claim: dict[str, Any]) -> dict[str, Any] | None:
    allocation: dict[str, Any] | None = (claim.get("status") or {}).get("allocation")
    return allocation


def _conditions(claim: dict[str, Any], driver: str) -> dict[str, dict[str, Any]]:
    """The conditions of the claim's status.devices entries of ``driver``, by type."""
    out: dict[str, dict[str, Any]] = {}
    for entry in (claim.get("status") or {}).get("devices") or []:
        if entry.get("driver") == driver:
            out.update({c["type"]: c for c in entry.get("conditions") or []})
    return out


def _metrics(app: BindingControllerApp) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    assert app.metrics_port is not None
    code, text = scrape(app.metrics_port)
    assert code == 200, text
    return {
        (name, tuple(sorted(labels.items()))): value
        for name, labels, value in parse_samples(text)
        if name.startswith("otel_dra_binding_controller_")
    }


def _value(app: BindingControllerApp, name: str, **labels: str) -> float:
    return _metrics(app).get((name, tuple(sorted(labels.items()))), 0.0)


def _spans(app: BindingControllerApp) -> list[ReadableSpan]:
    app.flush_spans()
    return list(app.spans.get_finished_spans())  # type: ignore[attr-defined]


@needs_binding_conditions
def test_the_pod_is_bound_after_the_delay_and_the_claim_says_attached(cluster, start):
    delay = 3.0
    app = start(cluster.driver, attach_delay=delay)
    cluster.claim_and_pod("attach")
    allocated = wait_until(lambda: _allocated(cluster.claim("attach")), timeout=60, what="the allocation")
    seen = time.time()
    assert allocated["devices"]["results"][0]["bindingConditions"] == ["Attached"]
    # Held in PreBind: allocated, reserved for the pod, not bound, no condition yet.
    claim = cluster.claim("attach")
    assert claim["status"]["reservedFor"][0]["name"] == "attach"
    assert not cluster.pod("attach")["spec"].get("nodeName")
    assert _conditions(claim, cluster.driver) == {}
    # The plugin writes its own condition and data into the same entry (another field manager):
    # the controller's write must merge with it, not replace it.
    result = allocated["devices"]["results"][0]
    plugin_entry = {
        "driver": cluster.driver,
        "pool": result["pool"],
        "device": result["device"],
        "conditions": [
            {
                "type": "Ready",
                "status": "True",
                "reason": "Prepared",
                "message": "",
                "lastTransitionTime": "2026-01-01T00:00:00Z",
            }
        ],
        "data": {"uuid": "gpu-test"},
    }
    body = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": "attach", "namespace": NS},
        "status": {"devices": [plugin_entry]},
    }
    cluster.client.request(
        "PATCH",
        f"/apis/resource.k8s.io/v1/namespaces/{NS}/resourceclaims/attach/status",
        query={"fieldManager": "plugin-test", "force": "true"},
        body=body,
        content_type="application/apply-patch+yaml",
    )

    wait_until(lambda: cluster.pod("attach")["spec"].get("nodeName"), timeout=30, what="the scheduler to bind the pod")
    bound = time.time()
    # Not before the delay (counted from when the controller saw the allocation, at most when the
    # test did), and within one scheduler poll of it.
    assert bound - seen >= delay - 0.5
    assert bound - seen <= delay + SCHEDULER_POLL + 3
    assert cluster.pod("attach")["spec"]["nodeName"] == cluster.node

    claim = cluster.claim("attach")
    conditions = _conditions(claim, cluster.driver)
    assert set(conditions) == {"Attached", "Ready"}  # merged with the plugin's
    attached = conditions["Attached"]
    assert attached["status"] == "True" and attached["reason"] == ATTACHED_REASON
    # Claims have no metadata.generation (the API server's strategy does not set it): then none.
    assert attached.get("observedGeneration") == claim["metadata"].get("generation")
    assert "simulated" in attached["message"]
    [entry] = claim["status"]["devices"]
    assert entry["data"] == {"uuid": "gpu-test"}
    managers = {m["manager"] for m in claim["metadata"]["managedFields"] if m.get("subresource") == "status"}
    assert {FIELD_MANAGER, "plugin-test"} <= managers
    # The plugin's later write with only its own fields leaves the controller's condition alone.
    plugin_entry["conditions"][0]["lastTransitionTime"] = "2026-01-01T00:00:01Z"
    cluster.client.request(
        "PATCH",
        f"/apis/resource.k8s.io/v1/namespaces/{NS}/resourceclaims/attach/status",
        query={"fieldManager": "plugin-test", "force": "true"},
        body=body,
        content_type="application/apply-patch+yaml",
    )
    assert set(_conditions(cluster.claim("attach"), cluster.driver)) == {"Attached", "Ready"}
    # The scheduler said it waited.
    reasons = {e["reason"] for e in cluster.events("attach")}
    assert "BindingConditionsPending" in reasons, reasons

    # Metrics: one attached device, none failed, nothing pending; its latency since the allocation.
    wait_until(lambda: app.controller.pending() == 0, what="nothing pending")
    assert _value(app, "otel_dra_binding_controller_conditions_total", driver=cluster.driver, outcome="attached") == 1
    assert _value(app, "otel_dra_binding_controller_conditions_total", driver=cluster.driver, outcome="failed") == 0
    count = _value(
        app,
        "otel_dra_binding_controller_allocation_to_condition_seconds_count",
        driver=cluster.driver,
        outcome="attached",
    )
    total = _value(
        app,
        "otel_dra_binding_controller_allocation_to_condition_seconds_sum",
        driver=cluster.driver,
        outcome="attached",
    )
    assert count == 1 and delay - 1.5 <= total <= delay + 3  # allocationTimestamp has whole seconds
    assert _value(app, "otel_dra_binding_controller_pending", driver=cluster.driver) == 0

    # The write's span is in the claim's trace, a child of the root the exporter emits.
    trace_id = trace_id_of(claim["metadata"]["uid"])
    assert trace_id is not None
    [span] = [s for s in _spans(app) if s.name == "set binding conditions"]
    assert span.context.trace_id == trace_id
    assert span.parent is not None and span.parent.span_id == root_span_id(trace_id)
    assert span.attributes["k8s.resourceclaim.uid"] == claim["metadata"]["uid"]
    assert span.attributes["otel_dra.binding.outcome"] == "attached"
    assert list(span.attributes["dra.devices"]) == [f"{cluster.driver}/{result['pool']}/{result['device']}"]
    [patch] = [s for s in _spans(app) if s.parent is not None and s.parent.span_id == span.context.span_id]
    assert patch.attributes["http.request.method"] == "PATCH" and patch.attributes["http.response.status_code"] == 200


@needs_binding_conditions
def test_a_restarted_controller_picks_up_waiting_allocations_from_its_list(cluster, start):
    cluster.claim_and_pod("later")
    wait_until(lambda: _allocated(cluster.claim("later")), timeout=60, what="the allocation")
    time.sleep(SCHEDULER_POLL + 1)  # the scheduler polled at least once more: still waiting
    assert not cluster.pod("later")["spec"].get("nodeName")
    start(cluster.driver, attach_delay=0)
    wait_until(lambda: cluster.pod("later")["spec"].get("nodeName"), timeout=30, what="the scheduler to bind the pod")
    assert _conditions(cluster.claim("later"), cluster.driver)["Attached"]["status"] == "True"


@needs_binding_conditions
def test_with_failure_fraction_one_the_scheduler_gives_the_device_up_and_the_pod_stays_unbound(cluster, start):
    app = start(cluster.driver, attach_delay=1, failure_fraction=1.0)
    cluster.claim_and_pod("fail")
    # What the claim goes through, sampled often enough to see each state (each lasts seconds).
    seen: list[tuple[str, str, str]] = []  # (allocationTimestamp, device, AttachFailed status)
    bound: list[str] = []
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            claim = cluster.claim("fail")
            allocation = _allocated(claim)
            if allocation is None:
                state = ("", "", "")
            else:
                failed = _conditions(claim, cluster.driver).get("AttachFailed", {})
                device = allocation["devices"]["results"][0]["device"]
                state = (allocation.get("allocationTimestamp", "?"), device, failed.get("status", ""))
            if not seen or seen[-1] != state:
                seen.append(state)
            node = cluster.pod("fail")["spec"].get("nodeName")
            if node:
                bound.append(node)
            stop.wait(0.2)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:

        def given_up_and_tried_again() -> bool:
            failed_at = [i for i, s in enumerate(seen) if s[2] == "True"]
            # After a failed allocation: no allocation, or another allocation (another time or device).
            return bool(failed_at) and any(s[:2] != seen[failed_at[0]][:2] for s in seen[failed_at[0] + 1 :])

        wait_until(given_up_and_tried_again, timeout=90, interval=0.5, what=f"a failed allocation given up: {seen}")
    finally:
        stop.set()
        watcher.join()
    assert bound == [] and not cluster.pod("fail")["spec"].get("nodeName")
    claim = cluster.claim("fail")
    failed = _conditions(claim, cluster.driver).get("AttachFailed")
    if failed is not None:  # allocated again and failed again
        assert failed["reason"] == FAILED_REASON
    # Every allocation failed, none attached; the scheduler reported why it did not bind.
    assert _value(app, "otel_dra_binding_controller_conditions_total", driver=cluster.driver, outcome="failed") >= 1
    assert _value(app, "otel_dra_binding_controller_conditions_total", driver=cluster.driver, outcome="attached") == 0
    messages = " ".join(e.get("message", "") for e in cluster.events("fail") if e["reason"] == "FailedScheduling")
    assert "binding" in messages.lower(), messages
    failed_spans = [s for s in _spans(app) if s.name == "set binding conditions"]
    assert failed_spans and all(s.attributes["otel_dra.binding.outcome"] == "failed" for s in failed_spans)


@needs_binding_conditions
def test_the_plugins_devices_wait_for_the_controller(client, start, testbed_sched):
    """The devices the plugin publishes with --binding-conditions (no kubelet: only its slices are
    used) are allocated, held and then bound once the controller attached them."""
    tag = uuid.uuid4().hex[:8]
    driver, node = f"{tag}.plugin.bind.example.com", f"bind-plugin-{tag}"
    ready_node(client, node)
    create(client, driver_class(driver))
    root = Path(tempfile.mkdtemp(prefix="obc-", dir="/tmp"))  # unix socket paths must stay short
    plugin = start_plugin(
        node_name=node,
        kubeconfig=str(testbed_sched.kubeconfig),
        driver_name=driver,
        num_devices=2,
        plugins_dir=root / "plugins",
        registrar_dir=root / "registry",
        cdi_root=root / "cdi",
        binding_conditions=True,
    )
    try:

        def published() -> list[dict[str, Any]]:
            found = client.get_json(
                "/apis/resource.k8s.io/v1/resourceslices", {"fieldSelector": f"spec.driver={driver}"}
            )
            return [d for s in found["items"] for d in s["spec"].get("devices") or []]

        devices = wait_until(published, what="the plugin's slices")
        assert {(tuple(d["bindingConditions"]), tuple(d["bindingFailureConditions"])) for d in devices} == {
            (("Attached",), ("AttachFailed",))
        }
        app = start(driver, attach_delay=1)
        create(client, device_claim("plugin-made", NS, driver))
        create(client, claim_pod("plugin-made", NS, "plugin-made", node=node))
        wait_until(lambda: _allocated(_claim(client, "plugin-made")), timeout=60, what="the allocation")
        wait_until(
            lambda: _pod(client, "plugin-made")["spec"].get("nodeName"), timeout=30, what="the scheduler to bind"
        )
        assert _conditions(_claim(client, "plugin-made"), driver)["Attached"]["status"] == "True"
        assert _value(app, "otel_dra_binding_controller_conditions_total", driver=driver, outcome="attached") == 1
    finally:
        plugin.stop(remove_slices=True)
        shutil.rmtree(root, ignore_errors=True)


def _claim(client: KubeClient, name: str) -> dict[str, Any]:
    found: dict[str, Any] = client.get_json(f"/apis/resource.k8s.io/v1/namespaces/{NS}/resourceclaims/{name}")
    return found


def _pod(client: KubeClient, name: str) -> dict[str, Any]:
    found: dict[str, Any] = client.get_json(f"/api/v1/namespaces/{NS}/pods/{name}")
    return found


def test_the_command_serves_readiness_and_metrics_and_stops_on_sigterm(testbed, tmp_path):
    port = free_port()
    env = {
        **os.environ,
        "OTEL_DRA_DRIVER_NAME": "cli.bind.example.com",
        "OTEL_DRA_ATTACH_DELAY": "1.5s",
        "OTEL_DRA_FAILURE_FRACTION": "0.5",
        "OTEL_DRA_METRICS_PORT": str(port),
        "OTEL_DRA_METRICS_ADDRESS": "127.0.0.1",
    }
    env.pop("OTEL_EXPORTER_OTLP_ENDPOINT", None)
    command = [sys.executable, "-m", "otel_dra", "binding-controller", "--kubeconfig", str(testbed.kubeconfig)]
    proc = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:

        def ready() -> bool:
            if proc.poll() is not None:
                return True  # exited: the assertion below says why
            try:
                return http_get(f"http://127.0.0.1:{port}/readyz", timeout=2)[0] == 200
            except OSError:  # not listening yet
                return False

        wait_until(ready, what="/readyz")
        assert proc.poll() is None, proc.communicate()[1]
        code, text = scrape(port)
        assert code == 200
        samples = {(n, tuple(sorted(labels.items()))): v for n, labels, v in parse_samples(text)}
        for outcome in ("attached", "failed"):
            key = (
                "otel_dra_binding_controller_conditions_total",
                (("driver", "cli.bind.example.com"), ("outcome", outcome)),
            )
            assert samples[key] == 0
        assert samples[("otel_dra_binding_controller_pending", (("driver", "cli.bind.example.com"),))] == 0
        assert "process_cpu_seconds_total" in text
    finally:
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=30)
    assert proc.returncode == 0, stderr
    assert (
        "attaching devices of driver cli.bind.example.com 1.5 s after their allocation, failing a fraction 0.5"
        in stderr
    )
    assert "stopped in" in stderr
    # Credentials that do not exist: exit 2, saying so.
    missing = subprocess.run(
        [*command[:-1], str(tmp_path / "none.kubeconfig")], env=env, capture_output=True, text=True, timeout=60
    )
    assert missing.returncode == 2 and "does not exist" in missing.stderr, missing.stderr
