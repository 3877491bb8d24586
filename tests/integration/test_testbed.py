"""The testbed itself: a real control plane that the rest of the integration tests rely on. (Its
build and release table, which need no binaries, are tested in tests/unit/test_testbed_build.py.)"""

from __future__ import annotations

import json
import os
import ssl
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml

from otel_dra.kube.client import KubeClient, load_credentials
from otel_dra.kubeletsim.nodes import ensure_node
from otel_dra.testbed import Binaries, Testbed, TestbedError, down, up
from otel_dra.testbed.build import kubernetes_release
from tests.helpers import wait_until

# --- the control plane ---------------------------------------------------------------------------


def _get_json(testbed: Testbed, *args: str) -> Any:
    return json.loads(testbed.kubectl("get", *args, "-o", "json").stdout)


def _alive(pid: int) -> bool:
    """A pid that still exists and is not a zombie waiting to be reaped."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat[stat.rfind(")") + 2] != "Z"


def test_version_is_the_pinned_kubernetes(testbed: Testbed) -> None:
    version = json.loads(testbed.kubectl("get", "--raw", "/version").stdout)
    assert version["gitVersion"] == kubernetes_release().version


def test_resource_k8s_io_v1_is_served(testbed: Testbed) -> None:
    out = testbed.kubectl("api-resources", "--api-group=resource.k8s.io", "-o", "name").stdout.split()
    for resource in ("resourceclaims", "resourceslices", "deviceclasses", "resourceclaimtemplates"):
        assert f"{resource}.resource.k8s.io" in out
    versions = testbed.kubectl("api-versions").stdout.split()
    assert "resource.k8s.io/v1" in versions


def test_kubeconfig_is_admin_with_embedded_ca(testbed: Testbed) -> None:
    config = yaml.safe_load(testbed.kubeconfig.read_text())
    cluster = config["clusters"][0]["cluster"]
    assert cluster["server"] == testbed.server
    assert "certificate-authority-data" in cluster
    assert oct(testbed.kubeconfig.stat().st_mode & 0o777) == "0o600"
    assert testbed.kubectl("auth", "can-i", "*", "*").stdout.strip() == "yes"
    # The CA really is what the server presents: a verifying client gets through.
    request = urllib.request.Request(f"{testbed.server}/readyz", headers={"Authorization": f"Bearer {testbed.token}"})
    with urllib.request.urlopen(request, context=testbed.api_ssl_context(), timeout=10) as response:
        assert response.read() == b"ok"


def test_apply_deviceclass(testbed: Testbed) -> None:
    manifest = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "DeviceClass",
        "metadata": {"name": "testbed-apply.example.com"},
        "spec": {"selectors": [{"cel": {"expression": "device.driver == 'gpu.example.com'"}}]},
    }
    testbed.kubectl("apply", "-f", "-", input=yaml.safe_dump(manifest))
    try:
        got = _get_json(testbed, "deviceclass", "testbed-apply.example.com")
        assert got["spec"]["selectors"][0]["cel"]["expression"] == "device.driver == 'gpu.example.com'"
    finally:
        testbed.kubectl("delete", "deviceclass", "testbed-apply.example.com", "--wait=false")


def test_per_device_node_selection_is_accepted(testbed: Testbed) -> None:
    """DEFAULT_FEATURE_GATES: slices whose devices each pick their node (as in the sample objects)."""
    manifest = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": "testbed-per-device"},
        "spec": {
            "driver": "nic.example.com",
            "perDeviceNodeSelection": True,
            "pool": {"name": "nics", "generation": 1, "resourceSliceCount": 1},
            "devices": [{"name": "nic-0", "nodeName": "node-a"}],
        },
    }
    testbed.kubectl("apply", "-f", "-", input=yaml.safe_dump(manifest))
    try:
        got = _get_json(testbed, "resourceslice", "testbed-per-device")
        assert got["spec"]["perDeviceNodeSelection"] is True
        assert got["spec"]["devices"][0]["nodeName"] == "node-a"
    finally:
        testbed.kubectl("delete", "resourceslice", "testbed-per-device")


def test_serviceaccount_token_is_subject_to_rbac(testbed: Testbed, tmp_path: Path) -> None:
    ns = "testbed-rbac"
    testbed.kubectl("create", "namespace", ns)
    try:
        testbed.kubectl("create", "serviceaccount", "reader", f"--namespace={ns}")
        token = testbed.mint_token(ns, "reader")
        kubeconfig = testbed.write_kubeconfig(tmp_path / "reader.kubeconfig", token)

        whoami = json.loads(testbed.kubectl("auth", "whoami", "-o", "json", kubeconfig=kubeconfig).stdout)
        assert whoami["status"]["userInfo"]["username"] == f"system:serviceaccount:{ns}:reader"

        denied = testbed.kubectl(
            "auth", "can-i", "list", "deviceclasses.resource.k8s.io", kubeconfig=kubeconfig, check=False
        )
        assert (denied.returncode, denied.stdout.strip()) == (1, "no")
        forbidden = testbed.kubectl("get", "deviceclasses", kubeconfig=kubeconfig, check=False)
        assert forbidden.returncode != 0
        assert "forbidden" in forbidden.stderr.lower()

        # Granting the permission flips the answer: RBAC, not a broken token, made the difference.
        testbed.kubectl(
            "create", "clusterrole", "testbed-deviceclass-reader", "--verb=list", "--resource=deviceclasses"
        )
        testbed.kubectl(
            "create",
            "clusterrolebinding",
            "testbed-deviceclass-reader",
            "--clusterrole=testbed-deviceclass-reader",
            f"--serviceaccount={ns}:reader",
        )
        allowed = testbed.kubectl("auth", "can-i", "list", "deviceclasses.resource.k8s.io", kubeconfig=kubeconfig)
        assert allowed.stdout.strip() == "yes"
    finally:
        testbed.kubectl("delete", "clusterrolebinding,clusterrole", "testbed-deviceclass-reader", check=False)
        testbed.kubectl("delete", "namespace", ns, "--wait=false")


def test_stop_and_start_apiserver_keeps_port_and_data(testbed: Testbed) -> None:
    testbed.kubectl("create", "configmap", "testbed-outage", "--from-literal=k=v")
    old_pid = testbed.pids["kube-apiserver"]
    testbed.stop_apiserver()
    try:
        assert "kube-apiserver" not in testbed.pids
        assert not _alive(old_pid)
        assert testbed.pids["etcd"]
        unreachable = testbed.kubectl("get", "configmaps", check=False, timeout=30)
        assert unreachable.returncode != 0
        assert "refused" in unreachable.stderr
    finally:
        testbed.start_apiserver()
    assert testbed.pids["kube-apiserver"] != old_pid
    got = _get_json(testbed, "configmap", "testbed-outage")  # same server URL, same etcd
    assert got["data"] == {"k": "v"}
    testbed.kubectl("delete", "configmap", "testbed-outage")
    # state.json follows, so another process (`testbed down`) would stop the new apiserver.
    assert Testbed.load(testbed.dir).pids == testbed.pids


def test_down_leaves_no_process(tmp_path: Path, testbed_binaries: Binaries) -> None:
    tb = up(tmp_path / "tb", binaries=testbed_binaries)
    pids = tb.pids
    assert set(pids) == {"etcd", "kube-apiserver"}
    assert all(_alive(pid) for pid in pids.values())
    down(tb.dir)
    for name, pid in pids.items():
        assert not Path(f"/proc/{pid}").exists(), f"{name} (pid {pid}) is still there"
    assert not (tb.dir / "etcd").exists()
    assert (tb.dir / "logs" / "kube-apiserver.log").stat().st_size > 0
    assert not (tb.dir / "state.json").exists()
    down(tb.dir)  # idempotent


def test_failed_start_stops_everything_and_shows_the_log(tmp_path: Path, testbed_binaries: Binaries) -> None:
    with pytest.raises(TestbedError, match="kube-apiserver exited") as info:
        up(tmp_path / "tb", binaries=testbed_binaries, apiserver_args=["--no-such-flag"])
    assert "unknown flag: --no-such-flag" in str(info.value)
    assert not (tmp_path / "tb" / "state.json").exists()
    etcd_cmdline = f"--data-dir={tmp_path / 'tb' / 'etcd'}".encode()
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit() and _alive(int(proc.name)):
            try:
                cmdline = (proc / "cmdline").read_bytes()
            except OSError:
                continue
            assert etcd_cmdline not in cmdline, "etcd was left running"


def test_cli_up_returns_and_processes_outlive_it(tmp_path: Path, testbed_binaries: Binaries) -> None:
    tb_dir = tmp_path / "cli"
    env = {**os.environ, "OTEL_DRA_CACHE": str(testbed_binaries.kubectl.parents[2])}
    cli = [sys.executable, "-m", "otel_dra", "testbed"]
    result = subprocess.run([*cli, "up", "--dir", str(tb_dir)], capture_output=True, text=True, env=env)
    try:
        assert result.returncode == 0, result.stderr
        assert result.stdout == f"KUBECONFIG={tb_dir.resolve() / 'kubeconfig'}\n"
        tb = Testbed.load(tb_dir)
        assert tb.token not in result.stdout + result.stderr
        assert all(_alive(pid) for pid in tb.pids.values())
        assert tb.kubectl("get", "namespace", "default", "-o", "name").stdout.strip() == "namespace/default"
    finally:
        stopped = subprocess.run([*cli, "down", "--dir", str(tb_dir)], capture_output=True, text=True, env=env)
    assert stopped.returncode == 0, stopped.stderr
    assert not (tb_dir / "state.json").exists()


# --- scheduler and controller-manager ------------------------------------------------------------


def _healthz(port: int) -> str:
    insecure = ssl.create_default_context()
    insecure.check_hostname = False
    insecure.verify_mode = ssl.CERT_NONE  # they serve an in-memory self-signed certificate
    with urllib.request.urlopen(f"https://127.0.0.1:{port}/healthz", context=insecure, timeout=10) as response:
        return str(response.read().decode())


def test_scheduler_and_controller_manager_are_healthy(testbed_sched: Testbed) -> None:
    assert set(testbed_sched.pids) == {"etcd", "kube-apiserver", "kube-scheduler", "kube-controller-manager"}
    assert _healthz(testbed_sched.ports["scheduler"]) == "ok"
    assert _healthz(testbed_sched.ports["controller_manager"]) == "ok"


def test_scheduler_allocates_a_claim_from_a_template(testbed_sched: Testbed) -> None:
    """The DRA flow other tests rely on: template -> claim (controller-manager) -> allocation (scheduler)."""
    tb = testbed_sched
    ns = "testbed-alloc"
    node = "testbed-node-a"
    objects: list[dict[str, Any]] = [
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}},
        {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {"name": node, "labels": {"kubernetes.io/hostname": node}},
        },
        {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "DeviceClass",
            "metadata": {"name": "testbed-alloc.example.com"},
            "spec": {"selectors": [{"cel": {"expression": "device.driver == 'testbed-alloc.example.com'"}}]},
        },
        {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceSlice",
            "metadata": {"name": f"{node}-testbed-alloc"},
            "spec": {
                "driver": "testbed-alloc.example.com",
                "nodeName": node,
                "pool": {"name": node, "generation": 1, "resourceSliceCount": 1},
                "devices": [{"name": "gpu-0", "attributes": {"index": {"int": 0}}}],
            },
        },
        {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaimTemplate",
            "metadata": {"name": "one-gpu", "namespace": ns},
            "spec": {
                "spec": {
                    "devices": {
                        "requests": [{"name": "gpu", "exactly": {"deviceClassName": "testbed-alloc.example.com"}}]
                    }
                }
            },
        },
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "consumer", "namespace": ns},
            "spec": {
                "containers": [
                    {
                        "name": "c",
                        "image": "registry.k8s.io/pause:3.10",
                        "resources": {"claims": [{"name": "gpu"}]},
                    }
                ],
                "resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": "one-gpu"}],
            },
        },
    ]
    tb.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(objects))
    try:
        # There is no kubelet: play its part by reporting the Node Ready with room for pods.
        ensure_node(KubeClient(load_credentials(str(tb.kubeconfig))), node)

        def claim_allocated() -> Any:
            claims = _get_json(tb, "resourceclaims", f"--namespace={ns}")["items"]
            return claims if claims and claims[0].get("status", {}).get("allocation") else None

        (claim,) = wait_until(claim_allocated, timeout=60, interval=0.2, what="the claim to be created and allocated")
        assert claim["metadata"]["name"].startswith("consumer-gpu-")
        (result,) = claim["status"]["allocation"]["devices"]["results"]
        assert (result["driver"], result["pool"], result["device"]) == (
            "testbed-alloc.example.com",
            node,
            "gpu-0",
        )
        pod = wait_until(
            lambda: (p := _get_json(tb, "pod", "consumer", f"--namespace={ns}"))["spec"].get("nodeName") and p,
            timeout=60,
            interval=0.2,
            what="the pod to be bound",
        )
        assert pod["spec"]["nodeName"] == node
    finally:
        tb.kubectl("delete", "namespace", ns, "--wait=false", check=False)
        tb.kubectl("delete", "node", node, "--wait=false", check=False)
        tb.kubectl("delete", "resourceslice", f"{node}-testbed-alloc", check=False)
        tb.kubectl("delete", "deviceclass", "testbed-alloc.example.com", check=False)
