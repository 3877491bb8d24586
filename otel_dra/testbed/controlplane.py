"""A real, local Kubernetes control plane: etcd + kube-apiserver (+ scheduler, controller-manager).

Everything runs as ordinary processes on loopback ports chosen at start-up, with all state (PKI,
tokens, logs, etcd data, kubeconfig) under one directory. Each child runs in its own session so that
it outlives the command that started it (``otel-dra testbed up`` returns once the API server is
ready) and so that ``down`` can signal its whole process group. ``DIR/state.json`` records what was
started, which lets a different process (``otel-dra testbed down``) stop it later.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from otel_dra.testbed.build import Binaries, find_binaries
from otel_dra.testbed.releases import (
    KUBERNETES_RELEASES,
    KubernetesRelease,
    kubernetes_release,
)

ETCD = "etcd"
APISERVER = "kube-apiserver"
SCHEDULER = "kube-scheduler"
CONTROLLER_MANAGER = "kube-controller-manager"
# Start order; stopping goes in reverse so clients leave before the servers they talk to.
COMPONENTS = (ETCD, APISERVER, SCHEDULER, CONTROLLER_MANAGER)

SERVICE_CLUSTER_IP_RANGE = "10.0.0.0/24"
# The testbed node's bridge address (otel_dra.testbed.node.BRIDGE_ADDRESS), where its pods reach the
# API server: the serving certificate names it.
NODE_POD_API_IP = "10.244.240.1"
# What pods that talk to the API server need from the control plane (``up(service_accounts=True)``,
# `testbed up --node`): the ServiceAccount admission plugin mounts each pod's token, the
# serviceaccount controller makes every namespace's `default` ServiceAccount (without it that
# plugin rejects pods), and the root-CA publisher the kube-root-ca.crt ConfigMap the token volume
# holds; and the workload controllers a Helm chart's Deployment and DaemonSet need.
POD_CONTROLLERS = (
    "serviceaccount-controller",
    "root-ca-certificate-publisher-controller",
    "deployment-controller",
    "replicaset-controller",
    "daemonset-controller",
)
# What each release needs switched on lives in its row of the release table.
ReleaseSettings = KubernetesRelease
RELEASE_SETTINGS: Mapping[str, KubernetesRelease] = {row.minor: row for row in KUBERNETES_RELEASES}


def release_settings(version: str | KubernetesRelease | None = None) -> KubernetesRelease:
    """The row of a release (default: the testbed's Kubernetes version, see kubernetes_release):
    its feature gates and where it serves DeviceTaintRules."""
    return kubernetes_release(version)


ADMIN_USER = "otel-dra-admin"
_STATE_VERSION = 1
_POLL_SECONDS = 0.1
_STOP_TIMEOUT = 20.0
_LOG_TAIL_LINES = 40

# Popen handles of the components this Python process started, by pid. Kept module-wide (not per
# Testbed) so that stopping them through any handle, e.g. `down(dir)` which reads state.json, reaps
# them instead of leaving zombies behind.
_CHILDREN: dict[int, subprocess.Popen[bytes]] = {}


class TestbedError(RuntimeError):
    """The testbed could not be started, reached or stopped."""

    __test__ = False  # not a pytest test class despite the name


class KubectlError(subprocess.CalledProcessError):
    """A kubectl call failed; unlike CalledProcessError its message includes kubectl's stderr."""

    def __str__(self) -> str:
        stderr = self.stderr.strip() if isinstance(self.stderr, str) else ""
        return f"{super().__str__()}\n{stderr}" if stderr else super().__str__()


@dataclass
class Testbed:
    """A running testbed and helpers to use it as its administrator or as other identities."""

    __test__ = False  # keeps pytest from collecting this class in modules that import it

    dir: Path
    kubeconfig: Path
    server: str
    token: str = field(repr=False)  # admin bearer token: never shown in logs or reprs
    ca_file: Path
    ports: dict[str, int]
    binaries: Binaries
    # Per component: argv, pid, start_time (to detect pid reuse) and log path, as in state.json.
    components: dict[str, dict[str, Any]] = field(default_factory=dict)
    # Real nodes (otel_dra.testbed.node), by node name: their directory and ports.
    nodes: dict[str, dict[str, Any]] = field(default_factory=dict)

    # --- state -----------------------------------------------------------------------------------

    @property
    def state_file(self) -> Path:
        return self.dir / "state.json"

    @property
    def pids(self) -> dict[str, int]:
        """Process ids (and process group ids) of the components that are currently started."""
        return {name: int(comp["pid"]) for name, comp in self.components.items() if comp.get("pid")}

    def _save_state(self) -> None:
        state = {
            "version": _STATE_VERSION,
            "server": self.server,
            "kubeconfig": str(self.kubeconfig),
            "ca_file": str(self.ca_file),
            "token": self.token,
            "ports": self.ports,
            "binaries": self.binaries.as_dict(),
            "components": self.components,
            "nodes": self.nodes,
        }
        write_private(self.state_file, json.dumps(state, indent=2) + "\n")

    @classmethod
    def load(cls, dir: Path) -> Testbed:
        """The testbed described by ``DIR/state.json`` (started by this or another process)."""
        state_file = dir / "state.json"
        try:
            state = json.loads(state_file.read_text())
        except FileNotFoundError:
            raise TestbedError(f"no testbed state in {dir} (not started, or already down)") from None
        if state.get("version") != _STATE_VERSION:
            raise TestbedError(f"{state_file} has an unknown format version {state.get('version')!r}")
        return cls(
            dir=dir.resolve(),
            kubeconfig=Path(state["kubeconfig"]),
            server=state["server"],
            token=state["token"],
            ca_file=Path(state["ca_file"]),
            ports={k: int(v) for k, v in state["ports"].items()},
            binaries=Binaries.from_dict(state["binaries"]),
            components=state["components"],
            nodes=state.get("nodes", {}),
        )

    # --- using the cluster -----------------------------------------------------------------------

    def kubectl(
        self,
        *args: str,
        input: str | None = None,
        check: bool = True,
        kubeconfig: Path | None = None,
        timeout: float = 60,
    ) -> subprocess.CompletedProcess[str]:
        """Run the built kubectl against this testbed (as admin unless ``kubeconfig`` is given)."""
        cmd = [str(self.binaries.kubectl), f"--kubeconfig={kubeconfig or self.kubeconfig}", *args]
        result = subprocess.run(cmd, input=input, capture_output=True, text=True, timeout=timeout)
        if check and result.returncode != 0:
            raise KubectlError(result.returncode, cmd, result.stdout, result.stderr)
        return result

    def mint_token(self, namespace: str, serviceaccount: str, *, duration: str | None = None) -> str:
        """A bound ServiceAccount token from the TokenRequest API; the ServiceAccount must exist."""
        args = ["create", "token", serviceaccount, f"--namespace={namespace}"]
        if duration:
            args.append(f"--duration={duration}")
        return self.kubectl(*args).stdout.strip()

    def write_kubeconfig(self, path: Path, token: str, *, user: str = "user") -> Path:
        """Write a kubeconfig for another identity (bearer ``token``) against this API server."""
        _write_kubeconfig(path, server=self.server, ca_pem=self.ca_file.read_bytes(), user=user, token=token)
        return path

    def api_ssl_context(self) -> ssl.SSLContext:
        """TLS settings that trust the testbed CA, for HTTP clients that talk to the API server."""
        return ssl.create_default_context(cafile=str(self.ca_file))

    # --- lifecycle ---------------------------------------------------------------------------------

    def stop_apiserver(self, timeout: float = _STOP_TIMEOUT) -> None:
        """Stop only kube-apiserver (etcd keeps the data), e.g. to test behaviour during an outage."""
        self._stop(APISERVER, timeout)
        self._save_state()

    def kill_apiserver(self, timeout: float = _STOP_TIMEOUT) -> None:
        """SIGKILL kube-apiserver (no graceful shutdown: open watches see their connections reset,
        not closed), as a crash or an OOM kill would; ``start_apiserver`` brings it back."""
        comp = self.components.get(APISERVER)
        if comp and comp.get("pid") and process_alive(int(comp["pid"]), comp.get("start_time")):
            _signal_group(int(comp["pid"]), signal.SIGKILL)
        self._stop(APISERVER, timeout)  # reaps it (and signals nothing more once it is gone)
        self._save_state()

    def start_apiserver(self, timeout: float = 120) -> None:
        """Start kube-apiserver again with the same flags, port and etcd; return once it is ready."""
        comp = self.components.get(APISERVER)
        if comp is None:
            raise TestbedError(f"{self.dir}: kube-apiserver was never started here")
        if comp.get("pid") and process_alive(int(comp["pid"]), comp.get("start_time")):
            raise TestbedError(f"{self.dir}: kube-apiserver is already running (pid {comp['pid']})")
        self._spawn(APISERVER, comp["argv"], append_log=True)
        try:
            self._wait_ready(APISERVER, timeout)
        except BaseException:
            with contextlib.suppress(Exception):
                self.stop_apiserver()
            raise

    def down(self, timeout: float = _STOP_TIMEOUT) -> None:
        """Stop every component and delete etcd's data; logs, PKI and kubeconfig stay for inspection.

        Nodes go first, while the API server still runs: their pods are deleted through it, and
        only then are kubelet and containerd stopped and the host put back. A node that could not
        be undone completely still lets the control plane stop, and then raises."""
        node_error: TestbedError | None = None
        if self.nodes:
            from otel_dra.testbed.node import stop_nodes  # node builds on this module

            try:
                stop_nodes(self)
            except TestbedError as exc:
                node_error = exc
        for name in reversed(COMPONENTS):
            self._stop(name, timeout)
        shutil.rmtree(self.dir / "etcd", ignore_errors=True)
        self.state_file.unlink(missing_ok=True)
        if node_error is not None:
            raise node_error

    def _spawn(
        self, name: str, argv: Sequence[str], *, append_log: bool = False, env: Mapping[str, str] | None = None
    ) -> None:
        log_path = self.dir / "logs" / f"{name}.log"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with log_path.open("ab" if append_log else "wb") as log:
            # A new session: the child survives the `testbed up` command and shares nothing (signals
            # from the terminal, process group) with it, and its pid is its process group id.
            proc = subprocess.Popen(
                list(argv),
                cwd=self.dir,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env=None if env is None else dict(env),
            )
        _CHILDREN[proc.pid] = proc
        self.components[name] = {
            "argv": list(argv),
            "pid": proc.pid,
            "start_time": _process_start_time(proc.pid),
            "log": str(log_path),
        }
        # Saved before waiting for readiness so that `down` can stop it even if we die meanwhile.
        self._save_state()

    def _stop(self, name: str, timeout: float) -> None:
        comp = self.components.get(name)
        if not comp or not comp.get("pid"):
            return
        pgid = int(comp["pid"])
        proc = _CHILDREN.pop(pgid, None)
        comp["pid"] = None
        if not process_alive(pgid, comp.get("start_time")):
            # Already gone, or the pid now belongs to someone else: signal nothing.
            if proc is not None:
                proc.poll()
            return
        _signal_group(pgid, signal.SIGTERM)
        if not _wait_group_gone(pgid, proc, timeout):
            _signal_group(pgid, signal.SIGKILL)
            if not _wait_group_gone(pgid, proc, timeout):
                raise TestbedError(f"{name} (process group {pgid}) survived SIGKILL")

    def _wait_ready(self, name: str, timeout: float) -> None:
        """Poll the component's health endpoint until it answers 200, failing fast if it exits."""
        url, context, headers = self._health_probe(name)
        opener = urllib.request.build_opener(
            urllib.request.ProxyHandler({}),  # loopback: never through an HTTP(S)_PROXY
            urllib.request.HTTPSHandler(context=context),
        )
        comp = self.components[name]
        deadline = time.monotonic() + timeout
        last_error = "no answer yet"
        while True:
            proc = _CHILDREN.get(int(comp["pid"]))
            exited = proc.poll() is not None if proc else not process_alive(int(comp["pid"]), None)
            if exited:
                code = f" with code {proc.returncode}" if proc else ""
                raise TestbedError(f"{name} exited{code} while starting\n{self._log_tail(name)}")
            try:
                request = urllib.request.Request(url, headers=headers)
                with opener.open(request, timeout=5) as response:
                    if response.status == 200:
                        return
                    last_error = f"HTTP {response.status}"
            except urllib.error.HTTPError as err:
                last_error = f"HTTP {err.code}: {err.read(500).decode(errors='replace')}"
            except (urllib.error.URLError, OSError) as err:
                last_error = str(err)
            if time.monotonic() > deadline:
                raise TestbedError(
                    f"{name} not ready after {timeout:.0f}s ({url}: {last_error})\n{self._log_tail(name)}"
                )
            time.sleep(_POLL_SECONDS)

    def _health_probe(self, name: str) -> tuple[str, ssl.SSLContext | None, dict[str, str]]:
        if name == ETCD:
            return f"http://127.0.0.1:{self.ports['etcd_client']}/health", None, {}
        if name == APISERVER:
            # /readyz, not /healthz: it also waits for the post-start hooks (RBAC bootstrap roles,
            # default namespaces), after which the cluster is usable.
            return f"{self.server}/readyz", self.api_ssl_context(), {"Authorization": f"Bearer {self.token}"}
        # The scheduler and controller-manager serve a self-signed certificate generated in memory.
        insecure = ssl.create_default_context()
        insecure.check_hostname = False
        insecure.verify_mode = ssl.CERT_NONE
        port = self.ports["scheduler" if name == SCHEDULER else "controller_manager"]
        return f"https://127.0.0.1:{port}/healthz", insecure, {}

    def _log_tail(self, name: str) -> str:
        log_path = self.dir / "logs" / f"{name}.log"
        try:
            lines = log_path.read_text(errors="replace").splitlines()
        except FileNotFoundError:
            return f"(no log at {log_path})"
        tail = "\n".join(lines[-_LOG_TAIL_LINES:])
        return f"--- last {min(len(lines), _LOG_TAIL_LINES)} lines of {log_path} ---\n{tail}"


# --- starting ----------------------------------------------------------------------------------------


def up(
    dir: Path,
    *,
    scheduler: bool = False,
    controller_manager: bool = False,
    binaries: Binaries | None = None,
    timeout: float = 120,
    feature_gates: Mapping[str, bool] | None = None,
    apiserver_args: Sequence[str] = (),
    kubernetes_version: str | KubernetesRelease | None = None,
    extra_controllers: Sequence[str] = (),
    service_accounts: bool = False,
) -> Testbed:
    """Start a control plane with its state under ``dir`` and return once every part is ready.

    ``timeout`` bounds the wait for each component. On any failure, whatever was started is stopped
    again and :class:`TestbedError` carries the tail of the failing component's log.
    ``feature_gates`` go to every component (they must agree, e.g. on which fields the scheduler may
    allocate from; default: those of the release, RELEASE_SETTINGS); ``apiserver_args`` are extra
    kube-apiserver flags; ``extra_controllers`` are kube-controller-manager controllers to run
    besides the resourceclaim and garbage-collector ones. ``kubernetes_version`` picks the release
    (default: kubernetes_release()), which must be the one ``binaries`` were built from.
    ``service_accounts``: pods get ServiceAccount tokens and workload controllers run
    (:data:`POD_CONTROLLERS`; needs ``controller_manager``), for pods of a real node that talk to
    the API server, such as the Helm chart's.
    """
    release = kubernetes_release(kubernetes_version)
    settings = release_settings(release)
    if feature_gates is None:
        feature_gates = settings.feature_gates
    refused = settings.gate_errors(feature_gates)
    if refused:
        raise TestbedError("; ".join(refused))
    dir = dir.expanduser().resolve()
    dir.mkdir(parents=True, exist_ok=True)
    if (dir / "state.json").exists():
        existing = Testbed.load(dir)
        if any(process_alive(pid, existing.components[n].get("start_time")) for n, pid in existing.pids.items()):
            raise TestbedError(f"a testbed is already running in {dir}; run `otel-dra testbed down` first")
        existing.down()
    binaries = binaries or find_binaries(version=release)
    if shutil.which("openssl") is None:
        raise TestbedError("the `openssl` command is needed to create the testbed's certificates")

    pki = dir / "pki"
    _make_pki(pki)
    token = secrets.token_urlsafe(32)
    token_file = dir / "tokens.csv"
    write_private(token_file, f'{token},{ADMIN_USER},{ADMIN_USER},"system:masters"\n')
    # A fresh cluster every time: stale data would resurrect objects from an earlier run.
    etcd_data = dir / "etcd"
    shutil.rmtree(etcd_data, ignore_errors=True)

    names = ["etcd_client", "etcd_peer", "apiserver"]
    names += ["scheduler"] if scheduler else []
    names += ["controller_manager"] if controller_manager else []
    ports = dict(zip(names, free_ports(len(names)), strict=True))
    server = f"https://127.0.0.1:{ports['apiserver']}"
    gate_list = ",".join(f"{name}={str(on).lower()}" for name, on in sorted(feature_gates.items()))
    gates = [f"--feature-gates={gate_list}"] if gate_list else []
    # Where DeviceTaintRules are served, kube-controller-manager runs the controller that acts on
    # them (evicts pods of NoExecute-tainted devices, writes the rules' EvictionInProgress status).
    taint_rules_served = settings.taint_rule_api is None
    if (
        scheduler
        and settings.taint_rule_api
        and feature_gates.get(settings.taint_rule_gate)
        # kube-apiserver merges repeated --runtime-config flags; one that names the version already
        # (to turn it off, say) is the caller's to decide.
        and not any(a.startswith("--runtime-config") and settings.taint_rule_api in a for a in apiserver_args)
    ):
        apiserver_args = [*apiserver_args, f"--runtime-config={settings.taint_rule_api}=true"]
        taint_rules_served = True
    controllers = ["resourceclaim-controller", "garbage-collector-controller", *extra_controllers]
    if service_accounts:
        if not controller_manager:
            raise TestbedError("service_accounts=True needs controller_manager=True (the serviceaccount controller)")
        controllers += [c for c in POD_CONTROLLERS if c not in controllers]
    if taint_rules_served:
        controllers.append("device-taint-eviction-controller")
    if feature_gates.get("GenericWorkload"):
        # PodGroups get the scheduling.k8s.io/podgroup-protection finalizer, which only this
        # controller removes: without it a deleted PodGroup stays Terminating.
        controllers.append("podgroup-protection-controller")
    testbed = Testbed(
        dir=dir,
        kubeconfig=dir / "kubeconfig",
        server=server,
        token=token,
        ca_file=pki / "ca.crt",
        ports=ports,
        binaries=binaries,
    )
    etcd_client = f"http://127.0.0.1:{ports['etcd_client']}"
    etcd_peer = f"http://127.0.0.1:{ports['etcd_peer']}"
    etcd_argv = [
        str(binaries.etcd),
        "--name=testbed",
        f"--data-dir={etcd_data}",
        f"--listen-client-urls={etcd_client}",
        f"--advertise-client-urls={etcd_client}",
        f"--listen-peer-urls={etcd_peer}",
        f"--initial-advertise-peer-urls={etcd_peer}",
        f"--initial-cluster=testbed={etcd_peer}",
        "--unsafe-no-fsync",  # a throw-away cluster: durability is not worth the fsync latency
        "--log-level=warn",
    ]
    apiserver_argv = [
        str(binaries.kube_apiserver),
        f"--etcd-servers={etcd_client}",
        f"--secure-port={ports['apiserver']}",
        "--bind-address=127.0.0.1",
        "--advertise-address=127.0.0.1",
        f"--cert-dir={pki}",
        f"--tls-cert-file={pki / 'apiserver.crt'}",
        f"--tls-private-key-file={pki / 'apiserver.key'}",
        f"--client-ca-file={pki / 'ca.crt'}",
        f"--token-auth-file={token_file}",
        "--authorization-mode=RBAC",
        f"--service-account-issuer={server}",
        f"--service-account-key-file={pki / 'sa.pub'}",
        f"--service-account-signing-key-file={pki / 'sa.key'}",
        f"--service-cluster-ip-range={SERVICE_CLUSTER_IP_RANGE}",
        "--allow-privileged=true",
        # ServiceAccount: no controller creates the `default` ServiceAccounts, so this plugin would
        # reject every Pod (TokenRequest does not depend on it). TaintNodesByCondition: it taints
        # every new Node not-ready, and only the node-lifecycle controller (deliberately not run:
        # there are no kubelets) would lift the taint, so no Pod could ever be scheduled.
        # With service_accounts the serviceaccount controller does make them, and the plugin stays.
        f"--disable-admission-plugins={'' if service_accounts else 'ServiceAccount,'}TaintNodesByCondition",
        # The `kubernetes` Service's Endpoints may not hold a loopback address: the default reconciler
        # would log a validation error every few seconds. Nothing runs in-cluster to need them.
        "--endpoint-reconciler-type=none",
        # Close open watches (scheduler, controller-manager, exporters under test) on SIGTERM; with
        # the default 0 the server keeps waiting for them and stop_apiserver would need SIGKILL.
        "--shutdown-watch-termination-grace-period=2s",
        "--profiling=false",
        *gates,
        *apiserver_args,
    ]
    try:
        testbed._spawn(ETCD, etcd_argv)
        testbed._wait_ready(ETCD, timeout)
        testbed._spawn(APISERVER, apiserver_argv)
        testbed._wait_ready(APISERVER, timeout)
        _write_kubeconfig(
            testbed.kubeconfig,
            server=server,
            ca_pem=testbed.ca_file.read_bytes(),
            user=ADMIN_USER,
            token=token,
        )
        kubeconfig = f"--kubeconfig={testbed.kubeconfig}"
        if scheduler:
            testbed._spawn(
                SCHEDULER,
                [
                    str(binaries.kube_scheduler),
                    kubeconfig,
                    "--leader-elect=false",
                    f"--secure-port={ports['scheduler']}",
                    "--bind-address=127.0.0.1",
                    *gates,
                ],
            )
        if controller_manager:
            testbed._spawn(
                CONTROLLER_MANAGER,
                [
                    str(binaries.kube_controller_manager),
                    kubeconfig,
                    "--leader-elect=false",
                    # ResourceClaimTemplate -> ResourceClaim, the garbage collector that deletes
                    # a pod's generated claims once the pod is gone (the claim controller leaves
                    # that to it) and, where DeviceTaintRules are served, device-taint eviction.
                    # Nothing else: that keeps the node-lifecycle controller from tainting the
                    # kubelet-less Nodes tests create.
                    f"--controllers={','.join(controllers)}",
                    # Controllers use the admin kubeconfig directly: the ServiceAccount token
                    # controller that per-controller credentials would need is not running.
                    "--use-service-account-credentials=false",
                    f"--secure-port={ports['controller_manager']}",
                    "--bind-address=127.0.0.1",
                    *gates,
                ],
            )
        for name in (SCHEDULER, CONTROLLER_MANAGER):
            if name in testbed.components:
                testbed._wait_ready(name, timeout)
        if service_accounts:
            _wait_pod_credentials(testbed, timeout)
    except BaseException:
        with contextlib.suppress(Exception):
            testbed.down()
        raise
    return testbed


def down(dir: Path) -> None:
    """Stop the testbed in ``dir``, if any; safe to call again or on a directory never started."""
    dir = dir.expanduser().resolve()
    if (dir / "state.json").exists():
        Testbed.load(dir).down()
    else:
        shutil.rmtree(dir / "etcd", ignore_errors=True)


@contextlib.contextmanager
def running(
    dir: Path,
    *,
    scheduler: bool = False,
    controller_manager: bool = False,
    binaries: Binaries | None = None,
    timeout: float = 120,
    feature_gates: Mapping[str, bool] | None = None,
    apiserver_args: Sequence[str] = (),
    kubernetes_version: str | KubernetesRelease | None = None,
    extra_controllers: Sequence[str] = (),
    service_accounts: bool = False,
) -> Iterator[Testbed]:
    """``up`` on entry and ``down`` on exit, for fixtures and scripts."""
    testbed = up(
        dir,
        scheduler=scheduler,
        controller_manager=controller_manager,
        binaries=binaries,
        timeout=timeout,
        feature_gates=feature_gates,
        apiserver_args=apiserver_args,
        kubernetes_version=kubernetes_version,
        extra_controllers=extra_controllers,
        service_accounts=service_accounts,
    )
    try:
        yield testbed
    finally:
        testbed.down()


def _wait_pod_credentials(testbed: Testbed, timeout: float, namespace: str = "default") -> None:
    """Until the controllers made ``namespace``'s `default` ServiceAccount and kube-root-ca.crt: a
    pod created before would be rejected (no ServiceAccount) or kept from starting (no CA)."""
    deadline = time.monotonic() + timeout
    while True:
        found = testbed.kubectl(
            "get", f"--namespace={namespace}", "serviceaccount/default", "configmap/kube-root-ca.crt", "-o", "name",
            check=False,
        )  # fmt: skip
        if found.returncode == 0 and len(found.stdout.split()) == 2:
            return
        if time.monotonic() > deadline:
            raise TestbedError(
                f"no `default` ServiceAccount and kube-root-ca.crt in namespace {namespace} after {timeout:.0f}s: "
                f"{found.stderr.strip()}\n{testbed._log_tail(CONTROLLER_MANAGER)}"
            )
        time.sleep(0.2)


# --- helpers -----------------------------------------------------------------------------------------


def free_ports(count: int) -> list[int]:
    """Distinct free loopback ports: all sockets are held open together so none is handed out twice."""
    with contextlib.ExitStack() as stack:
        sockets = [stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) for _ in range(count)]
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [int(sock.getsockname()[1]) for sock in sockets]


