"""Pods: claim references (as kube-state-metrics' kube_pod_resourceclaim_info) and device health
from allocatedResourcesStatus, parsed from pod objects shaped as Kubernetes 1.34-1.37 write them."""

from __future__ import annotations

from datetime import datetime
from typing import Any

import pytest
from google.protobuf import json_format

from bench.workload import Workload
from bench.workload import pod as bench_pod
from otel_dra._generated.k8s import core_pb2, meta_pb2
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


def _drop(problem: str) -> None:
    """A report that drops what it is told (for tests that look at other things)."""


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
    full = pod.parse(obj, _drop)
    assert full.claims and full.health
    assert pod.make_parser(("health",))(obj, _drop) == pod.Pod("ml", "trainer", "u-1", health=full.health)
    assert pod.make_parser(("claims",))(obj, _drop) == pod.Pod("ml", "trainer", "u-1", claims=full.claims)
    assert pod.make_parser(())(obj, _drop) == pod.Pod("ml", "trainer", "u-1")


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
    every = pod.make_parser(pod.FIELDS | pod.START_FIELDS)
    for obj in [*_pods_of_every_shape(), *_pods_starting()]:
        decoded = pod.from_protobuf(_encoded(obj))
        for parse in (pod.parse, every):
            a: list[str] = []
            b: list[str] = []
            assert parse(decoded, a.append) == parse(obj, b.append)
            assert a == b
        assert decoded["metadata"] == {
            k: v for k, v in obj["metadata"].items() if k in ("name", "namespace", "uid", "resourceVersion")
        }


def _as_message(value: Any, message: Any) -> Any:
    """A JSON object as json_format reads it into the trimmed message: its meta.v1.Time fields
    (RFC 3339 in the JSON) as {seconds}, the way the API server encodes them; null as the empty
    message it writes for a time not set. Fields the trimmed message lacks are left out."""
    if message.full_name == meta_pb2.Time.DESCRIPTOR.full_name:
        return {} if value is None else {"seconds": int(datetime.fromisoformat(value).timestamp())}
    out = {}
    for key, item in value.items():
        field = message.fields_by_name.get(key)
        if field is None:
            continue
        if field.message_type is None:
            out[key] = item
        elif field.is_repeated:
            out[key] = [_as_message(x, field.message_type) for x in item]
        else:
            out[key] = _as_message(item, field.message_type)
    return out


def _encoded(obj: dict[str, Any]) -> bytes:
    return json_format.ParseDict(_as_message(obj, core_pb2.Pod.DESCRIPTOR), core_pb2.Pod()).SerializeToString()


T0, T1, T2 = "2026-11-01T00:00:01Z", "2026-11-01T00:00:05Z", "2026-11-01T00:01:30Z"
START = pod.make_parser(pod.START_FIELDS)


def _ts(value: str) -> float:
    return datetime.fromisoformat(value).timestamp()


def _scheduled(status: str = "True", at: str | None = T0) -> dict[str, Any]:
    return {"type": "PodScheduled", "status": status, "lastTransitionTime": at}


def _container(name: str, state: dict[str, Any]) -> dict[str, Any]:
    return {"name": name, "ready": False, "restartCount": 0, "state": state}


def _pods_starting() -> list[dict[str, Any]]:
    """Pods on the way to running, as the API server's JSON has them (null for a time not set)."""
    node = {"nodeName": "node-7", "containers": [{"name": "a"}, {"name": "b"}]}
    return [
        # Pending: not scheduled yet (no nodeName, PodScheduled False), no containerStatuses.
        _pod({"containers": [{"name": "a"}]}, {"phase": "Pending", "conditions": [_scheduled("False", T0)]}),
        # Scheduled, containers being created (waiting).
        _pod(
            node,
            {
                "conditions": [_scheduled()],
                "containerStatuses": [
                    _container("a", {"waiting": {"reason": "ContainerCreating"}}),
                    _container("b", {"waiting": {"reason": "ContainerCreating"}}),
                ],
            },
        ),
        # Partly started: a running, b still waiting.
        _pod(
            node,
            {
                "conditions": [_scheduled()],
                "containerStatuses": [
                    _container("a", {"running": {"startedAt": T1}}),
                    _container("b", {"waiting": {"reason": "ContainerCreating"}}),
                ],
            },
        ),
        # All started: a ran and ended, b running; the init container (not counted) ended long ago.
        _pod(
            node,
            {
                "conditions": [
                    {"type": "Initialized", "status": "True", "lastTransitionTime": T1},
                    {"type": "Ready", "status": "False", "lastTransitionTime": T2},
                    _scheduled(),
                ],
                "initContainerStatuses": [_container("init", {"terminated": {"exitCode": 0, "startedAt": None}})],
                "containerStatuses": [
                    _container("a", {"terminated": {"exitCode": 0, "startedAt": T2, "finishedAt": T2}}),
                    _container("b", {"running": {"startedAt": T1}}),
                ],
            },
        ),
        # Ended without ever running (startedAt null): not started.
        _pod(
            node,
            {
                "conditions": [_scheduled()],
                "containerStatuses": [
                    _container("a", {"running": {"startedAt": T1}}),
                    _container("b", {"terminated": {"exitCode": 128, "reason": "StartError", "startedAt": None}}),
                ],
            },
        ),
    ]


