"""The exporter against a real kube-apiserver: live changes, RBAC, OTLP push, the CLI (API server
faults -- killed, compaction, throttling, a slow link -- are in tests/faults)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from otel_dra.fixtures import create, object_path
from tests.helpers import (
    SEED_FAMILIES,
    free_port,
    http_get,
    listening,
    parse_samples,
    rbac_kubeconfig,
    scrape,
    wait_until,
)
from tests.otlp_receiver import OtlpReceiver


def _series(port: int, name: str, **match: str) -> list[tuple[dict[str, str], float]]:
    code, text = scrape(port)
    assert code == 200, text
    return [
        (labels, value)
        for n, labels, value in parse_samples(text)
        if n == name and all(labels.get(k) == v for k, v in match.items())
    ]


def _claim(name: str, namespace: str, device: str | None = None, pods: tuple[str, ...] = ()) -> dict:
    obj: dict = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "live.example.com"}}]}},
    }
    if device:
        obj["status"] = {
            "allocation": {
                "devices": {
                    "results": [
                        {
                            "request": "gpu",
                            "driver": "live.example.com",
                            "pool": "live-pool",
                            "device": device,
                        }
                    ]
                }
            },
            "reservedFor": [
                {"resource": "pods", "name": p, "uid": f"00000000-0000-4000-8000-{i:012d}"} for i, p in enumerate(pods)
            ],
        }
    return obj


def test_live_changes(testbed, admin_client, start_exporter_app):
    admin_client.send_json("POST", "/api/v1/namespaces", {"metadata": {"name": "live"}})
    app = start_exporter_app(str(testbed.kubeconfig))
    wait_until(lambda: app.state.not_synced() is None, what="sync")
    total = "kube_resourceclaim_status_reserved_total"

    # create: a pending claim appears with 0 reservations
    create(admin_client, _claim("c1", "live"))
    wait_until(
        lambda: (
            _series(app.port, total, resourceclaim_name="c1")
            == [({"resourceclaim_name": "c1", "namespace": "live"}, 0.0)]
        ),
        what="c1 pending",
    )

    # modify: allocate it and reserve it for a pod
    path = object_path(_claim("c1", "live")) + "/status"
    current = admin_client.get_json(object_path(_claim("c1", "live")))
    current["status"] = _claim("c1", "live", "dev-0", ("pod-a",))["status"]
    admin_client.send_json("PUT", path, current)
    wait_until(
        lambda: (
            _series(app.port, total, resourceclaim_name="c1")
            and _series(app.port, total, resourceclaim_name="c1")[0][1] == 1.0
        ),
        what="c1 reserved",
    )
    assert _series(app.port, "kube_resourceclaim_status_allocated_device", resourceclaim_name="c1") == [
        (
            {
                "resourceclaim_name": "c1",
                "namespace": "live",
                "pool": "live-pool",
                "device_name": "dev-0",
                "driver": "live.example.com",
            },
            1.0,
        )
    ]
    assert [
        s[0]["pod_name"]
        for s in _series(app.port, "kube_resourceclaim_status_reserved_for_pod", resourceclaim_name="c1")
    ] == ["pod-a"]

    # a DeviceClass whose cost changes from valid to invalid loses its series
    dc = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "DeviceClass",
        "metadata": {"name": "live.example.com", "annotations": {"hourly-cost": "3.5"}},
        "spec": {},
    }
    create(admin_client, dc)
    wait_until(
        lambda: (
            _series(app.port, "kube_deviceclass_hourly_cost", deviceclass_name="live.example.com")
            == [({"deviceclass_name": "live.example.com"}, 3.5)]
        ),
        what="cost",
    )
    admin_client.send_json(
        "PATCH",
        object_path(dc),
        {"metadata": {"annotations": {"hourly-cost": "3,5"}}},
        content_type="application/merge-patch+json",
    )
    wait_until(
        lambda: _series(app.port, "kube_deviceclass_hourly_cost", deviceclass_name="live.example.com") == [],
        what="invalid cost omitted",
    )

    # a slice: create, then delete -- its series vanish
    rs = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": "live-slice"},
        "spec": {
            "driver": "live.example.com",
            "nodeName": "live-node",
            "pool": {"name": "live-pool", "generation": 1, "resourceSliceCount": 1},
            "devices": [{"name": "dev-0", "capacity": {"memory": {"value": "4Gi"}, "decoders": {"value": "2"}}}],
        },
    }
    create(admin_client, rs)
    mem = "kube_resourceslice_device_capacity_memory_bytes"
    wait_until(
        lambda: [v for _, v in _series(app.port, mem, resourceslice_name="live-slice")] == [4 * 2**30],
        what="slice",
    )
    admin_client.request("DELETE", object_path(rs))
    admin_client.request("DELETE", object_path(_claim("c1", "live")))
    admin_client.request("DELETE", object_path(dc))
    wait_until(
        lambda: (
            not _series(app.port, mem, resourceslice_name="live-slice")
            and not _series(app.port, total, resourceclaim_name="c1")
            # The DeviceClass's kube_deviceclass_info (its delete comes through another watch).
            and not _series(app.port, "kube_deviceclass_info", deviceclass_name="live.example.com")
        ),
        what="deleted series to vanish",
    )
    _code, text = scrape(app.port)
    # The objects' series are gone; the exporter's own histograms (otel_dra_claim_*: the claim's
    # allocation wait by driver and device class) keep what they observed, as histograms do.
    objects = "\n".join(line for line in text.splitlines() if not line.startswith(("otel_dra_", "# ")))
    assert "live-slice" not in objects and 'resourceclaim_name="c1"' not in objects
    assert "live.example.com" not in objects
    assert 'otel_dra_claim_allocation_duration_seconds_count{deviceclass_name="live.example.com"' in text


def test_rbac_list_watch_is_enough(testbed, start_exporter_app):
    kubeconfig = rbac_kubeconfig(testbed, "exporter-listwatch", '["list", "watch"]')
    app = start_exporter_app(kubeconfig)
    wait_until(lambda: app.state.not_synced() is None, timeout=30, what="sync with list+watch only")
    code, text = scrape(app.port)
    assert code == 200 and "kube_resourceclaim_status_reserved_total" in text


def test_the_short_switch_interval_starts_when_the_caches_are_in_sync(testbed, start_exporter_app):
    # The initial lists run at the interpreter's default switch interval; the 1 ms that keeps
    # scrapes responsive comes with the first check that finds the caches in sync.
    before = sys.getswitchinterval()
    sys.setswitchinterval(0.005)
    try:
        stuck = start_exporter_app(rbac_kubeconfig(testbed, "exporter-nolist", '["get"]'))
        wait_until(
            lambda: b"forbidden" in http_get(f"http://127.0.0.1:{stuck.port}/readyz")[1], timeout=30, what="forbidden"
        )
        assert scrape(stuck.port)[0] == 500
        assert sys.getswitchinterval() == pytest.approx(0.005)

        app = start_exporter_app(rbac_kubeconfig(testbed, "exporter-listwatch", '["list", "watch"]'))
        wait_until(lambda: http_get(f"http://127.0.0.1:{app.port}/readyz")[0] == 200, timeout=30, what="ready")
        assert sys.getswitchinterval() == pytest.approx(0.001)
    finally:
        sys.setswitchinterval(before)


def test_rbac_without_watch_is_a_clear_error_not_a_crash(testbed, tmp_path):
    kubeconfig = rbac_kubeconfig(testbed, "exporter-listonly", '["list"]')
    log = tmp_path / "exporter.log"
    port = free_port()
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "otel_dra",
                "exporter",
                "--kubeconfig",
                kubeconfig,
                "--port",
                str(port),
                "--address",
                "127.0.0.1",
                "--stale-after",
                "1",
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        wait_until(
            lambda: http_get(f"http://127.0.0.1:{port}/healthz")[0] == 200 if listening(port) else False,
            what="healthz",
        )
        code, body = wait_until(
            lambda: (lambda r: r if b"forbidden" in r[1] else None)(http_get(f"http://127.0.0.1:{port}/readyz")),
            timeout=30,
            what="readyz to say forbidden",
        )
        assert code == 503 and b"watch" in body
        assert scrape(port)[0] == 500
        time.sleep(3)
        assert proc.poll() is None, "the exporter must keep running and retrying"
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(20)
    text = log.read_text()
    assert "needs list and watch" in text
    # Logged once per distinct error, not once per retry.
    assert text.count("needs list and watch") <= 6, text


@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
def test_otlp_push(testbed, admin_client, start_exporter_app, monkeypatch, protocol):
    from otel_dra.fixtures import apply_all, sample_objects

    apply_all(admin_client, sample_objects())
    receiver = OtlpReceiver().start()
    try:
        port = receiver.grpc_port if protocol == "grpc" else receiver.http_port
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{port}")
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", protocol)
        monkeypatch.setenv("OTEL_METRIC_EXPORT_INTERVAL", "500")
        monkeypatch.setenv("OTEL_SERVICE_NAME", "dra-test")
        monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "k8s.cluster.name=testbed,deployment.environment=ci")
        app = start_exporter_app(str(testbed.kubeconfig))
        wait_until(lambda: app.state.not_synced() is None, what="sync")
        otel_names = {
            "kube_resourceslice_device_capacity_memory_bytes": "kube_resourceslice_device_capacity_memory",
        }
        wanted = {otel_names.get(n, n) for n in SEED_FAMILIES}
        assert receiver.wait_for(lambda r: wanted <= set(r.metric_points())), set(receiver.metric_points())

        # Same series over OTLP as over Prometheus (compared on one state: poll until an export
        # taken after the scrape's state has arrived).
        def compare():
            points = receiver.metric_points()
            _code, text = scrape(app.port)
            prom = {(n, tuple(sorted(labels.items())), v) for n, labels, v in parse_samples(text) if n in SEED_FAMILIES}
            pushed = {
                (n, tuple(sorted(a.items())), v)
                for otel, n in ((otel_names.get(n, n), n) for n in SEED_FAMILIES)
                for a, v in points.get(otel, [])
            }
            return (pushed == prom, sorted(prom ^ pushed)[:10])

        same, diff = wait_until(
            lambda: (lambda r: r if r[0] else None)(compare()) or False, timeout=10, what="OTLP == Prometheus"
        ) or (False, None)
        assert same, diff
        points = receiver.metric_points()
        assert "otel_dra.watch.events" in points or "otel_dra.cache.objects" in points
        attrs = receiver.resource_attributes()
        assert attrs["service.name"] == "dra-test"
        assert attrs["k8s.cluster.name"] == "testbed"
        app.stop()  # while the receiver is still up: the final flush must not wait for a dead endpoint
    finally:
        receiver.stop()


def test_cli_end_to_end_and_sigterm_flushes_otlp(testbed, tmp_path):
    receiver = OtlpReceiver().start()
    port = free_port()
    env = dict(
        os.environ,
        OTEL_EXPORTER_OTLP_ENDPOINT=f"http://127.0.0.1:{receiver.grpc_port}",
        OTEL_EXPORTER_OTLP_PROTOCOL="grpc",
        OTEL_METRIC_EXPORT_INTERVAL="600000",
    )
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "otel_dra",
            "exporter",
            "--kubeconfig",
            str(testbed.kubeconfig),
            "--port",
            str(port),
            "--log-format",
            "json",
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        _code, text = wait_until(
            lambda: (lambda r: r if r[0] == 200 else None)(scrape(port)) if listening(port) else None,
            timeout=30,
            what="first good scrape",
        )
        for name in SEED_FAMILIES:
            assert f"# TYPE {name} gauge" in text
        assert "target_info{" in text
        assert not receiver.metrics, "the 10-minute interval has not elapsed yet"
    finally:
        proc.send_signal(signal.SIGTERM)
        output, _ = proc.communicate(timeout=30)
    try:
        assert proc.returncode == 0, output
        # Shutdown flushed the final state over OTLP.
        assert "kube_resourceclaim_status_reserved_total" in receiver.metric_points()
        import json

        lines = [json.loads(line) for line in output.splitlines() if line.strip()]
        assert any("shutting down" in entry["msg"] for entry in lines)
    finally:
        receiver.stop()


def test_seed_allowlist_serves_and_pushes_the_seed_families_only(
    testbed, admin_client, start_exporter_app, monkeypatch
):
    """--metric-allowlist of the seven seed families: nothing else over Prometheus or OTLP, the
    exporter's own metrics and target_info unaffected, DeviceTaintRules not even watched."""
    from otel_dra.cli import build_parser
    from otel_dra.fixtures import apply_all, sample_objects

    apply_all(admin_client, sample_objects())
    families = build_parser().parse_args(["exporter", "--metric-allowlist=" + ",".join(SEED_FAMILIES)]).metric_allowlist
    receiver = OtlpReceiver().start()
    try:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{receiver.http_port}")
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
        monkeypatch.setenv("OTEL_METRIC_EXPORT_INTERVAL", "500")
        app = start_exporter_app(str(testbed.kubeconfig), families=families)
        wait_until(lambda: app.state.not_synced() is None, what="sync")
        _code, text = scrape(app.port)
        assert {n for n, _labels, _v in parse_samples(text) if n.startswith("kube_")} == set(SEED_FAMILIES)
        typed = {line.split()[2] for line in text.splitlines() if line.startswith("# TYPE ")}
        assert {n for n in typed if n.startswith("kube_")} == set(SEED_FAMILIES)
        assert "target_info" in typed and "otel_dra_cache_objects" in typed, typed
        watched = {labels["resource"] for n, labels, _v in parse_samples(text) if n == "otel_dra_cache_objects"}
        assert watched == {"resourceclaims", "resourceslices", "deviceclasses"}

        otel_names = {"kube_resourceslice_device_capacity_memory_bytes": "kube_resourceslice_device_capacity_memory"}
        wanted = {otel_names.get(n, n) for n in SEED_FAMILIES}
        assert receiver.wait_for(lambda r: wanted <= set(r.metric_points())), set(receiver.metric_points())
        app.stop()  # the final push, then nothing more arrives
        pushed = set(receiver.metric_points())
        assert {n for n in pushed if n.startswith("kube_")} == wanted
        assert "otel_dra.cache.objects" in pushed  # the self-metrics, pushed by the SDK
    finally:
        receiver.stop()
