"""A real node: containerd and the kubelet of the control plane's release joined to the testbed,
and the example DRA plugin as a host process that the kubelet registers and drives.

Container output is read from the kubelet's pod log files: the API server would reach the kubelet
for `kubectl logs` at the machine's own address, and test traffic stays on loopback (the pods'
bridge has no address on the host and no route out).

Marked `node` (``pytest -m node``); skipped, with the reason, where the machine cannot run a node
(not root, no overlayfs).
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
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from otel_dra.fixtures import create
from otel_dra.kube.client import ApiError, KubeClient, load_credentials
from otel_dra.testbed import Binaries, Testbed
from otel_dra.testbed.build import kubernetes_release
from otel_dra.testbed.node import (
    OUTSIDE_PATHS,
    Node,
    node_of,
    processes_of,
    restart_kubelet,
)
from tests.helpers import free_port, wait_until
from tests.integration import nodes
from tests.integration.nodes import (
    DRIVER,
    NAMESPACE,
    ROOT,
    HostPlugin,
    connected_since,
    container_env,
    host_plugins,
    kubelet_log_size,
    node_binaries,
    node_slices,
    phase,
    start_plugin,
    wait_running,
)

pytestmark = [pytest.mark.node, pytest.mark.testbed]


@pytest.fixture(scope="module")
def node_support(testbed_binaries: Binaries) -> Binaries:
    return node_binaries(testbed_binaries)


# --- what a node may change on the host, seen from outside -----------------------------------------


def _run(*argv: str) -> str:
    result = subprocess.run(list(argv), capture_output=True, text=True)
    return result.stdout if result.returncode == 0 else f"<{argv[0]} failed: {result.stderr.strip()}>"


def _listing(path: Path) -> list[str] | None:
    if not path.exists():
        return None
    return sorted(str(p.relative_to(path)) for p in path.rglob("*"))


def host_state() -> dict[str, Any]:
    """Mounts, iptables rules, sysctls, links, cgroups, fixed paths: all a node could leave behind."""
    cgroups = {}
    for hierarchy in sorted(Path("/sys/fs/cgroup").iterdir()):
        if hierarchy.is_dir() and not hierarchy.is_symlink():
            cgroups[hierarchy.name] = sorted(p.name for p in hierarchy.iterdir() if p.is_dir())
    sysctls = {}
    for pattern in ("kernel/panic*", "vm/overcommit*", "vm/panic_on_oom", "kernel/keys/root_max*"):
        for path in sorted(Path("/proc/sys").glob(pattern)):
            sysctls[str(path)] = path.read_text().strip()
    for path in (Path("/proc/sys/net/ipv4/ip_forward"), Path("/proc/sys/net/ipv6/conf/all/forwarding")):
        with contextlib.suppress(OSError):
            sysctls[str(path)] = path.read_text().strip()
    return {
        "mounts": sorted(line.split()[4] for line in Path("/proc/self/mountinfo").read_text().splitlines()),
        "iptables": {
            f"{binary} {table}": _run(binary, "-w", "-t", table, "-S")
            for binary in ("iptables", "ip6tables")
            for table in ("filter", "nat", "mangle", "raw")
        },
        "sysctls": sysctls,
        "links": sorted(os.listdir("/sys/class/net")),
        "cgroups": cgroups,
        "paths": {p: _listing(Path(p)) for p in (*OUTSIDE_PATHS, "/var/log/pods", "/var/lib/containerd")},
    }


def _cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "otel_dra", "testbed", *args], capture_output=True, text=True, env=env, timeout=timeout
    )


# --- up and down from the command line ------------------------------------------------------------


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """A testbed directory short enough for the node's unix sockets (pytest's tmp_path is not)."""
    path = Path(tempfile.mkdtemp(prefix="otel-dra-node-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_up_with_a_node_and_down_leave_nothing_behind(short_dir: Path, node_support: Binaries) -> None:
    """`testbed up --node` returns with the Node Ready, a pod of the local busybox image runs on it,
    and `testbed down` deletes it, stops everything and puts back every host change."""
    before = host_state()
    dir = short_dir / "tb"
    started = time.monotonic()
    up = _cli("up", "--dir", str(dir), "--node", "n1")
    up_seconds = time.monotonic() - started
    try:
        assert up.returncode == 0, up.stderr
        assert up.stdout == f"KUBECONFIG={dir / 'kubeconfig'}\n"
        ready = re.search(r"node n1 Ready after ([\d.]+)s", up.stderr)
        assert ready, up.stderr
        testbed = Testbed.load(dir)
        client = KubeClient(load_credentials(str(testbed.kubeconfig)))
        node = client.get_json("/api/v1/nodes/n1")
        assert {c["type"]: c["status"] for c in node["status"]["conditions"]}["Ready"] == "True"
        assert node["status"]["nodeInfo"]["kubeletVersion"] == kubernetes_release().version  # the control plane's
        assert node["status"]["nodeInfo"]["containerRuntimeVersion"].startswith("containerd://2.")
        create(client, nodes.pod("bb", [nodes.container("c")]))
        running_seconds = wait_running(client, "bb", node_of(testbed, "n1"))
        assert "PATH=/bin" in container_env(node_of(testbed, "n1"), "bb", "c")
    finally:
        started = time.monotonic()
        down = _cli("down", "--dir", str(dir))
        down_seconds = time.monotonic() - started
    assert down.returncode == 0, down.stderr
    assert "node n1: deleting 1 pod(s)" in down.stderr
    print(
        f"\nup --node {up_seconds:.1f}s (node Ready {ready.group(1)}s after containerd started), "
        f"pod Running {running_seconds:.1f}s, down {down_seconds:.1f}s"
    )
    assert processes_of(dir) == []
    after = host_state()
    for key in before:
        assert after[key] == before[key], f"{key} differs after down"


# --- the plugin as a host process ----------------------------------------------------------------


@pytest.fixture(scope="module")
def node_testbed(node_support: Binaries) -> Iterator[tuple[Testbed, Node]]:
    yield from nodes.node_testbed(node_support)


@pytest.fixture
def host_plugin(node_testbed: tuple[Testbed, Node]) -> Iterator[list[HostPlugin]]:
    """The plugins a test started (``_start_plugin``); each is stopped after the test."""
    yield from host_plugins()


def _claim_pod(client: KubeClient, name: str) -> None:
    template = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaimTemplate",
        "metadata": {"name": name, "namespace": NAMESPACE},
        "spec": {"spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": DRIVER}}]}}},
    }
    create(client, template)
    create(
        client,
        nodes.pod(
            name,
            [nodes.container("with-gpu", claims=("gpu",)), nodes.container("without")],
            resourceClaims=[{"name": "gpu", "resourceClaimTemplateName": name}],
        ),
    )


def _generated_claim(client: KubeClient, pod: str) -> dict[str, Any]:
    status = client.get_json(f"/api/v1/namespaces/{NAMESPACE}/pods/{pod}")["status"]
    [entry] = status["resourceClaimStatuses"]
    return client.get_json(
        f"/apis/resource.k8s.io/v1/namespaces/{NAMESPACE}/resourceclaims/{entry['resourceClaimName']}"
    )


def _checkpoint_uids(node: Node) -> set[str]:
    path = node.plugins_dir / DRIVER / "checkpoint.json"
    return set(json.loads(path.read_text())["claims"]) if path.exists() else set()


def _cdi_spec(node: Node, claim_uid: str) -> Path:
    return node.cdi_dir / f"k8s.{DRIVER}-gpu_{claim_uid}.json"


def _delete_and_check_unprepared(client: KubeClient, node: Node, pod: str, claim: dict[str, Any]) -> float:
    uid, claim_name = claim["metadata"]["uid"], claim["metadata"]["name"]
    started = time.monotonic()
    client.send_json("DELETE", f"/api/v1/namespaces/{NAMESPACE}/pods/{pod}", {})
    # The kubelet lets a pod go only once NodeUnprepareResources succeeded for its claims.
    wait_until(lambda: phase(client, pod) == "Gone", timeout=90, what=f"pod {pod} deleted")
    seconds = time.monotonic() - started
    # The plugin removes the spec and the checkpoint entry just after its answer (cleanup.py).
    wait_until(
        lambda: not _cdi_spec(node, uid).exists() and uid not in _checkpoint_uids(node),
        timeout=10,
        what=f"claim {claim_name}'s CDI spec and checkpoint entry removed",
    )

    def claim_gone() -> bool:
        try:
            client.get_json(f"/apis/resource.k8s.io/v1/namespaces/{NAMESPACE}/resourceclaims/{claim_name}")
        except ApiError as err:
            return err.status == 404
        return False

    wait_until(claim_gone, timeout=60, what=f"generated claim {claim_name} deleted")
    return seconds


def test_a_claim_pod_gets_exactly_its_devices_environment(
    node_testbed: tuple[Testbed, Node], host_plugin: list[HostPlugin], tmp_path: Path
) -> None:
    testbed, node = node_testbed
    client = KubeClient(load_credentials(str(testbed.kubeconfig)))
    start_plugin(testbed, node, host_plugin, tmp_path / "plugin.log")
    _claim_pod(client, "gpu-pod")
    seconds = wait_running(client, "gpu-pod", node)
    claim = _generated_claim(client, "gpu-pod")
    [result] = claim["status"]["allocation"]["devices"]["results"]
    device = result["device"]
    assert _cdi_spec(node, claim["metadata"]["uid"]).is_file()
    assert claim["metadata"]["uid"] in _checkpoint_uids(node)
    # The slices are owned by the Node the kubelet registered (the garbage collector's link).
    node_uid = client.get_json(f"/api/v1/nodes/{node.name}")["metadata"]["uid"]
    owner = {"apiVersion": "v1", "kind": "Node", "name": node.name, "uid": node_uid, "controller": True}
    assert [s["metadata"].get("ownerReferences") for s in node_slices(client, node)] == [[owner]]
    with_gpu, without = container_env(node, "gpu-pod", "with-gpu"), container_env(node, "gpu-pod", "without")
    # The same pod, image and command: the only difference is what CDI injected for the claim.
    assert without <= with_gpu
    n = device.removeprefix("gpu-")
    # Exactly what the upstream driver injects (names and values), for a claim without a config.
    assert with_gpu - without == {
        f"KUBERNETES_NODE_NAME={node.name}",
        f"DRA_RESOURCE_DRIVER_NAME={DRIVER}",
        f"GPU_DEVICE_GPU_{n}_RESOURCE_CLAIM={claim['metadata']['uid']}",
        "DRA_ADMIN_ACCESS=false",
        f"GPU_DEVICE_{n}={device}",
        f"GPU_DEVICE_{n}_SHARING_STRATEGY=TimeSlicing",
        f"GPU_DEVICE_{n}_TIMESLICE_INTERVAL=Default",
    }
    unprepare = _delete_and_check_unprepared(client, node, "gpu-pod", claim)
    print(f"\nclaim pod Running {seconds:.1f}s after creation, deleted and unprepared in {unprepare:.1f}s")


def test_a_restarted_kubelet_registers_the_plugin_again(
    node_testbed: tuple[Testbed, Node], host_plugin: list[HostPlugin], tmp_path: Path
) -> None:
    testbed, node = node_testbed
    client = KubeClient(load_credentials(str(testbed.kubeconfig)))
    start_plugin(testbed, node, host_plugin, tmp_path / "plugin.log")
    offset = kubelet_log_size(node)
    started = time.monotonic()
    restart_kubelet(testbed, node.name, progress=lambda _: None)
    restarted = time.monotonic() - started
    # Nothing restarts the plugin: the new kubelet finds its registration socket by itself.
    wait_until(lambda: connected_since(node, offset), timeout=60, what="the restarted kubelet to register the plugin")
    registered = time.monotonic() - started
    # A starting kubelet deletes its node's ResourceSlices in the background (no driver is known to
    # be there yet), just before or a few seconds after it registers the plugin; the plugin checks
    # its slices again at the registration and a few times after it (SlicePublisher.recheck_soon),
    # instead of leaving the node without devices until its next resync (29 s measured without).
    wait_until(lambda: node_slices(client, node), timeout=60, what="the plugin's ResourceSlices back")
    slices_back = time.monotonic() - started
    assert slices_back - registered < 12, f"slices back {slices_back - registered:.1f}s after the registration"
    _claim_pod(client, "after-restart")
    running_seconds = wait_running(client, "after-restart", node)
    unprepared = _delete_and_check_unprepared(client, node, "after-restart", _generated_claim(client, "after-restart"))
    print(
        f"\nkubelet restarted and Ready in {restarted:.1f}s, plugin registered again after {registered:.1f}s, "
        f"its slices back after {slices_back:.1f}s; claim pod Running {running_seconds:.1f}s, "
        f"unprepared {unprepared:.1f}s"
    )


def test_a_plugin_killed_between_prepare_and_deletion_loses_nothing(
    node_testbed: tuple[Testbed, Node], host_plugin: list[HostPlugin], tmp_path: Path
) -> None:
    testbed, node = node_testbed
    client = KubeClient(load_credentials(str(testbed.kubeconfig)))
    first = start_plugin(testbed, node, host_plugin, tmp_path / "plugin-1.log")
    _claim_pod(client, "survivor")
    wait_running(client, "survivor", node)
    claim = _generated_claim(client, "survivor")
    first.kill(signal.SIGKILL)
    assert _cdi_spec(node, claim["metadata"]["uid"]).is_file()  # prepared state outlives the process
    started = time.monotonic()
    start_plugin(testbed, node, host_plugin, tmp_path / "plugin-2.log")
    registered = time.monotonic() - started
    unprepared = _delete_and_check_unprepared(client, node, "survivor", claim)
    print(f"\nplugin killed; the new one registered in {registered:.1f}s, the pod unprepared in {unprepared:.1f}s")


def test_the_emulator_and_the_kubelet_call_the_plugin_alike(node_testbed: tuple[Testbed, Node], tmp_path: Path) -> None:
    """The same pod scenario (tests/integration/pod_scenario.py: two pods with a claim each from a
    template and one shared claim, then deletes) on an emulated node and on the real kubelet, in the
    same control plane: the plugin gets the same calls, with the same claims and CDI ids."""
    from tests.integration import pod_scenario
    from tests.integration.test_kubelet_sim import run_on_emulator

    testbed, node = node_testbed
    client = KubeClient(load_credentials(str(testbed.kubeconfig)))
    out = Path(tempfile.mkdtemp(prefix="parity-", dir="/tmp"))  # short: unix socket paths
    try:
        sim_roles, sim_record = run_on_emulator(testbed, DRIVER, out, nodes.container("c"))
        offset = kubelet_log_size(node)
        plugin = pod_scenario.RecordingPlugin(
            kubeconfig=testbed.kubeconfig,
            node=node.name,
            driver=DRIVER,
            cdi=node.cdi_dir,
            plugins=node.plugins_dir,
            registry=node.registry_dir,
            out=out,
        )
        try:

            def registered() -> bool:
                assert plugin.proc.poll() is None, plugin.log.read_text()
                return connected_since(node, offset) and bool(node_slices(client, node))

            wait_until(registered, timeout=60, what="the kubelet to register the plugin")
            roles = pod_scenario.run(
                client,
                namespace=NAMESPACE,
                node=node.name,
                driver=DRIVER,
                container=nodes.container("c"),
                wait_running=lambda pod: wait_running(client, pod, node),
                wait_gone=lambda pod: wait_until(lambda: phase(client, pod) == "Gone", timeout=90, what=f"{pod} gone"),
            )
        finally:
            plugin.stop()
        real, emulated = pod_scenario.calls(plugin.record, roles), pod_scenario.calls(sim_record, sim_roles)
        assert [(method, claims) for method, claims, _ in real] == pod_scenario.EXPECTED, real
        assert emulated == real
        print("\nthe plugin's calls, the same from the emulator and from the kubelet:")
        for call in real:
            print(f"  {call}")
    finally:
        shutil.rmtree(out, ignore_errors=True)


# --- the shipped dashboard and alerts against what a real node serves ------------------------------

# Metric names the dashboard and the rules read that only exist once something rare happened, each
# with what it takes; every other name they read must be served by the exporter, the plugin or the
# kubelet of this release.
_NEEDS_AN_EVENT = {
    "dra_node_prepare_skips_total": "a device with skipNodeOperations (alpha, DRAOptionalNodeOperations)",
    "dra_node_unprepare_skips_total": "a device with skipNodeOperations (alpha, DRAOptionalNodeOperations)",
    "rest_client_request_retries_total": "a retried API request",
    "kube_resourceslice_device_taint": "a tainted device",
    "kube_pod_resourceclaim_device_health": "a device whose health the kubelet wrote into pod status",
    "otel_dra_claim_binding_duration_seconds_count": "a device with binding conditions (DRADeviceBindingConditions)",
    # The counter exists only with tracing on (OTEL_EXPORTER_OTLP_TRACES_ENDPOINT) and appears with its
    # first add (an OTel counter has no series before).
    "otel_dra_tracing_spans_dropped_total": "a span dropped because the exporter's span queue was full",
}
_METRIC = re.compile(r"\b((?:kube|dra|otel_dra|rest_client|process)_[a-zA-Z0-9_:]*|up)\b")


def _names_read(expressions: list[tuple[str, str]]) -> dict[str, str]:
    """Metric name -> the first panel or rule that reads it (label values and strings left out)."""
    names: dict[str, str] = {}
    for where, expr in expressions:
        for name in _METRIC.findall(re.sub(r'"[^"]*"', '""', expr)):
            names.setdefault(name, where)
    return names


def test_the_dashboard_and_alerts_read_what_the_exporter_plugin_and_kubelet_serve(
    node_testbed: tuple[Testbed, Node],
    host_plugin: list[HostPlugin],
    start_exporter_app: Any,
    prometheus: Any,
    helm: Path,
    tmp_path: Path,
) -> None:
    """A real Prometheus scrapes the exporter, the plugin and this release's kubelet (over loopback,
    with the node's client certificate) while a claim pod runs; every metric the chart's dashboard
    and rules read is then in Prometheus, but for those that need a rare event (_NEEDS_AN_EVENT)."""
    from tests.integration.test_dashboard_and_rules import dashboard_expressions, rule_expressions

    testbed, node = node_testbed
    client = KubeClient(load_credentials(str(testbed.kubeconfig)))
    plugin_port = free_port()
    start_plugin(testbed, node, host_plugin, tmp_path / "plugin.log", f"--metrics-port={plugin_port}")
    exporter = start_exporter_app(str(testbed.kubeconfig))
    kubelet_port = int(testbed.nodes[node.name]["ports"]["kubelet"])
    pki = node.layout.dir / "pki"
    prometheus.set_jobs(
        {
            "exporter": {"static_configs": [{"targets": [f"127.0.0.1:{exporter.port}"]}]},
            "plugin": {"static_configs": [{"targets": [f"127.0.0.1:{plugin_port}"]}]},
            "kubelet": {
                "scheme": "https",
                # The kubelet trusts the testbed CA's client certificates; its own is self-signed.
                "tls_config": {
                    "cert_file": str(pki / "node.crt"),
                    "key_file": str(pki / "node.key"),
                    "insecure_skip_verify": True,
                },
                "static_configs": [{"targets": [f"127.0.0.1:{kubelet_port}"]}],
            },
        }
    )
    # One pod through its whole life first (unprepare histograms), its claim unpriced; then a price
    # on the class (removed again below) and a pod that runs. Prometheus keeps the names of both.
    _claim_pod(client, "scraped-once")
    wait_running(client, "scraped-once", node)
    wait_until(
        lambda: prometheus.query('kube_resourceclaim_unpriced_devices{job="exporter"}'),
        timeout=60,
        interval=1,
        what="the unpriced claim in Prometheus",
    )
    _delete_and_check_unprepared(client, node, "scraped-once", _generated_claim(client, "scraped-once"))
    price = {"metadata": {"annotations": {"hourly-cost": "2.5"}}}
    client.send_json("PATCH", f"/apis/resource.k8s.io/v1/deviceclasses/{DRIVER}", price, "application/merge-patch+json")
    _claim_pod(client, "scraped-pod")
    wait_running(client, "scraped-pod", node)
    read = _names_read([*dashboard_expressions(), *rule_expressions(helm)])
    assert {"dra_grpc_operations_duration_seconds_bucket", "dra_resource_claims_in_use"} <= set(read)

    def missing() -> dict[str, str]:
        served = prometheus.metric_names('{job=~"exporter|plugin|kubelet"}')
        return {name: where for name, where in read.items() if name not in served and name not in _NEEDS_AN_EVENT}

    try:
        wait_until(lambda: not missing(), timeout=60, interval=1, what="every metric the dashboard and rules read")
    except AssertionError:
        raise AssertionError(f"not served on Kubernetes {kubernetes_release().version}: {missing()}") from None
    for job in ("exporter", "plugin", "kubelet"):
        assert prometheus.targets_up(job), job
    # The kubelet's DRA metrics carry the plugin's call, as 1.34 to 1.38 name it.
    [sample] = prometheus.query(
        'sum(dra_grpc_operations_duration_seconds_count{job="kubelet",driver_name="gpu.example.com",'
        'method_name="/k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/NodePrepareResources"})'
    )
    assert float(sample["value"][1]) >= 1
    _delete_and_check_unprepared(client, node, "scraped-pod", _generated_claim(client, "scraped-pod"))
    unpriced = {"metadata": {"annotations": {"hourly-cost": None}}}
    client.send_json(
        "PATCH", f"/apis/resource.k8s.io/v1/deviceclasses/{DRIVER}", unpriced, "application/merge-patch+json"
    )


# --- one trace per claim ---------------------------------------------------------------------------


def _jaeger_spans(trace: dict[str, Any]) -> list[dict[str, Any]]:
    """A Jaeger trace's spans with their service name and parent span id (None for a root)."""
    processes = trace["processes"]
    out = []
    for span in trace["spans"]:
        parents = [r["spanID"] for r in span.get("references", []) if r["refType"] == "CHILD_OF"]
        out.append(
            {**span, "service": processes[span["processID"]]["serviceName"], "parent": parents[0] if parents else None}
        )
    return out


