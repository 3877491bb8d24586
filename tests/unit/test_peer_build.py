"""The Collector/Jaeger build recipes (no Go toolchain needed): manifest, cache keys, skipping."""

from __future__ import annotations

import dataclasses
import importlib
import os
from pathlib import Path

import pytest
import yaml

# The module, not the `build` function that otel_dra.testbed re-exports under the same name.
b = importlib.import_module("otel_dra.testbed.build")


def test_manifest_lists_one_collector_release_and_no_fileexporter(tmp_path: Path) -> None:
    manifest = yaml.safe_load(b.otelcol_manifest(tmp_path / "src"))
    assert manifest["dist"]["name"] == b.OTELCOL_NAME
    assert manifest["dist"]["output_path"] == str(tmp_path / "src")
    modules = [
        entry["gomod"] for kind in ("receivers", "processors", "exporters", "extensions") for entry in manifest[kind]
    ]
    names = {m.split()[0].rsplit("/", 1)[1]: m.split()[1] for m in modules}
    assert names == {
        "otlpreceiver": "v0.165.0",
        "batchprocessor": "v0.165.0",
        "memorylimiterprocessor": "v0.165.0",
        "k8sattributesprocessor": "v1.3.1",
        "resourceprocessor": "v0.165.1",
        "otlpexporter": "v0.165.0",
        "otlphttpexporter": "v0.165.0",
        "debugexporter": "v0.165.0",
        "prometheusexporter": "v0.165.1",
        "healthcheckextension": "v0.165.1",
    }
    assert not any("fileexporter" in m for m in modules)
    assert all(entry["gomod"].endswith(b.OTELCOL_STABLE_VERSION) for entry in manifest["providers"])
    # k8sattributes v1.3.1's internal/kubelet v0.164.1 is not served: the release's own replaces it.
    assert manifest["replaces"] == [
        "github.com/open-telemetry/opentelemetry-collector-contrib/internal/kubelet => "
        "github.com/open-telemetry/opentelemetry-collector-contrib/internal/kubelet v0.165.1"
    ]


def test_cache_key_changes_with_the_components(monkeypatch: pytest.MonkeyPatch) -> None:
    key = b._otelcol_key()
    assert key.startswith(f"{b.OTELCOL_NAME}-{b.OTELCOL_CORE_VERSION}-")
    monkeypatch.setitem(
        b.OTELCOL_COMPONENTS, "receivers", (*b.OTELCOL_COMPONENTS["receivers"], "example.com/other v1.0.0")
    )
    assert b._otelcol_key() != key


def test_missing_peers_say_how_to_build(tmp_path: Path) -> None:
    with pytest.raises(b.BinariesMissingError, match="testbed build --otelcol"):
        b.find_otelcol(tmp_path)
    with pytest.raises(b.BinariesMissingError, match="testbed build --jaeger"):
        b.find_jaeger(tmp_path)


def _fake_binary(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\n")
    path.chmod(0o755)


def test_cached_peers_are_not_rebuilt(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_binary(tmp_path / "bin" / b._otelcol_key() / b.OTELCOL_NAME)
    _fake_binary(tmp_path / "bin" / f"jaeger-{b.JAEGER_VERSION}" / "jaeger")
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))  # would fail if it tried to run go
    assert b.build_otelcol(tmp_path, progress=lambda _: None) == b.find_otelcol(tmp_path)
    assert b.build_jaeger(tmp_path, progress=lambda _: None) == b.find_jaeger(tmp_path)


def test_build_without_go_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.raises(b.BuildError, match="`go` tool is not on PATH"):
        b.build_otelcol(tmp_path, progress=lambda _: None)
    with pytest.raises(b.BuildError, match="`go` tool is not on PATH"):
        b.build_jaeger(tmp_path, progress=lambda _: None)


def test_jaeger_wrapper_repeats_the_replace_of_jaegers_go_mod() -> None:
    files = b.jaeger_wrapper_files()
    assert f"require github.com/jaegertracing/jaeger {b.JAEGER_VERSION}" in files["go.mod"]
    assert "replace github.com/Shopify/sarama => github.com/Shopify/sarama v1.33.0" in files["go.mod"]
    assert '"github.com/jaegertracing/jaeger/cmd/jaeger"' in files["tools.go"]


