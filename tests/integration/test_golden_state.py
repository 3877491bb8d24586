"""Golden expositions of the families beyond the seed, from a real API server where the real
kube-scheduler allocates the claims (tests/golden/state_objects.yaml, one golden file per case).

The objects are written in Kubernetes 1.34's shapes and brought to the testbed's minor before they
are created (tests.helpers.shaped_for_testbed): from 1.35 on, shared counters live in a slice of their own, and
DeviceTaintRules are created in the version that minor serves. Where the exposition differs by
minor, the files of 1.35 and later are in tests/golden/1.35+/ (today only the partitionable case:
the same values, with the counter sets reported on the counters slice).

Regenerate with `make golden` (UPDATE_GOLDEN=1; OTEL_DRA_KUBERNETES_VERSION=1.37 for the 1.35+
files), then read the diff: every value in these files was checked by hand against the objects
(see the comments in state_objects.yaml).
"""

from __future__ import annotations

import contextlib
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from otel_dra.fixtures import create, object_path
from otel_dra.kube.client import ApiError
from otel_dra.testbed.build import kubernetes_release, version_key
from otel_dra.testbed.controlplane import RELEASE_SETTINGS
from tests.helpers import (
    check_golden,
    claim_pod,
    declare_node_features,
    parse_samples,
    pod_scheduled,
    pool_wide_counters,
    ready_node,
    scrape,
    shaped_for_testbed,
    state_families,
    state_family_objects,
    wait_until,
)

GOLDEN_DIR = Path(__file__).parent.parent / "golden"
POOL_WIDE_COUNTERS = pool_wide_counters()


def _golden_file(name: str) -> Path:
    """tests/golden/1.35+/<name> on 1.35 and later where that minor's exposition differs (the
    partitionable case: its counters are in a slice of their own), else tests/golden/<name>."""
    since_1_35 = GOLDEN_DIR / "1.35+" / name
    return since_1_35 if POOL_WIDE_COUNTERS and since_1_35.exists() else GOLDEN_DIR / name


OBJECTS = [
    shaped
    for doc in yaml.safe_load_all((GOLDEN_DIR / "state_objects.yaml").read_text())
    if doc
    for shaped in shaped_for_testbed(doc)
]
# Kubernetes 1.37 adds skipNodeOperations (alpha; on in the testbed): there ext's slice skips every
# node operation, as the unit tests' world has it, so that the OTLP comparison below covers the
# 1.37-only families too. The golden files hold what 1.34 serves, so they do not change.
SKIP_NODE_OPERATIONS = version_key(kubernetes_release().minor) >= (1, 37)
if SKIP_NODE_OPERATIONS:
    for _obj in OBJECTS:
        if _obj["kind"] == "ResourceSlice" and _obj["metadata"]["name"] == "gold-ext":
            _obj["spec"] = {**_obj["spec"], "skipNodeOperations": ["*"]}
NODES = ("gold-part", "gold-gen", "gold-cost", "gold-admin", "gold-taint", "gold-bind", "gold-ext")
# Pods of the objects file (not made for a claim): ext-pod's extended-resource request.
OBJECT_PODS = [o for o in OBJECTS if o["kind"] == "Pod"]
LEAK_GRACE = 2.0


@dataclass(frozen=True)
class Case:
    namespaces: frozenset[str]
    drivers: frozenset[str]
    classes: frozenset[str] = field(default_factory=frozenset)
    rules: frozenset[str] = field(default_factory=frozenset)

    def owns(self, labels: dict[str, str]) -> bool:
        return (
            labels.get("namespace") in self.namespaces
            or labels.get("driver") in self.drivers
            or labels.get("deviceclass_name") in self.classes
            or labels.get("devicetaintrule_name") in self.rules
        )


def _case(namespace: str, *drivers: str, classes: tuple[str, ...] = (), rules: tuple[str, ...] = ()) -> Case:
    return Case(frozenset({namespace}), frozenset(drivers), frozenset(classes or drivers), frozenset(rules))


CASES = {
    "partitionable": _case("gold-part", "part.example.com", "share.example.com"),
    "generations": _case("gold-gen", "gen.example.com"),
    "cost": _case(
        "gold-cost",
        "cost.example.com",
        classes=(
            "cost-big.example.com",
            "cost-small.example.com",
            "cost-nocost.example.com",
            "cost-bad.example.com",
            "cost-gone.example.com",
        ),
    ),
    "admin_access": _case("gold-admin", "admin.example.com"),
    "leaked": _case("gold-leak", "leak.example.com"),
    "taint": _case("gold-taint", "taint.example.com", rules=("gold-taint-drain",)),
    "bind": _case("gold-bind", "bind.example.com"),
    "ext": _case("gold-ext", "ext.example.com"),
}

# Series whose value is the wall-clock time of the run are checked against the run's time window
# and shown as a placeholder.
_TIMES = {
    "kube_resourceclaim_device_binding_state_timestamp_seconds",
    "kube_resourceclaim_created_timestamp_seconds",
    "kube_resourceclaim_allocation_timestamp_seconds",
    "kube_resourceslice_device_taint_added_timestamp_seconds",
    "kube_devicetaintrule_taint_added_timestamp_seconds",
}


