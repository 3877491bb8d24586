"""What the real-node tests share: the node's fixture, the plugin as a host process that the
kubelet registers, and pods that print their environment (read from the kubelet's log files: the
API server would reach the kubelet at the machine's own address for `kubectl logs`).

Only one node runs on a machine at a time; a module's ``node_testbed`` fixture is torn down
before the next module's starts."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from otel_dra.fixtures import create
from otel_dra.kube.client import ApiError, KubeClient, load_credentials
from otel_dra.testbed import Binaries, Testbed, running
from otel_dra.testbed.build import BinariesMissingError, build_node
from otel_dra.testbed.images import BUSYBOX_IMAGE
from otel_dra.testbed.node import Node, find_node_binaries, host_support, start_node
from tests.helpers import driver_class, wait_until

ROOT = Path(__file__).resolve().parents[2]
DRIVER = "gpu.example.com"
NAMESPACE = "default"
# A container that prints its environment and then waits to be stopped (PID 1 needs a handler).
PRINT_ENV = "env; trap 'exit 0' TERM; while :; do sleep 3600 & wait $!; done"


def node_binaries(testbed_binaries: Binaries) -> Binaries:
    """The testbed's binaries with the node's; skips, with the reason, where no node can run."""
    support = host_support()
    if support.problems:
        pytest.skip("this machine cannot run a testbed node: " + "; ".join(support.problems))
    try:
        find_node_binaries(testbed_binaries.kubelet)
    except BinariesMissingError:
        build_node()  # containerd (minutes, once) and the images; runc/CNI missing still fails below
        find_node_binaries(testbed_binaries.kubelet)
    return testbed_binaries


def node_testbed(binaries: Binaries, **running_options: Any) -> Iterator[tuple[Testbed, Node]]:
    """A control plane with a scheduler and a controller manager and node ``n1`` (for a module
    fixture), with the DeviceClass of :data:`DRIVER`."""
    dir = Path(tempfile.mkdtemp(prefix="otel-dra-node-", dir="/tmp"))  # short: unix socket paths
    try:
        with running(dir, scheduler=True, controller_manager=True, binaries=binaries, **running_options) as testbed:
            node = start_node(testbed, "n1")
            client = KubeClient(load_credentials(str(testbed.kubeconfig)))
            create(client, driver_class(DRIVER))
            yield testbed, node
    finally:
        shutil.rmtree(dir, ignore_errors=True)


class HostPlugin:
    """``otel-dra plugin`` as a process on the host, in the node's kubelet directories."""

    def __init__(self, testbed: Testbed, node: Node, log: Path, *extra: str, env: dict[str, str] | None = None) -> None:
        self.log = log
        with log.open("ab") as out:
            self.proc = subprocess.Popen(
                [
                    sys.executable, "-m", "otel_dra", "plugin",
                    f"--node-name={node.name}",
                    f"--kubeconfig={testbed.kubeconfig}",
                    f"--cdi-root={node.cdi_dir}",
                    f"--kubelet-plugins-directory-path={node.plugins_dir}",
                    f"--kubelet-registrar-directory-path={node.registry_dir}",
                    "--num-devices=2",
                    *extra,
                ],
                stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})},
            )  # fmt: skip

    def kill(self, sig: signal.Signals = signal.SIGTERM) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            self.proc.wait(timeout=30)


def host_plugins() -> Iterator[list[HostPlugin]]:
    """For a fixture: the plugins a test started (:func:`start_plugin`), stopped after it."""
    started: list[HostPlugin] = []
    yield started
    for plugin in started:
        plugin.kill()


def connected_pattern(driver: str) -> re.Pattern[str]:
    """What the kubelet logs (-v=2, 1.34 to 1.38) once it has registered a DRA plugin and connected to it."""
    return re.compile(rf'"Connection changed" .*driverName="{re.escape(driver)}" .*connected=true')


def kubelet_log_size(node: Node) -> int:
    return node.kubelet_log.stat().st_size


def connected_since(node: Node, offset: int, driver: str = DRIVER) -> bool:
    with node.kubelet_log.open("rb") as log:
        log.seek(offset)
        return bool(connected_pattern(driver).search(log.read().decode(errors="replace")))


def node_slices(client: KubeClient, node: Node, driver: str = DRIVER) -> list[dict[str, Any]]:
    slices = client.get_json("/apis/resource.k8s.io/v1/resourceslices")["items"]
    return [s for s in slices if s["spec"].get("nodeName") == node.name and s["spec"].get("driver") == driver]


def start_plugin(
    testbed: Testbed,
    node: Node,
    plugins: list[HostPlugin],
    log: Path,
    *extra: str,
    env: dict[str, str] | None = None,
    driver: str = DRIVER,
) -> HostPlugin:
    """Start the plugin and wait until the kubelet has registered it and it has published."""
    offset = kubelet_log_size(node)
    plugin = HostPlugin(testbed, node, log, *extra, env=env)
    plugins.append(plugin)
    client = KubeClient(load_credentials(str(testbed.kubeconfig)))

    def registered() -> bool:
        assert plugin.proc.poll() is None, log.read_text()
        return connected_since(node, offset, driver) and bool(node_slices(client, node, driver))

    wait_until(registered, timeout=60, what="the kubelet to register the plugin and the plugin to publish")
    return plugin


def pod(name: str, containers: list[dict[str, Any]], **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": NAMESPACE},
        "spec": {"terminationGracePeriodSeconds": 1, "containers": containers, **spec},
    }


def container(name: str, *, claims: tuple[str, ...] = ()) -> dict[str, Any]:
    out: dict[str, Any] = {
        "name": name,
        "image": BUSYBOX_IMAGE,
        "imagePullPolicy": "Never",
        "command": ["/bin/sh", "-c", PRINT_ENV],
    }
    if claims:
        out["resources"] = {"claims": [{"name": claim} for claim in claims]}
    return out


def phase(client: KubeClient, name: str) -> str:
    try:
        found = client.get_json(f"/api/v1/namespaces/{NAMESPACE}/pods/{name}")
    except ApiError as err:
        if err.status == 404:
            return "Gone"
        raise
    return str((found.get("status") or {}).get("phase", "Pending"))


def wait_running(client: KubeClient, name: str, node: Node, timeout: float = 90) -> float:
    started = time.monotonic()
    try:
        wait_until(lambda: phase(client, name) == "Running", timeout=timeout, interval=0.2, what=f"pod {name} Running")
    except AssertionError:
        kubelet_tail = "\n".join(node.kubelet_log.read_text(errors="replace").splitlines()[-40:])
        found = client.get_json(f"/api/v1/namespaces/{NAMESPACE}/pods/{name}")
        raise AssertionError(
            f"pod {name} not Running: {found.get('status')}\n--- kubelet ---\n{kubelet_tail}"
        ) from None
    return time.monotonic() - started


def container_env(node: Node, pod: str, container: str) -> set[str]:
    """The `env` a container printed, from the kubelet's log file (CRI format: time stream tag text)."""
    [pod_dir] = node.pod_logs.glob(f"{NAMESPACE}_{pod}_*")
    log = pod_dir / container / "0.log"
    wait_until(lambda: log.is_file() and "PWD=" in log.read_text(), timeout=30, what=f"{pod}/{container} output")
    return {line.split(" ", 3)[3] for line in log.read_text().splitlines() if line.split(" ", 3)[1:2] == ["stdout"]}
