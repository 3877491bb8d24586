"""Fields newer than Kubernetes 1.34, from the real API server and kube-scheduler of the minor that
serves them (the testbed turns their alpha gates on: see RELEASE_SETTINGS):

- list-typed device attributes (1.36+, DRAListTypeAttributes) in ``kube_resourceslice_device_info``;
- optional node operations (1.37+, DRAOptionalNodeOperations): ``skipNodeOperations`` of a slice,
  and the copy the scheduler puts into the allocation results of the claims it allocates there.

The golden files hold what 1.34 serves, so these are checked here, on the minors that have them.
"""

from __future__ import annotations

import contextlib
from typing import Any

import pytest

from otel_dra.cluster.resourceslice import DeviceAttributes
from otel_dra.fixtures import create
from otel_dra.kube.client import ApiError, KubeClient, load_credentials
from tests.helpers import (
    declare_node_features,
    driver_class,
    node_slice,
    parse_samples,
    place,
    ready_node,
    scrape,
    wait_until,
)

NS = "current-api"


def _series(port: int, name: str, driver: str) -> list[dict[str, str]]:
    code, text = scrape(port)
    assert code == 200
    return [
        labels for n, labels, value in parse_samples(text) if n == name and labels.get("driver") == driver and value
    ]


@pytest.fixture
def objects(testbed_sched):
    client = KubeClient(load_credentials(str(testbed_sched.kubeconfig)))
    with contextlib.suppress(ApiError):
        client.send_json("POST", "/api/v1/namespaces", {"metadata": {"name": NS}})
    made: list[str] = []

    def make(obj: dict[str, Any]) -> dict[str, Any]:
        created = create(client, obj)
        if obj["kind"] in ("ResourceSlice", "DeviceClass"):
            plural = {"ResourceSlice": "resourceslices", "DeviceClass": "deviceclasses"}[obj["kind"]]
            made.append(f"/apis/resource.k8s.io/v1/{plural}/{obj['metadata']['name']}")
        return created

    yield client, make
    for path in (f"/api/v1/namespaces/{NS}/pods", f"/apis/resource.k8s.io/v1/namespaces/{NS}/resourceclaims"):
        with contextlib.suppress(ApiError):
            client.request("DELETE", path, query={"gracePeriodSeconds": 0})
    for path in made:
        with contextlib.suppress(ApiError):
            client.request("DELETE", path)


@pytest.mark.kubernetes(min="1.36", reason="list-typed device attributes are alpha from Kubernetes 1.36")
def test_list_typed_attributes_in_device_info(objects, testbed_sched, start_exporter_app):
    _client, make = objects
    driver = "lists.example.com"
    created = make(
        node_slice(
            "lists",
            driver,
            "lists-node",
            devices=[
                {
                    "name": "gpu-0",
                    "attributes": {
                        "numaNodes": {"ints": [1, 0]},
                        "links": {"strings": [f"nvlink-{i}" for i in range(10)]},
                        "type": {"string": "gpu"},
                    },
                }
            ],
        )
    )
    # The API server kept the lists (it drops fields of a gate that is off).
    assert created["spec"]["devices"][0]["attributes"]["numaNodes"] == {"ints": [1, 0]}
    app = start_exporter_app(
        str(testbed_sched.kubeconfig), device_attributes=DeviceAttributes.parse("type,numaNodes,links")
    )
    wait_until(lambda: app.state.not_synced() is None, what="sync")
    [info] = wait_until(lambda: _series(app.port, "kube_resourceslice_device_info", driver), what="device_info")
    assert info["attribute_type"] == "gpu"
    assert info["attribute_numa_nodes"] == "1,0"
    assert info["attribute_links"] == ",".join(f"nvlink-{i}" for i in range(8)) + ",+2 more"


@pytest.mark.kubernetes(min="1.37", reason="skipNodeOperations is alpha from Kubernetes 1.37")
def test_devices_that_skip_node_operations(objects, testbed_sched, start_exporter_app):
    client, make = objects
    driver = "skip.example.com"
    ready_node(client, "skip-node")
    declare_node_features(client, "skip-node", "DRAOptionalNodeOperations")
    make(driver_class(driver))
    created = make(
        node_slice("skip", driver, "skip-node", devices=[{"name": "d0"}, {"name": "d1"}], skipNodeOperations=["*"])
    )
    assert created["spec"]["skipNodeOperations"] == ["*"]
    make(node_slice("noskip", "noskip.example.com", "skip-node", devices=[{"name": "d0"}]))
    app = start_exporter_app(str(testbed_sched.kubeconfig))
    wait_until(lambda: app.state.not_synced() is None, what="sync")
    ops = {"NodePrepareResources", "NodeUnprepareResources"}
    wait_until(
        lambda: {s["operation"] for s in _series(app.port, "kube_resourceslice_skip_node_operation", driver)} == ops,
        what="the slice's skipped operations",
    )
    assert _series(app.port, "kube_resourceslice_skip_node_operation", "noskip.example.com") == []

    # The real scheduler copies the slice's list into the allocation result.
    assert place(client, NS, "skipper", "skip-node", driver)
    claim = client.get_json(f"/apis/resource.k8s.io/v1/namespaces/{NS}/resourceclaims/skipper")
    (result,) = claim["status"]["allocation"]["devices"]["results"]
    assert result["skipNodeOperations"] == ["*"]
    series = wait_until(
        lambda: _series(app.port, "kube_resourceclaim_device_skip_node_operation", driver), what="claim series"
    )
    assert {(s["resourceclaim_name"], s["device_name"], s["operation"]) for s in series} == {
        ("skipper", result["device"], op) for op in ops
    }
