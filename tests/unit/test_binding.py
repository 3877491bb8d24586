"""The binding-condition controller's decisions (otel_dra/binding/claims.py), its bookkeeping of
waiting claims before any write (otel_dra/binding/controller.py: no API request is made), and its
command-line flags. What it writes, against the real API server and kube-scheduler:
tests/integration/test_binding_controller.py."""

from __future__ import annotations

import copy
import logging
import re
from typing import Any

import pytest
from opentelemetry import trace
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from otel_dra.binding import claims
from otel_dra.binding.claims import ATTACHED, FAILED, DeviceKey, MalformedClaim, read_claim
from otel_dra.binding.controller import BindingController
from otel_dra.cli import main
from otel_dra.kube.client import Credentials, KubeClient

DRIVER = "gpu.example.com"
UID = "6a0c3f64-52c4-4a4e-9d3c-0c6f1f3c2b11"


def result(device: str, *, driver: str = DRIVER, share: str | None = None, binding: bool = True) -> dict[str, Any]:
    out: dict[str, Any] = {"request": "gpu", "driver": driver, "pool": "node-a", "device": device}
    if share:
        out["shareID"] = share
    if binding:
        out["bindingConditions"] = ["Attached"]
        out["bindingFailureConditions"] = ["AttachFailed"]
    return out


def claim(
    *results: dict[str, Any],
    devices: list[dict[str, Any]] | None = None,
    stamp: str = "2026-12-01T10:00:00Z",
    uid: str = UID,
    name: str = "c",
) -> dict[str, Any]:
    status: dict[str, Any] = {"allocation": {"devices": {"results": list(results)}, "allocationTimestamp": stamp}}
    if devices is not None:
        status["devices"] = devices
    return {
        "metadata": {"namespace": "ns", "name": name, "uid": uid, "generation": 1, "resourceVersion": "7"},
        "status": status,
    }


def condition(kind: str, status: str = "True", when: str = "2026-12-01T10:00:05Z") -> dict[str, Any]:
    return {"type": kind, "status": status, "reason": "R", "message": "", "lastTransitionTime": when}


def entry(device: str, *conditions: dict[str, Any], share: str | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"driver": DRIVER, "pool": "node-a", "device": device, "conditions": list(conditions)}
    if share:
        out["shareID"] = share
    return out


# --- which results wait -----------------------------------------------------------------------------


def test_unallocated_claims_and_results_without_binding_conditions_need_nothing():
    assert read_claim({"metadata": {"namespace": "ns", "name": "c", "uid": UID}}, DRIVER) is None
    assert read_claim({"metadata": {"namespace": "ns", "name": "c", "uid": UID}, "status": {}}, DRIVER) is None
    assert read_claim(claim(result("gpu-0", binding=False)), DRIVER) is None
    # Another driver's devices are another controller's.
    assert read_claim(claim(result("gpu-0", driver="other.example.com")), DRIVER) is None


def test_a_result_waits_until_its_conditions_are_true_or_one_failure_condition_is():
    allocation = read_claim(claim(result("gpu-0"), result("gpu-1"), result("gpu-2"), result("gpu-3")), DRIVER)
    assert allocation is not None
    assert [t.key.device for t in allocation.waiting] == ["gpu-0", "gpu-1", "gpu-2", "gpu-3"]
    assert allocation.allocated_at == 1796119200.0  # 2026-12-01T10:00:00Z
    decided = claim(
        result("gpu-0"),
        result("gpu-1"),
        result("gpu-2"),
        result("gpu-3"),
        devices=[
            entry("gpu-0", condition("Attached")),
            entry("gpu-1", condition("AttachFailed")),
            entry("gpu-2", condition("Attached", "False"), condition("Ready")),  # another writer's condition
            entry("gpu-3"),
        ],
    )
    allocation = read_claim(decided, DRIVER)
    assert allocation is not None
    assert [t.key.device for t in allocation.waiting] == ["gpu-2", "gpu-3"]
    # What a target keeps of its entry: its own condition types only, not the plugin's Ready.
    gpu2 = next(t for t in allocation.targets if t.key.device == "gpu-2")
    assert set(gpu2.current) == {"Attached"}


