"""A real, local Kubernetes control plane: etcd + kube-apiserver (+ scheduler, controller-manager).

Everything runs as ordinary processes on loopback ports chosen at start-up, with all state (PKI,
tokens, logs, etcd data, kubeconfig) under one directory. Each child runs in its own session so that
it outlives the command that started it (``otel-dra testbed up`` returns once the API server is
ready) and so that ``down`` can signal its whole process group. ``DIR/state.json`` records what was
started (:mod:`otel_dra.testbed.state`), which lets a different process (``otel-dra testbed down``)
stop it later.
"""

from __future__ import annotations

import contextlib
import secrets
import shutil
import signal
import ssl
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from otel_dra.testbed.build import Binaries, find_binaries
from otel_dra.testbed.network import NODE_POD_API_IP, SERVICE_CLUSTER_IP_RANGE, free_ports
from otel_dra.testbed.pki import make_pki
from otel_dra.testbed.processes import component_exited, exit_code, process_alive, signal_group
from otel_dra.testbed.releases import (
    KUBERNETES_RELEASES,
    KubernetesRelease,
    kubernetes_release,
)
from otel_dra.testbed.state import (
    STOP_TIMEOUT,
    KubectlError,
    TestbedError,
    TestbedState,
    stop_attached,
    write_private,
    write_token_kubeconfig,
)

ETCD = "etcd"
APISERVER = "kube-apiserver"
SCHEDULER = "kube-scheduler"
CONTROLLER_MANAGER = "kube-controller-manager"
# Start order; stopping goes in reverse so clients leave before the servers they talk to.
COMPONENTS = (ETCD, APISERVER, SCHEDULER, CONTROLLER_MANAGER)

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
_POLL_SECONDS = 0.1


@dataclass
class Testbed(TestbedState):
    """A running testbed and helpers to use it as its administrator or as other identities."""

    __test__ = False  # keeps pytest from collecting this class in modules that import it

    # --- lifecycle ---------------------------------------------------------------------------------

    def stop_apiserver(self, timeout: float = STOP_TIMEOUT) -> None:
        """Stop only kube-apiserver (etcd keeps the data), e.g. to test behaviour during an outage."""
        self.stop_component(APISERVER, timeout)
        self.save_state()

    def kill_apiserver(self, timeout: float = STOP_TIMEOUT) -> None:
        """SIGKILL kube-apiserver (no graceful shutdown: open watches see their connections reset,
        not closed), as a crash or an OOM kill would; ``start_apiserver`` brings it back."""
        if self.component_alive(APISERVER):
            signal_group(self.pids[APISERVER], signal.SIGKILL)
        self.stop_component(APISERVER, timeout)  # reaps it (and signals nothing more once it is gone)
        self.save_state()

    def start_apiserver(self, timeout: float = 120) -> None:
        """Start kube-apiserver again with the same flags, port and etcd; return once it is ready."""
        comp = self.components.get(APISERVER)
        if comp is None:
            raise TestbedError(f"{self.dir}: kube-apiserver was never started here")
        if self.component_alive(APISERVER):
            raise TestbedError(f"{self.dir}: kube-apiserver is already running (pid {comp['pid']})")
        self.spawn(APISERVER, comp["argv"], append_log=True)
        try:
            self._wait_ready(APISERVER, timeout)
        except BaseException:
            with contextlib.suppress(Exception):
                self.stop_apiserver()
            raise

    def down(self, timeout: float = STOP_TIMEOUT) -> None:
        """Stop every component and delete etcd's data; logs, PKI and kubeconfig stay for inspection.

        What is attached to the control plane goes first, while the API server still runs: a
        node's pods are deleted through it, and only then are kubelet and containerd stopped and
        the host put back (:func:`~otel_dra.testbed.state.before_down`). A node that could not be
        undone completely still lets the control plane stop, and then raises."""
        attached_error: TestbedError | None = None
        try:
            stop_attached(self)
        except TestbedError as exc:
            attached_error = exc
        for name in reversed(COMPONENTS):
            self.stop_component(name, timeout)
        shutil.rmtree(self.dir / "etcd", ignore_errors=True)
        self.state_file.unlink(missing_ok=True)
        if attached_error is not None:
            raise attached_error

    def _wait_ready(self, name: str, timeout: float) -> None:
        """Poll the component's health endpoint until it answers 200, failing fast if it exits."""
        url, context, headers = self._health_probe(name)
        opener = urllib.request.build_opener(
            urllib.request.ProxyHandler({}),  # loopback: never through an HTTP(S)_PROXY
            urllib.request.HTTPSHandler(context=context),
        )
        pid = int(self.components[name]["pid"])
        deadline = time.monotonic() + timeout
        last_error = "no answer yet"
        while True:
            if component_exited(pid, None):
                code = exit_code(pid)
                exited = f"{name} exited" + (f" with code {code}" if code is not None else "")
                raise TestbedError(f"{exited} while starting\n{self.log_tail(name)}")
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
                    f"{name} not ready after {timeout:.0f}s ({url}: {last_error})\n{self.log_tail(name)}"
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
    dir = _clear_dir(dir)
    binaries = binaries or find_binaries(version=release)
    if shutil.which("openssl") is None:
        raise TestbedError("the `openssl` command is needed to create the testbed's certificates")
    token, token_file = _fresh_state(dir)

    names = ["etcd_client", "etcd_peer", "apiserver"]
    names += ["scheduler"] if scheduler else []
    names += ["controller_manager"] if controller_manager else []
    ports = dict(zip(names, free_ports(len(names)), strict=True))
    server = f"https://127.0.0.1:{ports['apiserver']}"
    gate_list = ",".join(f"{name}={str(on).lower()}" for name, on in sorted(feature_gates.items()))
    gates = [f"--feature-gates={gate_list}"] if gate_list else []
    apiserver_args, taint_rules_served = _taint_rule_api(settings, feature_gates, apiserver_args, scheduler=scheduler)
    controllers = _controllers(
        feature_gates,
        extra_controllers,
        taint_rules_served=taint_rules_served,
        service_accounts=service_accounts,
        controller_manager=controller_manager,
    )
    testbed = Testbed(
        dir=dir,
        kubeconfig=dir / "kubeconfig",
        server=server,
        token=token,
        ca_file=dir / "pki" / "ca.crt",
        ports=ports,
        binaries=binaries,
    )
    _start_components(
        testbed,
        gates=gates,
        apiserver_argv=_apiserver_argv(testbed, token_file, gates, apiserver_args, service_accounts=service_accounts),
        controllers=controllers if controller_manager else None,
        scheduler=scheduler,
        service_accounts=service_accounts,
        timeout=timeout,
    )
    return testbed


