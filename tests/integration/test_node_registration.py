"""What the plugin accepts, the real kubelet registers; what it refuses, the kubelet (1.38) refuses
too, and the plugin says so at start-up (otel_dra/plugin/registration.py). One testbed node for
the module, on whatever release the testbed runs (OTEL_DRA_KUBERNETES_VERSION).

Three parts:
- the plugin itself (``otel-dra plugin`` processes, at once) at the limits it accepts: an endpoint
  of exactly 107 bytes (with a two-byte 'é', a space, '+' and '..' in its directory), an upper case
  driver name, and the longest driver name whose registration socket fits the node's
  plugins_registry (107 bytes: the kubelet's Go dial takes no more). Registered means the plugin
  heard ``NotifyRegistrationStatus(true)``, the kubelet logged the connection to its endpoint and
  the plugin's ResourceSlice was accepted;
- the plugin refusing the rest at start-up: exit 2, one line naming the flag, the value and the
  rule, no traceback, no socket left in the registry;
- the kubelet's own verdict on each rule at both sides of its limit (63/64-byte names, 107/108-byte
  endpoints, case, '_', '..', '%', '?', '#', '//', control characters ...): registration sockets
  served by the test, whose ``GetInfo`` says what the case says, so that no path length of the
  node's registry limits the name. Every verdict must be what the plugin's rules predict; on
  releases before 1.38, which validate nothing, only the accepted half is checked.

Marked `node`: root, `testbed build --node`, Debian's runc and CNI plugins (see test_node.py).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest

from otel_dra._generated.pluginregistration import api_pb2 as reg_pb2
from otel_dra._generated.pluginregistration import api_pb2_grpc as reg_grpc
from otel_dra.kube.client import KubeClient, load_credentials
from otel_dra.plugin.registration import (
    MAX_DRIVER_NAME_BYTES,
    MAX_SOCKET_PATH_BYTES,
    driver_name_problem,
    endpoint_problem,
)
from otel_dra.testbed import Binaries, Testbed, running
from otel_dra.testbed.node import Node, start_node
from tests.helpers import wait_until
from tests.integration import test_node

pytestmark = [pytest.mark.node, pytest.mark.testbed]

ROOT = Path(__file__).resolve().parents[2]
NODE = "n1"


# The same check and build as the other node tests (a module-scoped fixture per module).
node_support = test_node.node_support


@pytest.fixture(scope="module")
def node_testbed(node_support: Binaries) -> Iterator[tuple[Testbed, Node]]:
    # A short directory: the node's plugins_registry path decides the longest driver name that the
    # plugin's registration socket can carry there (the node's own sockets must fit too).
    dir = Path(tempfile.mkdtemp(prefix="odr-", dir="/tmp"))
    try:
        with running(dir, scheduler=True, controller_manager=True, binaries=node_support) as testbed:
            yield testbed, start_node(testbed, NODE)
    finally:
        shutil.rmtree(dir, ignore_errors=True)


@pytest.fixture
def scratch() -> Iterator[Path]:
    """Room under /tmp for plugin directories padded to the socket limit (tmp_path is too long)."""
    path = Path(tempfile.mkdtemp(prefix="odr-p-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _size(path: Path | str) -> int:
    return len(os.fsencode(str(path)))


def _padded_dir(base: Path, driver: str, size: int) -> Path:
    """A plugins directory under ``base`` whose ``<dir>/<driver>/dra.sock`` is ``size`` bytes."""
    tail = f"/{driver}/dra.sock"
    pad = size - _size(base) - 1 - len(tail)
    assert pad > 0, f"{base} is too long for a {size}-byte endpoint"
    plugins = base / ("p" * pad)
    assert _size(f"{plugins}{tail}") == size
    return plugins


# --- the plugin itself --------------------------------------------------------------------------


def _kubelet_connected(node: Node, driver: str, offset: int) -> bool:
    # The kubelet's DRA plugin manager at -v=2 (1.34 to 1.38), once it has registered the plugin
    # and connected to its endpoint.
    pattern = re.compile(rf'"Connection changed" .*driverName="{re.escape(driver)}" .*connected=true')
    with node.kubelet_log.open("rb") as log:
        log.seek(offset)
        return bool(pattern.search(log.read().decode(errors="replace")))


class _Plugin:
    """``otel-dra plugin`` in the node's directories, with its own driver name and plugins directory."""

    def __init__(self, testbed: Testbed, node: Node, driver: str, plugins: Path, log: Path) -> None:
        self.driver, self.plugins, self.log = driver, plugins, log
        self.argv = [
            sys.executable, "-m", "otel_dra", "plugin",
            f"--node-name={node.name}",
            f"--kubeconfig={testbed.kubeconfig}",
            f"--driver-name={driver}",
            f"--cdi-root={node.cdi_dir}",
            f"--kubelet-plugins-directory-path={plugins}",
            f"--kubelet-registrar-directory-path={node.registry_dir}",
            "--num-devices=1",
        ]  # fmt: skip
        with log.open("ab") as out:
            self.proc = subprocess.Popen(
                self.argv, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONPATH": str(ROOT)}
            )

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(timeout=30)