def test_every_binding_condition_must_be_true():
    two = dict(result("gpu-0"), bindingConditions=["Attached", "Cabled"])
    half = claim(two, devices=[entry("gpu-0", condition("Attached"))])
    allocation = read_claim(half, DRIVER)
    assert allocation is not None and [t.key.device for t in allocation.waiting] == ["gpu-0"]
    both = claim(two, devices=[entry("gpu-0", condition("Attached"), condition("Cabled"))])
    assert read_claim(both, DRIVER).waiting == ()  # type: ignore[union-attr]


def test_shares_of_one_device_are_matched_by_share_id():
    a, b = "0b7a9d0e-5b1e-4f55-9d0b-1e3f3a7c1c01", "0b7a9d0e-5b1e-4f55-9d0b-1e3f3a7c1c02"
    obj = claim(
        result("nic-0", share=a),
        result("nic-0", share=b),
        devices=[entry("nic-0", condition("Attached"), share=a)],
    )
    allocation = read_claim(obj, DRIVER)
    assert allocation is not None
    assert [t.key for t in allocation.waiting] == [DeviceKey(DRIVER, "node-a", "nic-0", b)]


def test_a_new_allocation_is_a_new_identity():
    first = read_claim(claim(result("gpu-0")), DRIVER)
    same = read_claim(claim(result("gpu-0"), devices=[entry("gpu-0", condition("Ready"))]), DRIVER)
    later = read_claim(claim(result("gpu-0"), stamp="2026-12-01T10:00:09Z"), DRIVER)
    other_device = read_claim(claim(result("gpu-1")), DRIVER)
    assert first is not None and same is not None and later is not None and other_device is not None
    assert first.identity == same.identity
    assert len({first.identity, later.identity, other_device.identity}) == 3


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda c: c.update(metadata=[]), "metadata is not an object"),
        (lambda c: c["metadata"].pop("uid"), "metadata.uid"),
        (lambda c: c["metadata"].update(generation="2"), "metadata.generation"),
        (lambda c: c.update(status=[]), "status is not an object"),
        (lambda c: c["status"].update(allocation="x"), "status.allocation is not an object"),
        (lambda c: c["status"]["allocation"]["devices"].update(results={}), "results is not a list"),
        (lambda c: c["status"]["allocation"]["devices"]["results"].append(7), "results[1] is not an object"),
        (lambda c: c["status"]["allocation"]["devices"]["results"][0].pop("pool"), "results[0].pool"),
        (
            lambda c: c["status"]["allocation"]["devices"]["results"][0].update(bindingConditions="Attached"),
            "results[0].bindingConditions is not a list of strings",
        ),
        (lambda c: c["status"].update(devices={}), "status.devices is not a list"),
        (lambda c: c["status"].update(devices=[{"driver": DRIVER}]), "status.devices[0].pool"),
        (lambda c: c["status"].update(devices=[entry("gpu-0", {"status": "True"})]), "conditions[0] has no type"),
    ],
)
def test_malformed_claims_say_which_field(mutate, message):
    obj = claim(result("gpu-0"))
    mutate(obj)
    with pytest.raises(MalformedClaim, match=re.escape(message)):
        read_claim(obj, DRIVER)


# --- the outcome ------------------------------------------------------------------------------------


