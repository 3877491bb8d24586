"""Pods: claim references (as kube-state-metrics' kube_pod_resourceclaim_info) and device health
from allocatedResourcesStatus, parsed from pod objects shaped as Kubernetes 1.34-1.37 write them."""

from __future__ import annotations

from typing import Any

import pytest
from google.protobuf import json_format

from bench.workload import Workload
from bench.workload import pod as bench_pod
from otel_dra._generated.k8s import core_pb2
from otel_dra.cluster import pod
from otel_dra.cluster.pod import ClaimRef, DeviceHealth


def _pod(spec: dict[str, Any] | None = None, status: dict[str, Any] | None = None) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"namespace": "ml", "name": "trainer", "uid": "u-1", "resourceVersion": "7"},
        "spec": spec or {"containers": [{"name": "c", "image": "x"}]},
        "status": status or {},
    }


def _samples(obj: pod.Pod) -> dict[str, list[tuple[tuple[str, ...], float]]]:
    return {f.gauge.name: [(tuple(labels), value) for labels, value in f.samples(obj)] for f in pod.STATE_FAMILIES}


def test_template_and_direct_claims_resolve_to_their_resourceclaims() -> None:
    problems: list[str] = []
    parsed = pod.parse(
        _pod(
            {
                "containers": [{"name": "c", "image": "x", "resources": {"claims": [{"name": "gpu"}]}}],
                "resourceClaims": [
                    {"name": "gpu", "resourceClaimTemplateName": "one-gpu"},
                    {"name": "shared", "resourceClaimName": "team-nic"},
                    {"name": "pending", "resourceClaimTemplateName": "one-gpu"},  # not generated yet
                ],
            },
            {"resourceClaimStatuses": [{"name": "gpu", "resourceClaimName": "trainer-gpu-x7k2p"}]},
        ),
        problems.append,
    )
    assert parsed.claims == (
        ClaimRef("gpu", "trainer-gpu-x7k2p", "one-gpu"),
        ClaimRef("shared", "team-nic", ""),
        ClaimRef("pending", "", "one-gpu"),
    )
    assert _samples(parsed)["kube_pod_resourceclaim_info"] == [
        (("ml", "trainer", "u-1", "gpu", "trainer-gpu-x7k2p", "one-gpu"), 1.0),
        (("ml", "trainer", "u-1", "shared", "team-nic", ""), 1.0),
        (("ml", "trainer", "u-1", "pending", "", "one-gpu"), 1.0),
    ]
    assert problems == []


def test_device_health_joins_claim_and_device() -> None:
    problems: list[str] = []
    parsed = pod.parse(
        _pod(
            {
                "containers": [{"name": "c", "image": "x"}],
                "resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": "t"}],
            },
            {
                "resourceClaimStatuses": [{"name": "gpu", "resourceClaimName": "trainer-gpu-abc"}],
                "containerStatuses": [
                    {
                        "name": "c",
                        "allocatedResourcesStatus": [
                            {
                                "name": "claim:gpu/dev",
                                "resources": [
                                    {"resourceID": "gpu.example.com/node-1/gpu-0", "health": "Healthy"},
                                    {
                                        "resourceID": "gpu.example.com/node-1/gpu-1",
                                        "health": "Unhealthy",
                                        "message": "XID 79",
                                    },
                                ],
                            },
                            {"name": "nvidia.com/gpu", "resources": [{"resourceID": "GPU-abc", "health": "Healthy"}]},
                            {"name": "claim:scheduler-made-claim", "resources": [{"resourceID": "d/p/x"}]},
                            # A driver that returns CDI device IDs: the kubelet names the device by
                            # the first one (v1.37 buildResourceHealth).
                            {
                                "name": "claim:gpu",
                                "resources": [
                                    {"resourceID": "k8s.gpu.example.com/gpu=8d1f-gpu-3", "health": "Unhealthy"},
                                    {"resourceID": "not a device", "health": "Healthy"},
                                ],
                            },
                        ],
                    }
                ],
            },
        ),
        problems.append,
    )
    assert parsed.health == (
        DeviceHealth("c", "trainer-gpu-abc", "dev", "gpu.example.com", "node-1", "gpu-0", "Healthy"),
        DeviceHealth("c", "trainer-gpu-abc", "dev", "gpu.example.com", "node-1", "gpu-1", "Unhealthy"),
        # An extended-resource claim is named by the ResourceClaim itself; no health yet: Unknown.
        DeviceHealth("c", "scheduler-made-claim", "", "d", "p", "x", "Unknown"),
        DeviceHealth("c", "trainer-gpu-abc", "", "", "", "", "Unhealthy", "k8s.gpu.example.com/gpu=8d1f-gpu-3"),
    )
    health = _samples(parsed)["kube_pod_resourceclaim_device_health"]
    unhealthy = [labels for labels, value in health if value == 1.0 and labels[-1] == "Unhealthy"]
    assert unhealthy == [
        (
            *("ml", "trainer", "u-1", "c", "trainer-gpu-abc", "dev"),
            *("gpu.example.com", "node-1", "gpu-1", "gpu.example.com/node-1/gpu-1", "Unhealthy"),
        ),
        (
            *("ml", "trainer", "u-1", "c", "trainer-gpu-abc", ""),
            "",
            "",
            "",
            "k8s.gpu.example.com/gpu=8d1f-gpu-3",
            "Unhealthy",
        ),
    ]
    # One series per device, its current health as the label: no zero-valued series.
    assert [(labels[-3], labels[-1], value) for labels, value in health] == [
        ("gpu-0", "Healthy", 1.0),
        ("gpu-1", "Unhealthy", 1.0),
        ("x", "Unknown", 1.0),
        ("", "Unhealthy", 1.0),
    ]
    assert problems == [
        "allocatedResourcesStatus claim:gpu: resourceID 'not a device' is neither <driver>/<pool>/<device> "
        "nor a CDI device ID <vendor>/<class>=<name>"
    ]


