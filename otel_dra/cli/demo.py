"""``otel-dra demo``: the whole DRA path on one machine, instrumented end to end.

It starts a local control plane (etcd, kube-apiserver, kube-scheduler, kube-controller-manager),
then N simulated nodes, each running the example kubelet plugin (``otel-dra plugin``) as its own
process with its metrics on its own port; ``otel-dra kubelet-sim`` plays the kubelets; the exporter
serves the cluster state on :8080; and a workload keeps cycling pods that take one GPU each through
a ResourceClaimTemplate, so the scheduler allocates, the plugins prepare and unprepare, and every
counter moves. Ctrl-C stops everything and leaves nothing running.

With ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` (or ``OTEL_EXPORTER_OTLP_ENDPOINT``, which sends the
metrics too) set, each claim's life is one trace there (trace id: the claim's UID without dashes):
the exporter's lifecycle spans and the plugins' prepare/unprepare. The demo then prints a Jaeger link
(``--jaeger-ui``) to the first claim allocated and reserved, and keeps that claim's pod running
until Ctrl-C, so the trace shows a claim in use.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from otel_dra.cli.exporter import start_exporter
from otel_dra.cli.flags import add_flag, add_logging_flags, http_url, int_in
from otel_dra.cli.kubelet_sim import kubelet_tracer
from otel_dra.cli.lifecycle import stop_on_signals
from otel_dra.cli.testbed import add_kubernetes_version_flag
from otel_dra.kube.client import ApiError, KubeClient
from otel_dra.telemetry.traceids import decides_root, trace_id_of

if TYPE_CHECKING:
    from opentelemetry.sdk.trace.sampling import Sampler

log = logging.getLogger("otel_dra.demo")

DRIVER = "gpu.example.com"
NAMESPACE = "demo"
TEMPLATE = "one-gpu"
APP_LABEL = "otel-dra-demo"
JAEGER_UI = "http://127.0.0.1:16686"
# One line: how to turn the claims' traces on (README, tour step 3, has the Jaeger to send them to).
TRACING_OFF = (
    "no OTLP traces endpoint: with OTEL_EXPORTER_OTLP_TRACES_ENDPOINT=http://127.0.0.1:4318/v1/traces"
    " (a local Jaeger: README, tour step 3) each claim's life is one trace there"
)


def demo_objects(driver: str = DRIVER) -> list[dict[str, Any]]:
    """The DeviceClass, namespace and claim template the workload's pods use."""
    return [
        {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "DeviceClass",
            "metadata": {"name": driver, "annotations": {"hourly-cost": "2.50"}},
            "spec": {"selectors": [{"cel": {"expression": f"device.driver == '{driver}'"}}]},
        },
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}},
        {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaimTemplate",
            "metadata": {"name": TEMPLATE, "namespace": NAMESPACE},
            "spec": {"spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": driver}}]}}},
        },
    ]


def workload_pod(index: int) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": f"worker-{index}", "namespace": NAMESPACE, "labels": {"app": APP_LABEL}},
        "spec": {
            "containers": [
                {"name": "work", "image": "registry.k8s.io/pause:3.10", "resources": {"claims": [{"name": "gpu"}]}}
            ],
            "resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": TEMPLATE}],
            "terminationGracePeriodSeconds": 5,
        },
    }


def reserving_pod(claim: Mapping[str, Any]) -> str | None:
    """The name of the first pod in the claim's ``status.reservedFor``."""
    for consumer in (claim.get("status") or {}).get("reservedFor") or []:
        if consumer.get("resource") == "pods" and consumer.get("name"):
            return str(consumer["name"])
    return None


def pick_claim(
    claims: Iterable[Mapping[str, Any]],
    *,
    sampled: Callable[[int], bool] | None = None,
    pods: Collection[str] | None = None,
) -> Mapping[str, Any] | None:
    """The claim to show a trace of: the oldest (then by name) that is allocated, reserved for a
    pod, not being deleted, has a UID that is a trace id and, where given, whose trace ``sampled``
    keeps and whose pod is one of ``pods``. None when there is none yet."""
    found = []
    for claim in claims:
        meta, status = claim.get("metadata") or {}, claim.get("status") or {}
        trace_id = trace_id_of(meta.get("uid") or "")
        pod = reserving_pod(claim)
        if not status.get("allocation") or pod is None or meta.get("deletionTimestamp") or trace_id is None:
            continue
        if (sampled is not None and not sampled(trace_id)) or (pods is not None and pod not in pods):
            continue
        found.append((meta.get("creationTimestamp") or "", meta.get("name") or "", claim))
    return min(found, key=lambda f: f[:2])[2] if found else None


