"""The testbed itself: a real control plane that the rest of the integration tests rely on."""

from __future__ import annotations

import json
import os
import ssl
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from otel_dra.kube.client import KubeClient, load_credentials
from otel_dra.kubeletsim.nodes import ensure_node
from otel_dra.testbed import (
    Binaries,
    BinariesMissingError,
    BuildError,
    Testbed,
    TestbedError,
    build,
    down,
    find_binaries,
    up,
)
from otel_dra.testbed.build import (
    KUBERNETES_RELEASES,
    KUBERNETES_STAGING_MODULES,
    control_plane,
    expected_binaries,
    kubernetes_release,
    kubernetes_wrapper_files,
    wrapper_files,
)

# --- build: no Go toolchain or binaries needed ------------------------------------------------------


def test_find_binaries_missing_says_how_to_build(tmp_path: Path) -> None:
    with pytest.raises(BinariesMissingError, match="otel-dra testbed build"):
        find_binaries(tmp_path)


def test_build_without_go_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.raises(BuildError, match="`go` tool is not on PATH"):
        build(tmp_path, progress=lambda _: None)


def test_build_skips_when_every_binary_exists(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    release = kubernetes_release()  # OTEL_DRA_KUBERNETES_VERSION, else the default
    key = control_plane(release)[0].key
    for rel in (
        f"bin/etcd-{release.etcd}/etcd",
        *(f"bin/{key}/{name}" for name in ("kube-apiserver", "kube-scheduler", "kubelet")),
        *(f"bin/{key}/{name}" for name in ("kube-controller-manager", "kubectl")),
    ):
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("#!/bin/sh\n")
        path.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))  # would fail if it tried to run go
    lines: list[str] = []
    binaries = build(tmp_path, progress=lines.append)
    assert binaries == find_binaries(tmp_path)
    assert lines == [f"testbed binaries already built under {tmp_path.resolve() / 'bin'}"]


def test_failed_go_step_shows_its_output_and_leaves_nothing_half_done(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake_bin = tmp_path / "fakebin"
    fake_bin.mkdir()
    fake_go = fake_bin / "go"
    fake_go.write_text("#!/bin/sh\necho 'go: module lookup disabled (simulated)'\nexit 1\n")
    fake_go.chmod(0o755)
    monkeypatch.setenv("PATH", str(fake_bin))
    cache = tmp_path / "cache"
    lines: list[str] = []
    key = control_plane()[0].key
    with pytest.raises(BuildError, match="go mod tidy\\] failed") as info:
        build(cache, progress=lines.append)
    assert "module lookup disabled (simulated)" in str(info.value)
    assert lines == [f"[{key}: go mod tidy] started"]  # output only on failure
    # The wrapper stays under its .tmp name: a later run starts it over instead of trusting it.
    assert not (cache / "src" / key).exists()
    assert not (cache / "bin" / key).exists()


def test_kubernetes_wrapper_pins_every_staging_module() -> None:
    go_mod = kubernetes_wrapper_files()["go.mod"]
    assert len(KUBERNETES_STAGING_MODULES) == 31
    for name in KUBERNETES_STAGING_MODULES:
        assert f"replace k8s.io/{name} => k8s.io/{name} v0.34.4\n" in go_mod
    assert "godebug default=go1.24\n" in go_mod
    assert "require k8s.io/kubernetes v1.34.4\n" in go_mod  # the table's row: the oldest release


def test_each_release_wrapper_repeats_its_own_go_mod() -> None:
    """Staging modules and godebug as each release's k8s.io/kubernetes go.mod has them (1.36 added
    cri-streaming and streaming); etcd as its hack/lib/etcd.sh names it."""
    expected = {"1.34": (31, "go1.24", "v3.6"), "1.35": (31, "go1.25", "v3.6"), "1.36": (33, "go1.26", "v3.6")}
    expected["1.37"] = (33, "go1.26", "v3.7")
    expected["1.38"] = (35, "go1.27", "v3.7")  # 1.38 added apiextensions-api and ktesting
    assert [release.minor for release in KUBERNETES_RELEASES] == sorted(expected)
    for minor, (modules, godebug, etcd) in expected.items():
        kubernetes, etcd_row = control_plane(minor)
        go_mod = wrapper_files(kubernetes)["go.mod"]
        staging = "v0." + kubernetes.version.removeprefix("v1.")
        assert go_mod.count(f" {staging}\n") == modules == len(kubernetes_release(minor).staging)
        assert f"godebug default={godebug}\n" in go_mod
        assert f"require k8s.io/kubernetes {kubernetes.version}\n" in go_mod
        assert etcd_row.version.startswith(etcd + ".")
    assert "replace k8s.io/streaming => k8s.io/streaming v0.37.2\n" in wrapper_files(control_plane("1.37")[0])["go.mod"]


@pytest.mark.parametrize("spec", ["1.37", "v1.37", "1.37.2", "v1.37.2", " 1.37 "])
def test_a_release_is_named_by_minor_or_version(spec: str) -> None:
    assert kubernetes_release(spec).version == "v1.37.2"


def test_the_release_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("OTEL_DRA_KUBERNETES_VERSION", "1.36")
    assert kubernetes_release().version == "v1.36.3"
    key = control_plane("1.36")[0].key
    assert key.startswith("kubernetes-v1.36.3-")
    assert expected_binaries(tmp_path).kube_apiserver == tmp_path.resolve() / "bin" / key / "kube-apiserver"
    with pytest.raises(BinariesMissingError, match=r"testbed build --kubernetes-version 1\.36"):
        find_binaries(tmp_path)
    monkeypatch.setenv("OTEL_DRA_KUBERNETES_VERSION", "1.33")
    with pytest.raises(BuildError, match=r"OTEL_DRA_KUBERNETES_VERSION='1.33' is not one the testbed builds"):
        kubernetes_release()


def test_the_version_flag_is_checked(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    from otel_dra.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["testbed", "up", "--dir", "x", "--kubernetes-version", "1.30"])
    assert exit_info.value.code == 2
    assert "'1.30' is not one the testbed builds (one of 1.34, 1.35, 1.36, 1.37" in capsys.readouterr().err
    monkeypatch.setenv("OTEL_DRA_KUBERNETES_VERSION", "2.0")
    assert main(["demo", "--nodes", "1"]) == 2
    assert "environment variable OTEL_DRA_KUBERNETES_VERSION" in capsys.readouterr().err


# --- the control plane ---------------------------------------------------------------------------


def _wait_for(what: str, probe: Callable[[], Any], timeout: float = 60) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = probe()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(0.2)


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

        (claim,) = _wait_for("the claim to be created and allocated", claim_allocated)
        assert claim["metadata"]["name"].startswith("consumer-gpu-")
        (result,) = claim["status"]["allocation"]["devices"]["results"]
        assert (result["driver"], result["pool"], result["device"]) == (
            "testbed-alloc.example.com",
            node,
            "gpu-0",
        )
        pod = _wait_for(
            "the pod to be bound",
            lambda: (p := _get_json(tb, "pod", "consumer", f"--namespace={ns}"))["spec"].get("nodeName") and p,
        )
        assert pod["spec"]["nodeName"] == node
    finally:
        tb.kubectl("delete", "namespace", ns, "--wait=false", check=False)
        tb.kubectl("delete", "node", node, "--wait=false", check=False)
        tb.kubectl("delete", "resourceslice", f"{node}-testbed-alloc", check=False)
        tb.kubectl("delete", "deviceclass", "testbed-alloc.example.com", check=False)
