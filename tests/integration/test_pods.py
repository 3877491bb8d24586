"""Pods against the real API server, scheduler and resourceclaim controller: kube_pod_resourceclaim_info
names the claim the controller generated from a template, and the direct claim, and follows the pod."""

from __future__ import annotations

import contextlib
import logging
from typing import Any

from otel_dra.fixtures import create, object_path
from otel_dra.kube.client import ApiError, KubeClient, load_credentials
from tests.helpers import parse_samples, rbac_kubeconfig, ready_node, scrape, wait_until

NS = "pods-info"
DRIVER = "pods.example.com"
NODE = "pods-node"
FAMILY = "kube_pod_resourceclaim_info"


def _objects() -> list[dict[str, Any]]:
    request = {"devices": {"requests": [{"name": "dev", "exactly": {"deviceClassName": DRIVER}}]}}
    return [
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NS}},
        {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "DeviceClass",
            "metadata": {"name": DRIVER},
            "spec": {"selectors": [{"cel": {"expression": f"device.driver == '{DRIVER}'"}}]},
        },
        {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceSlice",
            "metadata": {"name": f"{NODE}-slice"},
            "spec": {
                "driver": DRIVER,
                "nodeName": NODE,
                "pool": {"name": NODE, "generation": 1, "resourceSliceCount": 1},
                "devices": [{"name": "d0"}, {"name": "d1"}],
            },
        },
        {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaimTemplate",
            "metadata": {"name": "one-dev", "namespace": NS},
            "spec": {"spec": request},
        },
        {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaim",
            "metadata": {"name": "shared", "namespace": NS},
            "spec": request,
        },
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "worker", "namespace": NS},
            "spec": {
                "containers": [
                    {
                        "name": "c",
                        "image": "registry.k8s.io/pause:3.10",
                        "resources": {"claims": [{"name": "gpu"}, {"name": "nic"}]},
                    }
                ],
                "resourceClaims": [
                    {"name": "gpu", "resourceClaimTemplateName": "one-dev"},
                    {"name": "nic", "resourceClaimName": "shared"},
                ],
            },
        },
    ]


def _info(port: int) -> list[dict[str, str]]:
    code, text = scrape(port)
    assert code == 200, text
    return sorted(
        (labels for name, labels, _ in parse_samples(text) if name == FAMILY and labels["namespace"] == NS),
        key=lambda labels: labels["claim_name"],
    )


def test_pod_claims_resolve_to_the_generated_and_the_direct_claim(testbed_sched, start_exporter_app):
    client = KubeClient(load_credentials(str(testbed_sched.kubeconfig)))
    ready_node(client, NODE)
    for obj in _objects():
        create(client, obj)
    try:
        app = start_exporter_app(str(testbed_sched.kubeconfig))
        wait_until(lambda: app.state.not_synced() is None, what="sync")

        def generated() -> str | None:
            pod = client.get_json(f"/api/v1/namespaces/{NS}/pods/worker")
            names = {
                s["name"]: s.get("resourceClaimName") for s in pod.get("status", {}).get("resourceClaimStatuses", [])
            }
            return names.get("gpu")

        claim = wait_until(generated, what="the resourceclaim controller to generate the pod's claim")
        uid = client.get_json(f"/api/v1/namespaces/{NS}/pods/worker")["metadata"]["uid"]
        expected = [
            {"namespace": NS, "pod": "worker", "uid": uid, "claim_name": "gpu", "resourceclaim_name": claim,
             "resourceclaim_template_name": "one-dev"},
            {"namespace": NS, "pod": "worker", "uid": uid, "claim_name": "nic", "resourceclaim_name": "shared",
             "resourceclaim_template_name": ""},
        ]  # fmt: skip
        wait_until(lambda: _info(app.port) == expected, what="the pod's claims in kube_pod_resourceclaim_info")
        # The generated claim is the template's; the one the pod names is direct.
        sources = {
            labels["resourceclaim_name"]: labels["source"]
            for name, labels, _ in parse_samples(scrape(app.port)[1])
            if name == "kube_resourceclaim_source" and labels["namespace"] == NS
        }
        assert sources == {claim: "template", "shared": "direct"}
        client.request("DELETE", f"/api/v1/namespaces/{NS}/pods/worker", query={"gracePeriodSeconds": 0})
        wait_until(lambda: _info(app.port) == [], what="the deleted pod's series to go")
    finally:
        for obj in reversed(_objects()):  # the namespace last takes what is left of it
            with contextlib.suppress(ApiError):
                client.request("DELETE", object_path(obj))


def test_without_rbac_for_pods_the_rest_is_served(testbed, start_exporter_app, caplog):
    """The exporter's least-privilege role without pods: ready, pods logged once as forbidden."""
    kubeconfig = rbac_kubeconfig(testbed, "no-pods", "[list, watch]")
    with caplog.at_level(logging.INFO, logger="otel_dra.kube.reflector"):
        app = start_exporter_app(kubeconfig)
        wait_until(lambda: app.state.not_synced() is None, what="sync without pods")
        code, text = scrape(app.port)
        assert code == 200 and "kube_resourceclaim_status_reserved_total" in text
    [reflector] = [r for r in app.state.reflectors if r.resource.plural == "pods"]
    assert "forbidden" in (reflector.state().unavailable or "")
    messages = [m for m in (r.getMessage() for r in caplog.records) if m.startswith("pods: forbidden")]
    assert len(messages) == 1, messages