def trace_link(jaeger_ui: str, uid: str) -> str:
    """Jaeger's page of the trace of the claim with ``uid``: ``<ui>/trace/<uid's hex digits>``."""
    trace_id = trace_id_of(uid)
    if trace_id is None:
        raise ValueError(f"{uid!r} is not a UUID")
    return f"{jaeger_ui.rstrip('/')}/trace/{trace_id:032x}"


def trace_id_command(kubectl: str, claim: str = "<claim>", namespace: str = NAMESPACE) -> str:
    """The shell line that prints a claim's trace id (its UID without the dashes)."""
    return f"{kubectl} get resourceclaim -n {namespace} {claim} -o jsonpath='{{.metadata.uid}}' | tr -d -"


def tracing_off_lines(kubectl: str) -> str:
    """What the demo prints without tracing: how to turn it on, and how to get a claim's trace id."""
    return f"{TRACING_OFF}\n  {trace_id_command(kubectl)}   # any claim's trace id\n"


def claim_trace_lines(kubectl: str, jaeger_ui: str, claim: Mapping[str, Any]) -> str:
    """What the demo prints with tracing: the claim, its trace's link in Jaeger, and the line that
    gives any claim's trace id (for this one, the link's digits)."""
    meta = claim["metadata"]
    return (
        f"claim {meta['namespace']}/{meta['name']} (pod {reserving_pod(claim)}, kept running until Ctrl-C)"
        " is one trace: the exporter's lifecycle spans and the plugin's prepare claim\n"
        f"  {trace_link(jaeger_ui, meta['uid'])}\n"
        f"  {trace_id_command(kubectl, meta['name'], meta['namespace'])}   # any claim's trace id\n"
    )


class Workload:
    """Keeps ``pods`` pods alive, each for a random lifetime, then deletes and replaces it; a pod
    given to :meth:`keep` lives until the workload stops."""

    def __init__(self, client: KubeClient, pods: int, lifetime: tuple[float, float] = (5.0, 20.0)) -> None:
        self.client = client
        self.pods = pods
        self.lifetime = lifetime
        self.created = 0
        self.deleted = 0
        self._deadlines: dict[str, float] = {}
        self._lock = threading.Lock()  # held through a step, so that a kept pod is not deleted in it
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="demo-workload", daemon=True)

    def start(self) -> Workload:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def pods_alive(self) -> set[str]:
        """The workload's pods not deleted yet."""
        with self._lock:
            return set(self._deadlines)

    def keep(self, name: str) -> bool:
        """Let pod ``name`` live until the workload stops; False when it is not one of the pods
        alive (deleted already), or a step held the workload for more than 5 s."""
        if not self._lock.acquire(timeout=5):
            return False
        try:
            if name not in self._deadlines:
                return False
            self._deadlines[name] = math.inf
            return True
        finally:
            self._lock.release()

    def _run(self) -> None:
        while not self._stop.wait(0.5):
            try:
                with self._lock:
                    self._step()
            except ApiError as exc:  # the demo keeps going through API hiccups
                log.warning("workload: %s", exc)

    def _step(self) -> None:
        now = time.monotonic()
        for name, deadline in list(self._deadlines.items()):
            if now >= deadline:
                try:
                    self.client.request("DELETE", f"/api/v1/namespaces/{NAMESPACE}/pods/{name}")
                except ApiError as exc:
                    if exc.status != 404:
                        raise
                del self._deadlines[name]
                self.deleted += 1
        while len(self._deadlines) < self.pods and not self._stop.is_set():
            pod = workload_pod(self.created)
            self.client.send_json("POST", f"/api/v1/namespaces/{NAMESPACE}/pods", pod)
            self.created += 1
            self._deadlines[pod["metadata"]["name"]] = now + random.uniform(*self.lifetime)