# --- the peer table and its one generic builder --------------------------------------------------


def test_each_rows_wrapper_module() -> None:
    go_mod = "module otel-dra-peers/{}\n\ngo 1.24.0\n\nrequire {}\n"
    tools_go = '//go:build tools\npackage tools\nimport _ "{}"\n'
    assert b.wrapper_files(b.ETCD) == {
        "go.mod": go_mod.format("etcd", "go.etcd.io/etcd/server/v3 v3.6.16"),
        "tools.go": tools_go.format("go.etcd.io/etcd/server/v3"),
    }
    assert b.wrapper_files(b.HELM) == {
        "go.mod": go_mod.format("helm", "helm.sh/helm/v3 v3.21.4"),
        "tools.go": tools_go.format("helm.sh/helm/v3/cmd/helm"),
    }
    assert b.wrapper_files(b.OCB) == {
        "go.mod": go_mod.format("ocb", "go.opentelemetry.io/collector/cmd/builder v0.165.0"),
        "tools.go": tools_go.format("go.opentelemetry.io/collector/cmd/builder"),
    }
    assert b.wrapper_files(b.JAEGER) == {
        "go.mod": go_mod.format("jaeger", "github.com/jaegertracing/jaeger v1.76.0")
        + "\nreplace github.com/Shopify/sarama => github.com/Shopify/sarama v1.33.0\n",
        "tools.go": tools_go.format("github.com/jaegertracing/jaeger/cmd/jaeger"),
    }
    kubernetes = b.wrapper_files(b.KUBERNETES)
    assert kubernetes["go.mod"].startswith(
        "module otel-dra-peers/kubernetes\n\ngo 1.24.0\n\ngodebug default=go1.24\n\n"
        "require k8s.io/kubernetes v1.34.4\n\nreplace k8s.io/api => k8s.io/api v0.34.4\n\n"
    )
    assert kubernetes["go.mod"].endswith("\n\nreplace k8s.io/sample-controller => k8s.io/sample-controller v0.34.4\n")
    assert kubernetes["go.mod"].count("\nreplace ") == len(b.KUBERNETES_STAGING_MODULES)
    assert kubernetes["tools.go"] == (
        "//go:build tools\npackage tools\nimport (\n"
        '\t_ "k8s.io/kubernetes/cmd/kube-apiserver"\n'
        '\t_ "k8s.io/kubernetes/cmd/kube-scheduler"\n'
        '\t_ "k8s.io/kubernetes/cmd/kube-controller-manager"\n'
        '\t_ "k8s.io/kubectl/pkg/cmd"\n'
        '\t_ "k8s.io/kubernetes/cmd/kubectl"\n'
        '\t_ "k8s.io/kubernetes/cmd/kubelet"\n'
        ")\n"
    )
    assert b.kubernetes_wrapper_files() == kubernetes
    assert b.jaeger_wrapper_files() == b.wrapper_files(b.JAEGER)


def test_each_rows_go_build_command_and_environment() -> None:
    out = Path("/out")
    assert b.go_build_command(b.ETCD, out) == ["go", "build", "-o", "/out/etcd", "go.etcd.io/etcd/server/v3"]
    assert b.go_build_command(b.KUBERNETES, out) == [
        "go",
        "build",
        "-ldflags",
        "-s -w -X k8s.io/component-base/version.gitVersion=v1.34.4"
        " -X k8s.io/component-base/version.gitMajor=1 -X k8s.io/component-base/version.gitMinor=34",
        "-o",
        "/out/",
        *(f"k8s.io/kubernetes/cmd/{name}" for name in b.KUBERNETES_COMMANDS),
    ]
    assert b.go_build_command(b.HELM, out) == [
        "go",
        "build",
        "-ldflags",
        "-s -w -X helm.sh/helm/v3/internal/version.version=v3.21.4",
        "-o",
        "/out/helm",
        "helm.sh/helm/v3/cmd/helm",
    ]
    assert b.go_build_command(b.OCB, out) == [
        "go",
        "build",
        "-ldflags",
        "-s -w",
        "-o",
        "/out/ocb",
        "go.opentelemetry.io/collector/cmd/builder",
    ]
    assert b.go_build_command(b.JAEGER, out) == [
        "go",
        "build",
        "-trimpath",
        "-ldflags",
        "-s -w",
        "-o",
        "/out/jaeger",
        "github.com/jaegertracing/jaeger/cmd/jaeger",
    ]
    env = {"GOFLAGS": "-mod=mod"}
    # The control plane keeps the environment's cgo setting; every other peer is built static.
    assert b.go_build_environment(b.KUBERNETES, env) == env
    for peer in (b.ETCD, b.HELM, b.OCB, b.JAEGER):
        assert b.go_build_environment(peer, env) == {**env, "CGO_ENABLED": "0"}


