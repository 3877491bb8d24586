"""DeviceTaintRules as the testbed's Kubernetes release serves them (OTEL_DRA_KUBERNETES_VERSION):
`resource.k8s.io/v1alpha3` up to 1.35 and `v1beta2` in 1.36, both enabled with --runtime-config on
the scheduler testbed only, `v1` from 1.37 on by default. Where they are served the exporter reports
them from the newest version; where they are not, or RBAC forbids them, it logs it once and serves
everything else. From 1.35 on, kube-controller-manager's device-taint-eviction controller writes a
rule's EvictionInProgress condition, which the exporter reports. A rule without a device selector
matches every device before v1.37.1 and none since, `{}` every device on all releases: the exporter
reads the API server's version, and its free-device counts agree with the real kube-scheduler."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from typing import Any

import pytest

from otel_dra.cluster.devicetaintrule import absent_selector_matches_all
from otel_dra.fixtures import create, object_path
from otel_dra.kube.client import ApiError, KubeClient, load_credentials
from otel_dra.kube.version import read_server_version
from otel_dra.testbed import Testbed, running
from otel_dra.testbed.build import kubernetes_release, version_key
from otel_dra.testbed.controlplane import release_settings
from tests.helpers import (
    claim_pod,
    driver_class,
    node_slice,
    parse_samples,
    place,
    rbac_kubeconfig,
    ready_node,
    scrape,
    wait_until,
)

FAMILY = "kube_devicetaintrule_info"
CONDITION = "kube_devicetaintrule_status_condition"
ADDED = "kube_devicetaintrule_taint_added_timestamp_seconds"

RELEASE = kubernetes_release()
MINOR = version_key(RELEASE.minor)
SETTINGS = release_settings(RELEASE)
# Where the scheduler testbed serves DeviceTaintRules: the version it enables, or v1 (GA, by default).
SERVED_AT = SETTINGS.served_taint_rule_api
# 1.35 removed deviceSelector.deviceClassName and .selectors, and added the rule's status.
HAS_CLASS_SELECTOR = MINOR < (1, 35)
HAS_STATUS = MINOR >= (1, 35)


def _series(port: int, family: str) -> list[tuple[dict[str, str], float]]:
    code, text = scrape(port)
    assert code == 200, text
    return [(labels, value) for name, labels, value in parse_samples(text) if name == family]


def _rules(port: int) -> list[dict[str, str]]:
    return [labels for labels, _ in _series(port, FAMILY)]


def _reflector(app):
    [reflector] = [r for r in app.state.reflectors if r.resource.plural == "devicetaintrules"]
    return reflector


def _chosen(caplog: pytest.LogCaptureFixture) -> list[str]:
    """The log lines naming the version the exporter chose for DeviceTaintRules."""
    return [m for m in _rule_messages(caplog) if ": served at " in m]


def _rule_messages(caplog: pytest.LogCaptureFixture) -> list[str]:
    """The reflector's lines about DeviceTaintRules (other optional resources, pods, log too)."""
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("devicetaintrules")]


def _rule(name: str, selector: dict[str, str], effect: str, api_version: str = SERVED_AT) -> dict[str, Any]:
    return {
        "apiVersion": api_version,
        "kind": "DeviceTaintRule",
        "metadata": {"name": name},
        "spec": {"deviceSelector": selector, "taint": {"key": "example.com/firmware", "effect": effect}},
    }


@pytest.fixture(scope="module")
def unserved(request: pytest.FixtureRequest, tmp_path_factory, testbed_binaries) -> Iterator[Testbed]:
    """A control plane that does not serve DeviceTaintRules: the plain testbed where they are off by
    default (until 1.36); from 1.37 on, one with them switched off."""
    if SETTINGS.taint_rule_api is not None:
        yield request.getfixturevalue("testbed")
        return
    with running(
        tmp_path_factory.mktemp("testbed-no-taint-rules"),
        binaries=testbed_binaries,
        apiserver_args=[f"--runtime-config={SERVED_AT}/devicetaintrules=false"],
    ) as tb:
        yield tb


