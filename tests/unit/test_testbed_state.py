"""The testbed's state and processes without any built binary: a component is started in a session
of its own, recorded, found again from state.json and stopped with its whole process group; the
control plane stops what is attached to it first, without knowing what that is."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from otel_dra.testbed import state
from otel_dra.testbed.build import Binaries
from otel_dra.testbed.controlplane import Testbed
from otel_dra.testbed.node import stop_nodes
from otel_dra.testbed.processes import component_exited, process_alive
from otel_dra.testbed.state import TestbedError, TestbedState, before_down, stop_attached


def _testbed(tmp_path: Path) -> Testbed:
    names = ("etcd", "kube-apiserver", "kube-scheduler", "kube-controller-manager", "kubectl", "kubelet")
    binaries = Binaries.from_dict({name: str(tmp_path / "bin" / name) for name in names})
    return Testbed(tmp_path, tmp_path / "kubeconfig", "https://127.0.0.1:1", "t", tmp_path / "ca.crt", {}, binaries)


def test_a_component_is_recorded_found_again_and_stopped_with_its_group(tmp_path: Path) -> None:
    testbed = _testbed(tmp_path)
    # A child of its own in the group: stopping the component must end it too.
    testbed.spawn("sleeper", ["sh", "-c", f"{sys.executable} -c 'import time; time.sleep(60)' & wait"])
    pid = testbed.pids["sleeper"]
    assert testbed.component_alive("sleeper") and not component_exited(pid, None)
    assert json.loads(testbed.state_file.read_text())["components"]["sleeper"]["pid"] == pid
    assert oct(testbed.state_file.stat().st_mode & 0o777) == "0o600"  # it holds the admin token

    again = Testbed.load(tmp_path)
    assert isinstance(again, Testbed) and again.pids == testbed.pids and again.token == "t"
    again.stop_component("sleeper", timeout=10)
    assert not process_alive(pid, None)
    assert "sleeper" not in again.pids and not again.component_alive("sleeper")
    # Reaped, not left a zombie: started through one handle, stopped through another.
    assert not Path(f"/proc/{pid}").exists()
    again.stop_component("sleeper")  # stopped already: nothing to signal
    assert "(no log at" not in again.log_tail("sleeper")


def test_a_missing_state_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(TestbedError, match="no testbed state in"):
        TestbedState.load(tmp_path)


def test_the_package_registers_the_nodes_teardown() -> None:
    assert stop_nodes in state._BEFORE_DOWN


def test_attached_parts_stop_first_and_their_errors_are_raised_together(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(state, "_BEFORE_DOWN", [])
    calls: list[str] = []

    def failing(testbed: TestbedState) -> None:
        calls.append("failing")
        raise TestbedError("first part")

    def other(testbed: TestbedState) -> None:
        calls.append("other")
        raise TestbedError("second part")

    before_down(failing)
    before_down(failing)  # once per hook
    before_down(other)
    testbed = _testbed(tmp_path)
    (tmp_path / "etcd").mkdir()
    testbed.save_state()
    with pytest.raises(TestbedError, match="first part\nsecond part"):
        testbed.down()
    assert calls == ["failing", "other"]
    # The control plane went all the same.
    assert not testbed.state_file.exists() and not (tmp_path / "etcd").exists()


def test_nodes_are_not_forgotten_when_nothing_stops_them(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(state, "_BEFORE_DOWN", [])
    testbed = _testbed(tmp_path)
    testbed.nodes["n1"] = {"dir": str(tmp_path / "node-n1")}
    with pytest.raises(TestbedError, match="nodes n1 left running: nothing stops nodes"):
        stop_attached(testbed)