def _clear_dir(dir: Path) -> Path:
    """``dir`` resolved and created; a testbed stopped uncleanly there is taken down first, a
    running one refused."""
    dir = dir.expanduser().resolve()
    dir.mkdir(parents=True, exist_ok=True)
    if (dir / "state.json").exists():
        existing = Testbed.load(dir)
        if any(process_alive(pid, existing.components[n].get("start_time")) for n, pid in existing.pids.items()):
            raise TestbedError(f"a testbed is already running in {dir}; run `otel-dra testbed down` first")
        existing.down()
    return dir


def _fresh_state(dir: Path) -> tuple[str, Path]:
    """New PKI, a new admin token (returned with the token file the API server reads) and no etcd
    data: a fresh cluster every time, since stale data would resurrect objects from an earlier run."""
    make_pki(dir / "pki")
    token = secrets.token_urlsafe(32)
    token_file = dir / "tokens.csv"
    write_private(token_file, f'{token},{ADMIN_USER},{ADMIN_USER},"system:masters"\n')
    shutil.rmtree(dir / "etcd", ignore_errors=True)
    return token, token_file


def _taint_rule_api(
    settings: KubernetesRelease, feature_gates: Mapping[str, bool], apiserver_args: Sequence[str], *, scheduler: bool
) -> tuple[Sequence[str], bool]:
    """``apiserver_args`` with the API version that serves DeviceTaintRules switched on where the
    release keeps it off by default (and the scheduler, which acts on them, runs), and whether
    DeviceTaintRules are then served."""
    # Where DeviceTaintRules are served, kube-controller-manager runs the controller that acts on
    # them (evicts pods of NoExecute-tainted devices, writes the rules' EvictionInProgress status).
    served = settings.taint_rule_api is None
    if (
        scheduler
        and settings.taint_rule_api
        and feature_gates.get(settings.taint_rule_gate)
        # kube-apiserver merges repeated --runtime-config flags; one that names the version already
        # (to turn it off, say) is the caller's to decide.
        and not any(a.startswith("--runtime-config") and settings.taint_rule_api in a for a in apiserver_args)
    ):
        return [*apiserver_args, f"--runtime-config={settings.taint_rule_api}=true"], True
    return apiserver_args, served