def test_another_kubernetes_version_is_the_same_row_with_its_version() -> None:
    row = dataclasses.replace(b.KUBERNETES, version="v1.37.2")
    assert row.key == f"kubernetes-v1.37.2-{row.recipe_digest()}"
    assert row.bin_dir(Path("/c")) == Path(f"/c/bin/{row.key}")
    go_mod = b.wrapper_files(row)["go.mod"]
    assert "require k8s.io/kubernetes v1.37.2\n" in go_mod
    assert all(f"replace k8s.io/{name} => k8s.io/{name} v0.37.2\n" in go_mod for name in b.KUBERNETES_STAGING_MODULES)
    assert "-X k8s.io/component-base/version.gitVersion=v1.37.2" in b.go_build_command(row, Path("/o"))[3]
    assert "-X k8s.io/component-base/version.gitMinor=37" in b.go_build_command(row, Path("/o"))[3]


def test_the_table_has_one_row_per_cache_key() -> None:
    keys = [peer.key for peer in b.PEERS]
    kubernetes = f"kubernetes-v1.34.4-{b.KUBERNETES.recipe_digest()}"
    assert keys == ["etcd-v3.6.16", kubernetes, "helm-v3.21.4", "ocb-v0.165.0", "jaeger-v1.76.0", "containerd-v2.4.2"]
    assert set(b.CONTROL_PLANE) <= set(b.PEERS)
    with pytest.raises(ValueError, match="one-package row only"):
        b.GoPeer("x", "v1.0.0", "example.com/x", ("example.com/x/a", "example.com/x/b"), binary="x")


# A stand-in for go: records its working directory, CGO_ENABLED and arguments (tab-separated), writes
# go.sum for `mod tidy`, and for `build` an executable at -o (a file, or one per package in a
# directory given with a trailing separator).
_FAKE_GO = """#!/bin/sh
{ printf '%s\\t%s\\t' "$PWD" "${CGO_ENABLED-unset}"; printf '%s\\t' "$@"; echo; } >> "$FAKE_GO_CALLS"
case "$1" in
mod) : > go.sum ;;
build)
    while [ "$1" != "-o" ]; do shift; done
    out=$2
    shift 2
    case "$out" in
    */) for pkg in "$@"; do printf '#!/bin/sh\\n' > "$out${pkg##*/}"; chmod +x "$out${pkg##*/}"; done ;;
    *) printf '#!/bin/sh\\n' > "$out"; chmod +x "$out" ;;
    esac ;;
esac
"""