@dataclass
class PluginProcess:
    node: str
    metrics_port: int
    process: subprocess.Popen[bytes]
    log_path: Path

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def start_plugin(
    node: str,
    root: Path,
    kubeconfig: str,
    metrics_port: int,
    *,
    driver: str = DRIVER,
    num_devices: int = 8,
    env: Mapping[str, str] | None = None,
    prefix: Sequence[str] = (),
) -> PluginProcess:
    """Run ``otel-dra plugin`` for ``node`` as its own process, like the DaemonSet pod on that node.

    ``env`` replaces this process's environment (default: inherited, so ``OTEL_*`` settings reach
    the plugins); ``prefix`` goes before the command (a benchmark's ``taskset``)."""
    base = root / node
    for sub in ("plugins", "plugins_registry", "cdi"):
        (base / sub).mkdir(parents=True, exist_ok=True)
    log_path = base / "plugin.log"
    argv = [
        *prefix,
        sys.executable,
        "-m",
        "otel_dra",
        "plugin",
        f"--node-name={node}",
        f"--driver-name={driver}",
        f"--kubeconfig={kubeconfig}",
        f"--kubelet-plugins-directory-path={base / 'plugins'}",
        f"--kubelet-registrar-directory-path={base / 'plugins_registry'}",
        f"--cdi-root={base / 'cdi'}",
        f"--metrics-port={metrics_port}",
        f"--num-devices={num_devices}",
    ]
    environ = dict(os.environ if env is None else env)
    environ.setdefault("OTEL_SERVICE_NAME", "otel-dra-plugin")
    with open(log_path, "ab") as out:
        process = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=environ, start_new_session=True)
    return PluginProcess(node, metrics_port, process, log_path)


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "demo",
        help="local cluster + simulated GPU nodes running the instrumented plugin + exporter + workload",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--dir", default=None, help="state directory (default: a temporary one, removed at exit)")
    add_flag(p, "--nodes", "OTEL_DRA_DEMO_NODES", "simulated nodes", default=2, type=int_in(1, 50))
    add_flag(p, "--pods", "OTEL_DRA_DEMO_PODS", "pods kept running, one GPU each", default=10, type=int_in(0, 10000))
    add_flag(p, "--port", "OTEL_DRA_PORT", "exporter listen port", default=8080, type=int_in(0, 65535))
    add_flag(
        p,
        "--plugin-metrics-port",
        "OTEL_DRA_DEMO_PLUGIN_METRICS_PORT",
        "metrics port of the first node's plugin; node i uses this + i",
        default=8081,
        type=int_in(1, 65000),
    )
    add_flag(p, "--address", "OTEL_DRA_ADDRESS", "exporter listen address", default="127.0.0.1")
    add_flag(
        p,
        "--jaeger-ui",
        "OTEL_DRA_DEMO_JAEGER_UI",
        "Jaeger UI the printed trace link points to (with tracing on)",
        default=JAEGER_UI,
        type=http_url,
    )
    add_kubernetes_version_flag(p)
    add_logging_flags(p)
    p.set_defaults(func=cmd_demo)


def _link_a_claim(client: KubeClient, workload: Workload, kubectl: str, jaeger_ui: str, sampler: Sampler) -> bool:
    """Print the trace link of the first claim allocated and reserved (whose trace ``sampler``
    keeps, as the exporter decides it) and keep its pod running; False while there is none yet."""
    try:
        claims = client.get_json(f"/apis/resource.k8s.io/v1/namespaces/{NAMESPACE}/resourceclaims")["items"]
    except ApiError as exc:
        log.debug("listing claims for the trace link: %s", exc)
        return False
    claim = pick_claim(claims, sampled=lambda t: decides_root(sampler, t, "claim"), pods=workload.pods_alive())
    pod = reserving_pod(claim) if claim is not None else None
    if claim is None or pod is None or not workload.keep(pod):
        return False
    print(claim_trace_lines(kubectl, jaeger_ui, claim), flush=True)
    return True