def test_not_served_is_logged_once_and_everything_else_is_served(unserved, start_exporter_app, caplog):
    with caplog.at_level(logging.INFO, logger="otel_dra.kube.reflector"):
        app = start_exporter_app(str(unserved.kubeconfig))
        wait_until(lambda: app.state.not_synced() is None, what="sync without DeviceTaintRules")
        code, text = scrape(app.port)
        assert code == 200
        assert f"# TYPE {FAMILY} gauge" in text and f"\n{FAMILY}{{" not in text
        assert "kube_resourceclaim_status_reserved_total" in text
        state = _reflector(app).state()
        assert state.synced and "not served" in (state.unavailable or "")
        time.sleep(1)  # a window, not a condition: a repeated "not served" line would come within it
    messages = _rule_messages(caplog)
    assert len([m for m in messages if "not served" in m]) == 1, messages
    assert _chosen(caplog) == []


def test_served_rules_are_reported_from_the_newest_version_and_follow_changes(
    testbed_sched, start_exporter_app, caplog
):
    client = KubeClient(load_credentials(str(testbed_sched.kubeconfig)))
    with caplog.at_level(logging.INFO, logger="otel_dra.kube.reflector"):
        app = start_exporter_app(str(testbed_sched.kubeconfig))
        wait_until(lambda: app.state.not_synced() is None, what="sync")
    assert _reflector(app).state().unavailable is None
    assert _reflector(app).resource.group_version == SERVED_AT
    assert _chosen(caplog) == [f"devicetaintrules: served at {SERVED_AT} (found by API discovery), watching it"]
    selector = {"driver": "gpu.example.com"}
    if HAS_CLASS_SELECTOR:  # unknown fields from 1.35 on, even in v1alpha3
        selector["deviceClassName"] = "gpu.example.com"
    rule = _rule("live-rule", selector, "NoSchedule")
    rule["spec"]["taint"]["value"] = "outdated"
    before = time.time()
    create(client, rule)
    try:
        expected = {
            "devicetaintrule_name": "live-rule",
            "key": "example.com/firmware",
            "value": "outdated",
            "effect": "NoSchedule",
            "deviceclass_name": "gpu.example.com" if HAS_CLASS_SELECTOR else "",
            "driver": "gpu.example.com",
            "pool": "",
            "device_name": "",
        }
        wait_until(lambda: expected in _rules(app.port), what="the rule's series")
        # The API server set timeAdded (to the second) when the rule was created.
        [added] = [v for lbl, v in _series(app.port, ADDED) if lbl["devicetaintrule_name"] == "live-rule"]
        assert int(before) - 1 <= added <= time.time() + 1, added
    finally:
        client.request("DELETE", object_path(rule))
    wait_until(lambda: not any(r["devicetaintrule_name"] == "live-rule" for r in _rules(app.port)), what="series gone")
    assert not any(lbl["devicetaintrule_name"] == "live-rule" for lbl, _ in _series(app.port, ADDED))


@pytest.mark.skipif(MINOR < (1, 37), reason="v1, v1beta2 and v1alpha3 all serve DeviceTaintRules from 1.37 on")
@pytest.mark.parametrize(
    ("runtime_config", "chosen"),
    [
        ("resource.k8s.io/v1beta2=true,resource.k8s.io/v1alpha3=true", "resource.k8s.io/v1"),
        (
            "resource.k8s.io/v1beta2=true,resource.k8s.io/v1alpha3=true,resource.k8s.io/v1/devicetaintrules=false",
            "resource.k8s.io/v1beta2",
        ),
    ],
)
def test_the_newest_served_version_is_chosen(
    runtime_config, chosen, tmp_path_factory, testbed_binaries, start_exporter_app, caplog
):
    with running(
        tmp_path_factory.mktemp("testbed-taint-rule-versions"),
        binaries=testbed_binaries,
        apiserver_args=[f"--runtime-config={runtime_config}"],
    ) as tb:
        client = KubeClient(load_credentials(str(tb.kubeconfig)))
        # Written through the oldest version, read through the chosen one: one object either way.
        create(client, _rule("versions-rule", {"driver": "gpu.example.com"}, "None", "resource.k8s.io/v1alpha3"))
        with caplog.at_level(logging.INFO, logger="otel_dra.kube.reflector"):
            app = start_exporter_app(str(tb.kubeconfig))
            wait_until(lambda: app.state.not_synced() is None, what="sync")
            wait_until(lambda: _rules(app.port), what="the rule's series")
        assert _reflector(app).resource.group_version == chosen
        assert _chosen(caplog) == [f"devicetaintrules: served at {chosen} (found by API discovery), watching it"]
        [labels] = _rules(app.port)
        assert (labels["devicetaintrule_name"], labels["effect"], labels["driver"]) == (
            "versions-rule",
            "None",
            "gpu.example.com",
        )
        app.stop()