def _fake_go(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    fake_bin = tmp_path / "fakebin"
    fake_bin.mkdir()
    (fake_bin / "go").write_text(_FAKE_GO)
    (fake_bin / "go").chmod(0o755)
    calls = tmp_path / "go-calls"
    monkeypatch.setenv("PATH", f"{fake_bin}{os.pathsep}/usr/bin{os.pathsep}/bin")
    monkeypatch.setenv("FAKE_GO_CALLS", str(calls))
    monkeypatch.delenv("CGO_ENABLED", raising=False)
    return calls


def _go_calls(calls: Path) -> list[list[str]]:
    return [line.rstrip("\t").split("\t") for line in calls.read_text().splitlines()] if calls.exists() else []


def test_a_new_row_is_built_by_the_generic_builder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _fake_go(tmp_path, monkeypatch)
    row = b.GoPeer(
        name="hello",
        version="v1.2.3",
        module="example.com/hello",
        packages=("example.com/hello/cmd/hello", "example.com/hello/cmd/bye"),
        ldflags=lambda peer: f"-X main.version={peer.version}",
        replaces=("example.com/dep => example.com/dep v0.1.0",),
    )
    cache = tmp_path / "cache"
    lines: list[str] = []
    bin_dir = b.build_peer(row, cache, progress=lines.append)

    root = cache.resolve()
    assert bin_dir == root / "bin" / "hello-v1.2.3"
    assert sorted(p.name for p in bin_dir.iterdir()) == ["bye", "hello"]
    assert not (root / "bin" / "hello-v1.2.3.tmp").exists()
    src = root / "src" / "hello-v1.2.3"
    assert (src / "go.mod").read_text() == (
        "module otel-dra-peers/hello\n\ngo 1.24.0\n\nrequire example.com/hello v1.2.3\n\n"
        "replace example.com/dep => example.com/dep v0.1.0\n"
    )
    assert (src / "tools.go").read_text() == (
        '//go:build tools\npackage tools\nimport (\n\t_ "example.com/hello/cmd/hello"\n\t_ "example.com/hello/cmd/bye"\n)\n'
    )
    assert sorted(p.name for p in (root / "logs").iterdir()) == ["hello-v1.2.3-build.log", "hello-v1.2.3-tidy.log"]
    assert _go_calls(calls) == [
        [f"{src}.tmp", "unset", "mod", "tidy", "-e"],
        [str(src), "0", "build", "-ldflags", "-X main.version=v1.2.3", "-o", f"{bin_dir}.tmp/", *row.packages],
    ]
    steps = [line.rsplit("]", 1)[0] + "]" for line in lines]
    assert steps == [
        "[hello-v1.2.3: go mod tidy]",
        "[hello-v1.2.3: go mod tidy]",
        "[hello-v1.2.3: go build hello bye]",
        "[hello-v1.2.3: go build hello bye]",
    ]
    assert [line.split("] ", 1)[1].split(" in ")[0] for line in lines] == ["started", "done", "started", "done"]

    # Built once: a second run neither runs go nor reports anything.
    lines.clear()
    assert b.build_peer(row, cache, progress=lines.append) == bin_dir
    assert lines == []
    assert len(_go_calls(calls)) == 2


def test_every_built_row_is_found_and_not_rebuilt(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for peer in b.PEERS:
        for name in peer.binaries:
            _fake_binary(tmp_path / "bin" / peer.key / name)
    _fake_binary(tmp_path / "bin" / b._otelcol_key() / b.OTELCOL_NAME)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))  # would fail if it tried to run go
    for peer in b.PEERS:
        assert b.build_peer(peer, tmp_path, progress=lambda _: None) == tmp_path / "bin" / peer.key
    # The table's control-plane rows are those of the oldest release (control_plane derives the rest).
    assert b.build(tmp_path, progress=lambda _: None, version="1.34") == b.find_binaries(tmp_path, "1.34")
    assert b.build_helm(tmp_path, progress=lambda _: None) == b.find_helm(tmp_path)
    assert b.build_ocb(tmp_path, progress=lambda _: None) == tmp_path / "bin" / "ocb-v0.165.0" / "ocb"
    assert b.build_otelcol(tmp_path, progress=lambda _: None) == b.find_otelcol(tmp_path)
    assert b.build_jaeger(tmp_path, progress=lambda _: None) == b.find_jaeger(tmp_path)


def test_every_row_without_go_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    for peer in b.PEERS:
        with pytest.raises(b.BuildError, match=f"`go` tool is not on PATH: install Go .* to build {peer.title}"):
            b.build_peer(peer, tmp_path, progress=lambda _: None)
    assert not (tmp_path / "bin").exists()


