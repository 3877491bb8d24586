"""The plugin writes each prepared device's status into its ResourceClaim (``status.devices``,
otel_dra/plugin/devicestatus.py), against the real kube-apiserver of the testbed: server-side
apply merges with other writers, a clear removes only ours, the claim's UID guards a re-created
claim, a restart writes what is missing, a refused write is retried until it is allowed."""

from __future__ import annotations

import json
import uuid
from typing import Any

import pytest
import yaml

from otel_dra.kube.client import KubeClient
from otel_dra.plugin.checkpoint import PreparedDevice
from otel_dra.plugin.devices import simulated_uuid
from otel_dra.plugin.state import ClaimRef
from otel_dra.telemetry.traceids import root_span_id
from tests.helpers import wait_until
from tests.integration import test_plugin
from tests.integration.plugin_helpers import CLAIMS, DRIVER, make_claim, metric, ref, result

pytestmark = pytest.mark.testbed

# test_plugin's fixtures: in-process plugins on short directories, a fresh node name, the kubelet's
# side of the sockets, the claims' namespace.
dirs = test_plugin.dirs
node = test_plugin.node
start = test_plugin.start
kubelet = test_plugin.kubelet
namespace = test_plugin.namespace

WRITES = "otel_dra_plugin_device_status_writes_total"
OTHER_DRIVER = "nic.example.com"
TWO_REQUESTS = [
    {"name": "gpu", "exactly": {"deviceClassName": DRIVER}},
    {"name": "nic", "exactly": {"deviceClassName": OTHER_DRIVER}},
]


def status_devices(admin: KubeClient, namespace: str, name: str) -> list[dict[str, Any]]:
    claim = admin.get_json(f"{CLAIMS.format(ns=namespace)}/{name}")
    return list((claim.get("status") or {}).get("devices") or [])