def _claim(namespace: str) -> dict[str, Any]:
    """A claim that tolerates the rule's NoExecute taint for an hour: its pod stays pending eviction
    (EvictionInProgress True) instead of being deleted at once."""
    toleration = {"key": "example.com/firmware", "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 3600}
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": "evict-me", "namespace": namespace},
        "spec": {
            "devices": {
                "requests": [
                    {"name": "dev", "exactly": {"deviceClassName": "evict.example.com", "tolerations": [toleration]}}
                ]
            }
        },
    }


def _condition(port: int, status: str) -> bool:
    """EvictionInProgress of the rule is ``status`` (a complete state set, 1 on that status)."""
    states = {
        lbl["status"]: v
        for lbl, v in _series(port, CONDITION)
        if lbl["devicetaintrule_name"] == "evict-rule" and lbl["condition"] == "EvictionInProgress"
    }
    return states == {s: 1.0 if s == status else 0.0 for s in ("true", "false", "unknown")}


@pytest.mark.skipif(not HAS_STATUS, reason="DeviceTaintRules have a status from Kubernetes 1.35 on")
def test_eviction_in_progress_is_reported(testbed_sched, start_exporter_app):
    """A NoExecute rule on a device that an allocated, reserved claim uses: the real
    device-taint-eviction controller reports the pending eviction in the rule's status."""
    client = KubeClient(load_credentials(str(testbed_sched.kubeconfig)))
    namespace = node = "taint-evict"
    ready_node(client, node)
    objects: list[dict[str, Any]] = [
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}},
        {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "DeviceClass",
            "metadata": {"name": "evict.example.com"},
            "spec": {"selectors": [{"cel": {"expression": "device.driver == 'evict.example.com'"}}]},
        },
        {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceSlice",
            "metadata": {"name": "taint-evict-slice"},
            "spec": {
                "driver": "evict.example.com",
                "nodeName": node,
                "pool": {"name": node, "generation": 1, "resourceSliceCount": 1},
                "devices": [{"name": "e0"}],
            },
        },
        _claim(namespace),
        claim_pod("evict-me-pod", namespace, "evict-me", node=node),
    ]
    rule = _rule("evict-rule", {"driver": "evict.example.com", "pool": node, "device": "e0"}, "NoExecute")
    app = start_exporter_app(str(testbed_sched.kubeconfig))
    try:
        for obj in objects:
            create(client, obj)
        claim_path = f"/apis/resource.k8s.io/v1/namespaces/{namespace}/resourceclaims/evict-me"
        wait_until(
            lambda: (client.get_json(claim_path).get("status") or {}).get("reservedFor"),
            timeout=60,
            what="the scheduler to allocate and reserve the claim",
        )
        create(client, rule)
        wait_until(lambda: app.state.not_synced() is None, what="sync")
        wait_until(lambda: _condition(app.port, "true"), timeout=60, what="EvictionInProgress true")
        status = client.get_json(object_path(rule))["status"]
        [condition] = [c for c in status["conditions"] if c["type"] == "EvictionInProgress"]
        assert condition["reason"] == "PodsPendingEviction", condition
        # Effect None: nothing is evicted; the controller says so once.
        current = client.get_json(object_path(rule))
        current["spec"]["taint"]["effect"] = "None"
        client.send_json("PUT", object_path(rule), current)
        wait_until(lambda: _condition(app.port, "false"), timeout=60, what="EvictionInProgress false")
        client.request("DELETE", object_path(rule))
        wait_until(
            lambda: not any(lbl["devicetaintrule_name"] == "evict-rule" for lbl, _ in _series(app.port, CONDITION)),
            what="the rule's conditions gone",
        )
    finally:
        for obj in [rule, *reversed(objects)]:
            with contextlib.suppress(ApiError):
                client.request("DELETE", object_path(obj), query={"gracePeriodSeconds": 0})