def openssl(*args: str, cwd: Path) -> None:
    result = subprocess.run(["openssl", *args], cwd=cwd, capture_output=True, text=True)
    if result.returncode != 0:
        raise TestbedError(f"openssl {' '.join(args[:2])} failed:\n{result.stderr.strip()}")


def _make_pki(pki: Path) -> None:
    """A CA, an API server serving certificate signed by it, and a ServiceAccount signing key."""
    shutil.rmtree(pki, ignore_errors=True)
    pki.mkdir(parents=True, mode=0o700)
    days = "3650"
    ec_key = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    openssl(
        "req", "-x509", *ec_key, "-keyout", "ca.key", "-out", "ca.crt", "-days", days,
        "-subj", "/CN=otel-dra-testbed-ca",
        "-addext", "basicConstraints=critical,CA:TRUE",
        "-addext", "keyUsage=critical,keyCertSign,cRLSign",
        cwd=pki,
    )  # fmt: skip
    openssl(
        "req", *ec_key, "-keyout", "apiserver.key", "-out", "apiserver.csr", "-subj", "/CN=kube-apiserver",
        cwd=pki,
    )  # fmt: skip
    # 10.0.0.1 is the `kubernetes` Service's cluster IP in SERVICE_CLUSTER_IP_RANGE; NODE_POD_API_IP
    # is where a testbed node's pods reach the API server (through otel_dra.testbed.forward).
    (pki / "apiserver.ext").write_text(
        "basicConstraints=CA:FALSE\n"
        "keyUsage=critical,digitalSignature,keyEncipherment\n"
        "extendedKeyUsage=serverAuth\n"
        f"subjectAltName=IP:127.0.0.1,DNS:localhost,IP:10.0.0.1,IP:{NODE_POD_API_IP},DNS:kubernetes,"
        "DNS:kubernetes.default,DNS:kubernetes.default.svc\n"
    )
    openssl(
        "x509", "-req", "-in", "apiserver.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
        "-set_serial", "0x" + secrets.token_hex(16), "-days", days, "-extfile", "apiserver.ext",
        "-out", "apiserver.crt",
        cwd=pki,
    )  # fmt: skip
    # RSA: RS256 is the one algorithm every ServiceAccount-token consumer (OIDC discovery) accepts.
    openssl("genpkey", "-algorithm", "RSA", "-pkeyopt", "rsa_keygen_bits:2048", "-out", "sa.key", cwd=pki)
    openssl("pkey", "-in", "sa.key", "-pubout", "-out", "sa.pub", cwd=pki)


