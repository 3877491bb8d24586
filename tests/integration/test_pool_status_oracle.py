"""The upstream oracle: ResourcePoolStatusRequest (resource.k8s.io/v1alpha3, alpha in 1.36/1.37),
computed by kube-controller-manager's resourcepoolstatusrequest-controller, against our pool families
at the same moment, on the partitionable pool of test_shared_counters (counters in their own slice)
with one half allocated by the real scheduler, and on a pool whose device names an undefined set."""

from __future__ import annotations

import contextlib
import itertools
from typing import Any

import pytest

from otel_dra.fixtures import create
from otel_dra.kube.client import ApiError, KubeClient, load_credentials
from otel_dra.testbed import running
from tests.helpers import driver_class, parse_samples, place, ready_node, scrape, wait_until
from tests.integration.test_shared_counters import BAD_NODE, DRIVER, HALF, NODE, NS, SLICES

# A third pool like NODE's, whose devices slice names its partition type attribute (1.37, alpha).
TYPED = "counters-t"
PROFILE = f"{DRIVER}/profile"


def _typed_slices() -> list[dict[str, Any]]:
    out = []
    for obj in SLICES[:2]:
        spec = {**obj["spec"], "nodeName": TYPED, "pool": {**obj["spec"]["pool"], "name": TYPED}}
        if "devices" in spec:
            spec["partitionTypeAttribute"] = PROFILE
        out.append({**obj, "metadata": {"name": obj["metadata"]["name"].replace(NODE, TYPED)}, "spec": spec})
    return out


pytestmark = pytest.mark.kubernetes(min="1.37", reason="ResourcePoolStatusRequest, as 1.37 serves it")

RPSR_API = "resource.k8s.io/v1alpha3"
# Ours -> the request's status field.
FIELDS = {
    "kube_resourcepool_devices": "totalDevices",
    "kube_resourcepool_devices_allocated": "allocatedDevices",
    "kube_resourcepool_devices_free": "availableDevices",
}


@pytest.fixture(scope="module")
def oracle_testbed(tmp_path_factory, testbed_binaries):
    with running(
        tmp_path_factory.mktemp("testbed-pool-status"),
        scheduler=True,
        controller_manager=True,
        binaries=testbed_binaries,
        feature_gates={"DRAResourcePoolStatus": True, "DRAPartitionableDevicesType": True},
        apiserver_args=[f"--runtime-config={RPSR_API}=true"],
        extra_controllers=["resourcepoolstatusrequest-controller"],
    ) as tb:
        yield tb


def _ours(port: int) -> dict[str, dict[str, float]]:
    """pool -> our pool family -> value, for the driver's pools."""
    code, text = scrape(port)
    assert code == 200
    out: dict[str, dict[str, float]] = {}
    for name, labels, value in parse_samples(text):
        if labels.get("driver") != DRIVER:
            continue
        if name in FIELDS or name == "kube_resourcepool_invalid":
            out.setdefault(labels["pool"], {})[name] = value
        if name in ("kube_resourcepool_partitions", "kube_resourcepool_partitions_free") and labels["partition_type"]:
            out.setdefault(labels["pool"], {})[f"{name}/{labels['partition_type']}"] = value
    return out


def _request_status(client: KubeClient, name: str) -> dict[str, Any]:
    """Create a ResourcePoolStatusRequest for the driver and wait for the controller's answer."""
    create(
        client,
        {
            "apiVersion": RPSR_API,
            "kind": "ResourcePoolStatusRequest",
            "metadata": {"name": name},
            "spec": {"driver": DRIVER},
        },
    )
    path = f"/apis/{RPSR_API}/resourcepoolstatusrequests/{name}"

    def done() -> dict[str, Any] | None:
        status = client.get_json(path).get("status") or {}
        complete = any(
            c.get("type") in ("Complete", "Failed") and c.get("status") == "True"
            for c in status.get("conditions") or []
        )
        return status if complete else None

    return wait_until(done, timeout=60, what=f"the controller to answer ResourcePoolStatusRequest {name}")


