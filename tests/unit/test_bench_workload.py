"""The benchmark workload's pods (issue 13): what otel_dra.cluster.pod reads from them, and that
the workload without pods is the one of the earlier runs."""

from __future__ import annotations

import json

from bench.scale import cache_objects
from bench.workload import DRIVER, TEMPLATE_EVERY, Workload, claim, objects, placement, pod
from otel_dra.cluster import pod as podmod
from otel_dra.cluster.pod import ClaimRef, DeviceHealth


def _as_served(obj: dict, uid: str) -> dict:
    """The pod as the API server lists it: with a uid (its status is the one written through pods/status)."""
    served = json.loads(json.dumps(obj))
    served["metadata"]["uid"] = uid
    return served


def test_pods_give_one_claim_entry_and_the_health_of_their_claims_device() -> None:
    w = Workload(claims=40, namespaces=4, classes=2, pods=True)
    problems: list[str] = []
    info = health = 0
    for j in range(w.claims):
        obj = pod(j, w)
        parsed = podmod.parse(_as_served(obj, f"u-{j}"), problems.append)
        pool, device = placement(j, w)
        result = claim(j, w)["status"]["allocation"]["devices"]["results"][0]
        assert (result["pool"], result["device"]) == (pool, device)
        assert obj["spec"]["nodeName"] == pool  # the slice's node: no scheduler binds bench pods
        template = "one-gpu" if j % TEMPLATE_EVERY == 0 else ""
        assert parsed.claims == (ClaimRef("gpu", f"claim-{j:06d}", template),)
        assert parsed.health == (DeviceHealth("trainer", f"claim-{j:06d}", "gpu", DRIVER, pool, device, "Healthy"),)
        for fam in podmod.STATE_FAMILIES:
            count = sum(1 for _ in fam.samples(parsed))
            if fam.prom_name == "kube_pod_resourceclaim_info":
                info += count
            else:
                health += count
    assert problems == []
    assert (info, health) == (w.claims, w.claims)
    assert info + health == w.expected_pod_series()
    # About a real pod: 3 KB as written, 7.6 KB as the 1.37 API server serves it (defaults, managedFields).
    assert 2500 < len(json.dumps(pod(1, w))) < 6000


def test_templated_claims_carry_what_the_resourceclaim_controller_sets() -> None:
    w = Workload(claims=10, pods=True)
    made = claim(0, w, pod_uid="uid-0")
    assert made["metadata"]["annotations"] == {"resource.kubernetes.io/pod-claim-name": "gpu"}
    assert made["metadata"]["ownerReferences"][0]["uid"] == "uid-0"
    assert made["status"]["reservedFor"][0] == {"resource": "pods", "name": "pod-000000-0", "uid": "uid-0"}
    direct = claim(1, w, pod_uid="uid-1")
    assert "annotations" not in direct["metadata"] and direct["status"]["reservedFor"][0]["uid"] == "uid-1"


def test_without_pods_the_workload_is_unchanged() -> None:
    w = Workload(claims=30, namespaces=3, classes=2)
    kinds = [o["kind"] for o in objects(w)]
    assert "Pod" not in kinds and w.expected_pod_series() == 0
    assert claim(4, w) == claim(4, w, pod_uid=None)
    assert claim(4, w)["metadata"] == {"name": "claim-000004", "namespace": "bench-001"}
    assert claim(4, w)["status"]["reservedFor"][0]["uid"] == "00000000-0000-0000-0000-000000000fa0"
    assert kinds.count("Pod") == 0
    assert [o["kind"] for o in objects(Workload(claims=30, namespaces=3, classes=2, pods=True))].count("Pod") == 30


def test_cache_objects_reads_the_watched_resources() -> None:
    body = (
        b'# HELP otel_dra_cache_objects x\notel_dra_cache_objects{resource="pods"} 1000.0\n'
        b'otel_dra_cache_objects{resource="resourceclaims"} 1000.0\nother 1\n'
    )
    assert cache_objects(body) == {"pods": 1000, "resourceclaims": 1000}