def test_forbidden_by_rbac_is_logged_once_and_everything_else_is_served(testbed_sched, start_exporter_app, caplog):
    """The chart's role may not grant DeviceTaintRules: that must not take /metrics down."""
    name = "exporter-no-taintrules"
    kubeconfig = rbac_kubeconfig(testbed_sched, name, "[list, watch]", namespace="rbac-taintrules")
    with caplog.at_level(logging.INFO, logger="otel_dra.kube.reflector"):
        app = start_exporter_app(kubeconfig)
        wait_until(lambda: app.state.not_synced() is None, what="sync without DeviceTaintRules")
        assert _rules(app.port) == []
        state = _reflector(app).state()
        assert state.synced and "forbidden" in (state.unavailable or "")
    messages = [m for m in _rule_messages(caplog) if "forbidden" in m]
    assert len(messages) == 1, messages
    assert "grant list and watch on devicetaintrules.resource.k8s.io" in messages[0]


# --- rules without a device selector, and with an empty one, against the real scheduler ------------
NOSEL = "nosel.example.com"
NOSEL_NS = NOSEL_NODE = "taint-nosel"
NOSEL_DEVICES = 3


def _selectorless(name: str, selector: dict[str, Any] | None) -> dict[str, Any]:
    """A NoSchedule rule (never NoExecute: before v1.37.1 a rule without a selector taints every
    device of the cluster, and would evict the other tests' pods); ``selector`` None: none at all."""
    rule = _rule(name, {}, "NoSchedule")
    if selector is None:
        del rule["spec"]["deviceSelector"]
    else:
        rule["spec"]["deviceSelector"] = selector
    return rule


def _nosel_free(port: int) -> float | None:
    values = [v for lbl, v in _series(port, "kube_resourcepool_devices_free") if lbl["driver"] == NOSEL]
    return values[0] if values else None


def _clear_claims(client: KubeClient) -> None:
    for path in (
        f"/api/v1/namespaces/{NOSEL_NS}/pods",
        f"/apis/resource.k8s.io/v1/namespaces/{NOSEL_NS}/resourceclaims",
    ):
        with contextlib.suppress(ApiError):
            client.request("DELETE", path, query={"gracePeriodSeconds": 0})
    wait_until(
        lambda: not client.get_json(f"/apis/resource.k8s.io/v1/namespaces/{NOSEL_NS}/resourceclaims")["items"],
        timeout=60,
        what="the test's claims to be gone",
    )


def _placed(client: KubeClient, prefix: str, limit: int) -> int:
    """How many one-device claims the scheduler allocates on the node before it refuses one."""
    placed = 0
    while placed <= limit and place(client, NOSEL_NS, f"{prefix}-{placed}", NOSEL_NODE, NOSEL):
        placed += 1
    return placed


