"""Real gang scheduling (Kubernetes 1.38): kube-scheduler allocates a ResourceClaim that a PodGroup
names in ``spec.resourceClaims`` and reserves it for the PodGroup, not for each of its pods; the
exporter reports that claim as ``consumer_kind="podgroup"``, never as leaked (also once every pod
of the group is gone: the resourceclaim controller keeps a PodGroup's reservation while the
PodGroup exists) and prices it in the claim's namespace.

The gates are beta and off by default in 1.38: ``GenericWorkload`` (the PodGroup API,
``pod.spec.schedulingGroup``, the GangScheduling plugin) and ``DRAWorkloadResourceClaims`` (which
needs it: ``PodGroup.spec.resourceClaims`` and the PodGroup reservation in the scheduler's
DynamicResources plugin, the resourceclaim controller and the kubelet), and ``scheduling.k8s.io/v1beta1``
is not served unless ``--runtime-config`` says so. This module runs a control plane of its own
with all three, so no other test sees PodGroups. A pod's claim goes to the PodGroup only when its
``spec.resourceClaims`` entry equals one of the PodGroup's (name and ``resourceClaimName``), see
``BindTo`` in k8s.io/dynamic-resource-allocation/resourceclaim.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from otel_dra.fixtures import create
from otel_dra.kube.client import ApiError, KubeClient, load_credentials
from otel_dra.testbed import Binaries, Testbed, running
from otel_dra.testbed.build import kubernetes_release
from tests.helpers import (
    claim_pod,
    driver_class,
    namespace_series,
    node_slice,
    ready_node,
    wait_until,
)

pytestmark = pytest.mark.kubernetes(
    min="1.38", reason="PodGroups reserve ResourceClaims (gang scheduling, scheduling.k8s.io/v1beta1) from 1.38"
)

DRIVER = "gang.example.com"
NS = NODE = "podgroup-gang"
GROUP = "trainers"
CLAIM = "shared"
PODS = 3  # the gang: minCount pods, all of which use the one claim
LEAK_GRACE = 2.0
GANG_GATES = {"GenericWorkload": True, "DRAWorkloadResourceClaims": True}
PODGROUP_API = "scheduling.k8s.io/v1beta1"


@pytest.fixture(scope="module")
def gang_testbed(tmp_path_factory: pytest.TempPathFactory, testbed_binaries: Binaries) -> Iterator[Testbed]:
    """A control plane (scheduler and controller-manager included) with gang scheduling on."""
    release = kubernetes_release()
    with running(
        tmp_path_factory.mktemp("gang"),
        scheduler=True,
        controller_manager=True,
        binaries=testbed_binaries,
        kubernetes_version=release,
        feature_gates={**release.feature_gates, **GANG_GATES},
        apiserver_args=[f"--runtime-config={PODGROUP_API}=true"],
    ) as tb:
        yield tb


def _podgroup() -> dict[str, Any]:
    return {
        "apiVersion": PODGROUP_API,
        "kind": "PodGroup",
        "metadata": {"name": GROUP, "namespace": NS},
        "spec": {
            "schedulingPolicy": {"gang": {"minCount": PODS}},
            # Equal to the pods' entry (claim_pod: name "dev"), so the claim is the group's.
            "resourceClaims": [{"name": "dev", "resourceClaimName": CLAIM}],
        },
    }


def _member(name: str) -> dict[str, Any]:
    pod = claim_pod(name, NS, CLAIM)
    pod["spec"]["schedulingGroup"] = {"podGroupName": GROUP}
    return pod


def _claim(name: str) -> dict[str, Any]:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": NS},
        "spec": {"devices": {"requests": [{"name": "dev", "exactly": {"deviceClassName": DRIVER}}]}},
    }


def _series(port: int, family: str) -> dict[tuple[tuple[str, str], ...], float]:
    return namespace_series(port, family, NS)


def _claim_json(client: KubeClient, name: str) -> dict[str, Any]:
    claim: dict[str, Any] = client.get_json(f"/apis/resource.k8s.io/v1/namespaces/{NS}/resourceclaims/{name}")
    return claim


def test_the_scheduler_reserves_a_gang_claim_for_its_podgroup_and_the_exporter_reports_it(
    gang_testbed: Testbed, start_exporter_app: Any
) -> None:
    client = KubeClient(load_credentials(str(gang_testbed.kubeconfig)))
    client.send_json("POST", "/api/v1/namespaces", {"metadata": {"name": NS}})
    ready_node(client, NODE)
    priced = driver_class(DRIVER)
    priced["metadata"]["annotations"] = {"hourly-cost": "4"}
    create(client, priced)
    create(client, node_slice("podgroup-gang-slice", DRIVER, NODE, devices=[{"name": "d0"}, {"name": "d1"}]))
    create(client, _claim(CLAIM))
    try:
        group = client.send_json("POST", f"/apis/{PODGROUP_API}/namespaces/{NS}/podgroups", _podgroup())
    except ApiError as exc:
        pytest.fail(f"the API server refused the PodGroup (gates and runtime-config on?): {exc}")
    # Dropped silently where DRAWorkloadResourceClaims is off on the API server.
    assert group["spec"].get("resourceClaims") == _podgroup()["spec"]["resourceClaims"], group["spec"]
    members = [f"{GROUP}-{i}" for i in range(PODS)]
    for name in members:
        created = create(client, _member(name))
        # Dropped silently where GenericWorkload is off on the API server.
        assert created["spec"].get("schedulingGroup") == {"podGroupName": GROUP}, created["spec"]

    # The oracle: the real scheduler binds the whole gang and reserves the claim for the PodGroup.
    # (One PreBind writes the allocation; the group's other pods may fail theirs once with "got
    # allocated elsewhere in the meantime" and bind on the retry: wait for all of them.)
    def bound() -> dict[str, str] | None:
        nodes = {n: client.get_json(f"/api/v1/namespaces/{NS}/pods/{n}")["spec"].get("nodeName") for n in members}
        return nodes if all(nodes.values()) else None

    assert wait_until(bound, timeout=90, what="kube-scheduler to bind the gang") == dict.fromkeys(members, NODE)
    reference = {
        "apiGroup": "scheduling.k8s.io",
        "resource": "podgroups",
        "name": GROUP,
        "uid": group["metadata"]["uid"],
    }
    status = wait_until(
        lambda: (lambda s: s if s.get("reservedFor") else None)(_claim_json(client, CLAIM).get("status") or {}),
        timeout=30,
        what="the claim's reservation",
    )
    assert status["reservedFor"] == [reference], status
    [result] = status["allocation"]["devices"]["results"]
    assert (result["driver"], result["pool"]) == (DRIVER, NODE), result

    app = start_exporter_app(str(gang_testbed.kubeconfig), leak_grace=LEAK_GRACE)
    wait_until(lambda: app.state.not_synced() is None, what="sync")
    consumers = {
        (("consumer_kind", "podgroup"), ("consumer_name", GROUP), ("namespace", NS), ("resourceclaim_name", CLAIM)): 1.0
    }
    wait_until(
        lambda: _series(app.port, "kube_resourceclaim_status_reserved_for_consumer") == consumers,
        what="the PodGroup consumer series",
    )
    # Reserved for the group, not for each pod: no pod series, and the pod count (pods only) is 0.
    assert _series(app.port, "kube_resourceclaim_status_reserved_for_pod") == {}
    assert _series(app.port, "kube_resourceclaim_status_reserved_total") == {
        (("namespace", NS), ("resourceclaim_name", CLAIM)): 0.0
    }
    phase = _series(app.port, "kube_resourceclaim_status_phase")
    assert phase[(("namespace", NS), ("phase", "reserved"), ("resourceclaim_name", CLAIM))] == 1.0
    assert _series(app.port, "kube_resourceclaim_hourly_cost") == {
        (("deviceclass_name", DRIVER), ("namespace", NS), ("resourceclaim_name", CLAIM)): 4.0
    }

    # The gang goes away, the PodGroup stays: the resourceclaim controller (gate on) keeps the
    # PodGroup's reservation, so the claim stays in use.
    for name in members:
        client.request("DELETE", f"/api/v1/namespaces/{NS}/pods/{name}?gracePeriodSeconds=0")
    wait_until(lambda: not client.get_json(f"/api/v1/namespaces/{NS}/pods")["items"], what="the pods to go")
    # A control claim allocated (on the other device) and reserved by nobody, written after the
    # scheduler's last write of the gang claim: once the exporter calls it leaked, the gang claim
    # would have been called leaked too, were it.
    other = "d1" if result["device"] == "d0" else "d0"
    nobody = _claim("nobody")
    nobody["status"] = {
        "allocation": {"devices": {"results": [{"request": "dev", "driver": DRIVER, "pool": NODE, "device": other}]}},
        "reservedFor": [],
    }
    create(client, nobody)
    leaked = {(("namespace", NS), ("resourceclaim_name", "nobody")): 1.0}
    wait_until(lambda: _series(app.port, "kube_resourceclaim_leaked"), timeout=30, what="the control claim's leak")
    assert _series(app.port, "kube_resourceclaim_leaked") == leaked
    assert (_claim_json(client, CLAIM).get("status") or {}).get("reservedFor") == [reference]
    assert _series(app.port, "kube_resourceclaim_status_reserved_for_consumer") == consumers
    cost = _series(app.port, "kube_resourceclaim_hourly_cost")
    assert cost[(("deviceclass_name", DRIVER), ("namespace", NS), ("resourceclaim_name", CLAIM))] == 4.0