def test_binaries_are_keyed_by_binary_name(tmp_path: Path) -> None:
    binaries = b.expected_binaries(tmp_path, "1.34")
    data = binaries.as_dict()
    assert data == {
        "etcd": str(tmp_path / "bin/etcd-v3.6.16/etcd"),
        **{name: str(tmp_path / "bin" / b.control_plane("1.34")[0].key / name) for name in b.KUBERNETES_COMMANDS},
    }
    assert list(map(str, binaries.all())) == list(data.values())
    # State files of a newer build (with more binaries) still load.
    assert b.Binaries.from_dict({**data, "kube-proxy": "/elsewhere/kube-proxy"}) == binaries
    # And those from before the kubelet was built name it beside kube-apiserver.
    older = {name: path for name, path in data.items() if name != "kubelet"}
    assert b.Binaries.from_dict(older) == binaries


def test_a_binary_added_to_a_control_plane_row_is_built_beside_the_old_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A warm cache of a row without the new binary keeps its directory (other checkouts share the
    cache and still run it); the row with the binary has another key, so it builds anew."""
    for path in b.expected_binaries(tmp_path, "1.34").all():
        _fake_binary(path)
    old = b.control_plane("1.34")[0]
    calls = _fake_go(tmp_path, monkeypatch)
    kubernetes = dataclasses.replace(
        b.KUBERNETES, packages=(*b.KUBERNETES.packages, "k8s.io/kubernetes/cmd/kube-proxy")
    )
    monkeypatch.setattr(b, "CONTROL_PLANE", (kubernetes, b.ETCD))
    new = b.control_plane("1.34")[0]
    assert new.key != old.key and new.key.startswith("kubernetes-v1.34.4-")
    binaries = b.build(tmp_path, progress=lambda _: None, version="1.34")
    assert binaries == b.find_binaries(tmp_path, "1.34")
    assert (tmp_path / "bin" / new.key / "kube-proxy").is_file()
    assert sorted(p.name for p in (tmp_path / "bin" / old.key).iterdir()) == sorted(b.KUBERNETES_COMMANDS)
    # The staging check's `go mod download`, the wrapper's tidy, the build; etcd was there already.
    assert [call[2:4] for call in _go_calls(calls)] == [["mod", "download"], ["mod", "tidy"], ["build", "-ldflags"]]


def test_only_rows_that_ask_for_it_carry_a_recipe_digest() -> None:
    assert b.ETCD.key == "etcd-v3.6.16" and b.CONTAINERD.key == "containerd-v2.4.2"
    digest = b.KUBERNETES.recipe_digest()
    assert len(digest) == 10 and digest == b.KUBERNETES.recipe_digest()  # stable across calls
    # Each release's row differs (ldflags, replaces, godebug), and so does a row with other flags.
    assert len({row.key for minor in ("1.34", "1.37") for row in b.control_plane(minor)[:1]}) == 2
    assert dataclasses.replace(b.KUBERNETES, ldflags="-s").key != b.KUBERNETES.key


def test_the_upstream_driver_row_is_bench_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """bench.plugin --kubelet real's comparison peer: built on demand, never by `make peers`/CI."""
    row = b.UPSTREAM_DRIVER
    assert row not in b.PEERS
    assert row.key == "dra-example-driver-v0.4.0"
    assert row.binaries == ("dra-example-kubeletplugin",)
    files = b.wrapper_files(row)
    assert "require sigs.k8s.io/dra-example-driver v0.4.0" in files["go.mod"]
    assert '_ "sigs.k8s.io/dra-example-driver/cmd/dra-example-kubeletplugin"' in files["tools.go"]
    command = b.go_build_command(row, Path("/o"))
    assert command[-1] == "sigs.k8s.io/dra-example-driver/cmd/dra-example-kubeletplugin"
    assert "-trimpath" in command and command[command.index("-o") + 1] == "/o/dra-example-kubeletplugin"
    binary = tmp_path / "bin" / row.key / "dra-example-kubeletplugin"
    _fake_binary(binary)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))  # would fail if it tried to run go
    assert b.build_upstream_driver(tmp_path, progress=lambda _: None) == binary
