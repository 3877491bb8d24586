"""The testbed's build and its releases, as far as they need no Go toolchain and no built binary:
missing binaries and a missing or failing go are clear errors, a warm cache builds nothing, and each
release's wrapper module repeats that release's own go.mod. The control plane itself is tested in
tests/integration/test_testbed.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from otel_dra.testbed import BinariesMissingError, BuildError, build, find_binaries
from otel_dra.testbed.build import (
    KUBERNETES_RELEASES,
    KUBERNETES_STAGING_MODULES,
    control_plane,
    expected_binaries,
    kubernetes_release,
    kubernetes_wrapper_files,
    wrapper_files,
)


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