def _families_up_to(minor: str) -> dict[str, str]:
    """state_families() less those that need a Kubernetes newer than ``minor``."""
    needs = {f.prom_name: f.kubernetes for f in state_family_objects()}
    return {p: o for p, o in state_families().items() if not needs[p] or version_key(needs[p]) <= version_key(minor)}


# Families whose series need DRANodeAllocatableResources (alpha, off in the testbed's rows) and a
# Node that declares it: tests/integration/test_plugin_profiles.py and test_node_allocatable.py turn
# it on and check them against the plugin's cpu profile.
NEED_ALPHA_NODE_FEATURES = frozenset({"kube_resourceslice_device_node_allocatable"})

# The golden files are the same on every Kubernetes release: they hold the families that the oldest
# supported one serves (the others, e.g. DeviceTaintRule conditions, are tested where they exist).
GOLDEN_FAMILIES = _families_up_to(min(RELEASE_SETTINGS, key=version_key))


def _pods() -> list[dict[str, Any]]:
    """One pod per claim that has no written status: the scheduler allocates those."""
    return [
        claim_pod(f"{o['metadata']['name']}-pod", o["metadata"]["namespace"], o["metadata"]["name"])
        for o in OBJECTS
        if o["kind"] == "ResourceClaim" and "status" not in o
    ]


# Names Kubernetes makes up: the scheduler's claims for extended resources (generateName) and the
# share IDs of consumable-capacity allocations (UUIDs).
_GENERATED = (
    (re.compile(r"-extended-resources-[a-z0-9]{5}\b"), "-extended-resources-<random>"),
    (re.compile(r'share_id="[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}"'), 'share_id="<uuid>"'),
)


def _extended_claim(client: Any) -> dict[str, Any] | None:
    """The claim kube-scheduler made for ext-pod, once it is allocated and reserved."""
    claims = client.get_json("/apis/resource.k8s.io/v1/namespaces/gold-ext/resourceclaims")["items"]
    for claim in claims:
        status = claim.get("status") or {}
        if claim["metadata"]["name"].startswith("ext-pod-extended-resources-") and status.get("reservedFor"):
            return dict(claim)
    return None


def _set_device_conditions(client: Any, claim: dict[str, Any], conditions: list[dict[str, str]]) -> None:
    """Write status.devices for the claim's (single) device, as its driver would."""
    (result,) = claim["status"]["allocation"]["devices"]["results"]
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    claim["status"]["devices"] = [
        {
            "driver": result["driver"],
            "pool": result["pool"],
            "device": result["device"],
            "conditions": [{"message": "", **c, "lastTransitionTime": now} for c in conditions],
        }
    ]
    client.send_json("PUT", object_path({**claim, "kind": "ResourceClaim"}) + "/status", claim)


def _create(client: Any, obj: dict[str, Any]) -> None:
    try:
        create(client, obj)
    except ApiError as exc:
        if exc.status != 409:
            raise


def _allocated_and_reserved(client: Any, namespace: str, name: str) -> dict[str, Any] | None:
    claim = client.get_json(f"/apis/resource.k8s.io/v1/namespaces/{namespace}/resourceclaims/{name}")
    status = claim.get("status") or {}
    return claim if status.get("allocation") and status.get("reservedFor") else None


