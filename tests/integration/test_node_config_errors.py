"""A claim whose opaque config the plugin cannot decode, on a real node without the config webhook:
the scheduler allocates it, the kubelet asks the plugin to prepare it, the plugin refuses it
(InvalidConfig), and the kubelet reports the plugin's reason as a Warning event of the pod
(FailedPrepareDynamicResources), retrying with backoff; the pod never starts. The reason is the one
the webhook gives at creation (tests/integration/test_webhook.py), word for word.
Marked `node` (``pytest -m node``); skipped, with the reason, where the machine cannot run a node.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from otel_dra.admission.review import decode_review, judge
from otel_dra.fixtures import create
from otel_dra.kube.client import KubeClient, load_credentials
from otel_dra.testbed import Binaries, Testbed
from otel_dra.testbed.node import Node
from tests.helpers import wait_until
from tests.integration import nodes
from tests.integration.nodes import NAMESPACE, HostPlugin, host_plugins, node_binaries, phase, start_plugin

pytestmark = [pytest.mark.node, pytest.mark.testbed]

GPU = nodes.DRIVER
BAD = {"apiVersion": "gpu.resource.example.com/v1alpha1", "kind": "GpuConfig", "sharing": {"strategy": "MPS"}}
REASON = "unknown GPU sharing strategy: 'MPS' (one of TimeSlicing, SpacePartitioning)"


@pytest.fixture(scope="module")
def node_testbed(testbed_binaries: Binaries) -> Iterator[tuple[Testbed, Node]]:
    yield from nodes.node_testbed(node_binaries(testbed_binaries))


@pytest.fixture
def host_plugin(node_testbed: tuple[Testbed, Node]) -> Iterator[list[HostPlugin]]:
    yield from host_plugins()


def _template(name: str) -> dict[str, Any]:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaimTemplate",
        "metadata": {"name": name, "namespace": NAMESPACE},
        "spec": {
            "spec": {
                "devices": {
                    "requests": [{"name": "dev", "exactly": {"deviceClassName": GPU}}],
                    "config": [{"requests": ["dev"], "opaque": {"driver": GPU, "parameters": BAD}}],
                }
            }
        },
    }


def test_a_bad_config_fails_prepare_and_the_pods_events_say_why(
    node_testbed: tuple[Testbed, Node], host_plugin: list[HostPlugin], tmp_path: Path
) -> None:
    testbed, node = node_testbed
    client = KubeClient(load_credentials(str(testbed.kubeconfig)))
    start_plugin(testbed, node, host_plugin, tmp_path / "plugin.log", "--num-devices=1")
    template = _template("bad-config")
    create(client, template)
    pod = nodes.pod("bad-config", [nodes.container("c", claims=("dev",))])
    pod["spec"]["resourceClaims"] = [{"name": "dev", "resourceClaimTemplateName": "bad-config"}]
    create(client, pod)

    def prepare_failures() -> list[dict[str, Any]]:
        events = client.get_json(f"/api/v1/namespaces/{NAMESPACE}/events")["items"]
        return [
            e
            for e in events
            if e["involvedObject"].get("name") == "bad-config" and e.get("reason") == "FailedPrepareDynamicResources"
        ]

    [event] = wait_until(prepare_failures, timeout=90, what="the kubelet's FailedPrepareDynamicResources event")
    status = client.get_json(f"/api/v1/namespaces/{NAMESPACE}/pods/bad-config")["status"]
    [claim_status] = status["resourceClaimStatuses"]
    claim = claim_status["resourceClaimName"]
    # The kubelet's words around the plugin's: the claim, the entry (from the claim) and the reason.
    assert event["type"] == "Warning"
    assert event["message"].startswith(
        f"Failed to prepare dynamic resources: prepare dynamic resources: NodePrepareResources failed for "
        f"ResourceClaim {claim}: prepare claim "
    ), event["message"]
    assert event["message"].endswith(f"ResourceClaim {NAMESPACE}/{claim}: config[0] (FromClaim): {REASON}")
    assert phase(client, "bad-config") == "Pending"
    assert not any(c.get("state", {}).get("running") for c in status.get("containerStatuses") or [])
    # The kubelet tries again, with backoff: the same event, counted (or in a series).
    wait_until(
        lambda: any((e.get("count") or 1) > 1 or e.get("series") for e in prepare_failures()),
        timeout=90,
        what="the kubelet retrying the prepare",
    )
    # The webhook would have refused the template at creation, for the same reason.
    review = {
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": "u",
            "operation": "CREATE",
            "kind": {"group": "resource.k8s.io", "version": "v1", "kind": "ResourceClaimTemplate"},
            "object": template,
        },
    }
    verdict = judge(decode_review(json.dumps(review).encode()), GPU)
    assert not verdict.allowed and verdict.message.endswith(f": {REASON}")
    client.send_json("DELETE", f"/api/v1/namespaces/{NAMESPACE}/pods/bad-config", {})
    wait_until(lambda: phase(client, "bad-config") == "Gone", timeout=90, what="pod bad-config deleted")