def _controllers(
    feature_gates: Mapping[str, bool],
    extra_controllers: Sequence[str],
    *,
    taint_rules_served: bool,
    service_accounts: bool,
    controller_manager: bool,
) -> list[str]:
    """The kube-controller-manager controllers to run."""
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
    return controllers


def _etcd_argv(testbed: Testbed) -> list[str]:
    etcd_client = f"http://127.0.0.1:{testbed.ports['etcd_client']}"
    etcd_peer = f"http://127.0.0.1:{testbed.ports['etcd_peer']}"
    return [
        str(testbed.binaries.etcd),
        "--name=testbed",
        f"--data-dir={testbed.dir / 'etcd'}",
        f"--listen-client-urls={etcd_client}",
        f"--advertise-client-urls={etcd_client}",
        f"--listen-peer-urls={etcd_peer}",
        f"--initial-advertise-peer-urls={etcd_peer}",
        f"--initial-cluster=testbed={etcd_peer}",
        "--unsafe-no-fsync",  # a throw-away cluster: durability is not worth the fsync latency
        "--log-level=warn",
    ]


def _apiserver_argv(
    testbed: Testbed, token_file: Path, gates: Sequence[str], extra: Sequence[str], *, service_accounts: bool
) -> list[str]:
    """kube-apiserver's command line: its own flags, then ``gates``, then the caller's ``extra``."""
    pki = testbed.dir / "pki"
    return [
        str(testbed.binaries.kube_apiserver),
        f"--etcd-servers=http://127.0.0.1:{testbed.ports['etcd_client']}",
        f"--secure-port={testbed.ports['apiserver']}",
        "--bind-address=127.0.0.1",
        "--advertise-address=127.0.0.1",
        f"--cert-dir={pki}",
        f"--tls-cert-file={pki / 'apiserver.crt'}",
        f"--tls-private-key-file={pki / 'apiserver.key'}",
        f"--client-ca-file={pki / 'ca.crt'}",
        f"--token-auth-file={token_file}",
        "--authorization-mode=RBAC",
        f"--service-account-issuer={testbed.server}",
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
        *extra,
    ]


def _start_components(
    testbed: Testbed,
    *,
    gates: Sequence[str],
    apiserver_argv: Sequence[str],
    controllers: Sequence[str] | None,
    scheduler: bool,
    service_accounts: bool,
    timeout: float,
) -> None:
    """etcd, then kube-apiserver (``apiserver_argv``), then the scheduler and the
    controller-manager (``controllers``; None: not run), each waited for in turn; on any failure
    whatever was started is stopped again."""
    try:
        testbed.spawn(ETCD, _etcd_argv(testbed))
        testbed._wait_ready(ETCD, timeout)
        testbed.spawn(APISERVER, apiserver_argv)
        testbed._wait_ready(APISERVER, timeout)
        write_token_kubeconfig(
            testbed.kubeconfig,
            server=testbed.server,
            ca_pem=testbed.ca_file.read_bytes(),
            user=ADMIN_USER,
            token=testbed.token,
        )
        kubeconfig = f"--kubeconfig={testbed.kubeconfig}"
        if scheduler:
            testbed.spawn(
                SCHEDULER,
                [
                    str(testbed.binaries.kube_scheduler),
                    kubeconfig,
                    "--leader-elect=false",
                    f"--secure-port={testbed.ports['scheduler']}",
                    "--bind-address=127.0.0.1",
                    *gates,
                ],
            )
        if controllers is not None:
            testbed.spawn(
                CONTROLLER_MANAGER,
                [
                    str(testbed.binaries.kube_controller_manager),
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
                    f"--secure-port={testbed.ports['controller_manager']}",
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
                f"{found.stderr.strip()}\n{testbed.log_tail(CONTROLLER_MANAGER)}"
            )
        time.sleep(0.2)


__all__ = [
    "ADMIN_USER",
    "APISERVER",
    "COMPONENTS",
    "CONTROLLER_MANAGER",
    "ETCD",
    "NODE_POD_API_IP",
    "POD_CONTROLLERS",
    "RELEASE_SETTINGS",
    "SCHEDULER",
    "SERVICE_CLUSTER_IP_RANGE",
    "KubectlError",
    "ReleaseSettings",
    "Testbed",
    "TestbedError",
    "down",
    "release_settings",
    "running",
    "up",
]