@pytest.fixture(scope="module")
def golden_scrape(testbed_sched, start_exporter_app_module):
    from otel_dra.kube.client import KubeClient, load_credentials

    client = KubeClient(load_credentials(str(testbed_sched.kubeconfig)))
    started = time.time()
    for node in NODES:
        ready_node(client, node)
    if SKIP_NODE_OPERATIONS:
        declare_node_features(client, "gold-ext", "DRAOptionalNodeOperations")
    for obj in OBJECTS:
        _create(client, obj)
    for pod in _pods():
        _create(client, pod)
    claims: dict[str, dict[str, Any]] = {}
    for pod in _pods():
        ns, name = pod["metadata"]["namespace"], pod["spec"]["resourceClaims"][0]["resourceClaimName"]
        claims[name] = wait_until(
            lambda ns=ns, name=name: _allocated_and_reserved(client, ns, name),
            timeout=60,
            what=f"the scheduler to allocate {ns}/{name}",
        )
    wait_until(lambda: _extended_claim(client), timeout=60, what="the scheduler to make and allocate ext-pod's claim")
    # The class of an allocated claim goes away: its devices cannot be priced any more.
    client.request("DELETE", "/apis/resource.k8s.io/v1/deviceclasses/cost-gone.example.com")
    # The driver reports the health of the device it prepared.
    _set_device_conditions(
        client,
        claims["health"],
        [
            {"type": "Ready", "status": "True", "reason": "Prepared"},
            {"type": "Healthy", "status": "False", "reason": "XidError", "message": "Xid 79"},
        ],
    )
    # bind-done's device is attached: the scheduler, polling in PreBind, then binds its pod.
    _set_device_conditions(client, claims["bind-done"], [{"type": "Attached", "status": "True", "reason": "Attached"}])
    wait_until(
        lambda: pod_scheduled(client, "gold-bind", "bind-done-pod"), timeout=60, what="bind-done-pod to be bound"
    )
    # bind-wait's pod stays in PreBind, waiting for its device (the binding timeout is 10 minutes).
    assert pod_scheduled(client, "gold-bind", "bind-wait-pod") is None

    app = start_exporter_app_module(str(testbed_sched.kubeconfig), leak_grace=LEAK_GRACE)
    wait_until(lambda: app.state.not_synced() is None, what="caches to sync")
    families = set(state_families())

    def settled() -> str | None:
        code, text = scrape(app.port)
        assert code == 200
        ours = "\n".join(line for line in text.splitlines() if line.split("{")[0] in families)
        done = 'kube_resourceclaim_leaked{namespace="gold-leak",resourceclaim_name="stuck"}' in ours
        seen = (
            'reason="class_not_found"',
            'condition="Healthy"',
            'state="satisfied"} 1.0',
            'source="extended_resource"',
        )
        return text if done and all(needle in ours for needle in seen) else None

    text = wait_until(settled, timeout=30, what="the exporter to show the final state")
    yield text, started, time.time()
    for pod in [*_pods(), *OBJECT_PODS]:
        with contextlib.suppress(ApiError):
            path = f"/api/v1/namespaces/{pod['metadata']['namespace']}/pods/{pod['metadata']['name']}"
            client.request("DELETE", path, query={"gracePeriodSeconds": 0})
    for obj in reversed(OBJECTS):
        if obj["kind"] not in ("ResourceClaim", "Pod"):
            with contextlib.suppress(ApiError):
                client.request("DELETE", object_path(obj))


def _exposition(text: str, case: Case, window: tuple[float, float]) -> str:
    """The case's series of the new families, in served order, with run-time timestamps masked."""
    families = GOLDEN_FAMILIES
    out: list[str] = []
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            name = line.split()[2]
            if name in families:
                out.append(line)
            continue
        if not line or line.startswith("#"):
            continue
        name = line.split("{")[0].split(" ")[0]
        if name not in families:
            continue
        [(_, labels, value)] = parse_samples(line)
        if not case.owns(labels):
            continue
        if name in _TIMES and window[0] - 5 <= value <= window[1] + 5:
            line = line.rsplit(" ", 1)[0] + " <time of this run>"
        for pattern, placeholder in _GENERATED:
            line = pattern.sub(placeholder, line)
        out.append(line)
    # Keep a family's TYPE line only when the case has samples of it.
    kept = [
        line
        for i, line in enumerate(out)
        if not line.startswith("#") or (i + 1 < len(out) and not out[i + 1].startswith("#"))
    ]
    return "\n".join(kept) + "\n"


@pytest.mark.parametrize("case", sorted(CASES))
def test_golden(golden_scrape, case):
    text, started, ended = golden_scrape
    got = _exposition(text, CASES[case], (started, ended))
    check_golden(_golden_file(f"state_{case}.prom"), got)


@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
def test_otlp_has_the_same_series_as_prometheus(
    golden_scrape, testbed_sched, start_exporter_app, monkeypatch, protocol
):
    """Every family beyond the seed, over OTLP (pre-encoded points) and Prometheus, on the state above."""
    from tests.otlp_receiver import OtlpReceiver

    receiver = OtlpReceiver().start()
    try:
        port = receiver.grpc_port if protocol == "grpc" else receiver.http_port
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{port}")
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", protocol)
        monkeypatch.setenv("OTEL_METRIC_EXPORT_INTERVAL", "500")
        app = start_exporter_app(str(testbed_sched.kubeconfig), leak_grace=LEAK_GRACE)
        wait_until(lambda: app.state.not_synced() is None, what="sync")
        families = _families_up_to(kubernetes_release().minor)  # Prometheus name -> OTel name

        def compare() -> tuple[bool, list[Any]]:
            points = receiver.metric_points()
            _code, text = scrape(app.port)
            prom = {(n, tuple(sorted(lbl.items())), v) for n, lbl, v in parse_samples(text) if n in families}
            pushed = {
                (prom_name, tuple(sorted(a.items())), v)
                for prom_name, otel in families.items()
                for a, v in points.get(otel, [])
            }
            return pushed == prom, sorted(prom ^ pushed)[:10]

        wait_until(lambda: compare()[0], timeout=20, what="OTLP == Prometheus")
        ok, diff = compare()
        assert ok, diff
        # The state above has series of every family, and each went over OTLP; but those that need
        # an alpha gate the testbed leaves off (and a Node that declares it), tested where it is on.
        points = receiver.metric_points()
        expected = {otel for prom, otel in families.items() if prom not in NEED_ALPHA_NODE_FEATURES}
        assert {otel for otel in families.values() if points.get(otel)} == expected
        app.stop()
    finally:
        receiver.stop()
