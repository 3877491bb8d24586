"""The project's image built for real (buildah, a local Debian base) and the Helm chart installed
with it on a real node: the plugin DaemonSet pod registered by the kubelet through the chart's
hostPath sockets and preparing a workload pod's claim, the exporter Deployment pod Ready by its own
probes, both scraped by a real Prometheus on the host at their pod IPs, the plugin's prepare span
in Jaeger through the Collector, and the security context the chart promises read back from /proc
of the container processes.

Pods reach the host only at the node bridge's address (otel_dra.testbed.node.BRIDGE_ADDRESS): the
API server through the node's forwarder (``pod_api_server``), the Collector through one the test
runs. Container output is read from the kubelet's pod log files (never `kubectl logs`/`exec`, which
would make the API server dial the machine's own address).

Marked `node` (one real node per machine: run under ``flock /tmp/otel-dra-node.flock``).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import tarfile
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from otel_dra import __version__
from otel_dra.fixtures import create
from otel_dra.kube.client import KubeClient, load_credentials
from otel_dra.testbed import Binaries, Testbed, running
from otel_dra.testbed.forward import Forwarder
from otel_dra.testbed.imagebuild import BuiltImage, ImageBuildError, build_image, check_tools, mounts_left
from otel_dra.testbed.node import (
    BRIDGE_ADDRESS,
    Node,
    NodeLayout,
    ctr_argv,
    load_image,
    pod_api_server,
    start_node,
)
from tests import peers
from tests.helpers import wait_until

# The real-node helpers and the fixture that checks this machine can run a node (one place for
# them: test_node.py, whose tests drive the plugin as a host process).
from tests.integration import test_node
from tests.integration.nodes import container_env, phase, wait_running
from tests.integration.test_node import DRIVER, _claim_pod, _generated_claim

node_support = test_node.node_support

pytestmark = [pytest.mark.node, pytest.mark.testbed]

CHART = Path(__file__).resolve().parents[2] / "deploy" / "helm" / "otel-dra"
RELEASE = "rel"
CHART_NAMESPACE = "otel-dra"
NAMESPACE = "default"  # the workload pods' (test_node's helpers)
UID_NONROOT = 65532


@pytest.fixture(scope="module")
def image(node_support: Binaries) -> BuiltImage:
    """The image, built with buildah on the local base (cached by the inputs' digest)."""
    try:
        check_tools()
    except ImageBuildError as exc:
        pytest.fail(str(exc))
    return build_image(progress=lambda line: print(line, flush=True))


@pytest.fixture(scope="module")
def chart_node(node_support: Binaries, image: BuiltImage) -> Iterator[tuple[Testbed, Node]]:
    """A control plane whose pods get ServiceAccount tokens and workload controllers, a real node,
    and the image loaded into its containerd."""
    dir = Path(tempfile.mkdtemp(prefix="otel-dra-node-", dir="/tmp"))  # short: unix socket paths
    try:
        with running(
            dir, scheduler=True, controller_manager=True, service_accounts=True, binaries=node_support
        ) as testbed:
            node = start_node(testbed, "n1")
            load_image(testbed, node.name, image.archive, image_name=image.name)
            yield testbed, node
    finally:
        shutil.rmtree(dir, ignore_errors=True)


def _client(testbed: Testbed) -> KubeClient:
    return KubeClient(load_credentials(str(testbed.kubeconfig)))


def _pod_json(client: KubeClient, namespace: str, name: str) -> dict[str, Any]:
    pod: dict[str, Any] = client.get_json(f"/api/v1/namespaces/{namespace}/pods/{name}")
    return pod


def _config_blob(archive: Path) -> dict[str, Any]:
    """The image config of a one-manifest OCI archive."""
    with tarfile.open(archive) as tar:

        def blob(digest: str) -> Any:
            member = tar.extractfile(f"blobs/sha256/{digest.removeprefix('sha256:')}")
            assert member is not None
            return json.load(member)

        index = json.load(tar.extractfile("index.json"))  # type: ignore[arg-type]
        [entry] = index["manifests"]
        manifest = blob(entry["digest"])
        config: dict[str, Any] = blob(manifest["config"]["digest"])
        return config


# --- the image ------------------------------------------------------------------------------------


def test_the_image_build_is_cached_and_leaves_no_mounts(image: BuiltImage) -> None:
    assert image.name == f"localhost/otel-dra/otel-dra:{__version__}"
    assert image.archive.is_file()
    print(f"\nimage built: {image.seconds or 'cached'}; archive {image.archive.stat().st_size / 2**20:.0f} MiB")
    config = _config_blob(image.archive)
    assert config["config"]["User"] == f"{UID_NONROOT}:{UID_NONROOT}"
    assert config["config"]["Entrypoint"] == ["otel-dra"]
    assert config["config"]["Labels"]["org.opencontainers.image.version"] == __version__
    assert mounts_left() == []
    started = time.monotonic()
    again = build_image(progress=lambda _: None)
    assert again.archive == image.archive and again.seconds == {}  # nothing changed: nothing built
    assert time.monotonic() - started < 30
    assert mounts_left() == []


def test_the_image_runs_otel_dra_as_non_root_on_a_read_only_root(
    chart_node: tuple[Testbed, Node], image: BuiltImage
) -> None:
    """The image's own USER (no runAsUser in the pod), its entrypoint, and a read-only root that
    otel-dra does not need to write to."""
    testbed, node = chart_node
    client = _client(testbed)
    probe = (
        "id -u; id -g; "
        "if touch /probe 2>/dev/null; then echo root-writable; else echo root-read-only; fi; "
        "otel-dra --version"
    )
    security = {"readOnlyRootFilesystem": True, "allowPrivilegeEscalation": False}
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "image-check", "namespace": NAMESPACE},
        "spec": {
            "restartPolicy": "Never",
            "automountServiceAccountToken": False,
            "containers": [
                # The entrypoint as the image declares it.
                {"name": "version", "image": image.name, "imagePullPolicy": "Never", "args": ["--version"],
                 "securityContext": security},
                {"name": "probe", "image": image.name, "imagePullPolicy": "Never",
                 "command": ["/bin/sh", "-c", probe], "securityContext": security},
            ],
        },
    }  # fmt: skip
    create(client, pod)
    try:
        wait_until(
            lambda: phase(client, "image-check") in ("Succeeded", "Failed"),
            timeout=90,
            interval=0.5,
            what="the image-check pod to finish",
        )
        status = _pod_json(client, NAMESPACE, "image-check")["status"]
        assert status["phase"] == "Succeeded", status
        assert _log_lines(node, "image-check", "version") == [f"otel-dra {__version__}"]
        assert _log_lines(node, "image-check", "probe") == [
            str(UID_NONROOT),
            str(UID_NONROOT),
            "root-read-only",
            f"otel-dra {__version__}",
        ]
    finally:
        client.send_json("DELETE", f"/api/v1/namespaces/{NAMESPACE}/pods/image-check", {})