def write_private(path: Path, content: str) -> None:
    """Write a file readable only by its owner (it holds a token or key)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as file:
        file.write(content)
    path.chmod(0o600)  # O_CREAT's mode does not apply to a file that already existed


def _write_kubeconfig(path: Path, *, server: str, ca_pem: bytes, user: str, token: str) -> None:
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {
                "name": "otel-dra-testbed",
                "cluster": {
                    "server": server,
                    "certificate-authority-data": base64.b64encode(ca_pem).decode(),
                },
            }
        ],
        "users": [{"name": user, "user": {"token": token}}],
        "contexts": [{"name": "otel-dra-testbed", "context": {"cluster": "otel-dra-testbed", "user": user}}],
        "current-context": "otel-dra-testbed",
        "preferences": {},
    }
    write_private(path, yaml.safe_dump(config, sort_keys=False))


# --- processes ---------------------------------------------------------------------------------------
# Linux /proc is used where available: it tells a zombie from a live process and a reused pid from
# the one we started; elsewhere signal 0 is the (coarser) fallback.


def _proc_stat(pid: int) -> list[str] | None:
    """Fields of /proc/<pid>/stat from field 3 (state) on, or None if there is no such process."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    except OSError:
        return None
    # The command name (field 2) is in parentheses and may itself contain spaces or parentheses.
    return raw[raw.rfind(")") + 2 :].split()


