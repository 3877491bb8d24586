"""The testbed node's parts that need no daemon: host checks, configs, images, refusal paths."""

from __future__ import annotations

import io
import json
import tarfile
import time
from pathlib import Path

import pytest
import yaml

from otel_dra.testbed.build import Binaries
from otel_dra.testbed.controlplane import Testbed, TestbedError
from otel_dra.testbed.images import BUSYBOX, BUSYBOX_IMAGE, PAUSE_IMAGE, ImageError, node_images
from otel_dra.testbed.node import (
    HostSupport,
    NodeLayout,
    containerd_config,
    host_support,
    kubelet_config,
    start_node,
)

_STATUS_FULL = "Name:\tx\nCapEff:\t000001ffffffffff\n"
_STATUS_NO_SYS_RESOURCE = "Name:\tx\nCapEff:\t000001fffeffffff\n"  # what these VMs grant
_FILESYSTEMS = "nodev\tsysfs\nnodev\ttmpfs\n\text4\nnodev\toverlay\n"


def _cgroups(tmp_path: Path) -> Path:
    (tmp_path / "cg" / "memory").mkdir(parents=True)
    return tmp_path / "cg"


def test_a_capable_root_machine_has_no_problems(tmp_path: Path) -> None:
    support = host_support(euid=0, filesystems=_FILESYSTEMS, status=_STATUS_FULL, cgroup_root=_cgroups(tmp_path))
    assert support == HostSupport((), can_lower_oom_score=True)


def test_the_capability_trap_is_detected(tmp_path: Path) -> None:
    support = host_support(
        euid=0, filesystems=_FILESYSTEMS, status=_STATUS_NO_SYS_RESOURCE, cgroup_root=_cgroups(tmp_path)
    )
    # Not a refusal: containerd and the kubelet are configured around it (see the config tests).
    assert support == HostSupport((), can_lower_oom_score=False)


def test_what_a_machine_lacks_is_each_named(tmp_path: Path) -> None:
    support = host_support(euid=1000, filesystems="nodev\tsysfs\n", status=_STATUS_FULL, cgroup_root=tmp_path)
    assert len(support.problems) == 3
    assert "must run as root (euid 1000)" in support.problems[0]
    assert "no overlay filesystem" in support.problems[1]
    assert "no cgroup hierarchy" in support.problems[2]


def _fake_testbed(tmp_path: Path) -> Testbed:
    bin_dir = tmp_path / "bin"
    names = ("etcd", "kube-apiserver", "kube-scheduler", "kube-controller-manager", "kubectl", "kubelet")
    binaries = Binaries.from_dict({name: str(bin_dir / name) for name in names})
    return Testbed(tmp_path, tmp_path / "kubeconfig", "https://127.0.0.1:1", "t", tmp_path / "ca.crt", {}, binaries)


def test_a_machine_that_cannot_run_a_node_is_a_clear_error_not_a_hang(tmp_path: Path) -> None:
    testbed = _fake_testbed(tmp_path)
    started = time.monotonic()
    with pytest.raises(TestbedError, match=r"this machine cannot run a testbed node: a testbed node must run as root"):
        start_node(testbed, "n1", support=HostSupport(("a testbed node must run as root (euid 1000)",), True))
    with pytest.raises(TestbedError, match=r"node name 'N_1' is not a DNS label"):
        start_node(testbed, "N_1")
    assert time.monotonic() - started < 5
    assert not (tmp_path / "node-n1").exists()  # nothing was started or recorded


def test_a_directory_too_long_for_the_sockets_is_refused_up_front(tmp_path: Path) -> None:
    testbed = _fake_testbed(tmp_path / ("d" * 60))
    support = HostSupport((), True)
    with pytest.raises(TestbedError, match=r"too long for the node's unix sockets .* use a shorter --dir"):
        start_node(testbed, "n1", support=support)


def test_containerd_is_configured_around_the_capability_trap(tmp_path: Path) -> None:
    layout = NodeLayout(tmp_path / "node-n1")
    restricted = containerd_config(layout, restrict_oom_score_adj=True)
    assert "restrict_oom_score_adj = true" in restricted
    assert "restrict_oom_score_adj = false" in containerd_config(layout, restrict_oom_score_adj=False)
    # Everything under the node's directory, the CDI specs where the plugin writes them, the pause
    # image the local one, and no systemd.
    assert f'root = "{layout.dir}/containerd/root"' in restricted
    assert f'address = "{layout.containerd_socket}"' in restricted
    assert f'cdi_spec_dirs = ["{layout.cdi_dir}"]' in restricted
    assert f'sandbox = "{PAUSE_IMAGE}"' in restricted
    assert "SystemdCgroup = false" in restricted
    assert "netns_mounts_under_state_dir = true" in restricted


