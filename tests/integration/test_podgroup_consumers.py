"""ResourceClaims reserved for a PodGroup (Kubernetes 1.38, `scheduling.k8s.io`, gang scheduling)
against a real API server: reported with consumer_kind="podgroup", never leaked, priced in the
claim's namespace.

The reservation is written through the status subresource, as the golden objects write the claims
"a driver or controller allocated without reserving": the 1.38 API server validates it as it would
validate the scheduler's. With gang scheduling on in the testbed (its PodGroup API and gates), the
same checks hold for a claim the real scheduler reserves for a real PodGroup; that variant needs the
testbed's 1.38 row to turn those gates on.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

import pytest

from otel_dra.fixtures import create, object_path
from otel_dra.kube.client import ApiError, KubeClient, load_credentials
from tests.helpers import driver_class, namespace_series, node_slice, ready_node, wait_until

pytestmark = pytest.mark.kubernetes(min="1.38", reason="status.reservedFor names PodGroups from Kubernetes 1.38")

DRIVER = "pg.example.com"
NS = NODE = "podgroup-consumers"
LEAK_GRACE = 2.0
PODGROUP = {
    "apiGroup": "scheduling.k8s.io",
    "resource": "podgroups",
    "name": "trainers",
    "uid": "6a1f0c2e-0000-4000-8000-000000000001",
}


def _claim(name: str, reserved_for: list[dict[str, str]]) -> dict[str, Any]:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": NS},
        "spec": {"devices": {"requests": [{"name": "dev", "exactly": {"deviceClassName": DRIVER}}]}},
        "status": {
            "allocation": {
                "devices": {"results": [{"request": "dev", "driver": DRIVER, "pool": NODE, "device": name}]}
            },
            "reservedFor": reserved_for,
        },
    }


def _series(port: int, family: str) -> dict[tuple[tuple[str, str], ...], float]:
    return namespace_series(port, family, NS)


def test_a_claim_reserved_for_a_podgroup_is_in_use_and_priced_in_its_namespace(testbed_sched, start_exporter_app):
    client = KubeClient(load_credentials(str(testbed_sched.kubeconfig)))
    with contextlib.suppress(ApiError):
        client.send_json("POST", "/api/v1/namespaces", {"metadata": {"name": NS}})
    ready_node(client, NODE)
    priced = driver_class(DRIVER)
    priced["metadata"]["annotations"] = {"hourly-cost": "4"}
    objects: list[dict[str, Any]] = [
        priced,
        node_slice("podgroup-consumers-slice", DRIVER, NODE, devices=[{"name": "gang"}, {"name": "nobody"}]),
    ]
    claims = [_claim("gang", [PODGROUP]), _claim("nobody", [])]
    try:
        for obj in objects:
            create(client, obj)
        for claim in claims:
            try:
                create(client, claim)
            except ApiError as exc:
                if exc.status in (400, 422) and claim["metadata"]["name"] == "gang":
                    pytest.fail(f"the API server refused a PodGroup in status.reservedFor: {exc}")
                raise
        app = start_exporter_app(str(testbed_sched.kubeconfig), leak_grace=LEAK_GRACE)
        wait_until(lambda: app.state.not_synced() is None, what="sync")
        # Past the grace period: the unreserved claim is leaked, the PodGroup's is not.
        wait_until(lambda: _series(app.port, "kube_resourceclaim_leaked"), timeout=30, what="the leak")
        time.sleep(LEAK_GRACE + 1)
        # The oracle is the API server's claim: the reservation must still be there.
        gang = client.get_json(object_path(claims[0]))
        assert (gang.get("status") or {}).get("reservedFor") == [PODGROUP], gang.get("status")
        assert _series(app.port, "kube_resourceclaim_leaked") == {
            (("namespace", NS), ("resourceclaim_name", "nobody")): 1.0
        }
        assert _series(app.port, "kube_resourceclaim_status_reserved_for_consumer") == {
            (
                ("consumer_kind", "podgroup"),
                ("consumer_name", "trainers"),
                ("namespace", NS),
                ("resourceclaim_name", "gang"),
            ): 1.0
        }
        phase = _series(app.port, "kube_resourceclaim_status_phase")
        assert phase[(("namespace", NS), ("phase", "reserved"), ("resourceclaim_name", "gang"))] == 1.0
        # Pods only, byte for byte as the seed: 0 for the PodGroup's claim.
        assert (
            _series(app.port, "kube_resourceclaim_status_reserved_total")[
                (("namespace", NS), ("resourceclaim_name", "gang"))
            ]
            == 0.0
        )
        cost = _series(app.port, "kube_resourceclaim_hourly_cost")
        assert cost[(("deviceclass_name", DRIVER), ("namespace", NS), ("resourceclaim_name", "gang"))] == 4.0
    finally:
        with contextlib.suppress(ApiError):
            client.request("DELETE", f"/apis/resource.k8s.io/v1/namespaces/{NS}/resourceclaims")
        for obj in reversed(objects):
            with contextlib.suppress(ApiError):
                client.request("DELETE", object_path(obj))