def test_the_exporter_reads_the_api_servers_version(testbed_sched, start_exporter_app, caplog):
    client = KubeClient(load_credentials(str(testbed_sched.kubeconfig)))
    expected = read_server_version(client)  # the oracle: what the API server says it is
    with caplog.at_level(logging.INFO, logger="otel_dra.cluster.devicetaintrule"):
        app = start_exporter_app(str(testbed_sched.kubeconfig))
        wait_until(lambda: app.state.not_synced() is None, what="sync")
    assert app.state.server_version is not None
    assert app.state.server_version.version == expected and str(app.state.server_version.version) == str(expected)
    matches = "every device" if absent_selector_matches_all(expected) else "no device"
    assert [r.getMessage() for r in caplog.records if r.name == "otel_dra.cluster.devicetaintrule"] == [
        f"API server {expected}: DeviceTaintRules without spec.deviceSelector match {matches}"
    ]


def test_rules_without_and_with_an_empty_selector_agree_with_the_scheduler(testbed_sched, start_exporter_app):
    """A rule without deviceSelector blocks every device before v1.37.1 and none since; a rule
    with ``{}`` blocks every device on every release. The exporter's free count for the pool is
    what the real kube-scheduler still allocates, one-device claim by claim, under each rule."""
    client = KubeClient(load_credentials(str(testbed_sched.kubeconfig)))
    old_semantics = absent_selector_matches_all(read_server_version(client))
    expected_free = 0 if old_semantics else NOSEL_DEVICES
    with contextlib.suppress(ApiError):
        client.send_json("POST", "/api/v1/namespaces", {"metadata": {"name": NOSEL_NS}})
    ready_node(client, NOSEL_NODE)
    slice_ = node_slice(
        "taint-nosel-slice", NOSEL, NOSEL_NODE, devices=[{"name": f"n{i}"} for i in range(NOSEL_DEVICES)]
    )
    absent, empty = _selectorless("nosel-absent", None), _selectorless("nosel-empty", {})
    objects = [driver_class(NOSEL), slice_]
    try:
        for obj in objects:
            create(client, obj)
        app = start_exporter_app(str(testbed_sched.kubeconfig))
        wait_until(lambda: app.state.not_synced() is None, what="sync")
        wait_until(lambda: _nosel_free(app.port) == NOSEL_DEVICES, what="every device free before any rule")

        create(client, absent)
        wait_until(lambda: any(r["devicetaintrule_name"] == "nosel-absent" for r in _rules(app.port)), what="rule")
        [absent_flag] = [
            v
            for lbl, v in _series(app.port, "kube_devicetaintrule_device_selector_absent")
            if lbl["devicetaintrule_name"] == "nosel-absent"
        ]
        assert absent_flag == 1.0
        wait_until(lambda: _nosel_free(app.port) == expected_free, what=f"{expected_free} free under the rule")
        # A fixed wait, not a condition, because none can be observed: the scheduler's informer
        # receives the rule in the same watch event as the exporter's, but the scheduler shows
        # nothing of its cache (no status it writes, no metric per rule), and its one observable,
        # an allocation, is what is measured here (a probe claim would take a device or, refused,
        # be retried by the scheduler once the rule goes). A watch event on loopback takes
        # milliseconds; the second is a margin.
        time.sleep(1)
        placed = _placed(client, "absent", NOSEL_DEVICES)
        assert placed == expected_free, f"exporter said {expected_free} free, the scheduler allocated {placed}"
        _clear_claims(client)
        client.request("DELETE", object_path(absent))

        create(client, empty)
        wait_until(lambda: _nosel_free(app.port) == 0, what="no device free under {}")
        time.sleep(1)  # the scheduler's informer gets the rule: nothing shows when (see above)
        assert _placed(client, "empty", NOSEL_DEVICES) == 0, "the scheduler allocated a device under a {} rule"
        # The refused pod first: once the rule is gone the scheduler would retry it and take a device.
        _clear_claims(client)
        client.request("DELETE", object_path(empty))
        wait_until(lambda: _nosel_free(app.port) == NOSEL_DEVICES, what="every device free again")
    finally:
        for rule in (absent, empty):
            with contextlib.suppress(ApiError):
                client.request("DELETE", object_path(rule))
        _clear_claims(client)
        for obj in reversed(objects):
            with contextlib.suppress(ApiError):
                client.request("DELETE", object_path(obj))