def test_a_claims_life_is_one_trace_in_jaeger(
    node_testbed: tuple[Testbed, Node],
    host_plugin: list[HostPlugin],
    start_exporter_app: Any,
    jaeger: Any,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The exporter (watching) and the plugin (called by the real kubelet, which sends no trace
    context) put a claim's spans into the one trace its UID names, in Jaeger; a claim that the
    ratio sampler leaves out leaves no span in either service."""
    from otel_dra.telemetry import traceids
    from otel_dra.telemetry.traceids import TraceIdRatio

    testbed, node = node_testbed
    client = KubeClient(load_credentials(str(testbed.kubeconfig)))
    env = {
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": f"http://{jaeger.otlp_grpc}",
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "grpc",
        "OTEL_TRACES_SAMPLER_ARG": "0.5",
        "OTEL_BSP_SCHEDULE_DELAY": "200",
    }
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    plugin_port = free_port()
    start_plugin(testbed, node, host_plugin, tmp_path / "plugin.log", f"--metrics-port={plugin_port}", env=env)
    exporter = start_exporter_app(str(testbed.kubeconfig))
    assert exporter.tracing.sink is not None
    # Claims until one of each: the API server picks the UIDs, the sampler decides by them alone.
    sampler = TraceIdRatio(0.5)
    claims: dict[bool, dict[str, Any]] = {}
    for i in range(20):
        claim = create(
            client,
            {
                "apiVersion": "resource.k8s.io/v1",
                "kind": "ResourceClaim",
                "metadata": {"name": f"traced-{i}", "namespace": NAMESPACE},
                "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": DRIVER}}]}},
            },
        )
        sampled = sampler.sampled(uuid_int := int(claim["metadata"]["uid"].replace("-", ""), 16))
        assert traceids.trace_id_of(claim["metadata"]["uid"]) == uuid_int
        if sampled in claims:
            client.send_json("DELETE", f"/apis/resource.k8s.io/v1/namespaces/{NAMESPACE}/resourceclaims/traced-{i}", {})
            continue
        claims[sampled] = claim
        if len(claims) == 2:
            break
    assert len(claims) == 2, "twenty UIDs all on one side of a 0.5 ratio"
    for sampled, claim in claims.items():
        pod = f"traced-pod-{int(sampled)}"
        create(
            client,
            nodes.pod(
                pod,
                [nodes.container("with-gpu", claims=("gpu",))],
                resourceClaims=[{"name": "gpu", "resourceClaimName": claim["metadata"]["name"]}],
            ),
        )
        wait_running(client, pod, node)
        time.sleep(1)  # the exporter sees the pod's containers started
        client.send_json("DELETE", f"/api/v1/namespaces/{NAMESPACE}/pods/{pod}", {})
        wait_until(lambda pod=pod: phase(client, pod) == "Gone", timeout=90, what=f"pod {pod} deleted")
        client.send_json(
            "DELETE", f"/apis/resource.k8s.io/v1/namespaces/{NAMESPACE}/resourceclaims/{claim['metadata']['name']}", {}
        )
    traced = claims[True]
    trace_id = traced["metadata"]["uid"].replace("-", "")
    root = f"{traceids.root_span_id(int(trace_id, 16)):016x}"
    name = traced["metadata"]["name"]
    wanted = {
        ("otel-dra-exporter", f"ResourceClaim {NAMESPACE}/{name}"),
        ("otel-dra-exporter", "allocation"),
        ("otel-dra-exporter", "reserved for pod/traced-pod-1"),
        ("otel-dra-exporter", "consumer pod/traced-pod-1"),
        ("otel-dra-exporter", "pod traced-pod-1 start"),
        ("otel-dra-exporter", "deleted"),
        ("otel-dra-exporter", "lifetime"),
        ("otel-dra-plugin", "prepare claim"),
        ("otel-dra-plugin", "unprepare claim"),
    }
    spans: list[dict[str, Any]] = []

    def whole() -> bool:
        nonlocal spans
        found = jaeger.trace(trace_id)
        spans = _jaeger_spans(found) if found else []
        return wanted <= {(s["service"], s["operationName"]) for s in spans}

    try:
        wait_until(whole, timeout=60, interval=1, what="the claim's whole trace in Jaeger")
    except AssertionError:
        raise AssertionError(sorted((s["service"], s["operationName"]) for s in spans)) from None
    by_name = {s["operationName"]: s for s in spans}
    assert by_name[f"ResourceClaim {NAMESPACE}/{name}"]["spanID"] == root
    assert by_name[f"ResourceClaim {NAMESPACE}/{name}"]["parent"] is None
    for span in spans:
        if span["operationName"] in {n for _, n in wanted} - {
            f"ResourceClaim {NAMESPACE}/{name}",
            "prepare claim",
            "unprepare claim",
        }:
            assert span["parent"] == root, span["operationName"]
    # The plugin's claim spans: children of the claim's root, with nothing sent by the kubelet.
    for operation in ("prepare claim", "unprepare claim"):
        assert by_name[operation]["parent"] == root, operation
    # In order: allocated, then prepared, then unprepared, then deleted.
    allocation, prepare, unprepare = by_name["allocation"], by_name["prepare claim"], by_name["unprepare claim"]
    assert (
        allocation["startTime"] + allocation["duration"] <= prepare["startTime"] + 1_000_000
    )  # 1 s: object times are whole seconds
    assert prepare["startTime"] + prepare["duration"] <= unprepare["startTime"]
    assert unprepare["startTime"] <= by_name["deleted"]["startTime"] + 1_000_000
    # The claim the sampler left out: no span anywhere.
    left_out = claims[False]["metadata"]["uid"].replace("-", "")
    assert jaeger.trace(left_out) is None
    # The latency histograms point at the traced claim: an OpenMetrics scrape of the exporter (the
    # allocation wait, the pod's start) and of the plugin (allocation to prepared) carries its trace
    # id as an exemplar, and never the left-out claim's.
    for port, histograms in (
        (exporter.port, ("otel_dra_claim_allocation_duration_seconds", "otel_dra_pod_startup_duration_seconds")),
        (plugin_port, ("otel_dra_plugin_claim_allocation_to_prepared_seconds",)),
    ):
        body = _openmetrics(port)
        assert f'trace_id="{left_out}"' not in body
        for histogram in histograms:
            exemplars = re.findall(rf"^{histogram}_bucket{{[^}}]*}} \S+ # {{([^}}]*)}}", body, re.M)
            assert any(f'trace_id="{trace_id}"' in e for e in exemplars), (histogram, exemplars)


def _openmetrics(port: int) -> str:
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/metrics", headers={"Accept": "application/openmetrics-text; version=1.0.0"}
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        return response.read().decode()