def test_start_times_of_pods_pending_starting_and_started() -> None:
    problems: list[str] = []
    got = [(p.scheduled_at, p.started_at, p.node) for p in (START(o, problems.append) for o in _pods_starting())]
    assert got == [
        (None, None, ""),  # PodScheduled False: not scheduled
        (_ts(T0), None, "node-7"),
        (_ts(T0), None, "node-7"),  # one of two containers running: not started
        (_ts(T0), _ts(T2), "node-7"),  # the latest start, the terminated container's included
        (_ts(T0), None, "node-7"),
    ]
    assert problems == []
    # The bench pod: scheduled and running; the Ready condition is not what is read.
    bench = START(bench_pod(0, Workload(claims=1)), problems.append)
    assert (bench.scheduled_at, bench.started_at, bench.node) == (_ts(T1), _ts(T1), "node-00000")
    # Only the start times are kept: the families' fields stay empty.
    assert (bench.claims, bench.health) == ((), ())


def test_start_times_from_protobuf_are_those_of_the_json() -> None:
    for obj in [*_pods_starting(), bench_pod(0, Workload(claims=1))]:
        decoded = pod.from_protobuf(_encoded(obj))
        assert START(decoded, _drop) == START(obj, _drop)
        # The JSON shape the API server writes (RFC 3339 strings), of the last PodScheduled only.
        scheduled = [c for c in obj["status"].get("conditions", ()) if c["type"] == "PodScheduled"][-1:]
        assert decoded.get("status", {}).get("conditions", []) == scheduled
    started = pod.from_protobuf(_encoded(_pods_starting()[4]))["status"]["containerStatuses"]
    assert [c["state"] for c in started] == [{"running": {"startedAt": T1}}, {"terminated": {"startedAt": None}}]
    # Sub-second nanos are dropped, as the API server's JSON drops them.
    message = core_pb2.Pod()
    message.status.conditions.add(type="PodScheduled", status="True").lastTransitionTime.MergeFrom(
        meta_pb2.Time(seconds=int(_ts(T0)), nanos=999_000_000)
    )
    assert pod.from_protobuf(message.SerializeToString())["status"]["conditions"][0]["lastTransitionTime"] == T0


def test_malformed_start_times_are_reported_not_raised() -> None:
    problems: list[str] = []
    odd = START(
        _pod(
            {"nodeName": 7},
            {
                "conditions": [_scheduled(at="yesterday")],
                "containerStatuses": [_container("a", {"running": {"startedAt": 1793491205}})],
            },
        ),
        problems.append,
    )
    assert (odd.scheduled_at, odd.started_at, odd.node) == (None, None, "")
    assert problems == [
        "status.conditions[PodScheduled].lastTransitionTime: not a timestamp: 'yesterday'; series omitted",
        "status.containerStatuses[0].state.running.startedAt: not a timestamp: 1793491205; series omitted",
    ]
    # Not dicts where dicts belong, and a timestamp without a zone: reported or None, never raised.
    problems.clear()
    weird = _pod(
        {},
        {
            "conditions": [
                "x",
                {"type": "PodScheduled", "status": "True", "lastTransitionTime": "2026-11-01T00:00:01"},
            ],
            "containerStatuses": ["x", {"state": "running"}],
        },
    )
    assert START(weird, problems.append) == pod.Pod("ml", "trainer", "u-1")
    assert problems == [
        "status.conditions[PodScheduled].lastTransitionTime: timestamp without a time zone: "
        "'2026-11-01T00:00:01'; series omitted"
    ]
    # Out of range in protobuf (year 33658; past what time.gmtime takes): reported by the parser.
    for seconds in (10**12, 10**18):
        message = core_pb2.Pod()
        message.status.conditions.add(type="PodScheduled", status="True").lastTransitionTime.seconds = seconds
        problems.clear()
        assert START(pod.from_protobuf(message.SerializeToString()), problems.append).scheduled_at is None
        assert len(problems) == 1 and "not a timestamp" in problems[0]


def test_the_default_parser_keeps_no_start_times() -> None:
    obj = bench_pod(0, Workload(claims=1))
    both = pod.make_parser(pod.FIELDS | pod.START_FIELDS)(obj, _drop)
    assert both.scheduled_at is not None and both.started_at is not None and both.node
    for parse in (pod.parse, pod.make_parser(), pod.make_parser(pod.FIELDS), pod.make_parser(("claims", "other"))):
        slim = parse(obj, _drop)
        # None and "" are shared objects: a pod that keeps no start times holds no time or string of its own.
        assert slim.scheduled_at is None and slim.started_at is None and slim.node == ""
    assert pod.parse(obj, _drop) == pod.Pod(both.namespace, both.name, both.uid, both.claims, both.health)


def test_the_decoder_of_a_parser_without_start_times_leaves_them_out() -> None:
    obj = bench_pod(0, Workload(claims=1))
    data = _encoded(obj)
    assert pod.resource(pod.FIELDS | pod.START_FIELDS) is pod.RESOURCE
    slim = pod.resource(pod.FIELDS)
    assert slim == pod.RESOURCE and slim.protobuf is not None and slim.protobuf is not pod.from_protobuf
    trimmed = slim.protobuf(data)
    assert "nodeName" not in trimmed["spec"] and "conditions" not in trimmed["status"]
    assert all("state" not in c for c in trimmed["status"]["containerStatuses"])
    assert pod.parse(trimmed, _drop) == pod.parse(pod.from_protobuf(data), _drop) == pod.parse(obj, _drop)


def test_a_malformed_protobuf_pod_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="malformed protobuf Pod"):
        pod.from_protobuf(b"\x0a\x05ab")