def cmd_demo(args: argparse.Namespace) -> int:
    from otel_dra import __version__
    from otel_dra.fixtures import apply_all
    from otel_dra.kube.client import load_credentials
    from otel_dra.kubeletsim.sim import KubeletSim
    from otel_dra.telemetry.otlp import ConfigError
    from otel_dra.telemetry.tracing import build_tracing_pipeline, sampler_from_env
    from otel_dra.testbed import find_or_build_binaries, running

    try:
        tracing = build_tracing_pipeline(service_name="otel-dra-kubelet-sim", version=__version__)
    except ConfigError as exc:
        log.error("%s", exc)
        return 2
    stop = stop_on_signals()
    binaries = find_or_build_binaries(args.kubernetes_version)
    with tempfile.TemporaryDirectory(prefix="otel-dra-demo-") as tmp:
        directory = Path(args.dir) if args.dir else Path(tmp)
        with running(
            directory / "testbed",
            scheduler=True,
            controller_manager=True,
            binaries=binaries,
            kubernetes_version=args.kubernetes_version,
        ) as testbed:
            kubeconfig = str(testbed.kubeconfig)
            client = KubeClient(load_credentials(kubeconfig), user_agent="otel-dra-demo")
            apply_all(client, demo_objects())
            nodes = [f"node-{i}" for i in range(args.nodes)]
            plugins: list[PluginProcess] = []
            sim = workload = app = None
            try:
                # Nodes first: a plugin publishes its ResourceSlice for an existing Node.
                registries = {n: directory / "nodes" / n / "plugins_registry" for n in nodes}
                sim = KubeletSim(client, registries, tracer=kubelet_tracer(tracing)).start()
                for i, node in enumerate(nodes):
                    plugins.append(start_plugin(node, directory / "nodes", kubeconfig, args.plugin_metrics_port + i))
                for plugin in plugins:
                    if sim.watchers[plugin.node].wait_for(DRIVER, 60) is None:
                        log.error("plugin on %s did not register; its log: %s", plugin.node, plugin.log_path)
                        return 1
                try:
                    app = start_exporter(kubeconfig=kubeconfig, address=args.address, port=args.port)
                except OSError as exc:
                    log.error("cannot listen on port %d: %s", args.port, exc)
                    return 2
                workload = Workload(client, args.pods).start()
                host = args.address or "127.0.0.1"
                kubectl = f"KUBECONFIG={kubeconfig} {binaries.kubectl}"
                # The claims' spans go where the exporter's and the plugins' go: the OTLP traces
                # endpoint the same OTEL_* variables name (tracing.otlp: None without one).
                traced = tracing.otlp is not None
                plugin_lines = "\n".join(
                    f"  curl -s http://127.0.0.1:{p.metrics_port}/metrics | grep -E 'dra_example_driver|rest_client'"
                    f"   # plugin on {p.node} (log {p.log_path})"
                    for p in plugins
                )
                print(
                    f"\ndemo running: {args.nodes} node(s) x 8 simulated GPUs, {args.pods} pods cycling\n"
                    f"  curl -s http://{host}:{app.port}/metrics | grep ^kube_   # cluster state\n"
                    f"{plugin_lines}\n"
                    f"  {kubectl} get pods,resourceclaims -n {NAMESPACE}\n"
                    f"{'' if traced else tracing_off_lines(kubectl)}"
                    f"Ctrl-C stops everything.\n",
                    flush=True,
                )
                sampler = sampler_from_env()  # the exporter's and the plugins' (the same variables)
                linked = not traced or args.pods == 0  # no workload claim to link
                reported: set[str] = set()
                while not stop.wait(1.0):
                    if not linked:
                        linked = _link_a_claim(client, workload, kubectl, args.jaeger_ui, sampler)
                    for plugin in plugins:  # a plugin that dies (e.g. its port taken) must not go unnoticed
                        code = plugin.process.poll()
                        if code is not None and plugin.node not in reported:
                            reported.add(plugin.node)
                            log.error(
                                "plugin on %s exited with code %s; its log: %s", plugin.node, code, plugin.log_path
                            )
            finally:
                if workload is not None:
                    workload.stop()
                if app is not None:
                    app.stop()
                for plugin in plugins:
                    plugin.stop()
                if sim is not None:
                    sim.stop()
                tracing.shutdown()
    return 0