def _log_lines(node: Node, pod: str, container: str, namespace: str = NAMESPACE) -> list[str]:
    [pod_dir] = node.pod_logs.glob(f"{namespace}_{pod}_*")
    log = pod_dir / container / "0.log"
    return [line.split(" ", 3)[3] for line in log.read_text().splitlines() if line.split(" ", 3)[1:2] == ["stdout"]]


# --- the Helm chart on the node ----------------------------------------------------------------------


def _values(node: Node, image: BuiltImage, api: tuple[str, int], otlp: tuple[str, int]) -> dict[str, Any]:
    # No kube-proxy: the `kubernetes` Service's cluster IP leads nowhere, so the pods are pointed at
    # the node's API server forwarder (the serving certificate names its address).
    api_env = [
        {"name": "KUBERNETES_SERVICE_HOST", "value": api[0]},
        {"name": "KUBERNETES_SERVICE_PORT", "value": str(api[1])},
    ]
    return {
        "image": {"repository": image.repository, "tag": image.tag, "pullPolicy": "Never"},
        "extraEnv": api_env,
        "exporter": {"logFormat": "text"},
        "otlp": {"endpoint": f"http://{otlp[0]}:{otlp[1]}", "protocol": "http/protobuf", "exportInterval": 5000},
        "plugin": {
            "enabled": True,
            "numDevices": 2,
            # This node's kubelet --root-dir is not /var/lib/kubelet, nor is containerd's CDI dir
            # /var/run/cdi: the chart's host paths are values.
            "kubeletPluginsDirectoryPath": str(node.plugins_dir),
            "kubeletRegistrarDirectoryPath": str(node.registry_dir),
            "cdiRoot": str(node.cdi_dir),
            "extraEnv": api_env,
        },
    }