def test_the_failure_choice_is_deterministic_and_near_the_fraction():
    keys = [DeviceKey(DRIVER, "node-a", f"gpu-{i}") for i in range(4000)]
    chosen = [claims.fails(UID, k, 0.25) for k in keys]
    assert chosen == [claims.fails(UID, k, 0.25) for k in keys]  # the same in every run
    assert 0.22 < sum(chosen) / len(keys) < 0.28
    assert not any(claims.fails(UID, k, 0.0) for k in keys)
    assert all(claims.fails(UID, k, 1.0) for k in keys)
    # Each of uid, device and share takes part: the choice is per allocated device (share).
    key = keys[0]
    assert len({claims.fails(f"{UID[:-1]}{d}", key, 0.5) for d in "0123456789"}) == 2
    shares = [DeviceKey(DRIVER, "node-a", "nic-0", f"share-{i}") for i in range(40)]
    assert len({claims.fails(UID, s, 0.5) for s in shares}) == 2
    # Monotone in the fraction: what fails at 0.25 fails at 0.5 too.
    assert all(claims.fails(UID, k, 0.5) for k, failed in zip(keys, chosen, strict=True) if failed)


def test_a_result_without_failure_conditions_cannot_fail():
    obj = claim(dict(result("gpu-0"), bindingFailureConditions=None))
    allocation = read_claim(obj, DRIVER)
    assert allocation is not None
    assert claims.outcome(allocation, allocation.targets[0], 1.0) == ATTACHED
    allocation = read_claim(claim(result("gpu-0")), DRIVER)
    assert allocation is not None and claims.outcome(allocation, allocation.targets[0], 1.0) == FAILED


# --- the body -----------------------------------------------------------------------------------------


