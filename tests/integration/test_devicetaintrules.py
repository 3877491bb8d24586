"""DeviceTaintRules are an alpha API: reported where the API server serves them (the scheduler
testbed enables resource.k8s.io/v1alpha3), and where it does not, or RBAC forbids them, the
exporter logs it once and serves everything else."""

from __future__ import annotations

import logging
import time

from otel_dra.fixtures import create
from tests.helpers import parse_samples, rbac_kubeconfig, scrape, wait_until

FAMILY = "kube_devicetaintrule_info"


def _rules(port: int) -> list[dict[str, str]]:
    code, text = scrape(port)
    assert code == 200, text
    return [labels for name, labels, _ in parse_samples(text) if name == FAMILY]


def _reflector(app):
    [reflector] = [r for r in app.state.reflectors if r.resource.plural == "devicetaintrules"]
    return reflector


def test_not_served_is_logged_once_and_everything_else_is_served(testbed, start_exporter_app, caplog):
    with caplog.at_level(logging.INFO, logger="otel_dra.kube.reflector"):
        app = start_exporter_app(str(testbed.kubeconfig))
        wait_until(lambda: app.state.not_synced() is None, what="sync without DeviceTaintRules")
        code, text = scrape(app.port)
        assert code == 200
        assert f"# TYPE {FAMILY} gauge" in text and f"\n{FAMILY}{{" not in text
        assert "kube_resourceclaim_status_reserved_total" in text
        state = _reflector(app).state()
        assert state.synced and "not served" in (state.unavailable or "")
        time.sleep(1)
    messages = [r.getMessage() for r in caplog.records if "devicetaintrules" in r.getMessage()]
    assert len([m for m in messages if "not served" in m]) == 1, messages


def test_served_rules_are_reported_and_follow_changes(testbed_sched, start_exporter_app):
    from otel_dra.kube.client import KubeClient, load_credentials

    client = KubeClient(load_credentials(str(testbed_sched.kubeconfig)))
    app = start_exporter_app(str(testbed_sched.kubeconfig))
    wait_until(lambda: app.state.not_synced() is None, what="sync")
    assert _reflector(app).state().unavailable is None
    assert _reflector(app).resource.group_version == "resource.k8s.io/v1alpha3"
    rule = {
        "apiVersion": "resource.k8s.io/v1alpha3",
        "kind": "DeviceTaintRule",
        "metadata": {"name": "live-rule"},
        "spec": {
            "deviceSelector": {"deviceClassName": "gpu.example.com", "driver": "gpu.example.com"},
            "taint": {"key": "example.com/firmware", "value": "outdated", "effect": "NoSchedule"},
        },
    }
    create(client, rule)
    try:
        expected = {
            "devicetaintrule_name": "live-rule",
            "key": "example.com/firmware",
            "value": "outdated",
            "effect": "NoSchedule",
            "deviceclass_name": "gpu.example.com",
            "driver": "gpu.example.com",
            "pool": "",
            "device_name": "",
        }
        wait_until(lambda: expected in _rules(app.port), what="the rule's series")
    finally:
        client.request("DELETE", "/apis/resource.k8s.io/v1alpha3/devicetaintrules/live-rule")
    wait_until(lambda: not any(r["devicetaintrule_name"] == "live-rule" for r in _rules(app.port)), what="series gone")


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
    messages = [r.getMessage() for r in caplog.records if "forbidden" in r.getMessage()]
    assert len(messages) == 1, messages
    assert "grant list and watch on devicetaintrules.resource.k8s.io" in messages[0]