def _slices(client: KubeClient, driver: str) -> list[object]:
    selector = f"spec.nodeName={NODE},spec.driver={driver}"
    items: list[object] = client.get_json("/apis/resource.k8s.io/v1/resourceslices", {"fieldSelector": selector})[
        "items"
    ]
    return items


def test_the_kubelet_registers_the_plugin_at_each_limit_it_accepts(
    node_testbed: tuple[Testbed, Node], scratch: Path
) -> None:
    testbed, node = node_testbed
    client = KubeClient(load_credentials(str(testbed.kubeconfig)))
    # The longest name whose <registry>/<name>-reg.sock is 107 bytes here (63 needs a registry path
    # of at most 34 bytes; /var/lib/kubelet/plugins_registry is 33): 107 bytes is also the longest
    # path the kubelet's dial of the registration socket takes.
    longest = min(MAX_DRIVER_NAME_BYTES, MAX_SOCKET_PATH_BYTES - _size(node.registry_dir) - 1 - len("-reg.sock"))
    long_name = "l" + "0" * (longest - len("l.example.com")) + ".example.com"
    # A directory with what URL parsing leaves alone: '..' (the kubelet cleans nothing), a space,
    # '+' and a two-byte 'é' (the limit counts bytes), padded so that dra.sock is 107 bytes.
    odd = scratch / "sub" / ".." / "my plugins+é"
    (scratch / "sub").mkdir()
    cases = {
        "limit.example.com": _padded_dir(odd, "limit.example.com", MAX_SOCKET_PATH_BYTES),
        "Upper.Example.COM": node.plugins_dir,  # the kubelet lowers the name before checking it
        long_name: node.plugins_dir,
    }
    assert _size(node.registry_dir / f"{long_name}-reg.sock") == MAX_SOCKET_PATH_BYTES
    for driver, plugins in cases.items():
        assert driver_name_problem(driver) is None and endpoint_problem(f"{plugins}/{driver}/dra.sock") is None
    offset = node.kubelet_log.stat().st_size
    plugins_started = [
        _Plugin(testbed, node, driver, plugins, scratch / f"plugin-{i}.log")
        for i, (driver, plugins) in enumerate(cases.items())
    ]
    try:

        def all_registered() -> bool:
            for plugin in plugins_started:
                assert plugin.proc.poll() is None, f"{plugin.driver} exited:\n{plugin.output()}"
            return all(
                f"registered with the kubelet as {p.driver} " in p.output()
                and _kubelet_connected(node, p.driver, offset)
                and bool(_slices(client, p.driver))
                for p in plugins_started
            )

        wait_until(all_registered, timeout=90, what="the kubelet to register every plugin at its limits")
        for plugin in plugins_started:
            assert "rejected the registration" not in plugin.output(), plugin.output()
    finally:
        for plugin in plugins_started:
            plugin.stop()


