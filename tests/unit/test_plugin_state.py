"""The plugin's claim state (otel_dra/plugin/state.py) on its own: an allocation turned into prepared
devices and CDI edits, and the claims that cannot be prepared, without gRPC, an API server or files."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from otel_dra.plugin.checkpoint import PreparedClaim, PreparedDevice
from otel_dra.plugin.state import (
    ClaimError,
    ClaimRef,
    DeviceState,
    allocated_as,
    check_prepared,
    node_local,
    prepared_edits,
)

DRIVER = "gpu.example.com"
REF = ClaimRef("ns", "u1", "c")


def _state(published: tuple[str, ...] = ("gpu-0", "gpu-1")) -> DeviceState:
    return DeviceState(
        DRIVER,
        "node-a",
        lambda name: name if name in published else None,
        lambda uid, device: [f"k8s.{DRIVER}/gpu={uid}-{device}", f"k8s.{DRIVER}/gpu=common"],
    )


def _claim(*results: dict[str, Any], config: Any = None) -> dict[str, Any]:
    devices: dict[str, Any] = {"results": list(results)}
    if config is not None:
        devices["config"] = config
    return {"metadata": {"name": "c", "namespace": "ns", "uid": "u1"}, "status": {"allocation": {"devices": devices}}}


def _result(device: str, request: str = "r", **extra: Any) -> dict[str, Any]:
    return {"request": request, "driver": DRIVER, "pool": "node-a", "device": device, **extra}


def test_an_allocation_becomes_devices_and_one_cdi_edit_per_device():
    claim = _claim(
        _result("gpu-0", "a"),
        _result("gpu-0", "b"),  # two requests got the same (shareable) device
        _result("gpu-1", "a", consumedCapacity={"memory": "10Gi"}),
        {"request": "x", "driver": "other.example.com", "pool": "p", "device": "d"},  # not ours
    )
    prepared = _state().prepare(REF, claim)
    assert [(d.request_names, d.device_name) for d in prepared.devices] == [
        (("a",), "gpu-0"),
        (("b",), "gpu-0"),
        (("a",), "gpu-1"),
    ]
    assert prepared.devices[0].cdi_device_ids == (f"k8s.{DRIVER}/gpu=u1-gpu-0", f"k8s.{DRIVER}/gpu=common")
    assert [name for name, _ in prepared.edits] == ["gpu-0", "gpu-1"]
    env = dict(prepared.edits)
    assert env["gpu-0"][:2] == ["GPU_DEVICE_GPU_0_RESOURCE_CLAIM=u1", "DRA_ADMIN_ACCESS=false"]
    assert "GPU_DEVICE_1_MEMORY=10Gi" in env["gpu-1"]
    assert all(tuple(env[d.device_name]) == d.container_env for d in prepared.devices)


def test_admin_access_is_the_claims_for_every_device():
    claim = _claim(_result("gpu-0"), {"request": "x", "driver": "o", "pool": "p", "device": "d", "adminAccess": True})
    [(_, env)] = _state().prepare(REF, claim).edits
    assert "DRA_ADMIN_ACCESS=true" in env


def _broken(claim: dict[str, Any], change: Any) -> dict[str, Any]:
    claim = copy.deepcopy(claim)
    change(claim)
    return claim


@pytest.mark.parametrize(
    ("claim", "kind"),
    [
        (_broken(_claim(_result("gpu-0")), lambda c: c["metadata"].update(uid="old")), "UIDMismatch"),
        (_broken(_claim(_result("gpu-0")), lambda c: c.update(status={})), "NotAllocated"),
        (
            _broken(_claim(_result("gpu-0")), lambda c: c["status"]["allocation"]["devices"].update(results={})),
            "InvalidClaim",
        ),
        (_claim({"request": "r", "driver": DRIVER}), "InvalidClaim"),
        (_claim(_result("gpu-0", consumedCapacity=["10Gi"])), "InvalidClaim"),
        (_claim({**_result("gpu-0"), "driver": "other.example.com"}), "NoResultsForDriver"),
        (_claim({**_result("gpu-0"), "pool": "node-b"}), "WrongPool"),
        (_claim(_result("gpu-9")), "UnknownDevice"),
        (_claim(_result("gpu-0"), config=[{"source": "FromClaim", "requests": []}]), "InvalidConfig"),
    ],
)
def test_a_claim_that_cannot_be_prepared_says_why(claim, kind):
    with pytest.raises(ClaimError) as raised:
        _state().prepare(REF, claim)
    assert raised.value.kind == kind


def test_a_prepared_claim_answers_only_under_its_own_name_and_keeps_its_edits():
    device = PreparedDevice(("r",), "node-a", "gpu-0", ("id",), ("A=1",))
    old = PreparedDevice(("r",), "node-a", "gpu-1", ("id",))  # an older plugin version kept no environment
    prepared = PreparedClaim("ns", "c", (device, old))
    check_prepared(REF, prepared)
    with pytest.raises(ClaimError, match="was prepared as ns/c") as raised:
        check_prepared(ClaimRef("other", "u1", "c"), prepared)
    assert raised.value.kind == "UIDMismatch"
    edits = dict(prepared_edits("u1", prepared))
    assert edits["gpu-0"] == ["A=1"]
    assert edits["gpu-1"][:2] == ["GPU_DEVICE_GPU_1_RESOURCE_CLAIM=u1", "DRA_ADMIN_ACCESS=false"]


def test_a_cached_copy_counts_only_with_this_uid_and_an_allocation():
    assert allocated_as(REF, _claim(_result("gpu-0")))
    assert not allocated_as(REF, {**_claim(), "status": {}})
    assert not allocated_as(ClaimRef("ns", "u2", "c"), _claim(_result("gpu-0")))
    assert not allocated_as(REF, {"metadata": None})


def _selector(*terms: dict) -> dict:
    return {"status": {"allocation": {"nodeSelector": {"nodeSelectorTerms": list(terms)}}}}


NODE_FIELD = {"key": "metadata.name", "operator": "In", "values": ["n1"]}


@pytest.mark.parametrize(
    ("claim", "expected"),
    [
        (_selector({"matchFields": [NODE_FIELD]}), True),  # kube-scheduler's, for a node's own devices
        (_selector({"matchFields": [{**NODE_FIELD, "values": ["n2"]}]}), False),
        (_selector({"matchFields": [{**NODE_FIELD, "values": ["n1", "n2"]}]}), False),
        (_selector({"matchFields": [{**NODE_FIELD, "operator": "NotIn"}]}), False),
        (_selector({"matchFields": [NODE_FIELD]}, {"matchFields": [NODE_FIELD]}), False),  # terms are ORed
        (_selector({"matchFields": [NODE_FIELD], "matchExpressions": [{"key": "zone", "operator": "Exists"}]}), False),
        (_selector({"matchExpressions": [{"key": "rack", "operator": "In", "values": ["r1"]}]}), False),
        ({"status": {"allocation": {"devices": {"results": []}}}}, False),  # no selector: any node
        ({"status": {"allocation": {"nodeSelector": "n1"}}}, False),  # malformed
        ({"status": None}, False),
        ({}, False),
    ],
)
def test_node_local_is_the_schedulers_selector_for_one_node(claim: dict, expected: bool) -> None:
    assert node_local(claim, "n1") is expected
