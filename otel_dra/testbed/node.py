"""A real node for the testbed: containerd and the kubelet of the control plane's release, with
their state under the testbed's directory, joined to its API server.

This module is the node's lifecycle: :func:`check_node` (everything that can be known before
anything starts), :func:`start_node`, :func:`restart_kubelet`, :func:`load_image` and
:func:`stop_node`, which deletes the node's pods while the kubelet still runs, stops kubelet and
containerd and puts the host back. What the machine must offer and what a node changes on it are
:mod:`otel_dra.testbed.nodehost`; the node's files and credentials :mod:`otel_dra.testbed.nodeconfig`.
Their public names are importable from here too, as they always were.

The node knows nothing of the control plane's code, only of the testbed's recorded state
(:class:`~otel_dra.testbed.state.TestbedState`): the control plane stops it first through the
teardown the package registers (``otel_dra/testbed/__init__.py``).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from otel_dra.testbed.build import default_cache_root, resolve_cache_root
from otel_dra.testbed.images import Image, ImageError, node_images
from otel_dra.testbed.network import BRIDGE, BRIDGE_ADDRESS, POD_SUBNET, free_ports
from otel_dra.testbed.nodeconfig import (
    MAX_SOCKET_PATH,
    NodeLayout,
    check_socket_paths,
    cni_config,
    containerd_config,
    kubelet_config,
    kubelet_gates,
    node_credentials,
)
from otel_dra.testbed.nodehost import (
    CGROUP_ROOT,
    CNI_BIN_DIR,
    CNI_PLUGINS,
    IPTABLES,
    IPTABLES_TABLES,
    KUBEPODS,
    MACHINE_LOCK,
    OUTSIDE_PATHS,
    RUNC,
    SYSCTLS,
    HostSupport,
    NodeBinaries,
    find_node_binaries,
    host_support,
    machine_lock_holder,
    record_host,
    release_machine_lock,
    restore_host,
    take_machine_lock,
    unmount_under,
)
from otel_dra.testbed.processes import component_exited, processes_of
from otel_dra.testbed.state import STOP_TIMEOUT, TestbedError, TestbedState, write_private

Progress = Callable[[str], None]

_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_POLL = 0.5
_PROGRESS_EVERY = 5.0


def _to_stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


# --- starting ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Node:
    """A running testbed node, for tests and scripts."""

    name: str
    layout: NodeLayout
    kubelet_log: Path
    containerd_log: Path

    @property
    def plugins_dir(self) -> Path:
        return self.layout.plugins_dir

    @property
    def registry_dir(self) -> Path:
        return self.layout.registry_dir

    @property
    def cdi_dir(self) -> Path:
        return self.layout.cdi_dir

    @property
    def pod_logs(self) -> Path:
        return self.layout.pod_logs


def kubelet_component(name: str) -> str:
    return f"kubelet-{name}"


def containerd_component(name: str) -> str:
    return f"containerd-{name}"


def proxy_component(name: str) -> str:
    return f"apiserver-proxy-{name}"


def pod_api_server(testbed: TestbedState, name: str) -> tuple[str, int]:
    """Where node ``name``'s pods reach the API server: ``KUBERNETES_SERVICE_HOST`` and
    ``KUBERNETES_SERVICE_PORT`` for them (there is no kube-proxy behind the ``kubernetes``
    Service's cluster IP). The API server's certificate names this address."""
    record = testbed.nodes.get(name)
    if record is None or "pod_api" not in record:
        raise TestbedError(f"no node {name!r} in the testbed in {testbed.dir}")
    host, port = record["pod_api"]
    return str(host), int(port)


def node_of(testbed: TestbedState, name: str) -> Node:
    record = testbed.nodes.get(name)
    if record is None:
        raise TestbedError(f"no node {name!r} in the testbed in {testbed.dir}")
    layout = NodeLayout(Path(record["dir"]))
    logs = testbed.dir / "logs"
    return Node(
        name,
        layout,
        kubelet_log=logs / f"{kubelet_component(name)}.log",
        containerd_log=logs / f"{containerd_component(name)}.log",
    )


def _check_lock(dir: Path) -> None:
    """One node per machine: refuse when another testbed's node still runs."""
    holder = machine_lock_holder()
    if holder is None or holder == dir:
        return
    try:
        other = TestbedState.load(holder)
    except TestbedError:
        return  # that testbed is gone: the lock is stale
    if any(other.component_alive(name) for name in other.components if name.startswith(("kubelet-", "containerd-"))):
        raise TestbedError(
            f"a testbed node already runs on this machine (testbed {holder}); a second one would share "
            f"/var/lib/kubelet/device-plugins and /run/containerd with it: run "
            f"`otel-dra testbed down --dir {holder}` first"
        )


def check_node(
    dir: Path,
    name: str,
    kubelet: Path,
    *,
    cache_root: Path | None = None,
    support: HostSupport | None = None,
) -> tuple[HostSupport, NodeBinaries, tuple[Image, Image]]:
    """Everything that can be known before starting anything: a machine that can run a node, a
    ``dir`` short enough for its sockets, the binaries and the images. ``testbed up --node`` calls
    it before the control plane starts, so that a machine that cannot run a node fails at once."""
    if not _NAME.match(name) or len(name) > 63:
        raise TestbedError(f"node name {name!r} is not a DNS label (lower-case letters, digits, '-')")
    support = support or host_support()
    if support.problems:
        raise TestbedError("this machine cannot run a testbed node: " + "; ".join(support.problems))
    dir = dir.expanduser().resolve()
    check_socket_paths(NodeLayout(dir / f"node-{name}"))
    _check_lock(dir)
    binaries = find_node_binaries(kubelet, cache_root)
    try:
        images = node_images(resolve_cache_root(cache_root) if cache_root else default_cache_root())
    except ImageError as exc:
        raise TestbedError(str(exc)) from None
    return support, binaries, images


def start_node(
    testbed: TestbedState,
    name: str,
    *,
    timeout: float = 120,
    progress: Progress = _to_stderr,
    cache_root: Path | None = None,
    support: HostSupport | None = None,
    kubelet_flags: Sequence[str] = (),
) -> Node:
    """Start containerd and a kubelet that registers as Node ``name``; return once it is Ready.

    ``kubelet_flags`` go after the kubelet's own (a benchmark's ``--vmodule``, for example).
    ``progress`` gets a line every few seconds while it waits. On any failure what was started is
    stopped and the host put back, and :class:`TestbedError` carries the failing part's log tail.
    """
    if name in testbed.nodes:
        raise TestbedError(f"node {name!r} already runs in {testbed.dir}")
    if testbed.nodes:
        raise TestbedError(
            "one node per machine: the kubelet's device-plugins dir and containerd's shim sockets are fixed paths"
        )
    support, binaries, (pause, busybox) = check_node(
        testbed.dir, name, testbed.binaries.kubelet, cache_root=cache_root, support=support
    )
    layout = NodeLayout(testbed.dir / f"node-{name}")
    if not support.can_lower_oom_score:
        progress(
            "CAP_SYS_RESOURCE is withheld here: containerd gets restrict_oom_score_adj = true and the "
            "kubelet oomScoreAdj 0 (otherwise runc fails every pod sandbox)"
        )

    if layout.dir.exists():
        # Leftovers of a node that was not stopped cleanly: never reuse its state.
        errors: list[str] = []
        unmount_under(layout.dir, errors)
        if errors:
            raise TestbedError(f"cannot clear {layout.dir}: {'; '.join(errors)}")
        shutil.rmtree(layout.dir)
    layout.dir.mkdir(parents=True)
    write_private(layout.host_record, json.dumps(record_host(), indent=2) + "\n")
    testbed.nodes[name] = {"dir": str(layout.dir)}
    testbed.save_state()
    take_machine_lock(testbed.dir)
    node = node_of(testbed, name)
    try:
        _start(testbed, node, binaries, (pause.tarball, busybox.tarball), support, timeout, progress, kubelet_flags)
    except BaseException:
        with contextlib.suppress(Exception):
            stop_node(testbed, name, progress=lambda _: None)
        raise
    return node


def _start(
    testbed: TestbedState,
    node: Node,
    binaries: NodeBinaries,
    images: Sequence[Path],
    support: HostSupport,
    timeout: float,
    progress: Progress,
    kubelet_flags: Sequence[str] = (),
) -> None:
    layout = node.layout
    started = time.monotonic()
    kubeconfig = node_credentials(testbed, layout, node.name)
    for sub in ("containerd", "cni", "cdi", "pod-logs", "kubelet", "kubelet-certs"):
        (layout.dir / sub).mkdir(parents=True, exist_ok=True)
    config = layout.dir / "containerd" / "config.toml"
    config.write_text(containerd_config(layout, restrict_oom_score_adj=not support.can_lower_oom_score))
    (layout.dir / "cni" / "10-otel-dra.conflist").write_text(cni_config(layout))
    ports = dict(zip(("kubelet", "kubelet_healthz"), free_ports(2), strict=True))
    kubelet_config_file = layout.dir / "kubelet-config.yaml"
    kubelet_config_file.write_text(
        yaml.safe_dump(
            kubelet_config(
                layout,
                ca_file=testbed.ca_file,
                ports=ports,
                feature_gates=kubelet_gates(testbed),
            ),
            sort_keys=False,
        )
    )

    # containerd finds its shim on PATH.
    env = {**os.environ, "PATH": f"{binaries.shim.parent}{os.pathsep}{os.environ.get('PATH', '/usr/bin:/bin')}"}
    ctd = containerd_component(node.name)
    testbed.spawn(ctd, [str(binaries.containerd), f"--config={config}", "--log-level=info"], env=env)
    ctr = [str(binaries.ctr), f"--address={layout.containerd_socket}", "--namespace=k8s.io"]
    _wait(
        f"containerd for node {node.name}",
        lambda: _ctr_ready(ctr),
        testbed,
        ctd,
        timeout,
        progress,
    )
    for image in images:
        result = subprocess.run([*ctr, "images", "import", str(image)], capture_output=True, text=True, timeout=120)
        if result.returncode != 0:
            raise TestbedError(f"ctr images import {image} failed: {result.stderr.strip()}")
    progress(f"node {node.name}: containerd ready, images loaded ({time.monotonic() - started:.1f}s)")

    # The API server for the node's pods (they cannot reach the host's loopback): see forward.py.
    [proxy_port] = free_ports(1)
    api_port = int(testbed.server.rpartition(":")[2])
    testbed.spawn(
        proxy_component(node.name),
        [
            sys.executable, "-m", "otel_dra.testbed.forward",
            f"--listen={BRIDGE_ADDRESS}:{proxy_port}", f"--connect=127.0.0.1:{api_port}",
        ],
        # This checkout's otel_dra first, whatever the interpreter has installed.
        env={**os.environ, "PYTHONPATH": os.pathsep.join(
            p for p in (str(Path(__file__).resolve().parents[2]), os.environ.get("PYTHONPATH", "")) if p
        )},
    )  # fmt: skip
    testbed.nodes[node.name]["pod_api"] = [BRIDGE_ADDRESS, proxy_port]

    kubelet = kubelet_component(node.name)
    testbed.spawn(
        kubelet,
        [
            str(binaries.kubelet),
            f"--config={kubelet_config_file}",
            f"--kubeconfig={kubeconfig}",
            f"--root-dir={layout.kubelet_root}",
            f"--cert-dir={layout.dir / 'kubelet-certs'}",
            f"--hostname-override={node.name}",
            "--v=2",
            *kubelet_flags,
        ],
        env=env,
    )
    testbed.nodes[node.name]["ports"] = ports
    testbed.save_state()
    _wait(f"node {node.name} Ready", lambda: _kubelet_ready(testbed, node.name), testbed, kubelet, timeout, progress)
    proxy = testbed.components[proxy_component(node.name)]
    if component_exited(int(proxy["pid"]), proxy.get("start_time")):
        raise TestbedError(f"the pods' API server forwarder exited\n{testbed.log_tail(proxy_component(node.name))}")
    progress(f"node {node.name} Ready after {time.monotonic() - started:.1f}s")


def load_image(testbed: TestbedState, name: str, archive: Path, *, image_name: str | None = None) -> str:
    """Import an OCI archive (``buildah push ... oci-archive:``, :mod:`otel_dra.testbed.imagebuild`)
    into node ``name``'s containerd, in the k8s.io namespace the kubelet uses; return the image name
    pods refer to, as containerd lists it.

    ctr names an imported image after its ``io.containerd.image.name`` annotation, else after the
    ``org.opencontainers.image.ref.name`` that buildah writes, but only when that name starts with
    ``--base-name`` (a full name otherwise gets dropped and the image stays unnamed): so the
    repository of the archive's own name is passed as the base name.
    """
    from otel_dra.testbed.imagebuild import archive_image_name

    record = testbed.nodes.get(name)
    if record is None:
        raise TestbedError(f"no node {name!r} in the testbed in {testbed.dir}")
    image_name = image_name or archive_image_name(archive)
    ctr = ctr_argv(testbed, NodeLayout(Path(record["dir"])), name)
    result = subprocess.run(
        [*ctr, "images", "import", f"--base-name={image_name.rpartition(':')[0]}", str(archive)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    if result.returncode != 0:
        raise TestbedError(f"ctr images import {archive} failed: {result.stderr.strip()}")
    listed = subprocess.run([*ctr, "images", "ls", "--quiet"], capture_output=True, text=True, timeout=60)
    if image_name not in listed.stdout.split():
        raise TestbedError(
            f"ctr images import {archive} did not name the image {image_name} (containerd has: "
            f"{', '.join(listed.stdout.split()) or 'nothing'})"
        )
    return image_name


def ctr_argv(testbed: TestbedState, layout: NodeLayout, name: str) -> list[str]:
    """`ctr` against node ``name``'s containerd, in the k8s.io namespace (the kubelet's)."""
    argv = testbed.components.get(containerd_component(name), {}).get("argv") or []
    if not argv:
        raise TestbedError(f"node {name!r} has no containerd in {testbed.dir}")
    return [str(Path(argv[0]).with_name("ctr")), f"--address={layout.containerd_socket}", "--namespace=k8s.io"]


def _ctr_ready(ctr: Sequence[str]) -> tuple[bool, str]:
    result = subprocess.run([*ctr, "version"], capture_output=True, text=True, timeout=10)
    return result.returncode == 0, result.stderr.strip().splitlines()[-1] if result.stderr.strip() else "starting"


def _api_get(testbed: TestbedState, path: str) -> Any:
    opener = urllib.request.build_opener(
        urllib.request.ProxyHandler({}), urllib.request.HTTPSHandler(context=testbed.api_ssl_context())
    )
    request = urllib.request.Request(testbed.server + path, headers={"Authorization": f"Bearer {testbed.token}"})
    with opener.open(request, timeout=5) as response:
        return json.load(response)


def _kubelet_ready(testbed: TestbedState, name: str) -> tuple[bool, str]:
    """The kubelet answers its healthz (a Node object left Ready by the previous kubelet does not
    count) and the Node is Ready."""
    port = testbed.nodes[name]["ports"]["kubelet_healthz"]
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(f"http://127.0.0.1:{port}/healthz", timeout=5) as response:
            if response.status != 200:
                return False, f"kubelet healthz: HTTP {response.status}"
    except urllib.error.HTTPError as err:
        return False, f"kubelet healthz: HTTP {err.code}"
    except (urllib.error.URLError, OSError) as err:
        return False, f"kubelet healthz: {err}"
    return _node_ready(testbed, name)


def _node_ready(testbed: TestbedState, name: str) -> tuple[bool, str]:
    try:
        node = _api_get(testbed, f"/api/v1/nodes/{name}")
    except urllib.error.HTTPError as err:
        return False, "not registered yet" if err.code == 404 else f"HTTP {err.code}"
    except (urllib.error.URLError, OSError) as err:
        return False, str(err)
    for condition in node.get("status", {}).get("conditions", []):
        if condition.get("type") == "Ready":
            ok = condition.get("status") == "True"
            return ok, f"Ready={condition.get('status')}: {condition.get('message', '')}"
    return False, "registered, no Ready condition yet"


def _wait(
    what: str,
    check: Callable[[], tuple[bool, str]],
    testbed: TestbedState,
    component: str,
    timeout: float,
    progress: Progress,
) -> None:
    """Poll ``check`` until it passes; fail fast when ``component`` exits, time out with its log."""
    started = time.monotonic()
    last_report = started
    while True:
        comp = testbed.components[component]
        if component_exited(int(comp["pid"]), comp.get("start_time")):
            raise TestbedError(f"{component} exited while waiting for {what}\n{testbed.log_tail(component)}")
        try:
            ok, state = check()
        except subprocess.TimeoutExpired:
            ok, state = False, "no answer"
        if ok:
            return
        now = time.monotonic()
        if now - started > timeout:
            raise TestbedError(f"{what}: not after {timeout:.0f}s ({state})\n{testbed.log_tail(component)}")
        if now - last_report >= _PROGRESS_EVERY:
            progress(f"waiting for {what} ({now - started:.0f}s): {state}")
            last_report = now
        time.sleep(_POLL)


def restart_kubelet(testbed: TestbedState, name: str, *, timeout: float = 120, progress: Progress = _to_stderr) -> None:
    """Stop the node's kubelet (SIGTERM) and start it again with the same flags; return once the
    Node is Ready again. Pods keep running in containerd meanwhile, as on a real node."""
    component = kubelet_component(name)
    comp = testbed.components.get(component)
    if comp is None:
        raise TestbedError(f"no kubelet of node {name!r} in {testbed.dir}")
    testbed.stop_component(component, STOP_TIMEOUT)
    binaries_dir = Path(testbed.components[containerd_component(name)]["argv"][0]).parent
    env = {**os.environ, "PATH": f"{binaries_dir}{os.pathsep}{os.environ.get('PATH', '/usr/bin:/bin')}"}
    testbed.spawn(component, comp["argv"], append_log=True, env=env)
    _wait(f"node {name} Ready again", lambda: _kubelet_ready(testbed, name), testbed, component, timeout, progress)


# --- stopping ----------------------------------------------------------------------------------------


def stop_node(testbed: TestbedState, name: str, *, progress: Progress = _to_stderr, timeout: float = 30) -> None:
    """Delete the node's pods (while its kubelet runs), stop kubelet and containerd, and put back
    every host change they made. Raises :class:`TestbedError` listing what could not be undone."""
    record = testbed.nodes.get(name)
    if record is None:
        return
    layout = NodeLayout(Path(record["dir"]))
    errors: list[str] = []
    kubelet, ctd = kubelet_component(name), containerd_component(name)
    started = time.monotonic()
    if testbed.component_alive(kubelet) and testbed.component_alive("kube-apiserver"):
        _delete_pods(testbed, name, timeout, progress, errors)
    testbed.stop_component(kubelet, STOP_TIMEOUT)
    if testbed.component_alive(ctd):
        _remove_containers(layout, testbed, name)
    testbed.stop_component(ctd, STOP_TIMEOUT)
    testbed.stop_component(proxy_component(name), STOP_TIMEOUT)
    _kill_shims(layout)
    recorded: dict[str, Any] = {}
    with contextlib.suppress(FileNotFoundError, ValueError):
        recorded = json.loads(layout.host_record.read_text())
    restore_host(recorded, layout.dir, errors)
    if not errors:
        # The bulky state (image snapshots, pod dirs); configs, certificates and logs stay.
        for sub in ("containerd/root", "containerd/state", "containerd/runc", "kubelet", "cni-ipam"):
            shutil.rmtree(layout.dir / sub, ignore_errors=True)
    release_machine_lock(testbed.dir)
    testbed.nodes.pop(name, None)
    testbed.components.pop(kubelet, None)
    testbed.components.pop(ctd, None)
    testbed.components.pop(proxy_component(name), None)
    testbed.save_state()
    progress(f"node {name} stopped and the host restored in {time.monotonic() - started:.1f}s")
    if errors:
        raise TestbedError(f"node {name}: could not undo every host change:\n" + "\n".join(errors))


def _node_pods(testbed: TestbedState, name: str) -> list[tuple[str, str]]:
    pods = _api_get(testbed, f"/api/v1/pods?fieldSelector=spec.nodeName%3D{name}")
    return [(p["metadata"]["namespace"], p["metadata"]["name"]) for p in pods.get("items", [])]


def _delete_pods(testbed: TestbedState, name: str, timeout: float, progress: Progress, errors: list[str]) -> None:
    """Delete every pod bound to the node and wait until the kubelet has confirmed each: a pod the
    kubelet never stopped would leave its containers behind the kubelet's exit."""
    try:
        pods = _node_pods(testbed, name)
    except (urllib.error.URLError, OSError) as exc:
        errors.append(f"listing the pods of node {name}: {exc}")
        return
    if not pods:
        return
    progress(f"node {name}: deleting {len(pods)} pod(s)")
    for namespace, pod in pods:
        testbed.kubectl(
            "delete", "pod", pod, f"--namespace={namespace}", "--grace-period=1", "--wait=false", check=False
        )
    deadline = time.monotonic() + timeout
    while (left := _node_pods(testbed, name)) and time.monotonic() < deadline:
        time.sleep(_POLL)
    if left:
        # Not an error of the teardown: a pod whose claims' DRA plugin is gone cannot be unprepared,
        # so the kubelet keeps it. Its containers go below (ctr, cgroups) all the same; the objects
        # must not outlive the node.
        progress(
            f"node {name}: the kubelet did not finish deleting {left} within {timeout:.0f}s (a DRA plugin "
            "gone?): removing their containers directly"
        )
        for namespace, pod in left:
            testbed.kubectl(
                "delete", "pod", pod, f"--namespace={namespace}", "--grace-period=0", "--force", check=False
            )


def _remove_containers(layout: NodeLayout, testbed: TestbedState, name: str) -> None:
    """Tasks and containers the kubelet left in containerd (stopped sandboxes await its GC)."""
    state = testbed.components.get(containerd_component(name), {})
    argv = state.get("argv") or []
    containerd_bin = Path(argv[0]) if argv else None
    if containerd_bin is None:
        return
    ctr = [str(containerd_bin.with_name("ctr")), f"--address={layout.containerd_socket}", "--namespace=k8s.io"]

    def ids(*what: str) -> list[str]:
        result = subprocess.run([*ctr, *what, "ls", "-q"], capture_output=True, text=True, timeout=30)
        return result.stdout.split() if result.returncode == 0 else []

    for task in ids("tasks"):
        subprocess.run([*ctr, "tasks", "kill", "--signal", "SIGKILL", task], capture_output=True, timeout=30)
    for task in ids("tasks"):
        subprocess.run([*ctr, "tasks", "delete", "--force", task], capture_output=True, timeout=30)
    containers = ids("containers")
    if containers:
        subprocess.run([*ctr, "containers", "delete", *containers], capture_output=True, timeout=60)


def _kill_shims(layout: NodeLayout) -> None:
    """Shims detach from containerd's process group; end those of this node's containerd."""
    address = str(layout.containerd_socket).encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if b"containerd-shim" in cmdline and address in cmdline:
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(entry.name), signal.SIGKILL)


def stop_nodes(testbed: TestbedState, progress: Progress = _to_stderr) -> None:
    """Stop every node of the testbed (``Testbed.down`` does, before the control plane: the package
    registers this with :func:`~otel_dra.testbed.state.before_down`)."""
    errors = []
    for name in list(testbed.nodes):
        try:
            stop_node(testbed, name, progress=progress)
        except TestbedError as exc:
            errors.append(str(exc))
    if errors:
        raise TestbedError("\n".join(errors))


__all__ = [
    "BRIDGE",
    "BRIDGE_ADDRESS",
    "CGROUP_ROOT",
    "CNI_BIN_DIR",
    "CNI_PLUGINS",
    "IPTABLES",
    "IPTABLES_TABLES",
    "KUBEPODS",
    "MACHINE_LOCK",
    "MAX_SOCKET_PATH",
    "OUTSIDE_PATHS",
    "POD_SUBNET",
    "RUNC",
    "SYSCTLS",
    "HostSupport",
    "Node",
    "NodeBinaries",
    "NodeLayout",
    "check_node",
    "check_socket_paths",
    "cni_config",
    "containerd_component",
    "containerd_config",
    "ctr_argv",
    "find_node_binaries",
    "host_support",
    "kubelet_component",
    "kubelet_config",
    "load_image",
    "node_of",
    "pod_api_server",
    "processes_of",
    "proxy_component",
    "record_host",
    "restart_kubelet",
    "start_node",
    "stop_node",
    "stop_nodes",
]