def test_the_kubelet_is_configured_for_these_machines(tmp_path: Path) -> None:
    layout = NodeLayout(tmp_path / "node-n1")
    config = kubelet_config(
        layout, ca_file=tmp_path / "ca.crt", ports={"kubelet": 1, "kubelet_healthz": 2}, feature_gates={"X": True}
    )
    yaml.safe_dump(config)  # plain data
    assert config["oomScoreAdj"] == 0
    assert config["cgroupDriver"] == "cgroupfs"
    assert config["failCgroupV1"] is False and config["failSwapOn"] is False
    assert config["address"] == config["healthzBindAddress"] == "127.0.0.1"
    assert config["readOnlyPort"] == 0
    assert config["podLogsDir"] == str(layout.pod_logs)
    assert config["containerRuntimeEndpoint"] == f"unix://{layout.containerd_socket}"
    assert config["imageGCHighThresholdPercent"] == 100
    assert config["featureGates"] == {"X": True}
    assert layout.registry_dir == layout.kubelet_root / "plugins_registry"  # the plugin watcher's only dir


@pytest.mark.skipif(not BUSYBOX.is_file(), reason="needs Debian's busybox-static")
def test_the_images_are_oci_layouts_made_the_same_everywhere(tmp_path: Path) -> None:
    pause, busybox = node_images(tmp_path / "a")
    again = node_images(tmp_path / "b")
    assert pause.tarball.read_bytes() == again[0].tarball.read_bytes()
    assert busybox.tarball.read_bytes() == again[1].tarball.read_bytes()
    assert (pause.name, busybox.name) == (PAUSE_IMAGE, BUSYBOX_IMAGE)
    with tarfile.open(busybox.tarball) as tar:
        names = set(tar.getnames())
        index = json.load(tar.extractfile("index.json"))  # type: ignore[arg-type]
        entry = index["manifests"][0]
        assert entry["annotations"]["io.containerd.image.name"] == BUSYBOX_IMAGE
        manifest = json.load(tar.extractfile(f"blobs/sha256/{entry['digest'].removeprefix('sha256:')}"))  # type: ignore[arg-type]
        config_blob = tar.extractfile(f"blobs/sha256/{manifest['config']['digest'].removeprefix('sha256:')}")
        config = json.load(config_blob)  # type: ignore[arg-type]
        layer = tar.extractfile(f"blobs/sha256/{manifest['layers'][0]['digest'].removeprefix('sha256:')}")
        layer_bytes = layer.read()  # type: ignore[union-attr]
    assert {"oci-layout", "index.json"} <= names
    assert config["rootfs"]["diff_ids"] == [manifest["layers"][0]["digest"]]
    assert config["config"]["Cmd"] == ["/bin/sh"]
    with tarfile.open(fileobj=io.BytesIO(layer_bytes)) as layer_tar:
        members = {m.name: m for m in layer_tar.getmembers()}
    assert members["bin/busybox"].size == BUSYBOX.stat().st_size
    assert members["bin/sh"].linkname == "busybox"
    assert {m.mtime for m in members.values()} == {0}


def test_images_need_busybox_static(tmp_path: Path) -> None:
    with pytest.raises(ImageError, match="install Debian's busybox-static"):
        node_images(tmp_path, busybox=tmp_path / "no-busybox")
    dynamic = tmp_path / "busybox"
    dynamic.write_bytes(b"\x7fELF" + b"\0" * 100 + b"/lib64/ld-linux-x86-64.so.2\0")
    with pytest.raises(ImageError, match="dynamically linked"):
        node_images(tmp_path, busybox=dynamic)


def test_up_with_a_node_on_a_machine_that_cannot_run_one_fails_before_the_control_plane(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import otel_dra.testbed.node as node_module
    from otel_dra.cli import main
    from otel_dra.testbed.build import expected_binaries

    cache = tmp_path / "cache"
    monkeypatch.setenv("OTEL_DRA_CACHE", str(cache))
    for path in expected_binaries(cache).all():  # stand-ins: nothing may run them
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("#!/bin/sh\nexit 99\n")
        path.chmod(0o755)
    not_root = host_support(
        euid=1000, filesystems=_FILESYSTEMS, status=_STATUS_NO_SYS_RESOURCE, cgroup_root=_cgroups(tmp_path)
    )
    monkeypatch.setattr(node_module, "host_support", lambda: not_root)
    started = time.monotonic()
    assert main(["testbed", "up", "--dir", str(tmp_path / "tb"), "--node", "n1"]) == 1
    assert time.monotonic() - started < 5
    err = capsys.readouterr().err
    assert "error: this machine cannot run a testbed node: a testbed node must run as root (euid 1000)" in err
    assert not (tmp_path / "tb" / "state.json").exists()  # no control plane was started