def _helm(helm: Path, testbed: Testbed, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(helm), f"--kubeconfig={testbed.kubeconfig}", *args], capture_output=True, text=True, timeout=300
    )


def _chart_pod(client: KubeClient, component: str) -> dict[str, Any] | None:
    pods = client.get_json(
        f"/api/v1/namespaces/{CHART_NAMESPACE}/pods?labelSelector=app.kubernetes.io/component%3D{component}"
    )["items"]
    return pods[0] if len(pods) == 1 else None


def _ready(pod: dict[str, Any] | None) -> bool:
    conditions = (pod or {}).get("status", {}).get("conditions", [])
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)


def _diagnose(client: KubeClient, node: Node) -> str:
    pods = client.get_json(f"/api/v1/namespaces/{CHART_NAMESPACE}/pods")["items"]
    states = [(p["metadata"]["name"], p.get("status")) for p in pods]
    logs = []
    for pod_dir in node.pod_logs.glob(f"{CHART_NAMESPACE}_*"):
        for log in pod_dir.glob("*/*.log"):
            logs.append(f"--- {log} ---\n" + "\n".join(log.read_text(errors="replace").splitlines()[-30:]))
    events = client.get_json(f"/api/v1/namespaces/{CHART_NAMESPACE}/events")["items"]
    messages = [f"{e['involvedObject']['name']}: {e.get('reason')}: {e.get('message')}" for e in events][-30:]
    kubelet = "\n".join(node.kubelet_log.read_text(errors="replace").splitlines()[-30:])
    return (
        f"pods: {json.dumps(states, indent=1)[:6000]}\nevents:\n"
        + "\n".join(messages)
        + "\n"
        + "\n".join(logs)
        + (f"\n--- kubelet ---\n{kubelet}")
    )