def test_the_plugin_refuses_the_rest_at_start_up(node_testbed: tuple[Testbed, Node], scratch: Path) -> None:
    """One step past each limit: refused before anything starts, with the rule and the value."""
    testbed, node = node_testbed
    driver = "gpu.example.com"
    cases = {
        # (driver name, plugins directory): what the one error line says
        ("x" * 64, node.plugins_dir): "--driver-name: 'xxxx",  # argparse names the flag
        ("gpu_x.example.com", node.plugins_dir): "is not a DNS-1123 subdomain",
        ("-gpu.example.com", node.plugins_dir): "is not a DNS-1123 subdomain",
        # A short plugins directory, so that only the registration socket is too long (the node's
        # plugins_registry leaves room for less than 63 bytes of name).
        ("y" * 63, scratch / "p"): "--kubelet-registrar-directory-path",
        (driver, _padded_dir(scratch / "é", driver, MAX_SOCKET_PATH_BYTES + 1)): "is 108 bytes long",
        (driver, scratch / "a?b"): "contains '?', which starts a query",
        (driver, scratch / "a%2e"): "contains '%'",
        (driver, Path("/" + str(scratch))): "starts with '//'",
    }
    before = sorted(os.listdir(node.registry_dir))
    procs = {
        case: _Plugin(testbed, node, case[0], case[1], scratch / f"refused-{i}.log") for i, case in enumerate(cases)
    }
    for (name, plugins), plugin in procs.items():
        assert plugin.proc.wait(timeout=60) == 2, plugin.output()
        out = plugin.output()
        assert "error:" in out and cases[(name, plugins)] in out, out
        assert "Traceback" not in out, out
    assert sorted(os.listdir(node.registry_dir)) == before


# --- the kubelet's verdict on each rule ------------------------------------------------------------


def _endpoint(size: int) -> str:
    """An absolute path of ``size`` bytes, with a two-byte 'é' in it."""
    head = "/tmp/odr-fake/é/"
    return head + "e" * (size - len(head.encode()) - len("/dra.sock")) + "/dra.sock"


# Each rule just inside and just outside its limit: (driver name, endpoint, registers on 1.38).
_PLAIN = "/tmp/odr-fake/{}/dra.sock"
_NAMES = [
    ("a" * 63, True),
    ("b" * 64, False),
    ("Upper.Case.Example.COM", True),  # ToLower comes first
    ("\u212a8s.example.com", True),  # the Kelvin sign: Go's ToLower makes it 'k'
    ("\u212a" + "k" * 60, True),  # 63 bytes in 61 characters
    ("\u212a" + "k" * 61, False),  # 64 bytes
    ("under_score.example.com", False),
    ("-lead.example.com", False),
    ("trail.example.com.", False),
    ("double..dot.example.com", False),
    ("newline.example.com\n", False),
    ("space .example.com", False),
]
_ENDPOINTS = [
    (_endpoint(MAX_SOCKET_PATH_BYTES), True),
    (_endpoint(MAX_SOCKET_PATH_BYTES + 1), False),
    ("dra.sock", False),
    ("/tmp/odr-fake/a/../b/dra.sock", True),  # nothing is cleaned
    ("/tmp/odr-fake//c/dra.sock", True),
    ("/tmp/odr-fake/d/", True),
    ("/tmp/odr-fake/my plugins+x:y@z/dra.sock", True),
    ("/tmp/odr-fake/%2e%2e/%2e%2e/dra.sock", False),
    ("/tmp/odr-fake/q/dra.sock?x=1", False),
    ("/tmp/odr-fake/f/dra.sock#frag", False),
    ("//host/tmp/odr-fake/dra.sock", False),
    ("/tmp/odr-fake/t\tb/dra.sock", False),
]
CASES = [(name, _PLAIN.format(i), ok) for i, (name, ok) in enumerate(_NAMES)] + [
    (f"ep{i}.example.com", endpoint, ok) for i, (endpoint, ok) in enumerate(_ENDPOINTS)
]


def _predicted(name: str, endpoint: str) -> str | None:
    """The plugin's rules: why it refuses the case, or None."""
    return driver_name_problem(name) or endpoint_problem(endpoint)


def test_the_cases_are_what_they_claim() -> None:
    for name, endpoint, ok in CASES:
        assert (_predicted(name, endpoint) is None) == ok, (name, endpoint, _predicted(name, endpoint))