def _compare(status: dict[str, Any], ours: dict[str, dict[str, float]]) -> dict[str, Any]:
    """Per pool: theirs vs ours for each count, and the validation error vs our invalid flag."""
    report: dict[str, Any] = {}
    for pool in status.get("pools") or []:
        name = pool["poolName"]
        mine = ours.get(name, {})
        report[name] = {
            "counts": {ours_name: (pool.get(field), mine.get(ours_name)) for ours_name, field in FIELDS.items()},
            "invalid": (bool(pool.get("validationError")), mine.get("kube_resourcepool_invalid")),
            "validationError": pool.get("validationError"),
            "partitions": {
                entry["type"]: (
                    (entry.get("total"), mine.get(f"kube_resourcepool_partitions/{entry['type']}")),
                    (entry.get("allocatable"), mine.get(f"kube_resourcepool_partitions_free/{entry['type']}")),
                )
                for entry in pool.get("partitionSummary") or []
            },
        }
    return report


def test_pool_figures_agree_with_resource_pool_status_request(oracle_testbed, start_exporter_app):
    client = KubeClient(load_credentials(str(oracle_testbed.kubeconfig)))
    with contextlib.suppress(ApiError):
        client.send_json("POST", "/api/v1/namespaces", {"metadata": {"name": NS}})
    for node in (NODE, BAD_NODE, TYPED):
        ready_node(client, node)
    for obj in (*SLICES, *_typed_slices()):
        create(client, obj)
    create(client, driver_class(DRIVER))
    app = start_exporter_app(str(oracle_testbed.kubeconfig))
    wait_until(lambda: app.state.not_synced() is None, what="sync")

    before = _compare(
        _request_status(client, "oracle-before"), wait_until(lambda: _ours(app.port).get(NODE) and _ours(app.port))
    )
    assert place(client, NS, "first-half", NODE, DRIVER, HALF)
    assert place(client, NS, "typed-half", TYPED, DRIVER, HALF)
    wait_until(
        lambda: all(_ours(app.port)[p].get("kube_resourcepool_devices_allocated") == 1.0 for p in (NODE, TYPED)),
        what="the allocations seen",
    )
    # The controller answers each request once, from its informers: ask again until its answer
    # counts the allocations too (a request made before its informers saw them would not).
    attempts = itertools.count()

    def allocations_seen_by_the_controller() -> dict[str, Any] | None:
        status = _request_status(client, f"oracle-after-{next(attempts)}")
        allocated = {p["poolName"]: p.get("allocatedDevices") for p in status.get("pools") or []}
        return status if all(allocated.get(pool) == 1 for pool in (NODE, TYPED)) else None

    status = wait_until(allocations_seen_by_the_controller, timeout=60, what="the controller to count the allocations")
    after = _compare(status, _ours(app.port))
    # Where the two differ by design (docs/metrics.md, "Agreement with ResourcePoolStatusRequest"):
    for report in (before, after):
        # The pool whose device names an undefined counter set: the scheduler allocates nothing from
        # it (test_shared_counters), we call it invalid; the request reports it without an error.
        assert report[BAD_NODE]["invalid"] == (False, 1.0), report[BAD_NODE]
        for pool in (NODE, TYPED):
            entry = report[pool]
            assert entry["invalid"] == (False, 0.0), entry
            counts = entry["counts"]
            for family in ("kube_resourcepool_devices", "kube_resourcepool_devices_allocated"):
                theirs, mine = counts[family]
                assert theirs == mine, (pool, family, entry)
            # availableDevices is total - allocated - tainted: it does not count partitions whose
            # shared counters are used up; ours (what the scheduler can still allocate) does.
            theirs, mine = counts["kube_resourcepool_devices_free"]
            assert mine is not None and theirs >= mine, (pool, entry)
        # With a partition type, the request's summary is what ours says, type by type, and its
        # allocatable partitions add up to our free devices.
        partitions = report[TYPED]["partitions"]
        assert set(partitions) == {"full", "half"}, partitions
        for (total, our_total), (allocatable, our_free) in partitions.values():
            assert (total, allocatable) == (our_total, our_free), partitions
        free = report[TYPED]["counts"]["kube_resourcepool_devices_free"][1]
        assert sum(allocatable for _, (allocatable, _) in partitions.values()) == free
    # One half taken: the request says 2 available, ours (and the scheduler) 1.
    assert after[NODE]["counts"]["kube_resourcepool_devices_free"] == (2, 1.0)
    assert after[TYPED]["partitions"] == {"full": ((1, 1.0), (0, 0.0)), "half": ((2, 2.0), (1, 1.0))}