def _process_start_time(pid: int) -> int | None:
    stat = _proc_stat(pid)
    return int(stat[19]) if stat else None  # field 22: start time in clock ticks since boot


def process_alive(pid: int, start_time: int | None) -> bool:
    """Whether ``pid`` is a live (non-zombie) process and, if known, the one started at ``start_time``."""
    if Path("/proc/self/stat").exists():
        stat = _proc_stat(pid)
        if stat is None or stat[0] == "Z":
            return False
        return start_time is None or int(stat[19]) == start_time
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def component_exited(pid: int, start_time: int | None) -> bool:
    """Whether a component started by any handle has exited (reaping it if this process started it)."""
    proc = _CHILDREN.get(pid)
    return proc.poll() is not None if proc is not None else not process_alive(pid, start_time)


def _group_alive(pgid: int) -> bool:
    """Whether any live (non-zombie) process is left in process group ``pgid``."""
    proc_root = Path("/proc")
    if not (proc_root / "self" / "stat").exists():
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    for entry in proc_root.iterdir():
        if not entry.name.isdigit():
            continue
        stat = _proc_stat(int(entry.name))
        if stat is not None and int(stat[2]) == pgid and stat[0] != "Z":
            return True
    return False


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, sig)


def _wait_group_gone(pgid: int, proc: subprocess.Popen[bytes] | None, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while True:
        if proc is not None:
            proc.poll()  # reap our own child so it does not linger as a zombie
        if not _group_alive(pgid):
            if proc is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=1)
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(_POLL_SECONDS)