class _Registration(reg_grpc.RegistrationServicer):
    """A registration socket as the case says; keeps the kubelet's first verdict."""

    def __init__(self, name: str, endpoint: str) -> None:
        self.info = reg_pb2.PluginInfo(
            type="DRAPlugin", name=name, endpoint=endpoint, supported_versions=["v1.DRAPlugin"]
        )
        self.verdict: tuple[bool, str] | None = None
        self._lock = threading.Lock()

    def GetInfo(self, request: reg_pb2.InfoRequest, context: grpc.ServicerContext) -> reg_pb2.PluginInfo:
        return self.info

    def NotifyRegistrationStatus(
        self, request: reg_pb2.RegistrationStatus, context: grpc.ServicerContext
    ) -> reg_pb2.RegistrationStatusResponse:
        with self._lock:
            if self.verdict is None:
                self.verdict = (request.plugin_registered, request.error)
        return reg_pb2.RegistrationStatusResponse()


@pytest.fixture(scope="module")
def verdicts(node_testbed: tuple[Testbed, Node]) -> dict[tuple[str, str], tuple[bool, str] | None]:
    """Every case served at once in the node's plugins_registry; the kubelet's verdicts."""
    _, node = node_testbed
    served: dict[tuple[str, str], _Registration] = {}
    servers: list[tuple[grpc.Server, futures.ThreadPoolExecutor, Path]] = []
    try:
        for i, (name, endpoint, _) in enumerate(CASES):
            servicer = _Registration(name, endpoint)
            pool = futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix=f"fake-reg-{i}")
            server = grpc.server(pool)
            reg_grpc.add_RegistrationServicer_to_server(servicer, server)
            socket = node.registry_dir / f"fake-{i}.sock"  # a short name: the name rules are GetInfo's
            server.add_insecure_port(f"unix:{socket}")
            server.start()
            servers.append((server, pool, socket))
            served[(name, endpoint)] = servicer
        with contextlib.suppress(AssertionError):  # the tests name the cases left without one
            wait_until(
                lambda: all(s.verdict is not None for s in served.values()),
                timeout=60,
                what="the kubelet's verdict on every registration",
            )
        return {case: s.verdict for case, s in served.items()}
    finally:
        for server, pool, socket in servers:
            server.stop(0).wait(5)
            pool.shutdown(wait=True)
            socket.unlink(missing_ok=True)


def test_the_kubelet_registers_every_case_the_plugin_accepts(
    verdicts: dict[tuple[str, str], tuple[bool, str] | None],
) -> None:
    accepted = [(name, endpoint) for name, endpoint, ok in CASES if ok]
    wrong = {case: verdicts[case] for case in accepted if verdicts[case] != (True, "")}
    assert not wrong, f"the plugin accepts these, the kubelet did not register them: {wrong}"


def _kubelet_says(problem: str) -> str:
    """What the kubelet's error says for the plugin's reason (validateDriverName, validateEndpoint)."""
    if "ValidateCSIDriverName" in problem:
        return "invalid DRA driver name"
    if "absolute path" in problem:
        return "must be an absolute path"
    if "bytes long" in problem:
        return "must not be longer than 108 bytes"
    assert "must be a plain path" in problem, problem
    return "must be a plain path"


@pytest.mark.kubernetes(min="1.38", reason="the kubelet validates registrations from 1.38 on")
def test_the_kubelet_refuses_every_case_the_plugin_refuses(
    verdicts: dict[tuple[str, str], tuple[bool, str] | None],
) -> None:
    for name, endpoint, ok in CASES:
        if ok:
            continue
        problem = _predicted(name, endpoint)
        assert problem is not None
        verdict = verdicts[(name, endpoint)]
        assert verdict is not None and verdict[0] is False, (
            f"{(name, endpoint)}: the plugin refuses it ({problem}), the kubelet said {verdict}"
        )
        assert "plugin validation failed" in verdict[1] and _kubelet_says(problem) in verdict[1], (
            name,
            endpoint,
            problem,
            verdict,
        )