def test_a_slim_parser_keeps_only_the_fields_of_the_served_families() -> None:
    obj = _pod(
        {"containers": [{"name": "c", "image": "x"}], "resourceClaims": [{"name": "gpu", "resourceClaimName": "g"}]},
        {
            "containerStatuses": [
                {
                    "name": "c",
                    "allocatedResourcesStatus": [
                        {"name": "claim:gpu", "resources": [{"resourceID": "d/p/x", "health": "Healthy"}]}
                    ],
                }
            ]
        },
    )
    full = pod.parse(obj, [].append)
    assert full.claims and full.health
    assert pod.make_parser(("health",))(obj, [].append) == pod.Pod("ml", "trainer", "u-1", health=full.health)
    assert pod.make_parser(("claims",))(obj, [].append) == pod.Pod("ml", "trainer", "u-1", claims=full.claims)
    assert pod.make_parser(())(obj, [].append) == pod.Pod("ml", "trainer", "u-1")


def test_a_pod_without_dra_keeps_nothing_and_bad_fields_are_reported() -> None:
    problems: list[str] = []
    assert pod.parse(_pod(), problems.append) == pod.Pod("ml", "trainer", "u-1")
    odd = pod.parse(
        _pod(
            {
                "resourceClaims": [
                    "not-a-dict",
                    {"resourceClaimName": "nameless"},
                    {"name": "ok", "resourceClaimName": 5},
                ]
            },
            {
                "resourceClaimStatuses": "wrong",
                "containerStatuses": [
                    {
                        "name": "c",
                        "allocatedResourcesStatus": [{"name": "claim:ok", "resources": [{"resourceID": "a/b"}]}],
                    },
                    {
                        "name": "d",
                        "allocatedResourcesStatus": [
                            {"name": "claim:ok", "resources": [{"resourceID": "a/b/c", "health": "Sick"}]}
                        ],
                    },
                ],
            },
        ),
        problems.append,
    )
    assert odd.claims == (ClaimRef("ok", "", ""),)
    assert odd.health == (DeviceHealth("d", "ok", "", "a", "b", "c", "Unknown"),)
    assert len(problems) == 2 and "'a/b' is neither <driver>/<pool>/<device>" in problems[0] and "'Sick'" in problems[1]


def _pods_of_every_shape() -> list[dict[str, Any]]:
    """The pods of this module's tests and the bench workload's, as JSON."""
    w = Workload(claims=8, namespaces=2)
    out = [bench_pod(j, w) for j in range(8)]
    health = {"name": "claim:gpu/gpu", "resources": [{"resourceID": "d/p/x", "health": "Unhealthy"}]}
    out.append(
        _pod(
            {"containers": [{"name": "c"}], "resourceClaims": [{"name": "gpu", "resourceClaimName": "c1"}]},
            {
                "initContainerStatuses": [{"name": "init", "allocatedResourcesStatus": [health]}],
                "containerStatuses": [{"name": "c", "allocatedResourcesStatus": [health, {"name": "nvidia.com/gpu"}]}],
            },
        )
    )
    out.append(_pod())
    return out


def test_a_pod_decoded_from_protobuf_parses_as_its_json() -> None:
    # The trimmed message built from the JSON (same field names), encoded, decoded again: what the
    # reflector gets from a protobuf list. The real API server's protobuf is compared with its JSON
    # in tests/integration/test_pods_protobuf.py.
    for obj in _pods_of_every_shape():
        message = json_format.ParseDict(obj, core_pb2.Pod(), ignore_unknown_fields=True)
        decoded = pod.from_protobuf(message.SerializeToString())
        a: list[str] = []
        b: list[str] = []
        assert pod.parse(decoded, a.append) == pod.parse(obj, b.append)
        assert a == b
        assert decoded["metadata"] == {
            k: v for k, v in obj["metadata"].items() if k in ("name", "namespace", "uid", "resourceVersion")
        }


def test_a_malformed_protobuf_pod_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="malformed protobuf Pod"):
        pod.from_protobuf(b"\x0a\x05ab")