def _container_pid(testbed: Testbed, node: Node, pod: dict[str, Any]) -> int:
    [status] = pod["status"]["containerStatuses"]
    container_id = status["containerID"].removeprefix("containerd://")
    tasks = subprocess.run(
        [*ctr_argv(testbed, NodeLayout(node.layout.dir), node.name), "tasks", "ls"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    for line in tasks.splitlines()[1:]:
        task, pid, *_ = line.split()
        if task == container_id:
            return int(pid)
    raise AssertionError(f"no task {container_id} in containerd:\n{tasks}")


def _proc_security(pid: int) -> dict[str, Any]:
    """What the kernel enforces on a container process, read on the host."""
    status = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    root_mount = None
    for line in Path(f"/proc/{pid}/mountinfo").read_text().splitlines():
        fields = line.split()
        if fields[4] == "/":  # the mount point, as the process sees it
            root_mount = fields[5].split(",")  # per-mount options: rw or ro first
    return {
        "uid": status["Uid"].split(),
        "gid": status["Gid"].split(),
        "groups": status["Groups"].split(),
        **{cap: int(status[cap].strip(), 16) for cap in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb")},
        "no_new_privs": status["NoNewPrivs"].strip(),
        "seccomp": status["Seccomp"].strip(),
        "root": root_mount,
    }


def test_the_chart_on_the_node_registers_prepares_is_scraped_and_traced(
    chart_node: tuple[Testbed, Node],
    image: BuiltImage,
    helm: Path,
    prometheus: peers.Prometheus,
    otelcol_gateway: peers.Collector,
    jaeger: peers.Jaeger,
    tmp_path: Path,
) -> None:
    testbed, node = chart_node
    client = _client(testbed)
    collector_host, collector_port = otelcol_gateway.endpoint(4318).rsplit(":", 1)
    # The plugin pod's OTLP endpoint: the Collector on the host, through the bridge's address.
    with Forwarder((BRIDGE_ADDRESS, 0), (collector_host, int(collector_port))) as otlp:
        values = tmp_path / "values.yaml"
        values.write_text(yaml.safe_dump(_values(node, image, pod_api_server(testbed, node.name), otlp.address)))
        started = time.monotonic()
        installed = _helm(
            helm, testbed, "install", RELEASE, str(CHART), f"--namespace={CHART_NAMESPACE}", "--create-namespace",
            "-f", str(values),
        )  # fmt: skip
        assert installed.returncode == 0, installed.stderr
        try:
            _check_chart_on_node(testbed, node, client, prometheus, jaeger, started)
        finally:
            uninstalled = _helm(helm, testbed, "uninstall", RELEASE, f"--namespace={CHART_NAMESPACE}", "--wait")
            assert uninstalled.returncode == 0, uninstalled.stderr
            wait_until(
                lambda: not client.get_json(f"/api/v1/namespaces/{CHART_NAMESPACE}/pods")["items"],
                timeout=90,
                what="the chart's pods gone",
            )
    assert not list(node.registry_dir.glob(f"{DRIVER}*"))  # the plugin took its registration socket along


def _check_chart_on_node(
    testbed: Testbed,
    node: Node,
    client: KubeClient,
    prometheus: peers.Prometheus,
    jaeger: peers.Jaeger,
    started: float,
) -> None:
    offset = node.kubelet_log.stat().st_size
    connected = re.compile(rf'"Connection changed" .*driverName="{re.escape(DRIVER)}" .*connected=true')

    def plugin_registered() -> bool:
        text = node.kubelet_log.read_bytes()[offset:].decode(errors="replace")
        slices = client.get_json("/apis/resource.k8s.io/v1/resourceslices")["items"]
        mine = [s for s in slices if s["spec"].get("nodeName") == node.name and s["spec"]["driver"] == DRIVER]
        return bool(connected.search(text)) and bool(mine)

    try:
        wait_until(plugin_registered, timeout=120, interval=0.5, what="the kubelet to register the plugin pod")
        registered = time.monotonic() - started
        wait_until(lambda: _ready(_chart_pod(client, "exporter")), timeout=120, interval=0.5, what="exporter Ready")
        exporter_ready = time.monotonic() - started
        wait_until(lambda: _ready(_chart_pod(client, "kubeletplugin")), timeout=60, interval=0.5, what="plugin Ready")
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{_diagnose(client, node)}") from None
    exporter, plugin = _chart_pod(client, "exporter"), _chart_pod(client, "kubeletplugin")
    assert exporter and plugin
    # Ready by the chart's own probes, which the kubelet runs against the pod IPs from the host.
    [exporter_container] = exporter["spec"]["containers"]
    assert exporter_container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert plugin["spec"]["containers"][0]["livenessProbe"]["grpc"]
    # The plugin's socket is where the kubelet looks: in its --root-dir, through the hostPath mounts.
    assert (node.registry_dir / f"{DRIVER}-reg.sock").is_socket()
    assert (node.plugins_dir / DRIVER / "dra.sock").is_socket()

    # A workload pod: the plugin pod prepares its claim, containerd injects the CDI edits.
    _claim_pod(client, "chart-gpu")
    running_seconds = wait_running(client, "chart-gpu", node)
    claim = _generated_claim(client, "chart-gpu")
    [result] = claim["status"]["allocation"]["devices"]["results"]
    device = result["device"]
    with_gpu, without = container_env(node, "chart-gpu", "with-gpu"), container_env(node, "chart-gpu", "without")
    assert {f"DRA_RESOURCE_DRIVER_NAME={DRIVER}", f"GPU_DEVICE_{device.removeprefix('gpu-')}={device}"} <= (
        with_gpu - without
    )
    assert (node.cdi_dir / f"k8s.{DRIVER}-gpu_{claim['metadata']['uid']}.json").is_file()

    # A real Prometheus on the host scrapes both pods at their IPs on the node's bridge.
    exporter_ip, plugin_ip = exporter["status"]["podIP"], plugin["status"]["podIP"]
    assert exporter_ip.startswith("10.244.240.") and plugin_ip.startswith("10.244.240.")
    prometheus.set_jobs(
        {
            "chart-exporter": {"static_configs": [{"targets": [f"{exporter_ip}:8080"]}]},
            "chart-plugin": {"static_configs": [{"targets": [f"{plugin_ip}:8080"]}]},
        }
    )
    claim_name = claim["metadata"]["name"]
    wait_until(
        lambda: prometheus.query(
            f'kube_resourceclaim_status_allocated_device{{job="chart-exporter",resourceclaim_name="{claim_name}",'
            f'device_name="{device}"}}'
        ),
        timeout=60,
        interval=1,
        what="the exporter pod's series of the workload claim in Prometheus",
    )
    wait_until(
        lambda: prometheus.query('sum(dra_example_driver_prepare_claims_total{job="chart-plugin"}) >= 1'),
        timeout=60,
        interval=1,
        what="the plugin pod's prepare counter in Prometheus",
    )
    assert prometheus.targets_up("chart-exporter") and prometheus.targets_up("chart-plugin")

    # The plugin pod's prepare span, through the Collector into Jaeger, carries the workload's claim.
    service = f"{RELEASE}-otel-dra-kubeletplugin"

    def prepare_spans() -> list[dict[str, Any]]:
        spans = [s for t in jaeger.traces(service, operation="prepare claim") for s in t["spans"]]
        # The claim's trace also holds the plugin's status write (a PATCH span with the same claim
        # attributes): only the prepare spans count here.
        return [
            s
            for s in spans
            if s["operationName"] == "prepare claim"
            and {"key": "dra.claim.uid", "type": "string", "value": claim["metadata"]["uid"]} in s["tags"]
        ]

    found = wait_until(prepare_spans, timeout=60, interval=1, what=f"the prepare span of {claim_name} in Jaeger")
    # OTLP delivery is at least once: an export the SDK or the Collector retried after a timeout
    # (a loaded CI machine) reaches Jaeger twice with the same ids. That is one span; two distinct
    # ones would be two prepare calls, which this pod's single start must not make.
    distinct = {(s["traceID"], s["spanID"]): s for s in found}
    assert len(distinct) == 1, [
        (s["operationName"], s["spanID"], s["startTime"], [t for t in s["tags"] if t["key"].startswith("error")])
        for s in found
    ]
    [span] = distinct.values()
    tags = {t["key"]: t["value"] for t in span["tags"]}
    assert tags["dra.claim.name"] == claim_name and tags["k8s.namespace.name"] == NAMESPACE

    # What the runtime enforces on both containers, from /proc.
    exporter_sec = _proc_security(_container_pid(testbed, node, exporter))
    plugin_sec = _proc_security(_container_pid(testbed, node, plugin))
    assert exporter_sec["uid"] == [str(UID_NONROOT)] * 4 and exporter_sec["gid"] == [str(UID_NONROOT)] * 4
    print(f"\nexporter container /proc: {exporter_sec}\nplugin container /proc: {plugin_sec}")
    # The plugin is UID 0 for the kubelet's root-owned directories, and nothing more (below).
    assert plugin_sec["uid"] == ["0"] * 4
    for sec in (exporter_sec, plugin_sec):
        assert all(sec[cap] == 0 for cap in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb")), sec
        assert sec["no_new_privs"] == "1", sec
        assert sec["seccomp"] == "2", sec  # SECCOMP_MODE_FILTER: the RuntimeDefault profile
        assert sec["root"] and sec["root"][0] == "ro", sec
    # The plugin's host access is exactly its sockets' and CDI specs' directories.
    host_paths = sorted(v["hostPath"]["path"] for v in plugin["spec"]["volumes"] if "hostPath" in v)
    assert host_paths == sorted([str(node.plugins_dir / DRIVER), str(node.registry_dir), str(node.cdi_dir)])
    assert not plugin["spec"].get("hostNetwork") and not plugin["spec"].get("hostPID")

    # Deleting the workload pod unprepares its claim through the plugin pod.
    client.send_json("DELETE", f"/api/v1/namespaces/{NAMESPACE}/pods/chart-gpu", {})
    wait_until(lambda: phase(client, "chart-gpu") == "Gone", timeout=90, what="workload pod deleted")
    spec = node.cdi_dir / f"k8s.{DRIVER}-gpu_{claim['metadata']['uid']}.json"
    wait_until(lambda: not spec.exists(), timeout=10, what="the claim's CDI spec removed after the unprepare")
    print(
        f"\nhelm install -> plugin registered {registered:.1f}s, exporter Ready {exporter_ready:.1f}s; "
        f"workload pod Running {running_seconds:.1f}s after creation"
    )