def test_attached_sets_every_binding_condition_true_keeping_those_already_true():
    cabled = condition("Cabled", when="2026-12-01T09:59:59Z")
    obj = claim(dict(result("gpu-0"), bindingConditions=["Attached", "Cabled"]), devices=[entry("gpu-0", cabled)])
    allocation = read_claim(obj, DRIVER)
    assert allocation is not None
    [target] = allocation.waiting
    got = claims.new_conditions(target, ATTACHED, now=1796119202.7, generation=3, message="m")
    assert got == [
        {
            "type": "Attached",
            "status": "True",
            "reason": claims.ATTACHED_REASON,
            "message": "m",
            "lastTransitionTime": "2026-12-01T10:00:02Z",
            "observedGeneration": 3,
        },
        cabled,
    ]
    [failed] = claims.new_conditions(target, FAILED, now=1796119202.0, generation=None, message="no")
    assert failed["type"] == "AttachFailed" and failed["reason"] == claims.FAILED_REASON
    assert failed["status"] == "True" and "observedGeneration" not in failed
    # metav1.Condition's reason format: CamelCase, as the API server validates it.
    pattern = re.compile(r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$")
    assert pattern.match(claims.ATTACHED_REASON) and pattern.match(claims.FAILED_REASON)


def test_the_apply_body_names_every_binding_result_and_the_uid():
    share = "0b7a9d0e-5b1e-4f55-9d0b-1e3f3a7c1c01"
    done = condition("Attached")
    obj = claim(
        result("gpu-0"),
        result("gpu-1"),
        result("nic-0", share=share),
        result("cpu-0", binding=False),
        devices=[entry("gpu-1", done, condition("Ready"))],
    )
    allocation = read_claim(obj, DRIVER)
    assert allocation is not None
    written = {t.key: claims.new_conditions(t, ATTACHED, now=0, generation=1, message="m") for t in allocation.waiting}
    body = claims.apply_body(allocation, written)
    assert body["apiVersion"] == "resource.k8s.io/v1" and body["kind"] == "ResourceClaim"
    assert body["metadata"] == {"name": "c", "namespace": "ns", "uid": UID}
    devices = body["status"]["devices"]
    assert [(d["device"], d.get("shareID")) for d in devices] == [("gpu-0", None), ("gpu-1", None), ("nic-0", share)]
    assert "shareID" not in devices[0]
    # The decided result keeps its binding condition as it is (our earlier write stays ours), and
    # never carries another writer's Ready.
    assert devices[1]["conditions"] == [done]
    assert devices[0]["conditions"] == written[DeviceKey(DRIVER, "node-a", "gpu-0")]
    assert set(body["status"]) == {"devices"}  # nothing of the allocation or the reservations


def test_seconds_since_allocation():
    allocation = read_claim(claim(result("gpu-0")), DRIVER)
    assert allocation is not None
    assert claims.seconds_since_allocation(allocation, seen_wall=0.0, now=1796119202.5) == 2.5
    assert claims.seconds_since_allocation(allocation, seen_wall=0.0, now=1795082390.0) == 0.0  # clock skew
    unstamped = read_claim(claim(result("gpu-0"), stamp=""), DRIVER)
    assert unstamped is not None and unstamped.allocated_at is None
    assert claims.seconds_since_allocation(unstamped, seen_wall=100.0, now=103.0) == 3.0


def test_the_plugins_binding_conditions_are_what_the_controller_sets():
    """The plugin publishes Attached/AttachFailed (--binding-conditions); the scheduler copies them
    into the allocation results, which is all the controller reads."""
    devices = pytest.importorskip("otel_dra.plugin.devices")
    published = dict(
        result("gpu-0"),
        bindingConditions=[devices.BINDING_CONDITION],
        bindingFailureConditions=[devices.BINDING_FAILURE_CONDITION],
    )
    allocation = read_claim(claim(published), DRIVER)
    assert allocation is not None
    [target] = allocation.waiting
    assert [c["type"] for c in claims.new_conditions(target, ATTACHED, now=0, generation=1, message="")] == ["Attached"]
    assert [c["type"] for c in claims.new_conditions(target, FAILED, now=0, generation=1, message="")] == [
        "AttachFailed"
    ]


# --- the controller's bookkeeping (no API request: the delay is far off) ------------------------------


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def controller():
    # A client for an address nothing listens on: nothing here may reach it (the watch is not
    # started, and no deadline comes within the test).
    credentials = Credentials("http://127.0.0.1:9", "test", None, None, None, True, None, dict)
    reader = InMemoryMetricReader()
    clock = _Clock()
    made = BindingController(
        KubeClient(credentials),
        driver=DRIVER,
        meter_provider=MeterProvider(metric_readers=[reader]),
        tracer_provider=trace.NoOpTracerProvider(),
        attach_delay=3600,
        clock=clock,
    )
    made.clock = clock  # type: ignore[attr-defined]
    made.reader = reader  # type: ignore[attr-defined]
    yield made
    made.stop()


def _points(reader: InMemoryMetricReader) -> dict[str, float]:
    out = {}
    for rm in reader.get_metrics_data().resource_metrics:
        for sm in rm.scope_metrics:
            for metric in sm.metrics:
                for point in metric.data.data_points:
                    out[metric.name] = getattr(point, "value", 0)
    return out


def test_the_controller_keeps_a_deadline_per_allocation(controller):
    c = controller
    c.upsert(claim(result("gpu-0")))
    assert c.entries() == {UID: "waiting"} and c.pending() == 1
    [(due, seq, _)] = c._heap
    assert due == 1000.0 + 3600
    c.clock.now += 10
    # The same allocation again (a relist, the plugin's Ready): the deadline stays.
    c.upsert(claim(result("gpu-0"), devices=[entry("gpu-0", condition("Ready"))]))
    assert [h[:2] for h in c._heap] == [(due, seq)]
    c.replace([claim(result("gpu-0"))])
    assert [h[:2] for h in c._heap] == [(due, seq)] and c.entries() == {UID: "waiting"}
    # A new allocation (deallocated, allocated again) starts the delay over.
    c.upsert(claim(result("gpu-1"), stamp="2026-12-01T10:00:30Z"))
    assert c._entries[UID].due == 1010.0 + 3600 and c._entries[UID].seq != seq
    # Set (by anyone), deallocated or deleted: dropped.
    c.upsert(claim(result("gpu-1"), stamp="2026-12-01T10:00:30Z", devices=[entry("gpu-1", condition("Attached"))]))
    assert c.entries() == {}
    c.upsert(claim(result("gpu-2")))
    c.upsert({"metadata": {"namespace": "ns", "name": "c", "uid": UID}, "status": {}})
    assert c.entries() == {}
    c.upsert(claim(result("gpu-2")))
    c.delete(claim(result("gpu-2")))
    assert c.entries() == {} and c.pending() == 0


def test_a_relist_drops_claims_it_no_longer_lists(controller):
    other = "0f0e5d2c-1b8a-4c2e-8f3e-2a4b6c8d0e1f"
    controller.upsert(claim(result("gpu-0")))
    controller.upsert(claim(result("gpu-1"), uid=other, name="d"))
    controller.replace(iter([claim(result("gpu-1"), uid=other, name="d")]))  # a list is streamed
    assert controller.entries() == {other: "waiting"}


def test_a_malformed_claim_is_skipped_counted_and_logged(controller, caplog):
    caplog.set_level(logging.WARNING)
    bad = claim(result("gpu-0"), name="broken")
    bad["status"]["allocation"]["devices"]["results"][0]["bindingConditions"] = [1]
    good = claim(result("gpu-1"), uid="0f0e5d2c-1b8a-4c2e-8f3e-2a4b6c8d0e1f", name="fine")
    controller.replace([bad, good, "not even an object"])  # type: ignore[list-item]
    assert list(controller.entries().values()) == ["waiting"]
    messages = [r.getMessage() for r in caplog.records]
    assert any("ResourceClaim ns/broken: skipped, it is malformed" in m and "bindingConditions" in m for m in messages)
    assert any("ResourceClaim (no metadata): skipped" in m for m in messages)
    assert _points(controller.reader)["otel_dra.binding_controller.claims.invalid"] == 2
    # A malformed version of a tracked claim drops it (its next good version brings it back).
    controller.upsert(copy.deepcopy(good))
    broken_good = copy.deepcopy(good)
    broken_good["status"]["devices"] = "x"
    controller.upsert(broken_good)
    assert controller.entries() == {}


def test_the_controller_refuses_a_bad_delay_or_fraction():
    credentials = Credentials("http://127.0.0.1:9", "test", None, None, None, True, None, dict)
    kwargs: dict[str, Any] = {
        "driver": DRIVER,
        "meter_provider": MeterProvider(),
        "tracer_provider": trace.NoOpTracerProvider(),
    }
    with pytest.raises(ValueError, match="attach_delay"):
        BindingController(KubeClient(credentials), attach_delay=-1, **kwargs)
    with pytest.raises(ValueError, match="failure_fraction"):
        BindingController(KubeClient(credentials), failure_fraction=1.5, **kwargs)


# --- flags ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "env", "message"),
    [
        (["--failure-fraction", "1.5"], {}, "--failure-fraction: '1.5' must be between 0 and 1"),
        (["--failure-fraction", "nan"], {}, "--failure-fraction: 'nan' must be between 0 and 1"),
        (["--attach-delay", "-1"], {}, "--attach-delay: '-1' must be between 0 and 3600 seconds"),
        (["--attach-delay", "soon"], {}, "'soon' is not a number of seconds"),
        (["--driver-name", "GPU_Example"], {}, "--driver-name: 'GPU_Example' is not a lowercase DNS subdomain"),
        (["--metrics-port", "70000"], {}, "--metrics-port: 70000 is outside -1..65535"),
        (
            [],
            {"OTEL_DRA_FAILURE_FRACTION": "half"},
            "environment variable OTEL_DRA_FAILURE_FRACTION: 'half' is not a number",
        ),
    ],
)
def test_bad_flags_are_refused_with_the_flag_named(argv, env, message, monkeypatch, capsys):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit) as exited:
        code = main(["binding-controller", *argv])
        raise SystemExit(code)
    assert exited.value.code == 2
    assert message in capsys.readouterr().err


def test_flag_defaults():
    from otel_dra.cli import build_parser

    args = build_parser("binding-controller").parse_args(["binding-controller"])
    assert (args.driver_name, args.attach_delay, args.failure_fraction, args.metrics_port) == (
        DRIVER,
        2.0,
        0.0,
        -1,
    )
    args = build_parser("binding-controller").parse_args(["binding-controller", "--attach-delay", "0.5s"])
    assert args.attach_delay == 0.5