def ours(entries: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Our driver's entries by device, with each entry's conditions by type."""
    return {
        e["device"]: {**e, "conditions": {c["type"]: c for c in e.get("conditions") or []}}
        for e in entries
        if e["driver"] == DRIVER
    }


def apply_as(admin: KubeClient, claim: dict[str, Any], manager: str, devices: list[dict[str, Any]]) -> None:
    """Another writer's server-side apply of status.devices (a second driver, a controller)."""
    meta = claim["metadata"]
    admin.request(
        "PATCH",
        f"{CLAIMS.format(ns=meta['namespace'])}/{meta['name']}/status",
        query={"fieldManager": manager, "force": "true"},
        body={
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaim",
            "metadata": {"name": meta["name"], "namespace": meta["namespace"]},
            "status": {"devices": devices},
        },
        content_type="application/apply-patch+yaml",
    )


def condition(kind: str) -> dict[str, str]:
    return {
        "type": kind,
        "status": "True",
        "reason": "Attached",
        "message": "m",
        "lastTransitionTime": "2026-01-01T00:00:00Z",
    }


def writes(app: Any, operation: str, result: str) -> float | None:
    assert app.driver.device_status.flush(20), "the device status writer did not settle"
    return metric(app.metrics_port, WRITES, operation=operation, result=result)


def test_prepare_writes_the_devices_status_and_unprepare_clears_it(start, kubelet, node, namespace, admin_client):
    app = start(node)
    name = f"status-{node}"
    claim = make_claim(admin_client, namespace, name, [result(node, "gpu-0"), result(node, "gpu-1")])
    uid = claim["metadata"]["uid"]
    assert kubelet.prepare([ref(claim)]).claims[uid].error == ""

    entries = wait_until(
        lambda: (
            len(ours(status_devices(admin_client, namespace, name))) == 2
            and ours(status_devices(admin_client, namespace, name))
        ),
        timeout=20,
        what="our status.devices entries",
    )
    for index in (0, 1):
        entry = entries[f"gpu-{index}"]
        assert entry["pool"] == node and "shareID" not in entry
        assert entry["data"] == {"uuid": simulated_uuid(node, index)}
        assert "networkData" not in entry
        ready = entry["conditions"]["Ready"]
        assert (ready["status"], ready["reason"]) == ("True", "Prepared")
        assert ready["message"] == f"prepared by {DRIVER} on node {node}"
        # The claim's generation when it has one (kube-apiserver 1.37 tracks none for claims).
        assert ready.get("observedGeneration") == claim["metadata"].get("generation")
        assert ready["lastTransitionTime"].endswith("Z")
    fields = admin_client.get_json(f"{CLAIMS.format(ns=namespace)}/{name}")["metadata"]["managedFields"]
    assert {(f["manager"], f["operation"]) for f in fields if f.get("subresource") == "status"} >= {
        (f"{DRIVER}/{node}", "Apply")
    }
    assert writes(app, "apply", "success") == 1

    # The kubelet prepares again (its restart, a second pod): written already, not again.
    assert kubelet.prepare([ref(claim)]).claims[uid].error == ""
    assert writes(app, "apply", "success") == 1
    assert metric(app.metrics_port, "rest_client_requests_total", code="200", method="PATCH") == 1

    # The write is a CLIENT span in the claim's trace, a child of the claim's derived root.
    app.driver.device_status.spans.flush()
    (span,) = [s for s in test_plugin._spans(app) if s.name.startswith("PATCH ")]
    trace_id = uuid.UUID(uid).int
    assert span.context.trace_id == trace_id and span.parent.span_id == root_span_id(trace_id)
    assert span.attributes["http.response.status_code"] == 200
    assert span.attributes["url.template"].endswith("/resourceclaims/{name}/status")
    assert span.attributes["dra.claim.uid"] == uid and span.attributes["dra.device_status.operation"] == "apply"

    assert kubelet.unprepare([ref(claim)]).claims[uid].error == ""
    wait_until(lambda: not status_devices(admin_client, namespace, name), timeout=20, what="our entries cleared")
    assert writes(app, "clear", "success") == 1


def test_a_node_local_claims_entries_go_with_its_allocation_not_with_a_clear(
    start, kubelet, node, namespace, admin_client
):
    """Allocated to this node alone (the scheduler's node selector for a node's own devices): the
    unprepare writes nothing, and the API server removes the entries when the allocation goes, as
    the resource claim controller's deallocation does (an update of the status without it)."""
    app = start(node)
    name = f"local-{node}"
    claim = make_claim(admin_client, namespace, name, [result(node, "gpu-0")], node=node)
    uid = claim["metadata"]["uid"]
    assert kubelet.prepare([ref(claim)]).claims[uid].error == ""
    wait_until(lambda: ours(status_devices(admin_client, namespace, name)), timeout=20, what="our entry")
    assert writes(app, "apply", "success") == 1

    assert kubelet.unprepare([ref(claim)]).claims[uid].error == ""
    assert not writes(app, "clear", "success")  # 0: the series exists from the start
    assert metric(app.metrics_port, "rest_client_requests_total", code="200", method="PATCH") == 1
    assert set(ours(status_devices(admin_client, namespace, name))) == {"gpu-0"}  # until deallocated

    # Deallocated: the status written back without its allocation, the entries still in it.
    current = admin_client.get_json(f"{CLAIMS.format(ns=namespace)}/{name}")
    assert current["status"]["devices"]
    del current["status"]["allocation"]
    after = admin_client.send_json("PUT", f"{CLAIMS.format(ns=namespace)}/{name}/status", current)
    assert not (after.get("status") or {}).get("devices"), after.get("status")

    # Allocated again to the same device and prepared: written again, not taken as written already.
    again = admin_client.get_json(f"{CLAIMS.format(ns=namespace)}/{name}")
    again["status"] = {"allocation": claim["status"]["allocation"]}
    admin_client.send_json("PUT", f"{CLAIMS.format(ns=namespace)}/{name}/status", again)
    wait_until(
        lambda: bool(
            (
                admin_client.get_json(f"{CLAIMS.format(ns=namespace)}/{name}", {"resourceVersion": "0"}).get("status")
                or {}
            ).get("allocation")
        ),
        timeout=10,
        interval=0.01,
        what="the allocation in the watch cache",
    )
    assert kubelet.prepare([ref(claim)]).claims[uid].error == ""
    wait_until(lambda: ours(status_devices(admin_client, namespace, name)), timeout=20, what="our entry again")
    assert writes(app, "apply", "success") == 2


def test_other_writers_entries_survive_our_write_and_our_clear(start, kubelet, node, namespace, admin_client):
    app = start(node)
    name = f"shared-{node}"
    nic = {"request": "nic", "driver": OTHER_DRIVER, "pool": node, "device": "nic-0"}
    claim = make_claim(admin_client, namespace, name, [result(node, "gpu-0"), nic], requests=TWO_REQUESTS)
    uid = claim["metadata"]["uid"]
    # Another driver's entry, and a controller's condition on the entry of our device.
    other_entry = {"driver": OTHER_DRIVER, "pool": node, "device": "nic-0", "conditions": [condition("Ready")]}
    apply_as(admin_client, claim, "nic.example.com/elsewhere", [other_entry])
    attached = {"driver": DRIVER, "pool": node, "device": "gpu-0", "conditions": [condition("Attached")]}
    apply_as(admin_client, claim, "binding-controller", [attached])

    assert kubelet.prepare([ref(claim)]).claims[uid].error == ""
    entries = wait_until(
        lambda: (
            "Ready" in ours(status_devices(admin_client, namespace, name))["gpu-0"]["conditions"]
            and status_devices(admin_client, namespace, name)
        ),
        timeout=20,
        what="our Ready condition",
    )
    assert ours(entries)["gpu-0"]["conditions"].keys() == {"Attached", "Ready"}
    assert ours(entries)["gpu-0"]["data"] == {"uuid": simulated_uuid(node, 0)}
    assert [e for e in entries if e["driver"] == OTHER_DRIVER] == [other_entry]

    assert kubelet.unprepare([ref(claim)]).claims[uid].error == ""
    wait_until(
        lambda: "Ready" not in ours(status_devices(admin_client, namespace, name))["gpu-0"]["conditions"],
        timeout=20,
        what="our condition cleared",
    )
    left = status_devices(admin_client, namespace, name)
    # Ours are gone (the Ready condition, the data); the controller's condition and the other
    # driver's entry are exactly as they were.
    assert ours(left)["gpu-0"] == {
        "driver": DRIVER,
        "pool": node,
        "device": "gpu-0",
        "conditions": {"Attached": attached["conditions"][0]},
    }
    assert [e for e in left if e["driver"] == OTHER_DRIVER] == [other_entry]
    assert writes(app, "clear", "success") == 1


def test_a_recreated_claim_never_gets_the_old_claims_entries(start, kubelet, node, namespace, admin_client):
    app = start(node)
    name = f"again-{node}"
    old = make_claim(admin_client, namespace, name, [result(node, "gpu-0")])
    old_uid = old["metadata"]["uid"]
    assert kubelet.prepare([ref(old)]).claims[old_uid].error == ""
    wait_until(lambda: ours(status_devices(admin_client, namespace, name)), timeout=20, what="the old claim's entry")
    assert writes(app, "apply", "success") == 1

    # Deleted (no unprepare yet: the kubelet is late) and re-created with the same name, prepared.
    admin_client.request("DELETE", f"{CLAIMS.format(ns=namespace)}/{name}")
    wait_until(
        lambda: (
            name not in [c["metadata"]["name"] for c in admin_client.get_json(CLAIMS.format(ns=namespace))["items"]]
        ),
        what="the old claim gone",
    )
    new = make_claim(admin_client, namespace, name, [result(node, "gpu-0"), result(node, "gpu-1")])
    new_uid = new["metadata"]["uid"]
    assert new_uid != old_uid
    assert kubelet.prepare([ref(new)]).claims[new_uid].error == ""
    wait_until(
        lambda: len(ours(status_devices(admin_client, namespace, name))) == 2,
        timeout=20,
        what="the new claim's entries",
    )
    assert writes(app, "apply", "success") == 2
    before = status_devices(admin_client, namespace, name)

    # The old claim's unprepare: its clear, with the old UID, must not remove the new claim's
    # entries (same name, same field manager).
    assert kubelet.unprepare([ref(old)]).claims[old_uid].error == ""
    assert writes(app, "clear", "gone") == 1
    assert writes(app, "clear", "success") == 0
    # An apply with the old UID (as a write retried across the re-creation) does not land either:
    # applied, it would leave the new claim with gpu-0 only.
    old_ref = ClaimRef(namespace, old_uid, name)
    app.driver.device_status.prepared(old_ref, [PreparedDevice(("gpu",), node, "gpu-0", ())])
    assert writes(app, "apply", "gone") == 1
    assert status_devices(admin_client, namespace, name) == before


def test_a_restarted_plugin_writes_a_status_removed_behind_its_back(start, kubelet, node, namespace, admin_client):
    first = start(node)
    name = f"restart-status-{node}"
    claim = make_claim(admin_client, namespace, name, [result(node, "gpu-2")])
    uid = claim["metadata"]["uid"]
    assert kubelet.prepare([ref(claim)]).claims[uid].error == ""
    wait_until(lambda: ours(status_devices(admin_client, namespace, name)), timeout=20, what="the first write")
    first.stop()
    # Someone removes the status while the plugin is down.
    admin_client.request(
        "PATCH",
        f"{CLAIMS.format(ns=namespace)}/{name}/status",
        body={"status": {"devices": None}},
        content_type="application/merge-patch+json",
    )
    assert status_devices(admin_client, namespace, name) == []

    second = start(node)  # no prepare comes: the checkpoint says what to write
    entries = wait_until(
        lambda: ours(status_devices(admin_client, namespace, name)), timeout=20, what="the status written again"
    )
    assert entries["gpu-2"]["conditions"]["Ready"].get("observedGeneration") == claim["metadata"].get("generation")
    assert writes(second, "apply", "success") == 1
    second.stop()

    # A restart that finds the status as it should be reads it and writes nothing.
    third = start(node)
    assert third.driver.device_status.flush(20)
    assert writes(third, "apply", "success") == 0
    assert metric(third.metrics_port, "rest_client_requests_total", code="200", method="PATCH") is None
    assert ours(status_devices(admin_client, namespace, name)) == entries
    assert kubelet.unprepare([ref(claim)]).claims[uid].error == ""
    wait_until(lambda: not status_devices(admin_client, namespace, name), timeout=20, what="cleared")


def test_a_restarted_plugin_drops_the_checkpoint_entries_of_claims_gone_or_allocated_anew(
    start, kubelet, dirs, node, namespace, admin_client
):
    """What an unprepare's checkpoint write (not fsynced) can leave after a machine crash: an entry
    whose claim is gone, or was deallocated and allocated other devices meanwhile. The restarted
    plugin reads each, and drops both: the second must not be answered from the checkpoint."""
    first = start(node)
    names = {"kept": f"kept-{node}", "gone": f"gone-{node}", "moved": f"moved-{node}"}
    devices = {"kept": "gpu-4", "gone": "gpu-5", "moved": "gpu-6"}
    claims = {k: make_claim(admin_client, namespace, n, [result(node, devices[k])]) for k, n in names.items()}
    uids = {k: c["metadata"]["uid"] for k, c in claims.items()}
    for k, claim in claims.items():
        assert kubelet.prepare([ref(claim)]).claims[uids[k]].error == ""
    assert first.driver.device_status.flush(20)
    first.stop()
    # While the plugin is down, and with no unprepare coming (the crash lost it): one claim is
    # deleted, another deallocated and allocated gpu-7.
    admin_client.request("DELETE", f"{CLAIMS.format(ns=namespace)}/{names['gone']}")
    moved = admin_client.get_json(f"{CLAIMS.format(ns=namespace)}/{names['moved']}")
    del moved["status"]["allocation"]
    moved = admin_client.send_json("PUT", f"{CLAIMS.format(ns=namespace)}/{names['moved']}/status", moved)
    moved["status"] = {"allocation": {"devices": {"results": [result(node, "gpu-7")]}}}
    admin_client.send_json("PUT", f"{CLAIMS.format(ns=namespace)}/{names['moved']}/status", moved)
    wait_until(
        lambda: (
            names["gone"]
            not in {c["metadata"]["name"] for c in admin_client.get_json(CLAIMS.format(ns=namespace))["items"]}
        ),
        timeout=20,
        what="the claim deleted",
    )

    second = start(node)
    assert second.driver.device_status.flush(20)
    assert second.driver.checkpoint.uids() == [uids["kept"]]
    assert json.loads(dirs.checkpoint.read_text())["claims"].keys() == {uids["kept"]}
    assert not dirs.cdi_spec(uids["gone"]).exists() and dirs.cdi_spec(uids["kept"]).exists()
    # A late unprepare of the gone claim has nothing left to do; the kept one is still prepared;
    # the moved one is prepared as it is allocated now.
    assert kubelet.unprepare([ref(claims["gone"])]).claims[uids["gone"]].error == ""
    for k, device in (("kept", "gpu-4"), ("moved", "gpu-7")):
        answer = kubelet.prepare([ref(claims[k])]).claims[uids[k]]
        assert answer.error == "" and [d.device_name for d in answer.devices] == [device], k


def _rbac(rules: list[dict[str, Any]]) -> str:
    return yaml.safe_dump_all(
        [
            {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "status-retry"}},
            {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "plugin", "namespace": "status-retry"}},
            {
                "apiVersion": "rbac.authorization.k8s.io/v1",
                "kind": "ClusterRole",
                "metadata": {"name": "otel-dra-status-retry-test"},
                "rules": rules,
            },
            {
                "apiVersion": "rbac.authorization.k8s.io/v1",
                "kind": "ClusterRoleBinding",
                "metadata": {"name": "otel-dra-status-retry-test"},
                "roleRef": {
                    "apiGroup": "rbac.authorization.k8s.io",
                    "kind": "ClusterRole",
                    "name": "otel-dra-status-retry-test",
                },
                "subjects": [{"kind": "ServiceAccount", "name": "plugin", "namespace": "status-retry"}],
            },
        ]
    )


