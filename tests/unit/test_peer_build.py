"""The Collector/Jaeger build recipes (no Go toolchain needed): manifest, cache keys, skipping."""

from __future__ import annotations

import importlib
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
