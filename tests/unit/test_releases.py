"""The testbed's release table (otel_dra/testbed/releases.py): versions, the tracking row, the
default, the CI matrix and the gates. No Go toolchain or network: the proxy's answers are given."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from otel_dra.testbed import releases as r
from otel_dra.testbed.errors import BuildError


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A cache root of its own, so that what this machine last resolved does not leak in."""
    monkeypatch.setenv("OTEL_DRA_CACHE", str(tmp_path))
    monkeypatch.delenv(r.KUBERNETES_VERSION_ENV, raising=False)
    return tmp_path


def test_versions_compare_as_releases_do() -> None:
    order = ["v1.37.0", "v1.37.1", "v1.37.2", "v1.38.0-alpha.2", "v1.38.0-beta.0", "v1.38.0-rc.0", "v1.38.0-rc.1"]
    order += ["v1.38.0", "v1.38.1"]
    assert sorted(reversed(order), key=r.version_key) == order
    assert r.version_key("1.37") < r.version_key("1.38") and r.version_key("1.26") < r.version_key("1.27.3")
    with pytest.raises(ValueError, match="not a version"):
        r.version_key("v1.38.0-gamma.1")


def test_the_tracking_row_takes_the_newest_served_of_its_minor() -> None:
    row = next(row for row in r.KUBERNETES_RELEASES if row.tracks)
    assert row.minor == "1.38"
    served = ["v1.37.2", "v1.38.0-alpha.2", "v1.38.0-beta.0", "v1.38.0-rc.1", "v1.39.0-alpha.0", "garbage"]
    assert r.newest_of_minor(row, served) == "v1.38.0-rc.1"
    # Never below the floor (an older answer cached by a proxy), and a pinned row stays pinned.
    assert r.newest_of_minor(row, ["v1.38.0-alpha.2"]) == row.version
    pinned = r.KUBERNETES_RELEASES[0]
    assert r.newest_of_minor(pinned, ["v1.34.9"]) == pinned.version


def test_the_default_is_the_newest_ga_and_becomes_1_38_by_the_table_alone(cache: Path) -> None:
    assert r.default_release().version == "v1.37.2"  # nothing resolved: 1.38 at its floor, beta.0
    assert r.newest_release().version == "v1.38.0-beta.0"
    assert r.ci_minors() == ("1.34", "1.38")
    r.write_resolved({"1.38": "v1.38.0-rc.1"})
    assert r.kubernetes_release("1.38").version == "v1.38.0-rc.1"
    assert r.default_release().minor == "1.37" and r.ci_minors() == ("1.34", "1.38")
    r.write_resolved({"1.38": "v1.38.0"})
    assert r.default_release().version == "v1.38.0"
    assert r.kubernetes_release().version == "v1.38.0"
    assert r.ci_minors() == ("1.34",)  # the newest is the default: the whole suite runs there
    assert json.loads((cache / r.RESOLVED_FILE).read_text()) == {"versions": {"1.38": "v1.38.0"}}


def test_a_broken_resolution_file_falls_back_to_the_floors(cache: Path) -> None:
    (cache / r.RESOLVED_FILE).write_text("{not json")
    assert r.kubernetes_release("1.38").version == "v1.38.0-beta.0"
    (cache / r.RESOLVED_FILE).write_text(json.dumps({"versions": {"1.38": "latest"}}))
    assert r.kubernetes_release("1.38").version == "v1.38.0-beta.0"


@pytest.mark.parametrize("spec", ["1.38", "v1.38", "1.38.0-beta.0", "v1.38.0-beta.0"])
def test_a_pre_release_is_named_by_minor_or_version(cache: Path, spec: str) -> None:
    assert r.kubernetes_release(spec).version == "v1.38.0-beta.0"


def test_an_unknown_release_is_a_build_error(cache: Path) -> None:
    with pytest.raises(BuildError, match=r"'1.39' is not one the testbed builds \(one of 1.34, .*1.38"):
        r.kubernetes_release("1.39")


def test_no_row_turns_on_a_gate_it_removed() -> None:
    for row in r.KUBERNETES_RELEASES:
        assert not row.gate_errors(row.feature_gates), row.minor
        assert row.go == "" or r.version_key(row.go.removeprefix("go")) > r.version_key(r.MACHINE_GO)
    newest = r.KUBERNETES_RELEASES[-1]
    assert newest.gate_errors({"DynamicResourceAllocation": True, "DRAListTypeAttributes": True}) == [
        "feature gate DynamicResourceAllocation was removed in Kubernetes 1.38 (its components refuse to start with it)"
    ]
    assert r.KUBERNETES_RELEASES[0].gate_errors({"DynamicResourceAllocation": True}) == []


def test_the_table_rows_are_in_order_one_per_minor() -> None:
    minors = [row.minor for row in r.KUBERNETES_RELEASES]
    assert minors == sorted(set(minors), key=r.version_key)
    assert minors[0] == "1.34"  # the oldest we support


def test_the_cli_prints_the_matrix(cache: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from otel_dra.cli import main

    assert main(["testbed", "releases", "--ci"]) == 0
    assert capsys.readouterr().out == "1.34 1.38\n"
    assert main(["testbed", "releases", "--default"]) == 0
    assert capsys.readouterr().out == "1.37\n"
    assert main(["testbed", "releases"]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[-1] == "1.38\tv1.38.0-beta.0\tetcd v3.7.3, Go 1.27.3\tnewest, pre-release"
    assert table[-2] == "1.37\tv1.37.2\tetcd v3.7.3\tdefault"


def test_refresh_keeps_the_proxys_answer_and_names_a_minor_the_table_lacks(
    cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import importlib

    build = importlib.import_module("otel_dra.testbed.build")
    served = ["v1.37.2", "v1.38.0-beta.0", "v1.38.0-rc.0", "v1.39.0-alpha.0"]
    monkeypatch.setattr(build, "served_versions", lambda module: served)
    lines: list[str] = []
    table = build.refresh_releases(lines.append)
    assert table[-1].version == "v1.38.0-rc.0" and r.kubernetes_release("1.38").version == "v1.38.0-rc.0"
    assert lines == [
        "Kubernetes v1.39.0-alpha.0 is served and newer than every row of the release table (releases.py)",
        "Kubernetes 1.38: the newest release served is v1.38.0-rc.0",
    ]

    def unreachable(module: str) -> list[str]:
        raise build.BuildError("go list -m -versions k8s.io/kubernetes failed: dial tcp: i/o timeout")

    monkeypatch.setattr(build, "served_versions", unreachable)
    lines.clear()
    assert build.refresh_releases(lines.append)[-1].version == "v1.38.0-rc.0"  # the last answer kept
    assert lines == [
        "could not ask the module proxy for Kubernetes releases (go list -m -versions k8s.io/kubernetes failed: "
        "dial tcp: i/o timeout); keeping 1.38 v1.38.0-rc.0"
    ]