@pytest.mark.kubernetes(
    min="1.36",
    reason="the API server checks resourceclaims/driver (DRAResourceClaimGranularStatusAuthorization) from 1.36",
)
def test_a_refused_write_is_retried_until_it_is_allowed(testbed, helm, kubelet, dirs, node, namespace, admin_client):
    from otel_dra.cli.plugin import start_plugin

    chart = test_plugin.chart_plugin_rules(helm)
    without = [r for r in chart if not any(res.startswith("resourceclaims/") for res in r["resources"])]
    testbed.kubectl("apply", "-f", "-", input=_rbac(without))
    kubeconfig = testbed.write_kubeconfig(
        testbed.dir / "status-retry.kubeconfig", testbed.mint_token("status-retry", "plugin")
    )
    app = start_plugin(
        node_name=node,
        kubeconfig=str(kubeconfig),
        plugins_dir=dirs.plugins,
        registrar_dir=dirs.registry,
        cdi_root=dirs.cdi,
        metrics_port=0,
        metrics_address="127.0.0.1",
    )
    try:
        name = f"refused-{node}"
        claim = make_claim(admin_client, namespace, name, [result(node, "gpu-0")])
        uid = claim["metadata"]["uid"]
        assert kubelet.prepare([ref(claim)]).claims[uid].error == ""  # the prepare does not wait for it
        wait_until(
            lambda: (metric(app.metrics_port, WRITES, operation="apply", result="error") or 0) >= 1,
            what="a refused write",
        )
        assert metric(app.metrics_port, "rest_client_requests_total", code="403", method="PATCH")
        assert app.driver.device_status.pending == 1  # kept, not dropped
        # The status subresource alone is not enough: the API server also checks the driver's
        # synthetic permission (DRAResourceClaimGranularStatusAuthorization) and refuses with 422.
        status = {"apiGroups": ["resource.k8s.io"], "resources": ["resourceclaims/status"], "verbs": ["patch"]}
        testbed.kubectl("apply", "-f", "-", input=_rbac([*without, status]))
        wait_until(
            lambda: metric(app.metrics_port, "rest_client_requests_total", code="422", method="PATCH"),
            timeout=40,
            what="a write refused for want of resourceclaims/driver",
        )
        assert not ours(status_devices(admin_client, namespace, name))
        # Granted: a token not bound to a pod on the claim's node needs the arbitrary-node verb.
        driver = {
            "apiGroups": ["resource.k8s.io"],
            "resources": ["resourceclaims/driver"],
            "resourceNames": [DRIVER],
            "verbs": ["arbitrary-node:patch"],
        }
        testbed.kubectl("apply", "-f", "-", input=_rbac([*without, status, driver]))
        wait_until(lambda: ours(status_devices(admin_client, namespace, name)), timeout=40, what="the retried write")
        assert writes(app, "apply", "success") == 1
        assert app.driver.device_status.pending == 0
        assert kubelet.unprepare([ref(claim)]).claims[uid].error == ""
        wait_until(lambda: not status_devices(admin_client, namespace, name), timeout=20, what="cleared")
    finally:
        app.stop(remove_slices=True)


@pytest.mark.kubernetes(min="1.36", reason="shareID (DRAConsumableCapacity) is beta and on from 1.36")
def test_a_shared_nic_gets_one_entry_per_share_with_its_network_data(start, kubelet, node, namespace, admin_client):
    app = start(node, profile="net", num_devices=2)
    name = f"shares-{node}"
    shares = [str(uuid.uuid4()), str(uuid.uuid4())]
    results = [{**result(node, "nic-0"), "shareID": share} for share in shares]
    claim = make_claim(admin_client, namespace, name, results)
    uid = claim["metadata"]["uid"]
    assert kubelet.prepare([ref(claim)]).claims[uid].error == ""
    entries = wait_until(
        lambda: (
            len(status_devices(admin_client, namespace, name)) == 2 and status_devices(admin_client, namespace, name)
        ),
        timeout=20,
        what="one entry per share",
    )
    assert sorted(e["shareID"] for e in entries) == sorted(shares)
    nic = app.driver.inventory.get("nic-0")
    data, network = nic.status_data()
    for entry in entries:
        assert (entry["driver"], entry["pool"], entry["device"]) == (DRIVER, node, "nic-0")
        assert entry["data"] == data and entry["networkData"] == network
        assert network["interfaceName"] == "dranet0" and network["hardwareAddress"].startswith("02:")
    assert kubelet.unprepare([ref(claim)]).claims[uid].error == ""
    wait_until(lambda: not status_devices(admin_client, namespace, name), timeout=20, what="both cleared")
