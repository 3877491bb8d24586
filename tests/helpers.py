"""Small helpers shared by the integration tests."""

from __future__ import annotations

import os
import random
import re
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

SEED_FAMILIES = (
    "kube_resourceclaim_status_allocated_device",
    "kube_resourceclaim_status_reserved_for_pod",
    "kube_resourceclaim_status_reserved_total",
    "kube_resourceslice_device_capacity_memory_bytes",
    "kube_resourceslice_device_capacity_multiprocessors",
    "kube_resourceslice_device_capacity_decoders",
    "kube_deviceclass_hourly_cost",
)


def pool_wide_counters() -> bool:
    """Whether the testbed's Kubernetes (OTEL_DRA_KUBERNETES_VERSION) is 1.35 or later, where shared
    counters are pool-wide and may not share a slice with devices."""
    from otel_dra.testbed.build import kubernetes_release, version_key

    return version_key(kubernetes_release().minor) >= (1, 35)


def shaped_for_testbed(obj: dict[str, Any]) -> list[dict[str, Any]]:
    """An object written in Kubernetes 1.34's shapes, as the testbed's minor accepts it.

    Since 1.35 "only one of sharedCounters or devices" may be set in a slice: a slice with both
    becomes a counters slice ``<name>-counters`` and its devices' slice, one more slice of the same
    pool. DeviceTaintRules are created in the API version that minor serves."""
    from otel_dra.testbed.controlplane import release_settings

    if obj["kind"] == "DeviceTaintRule":
        return [{**obj, "apiVersion": release_settings().served_taint_rule_api}]
    spec = obj.get("spec") or {}
    if obj["kind"] != "ResourceSlice" or not pool_wide_counters() or not spec.get("sharedCounters"):
        return [obj]
    pool = {**spec["pool"], "resourceSliceCount": spec["pool"]["resourceSliceCount"] + 1}
    devices = {k: v for k, v in spec.items() if k != "sharedCounters"}
    counters = {k: v for k, v in spec.items() if k != "devices"}
    name = obj["metadata"]["name"]
    return [
        {**obj, "metadata": {**obj["metadata"], "name": f"{name}-counters"}, "spec": {**counters, "pool": pool}},
        {**obj, "spec": {**devices, "pool": pool}},
    ]


def check_golden(path: Path, got: str) -> None:
    """Compare ``got`` with the golden file ``path``; with UPDATE_GOLDEN=1 (``make golden``) write it
    instead. A regenerated file is only right once its diff has been read line by line."""
    if os.environ.get("UPDATE_GOLDEN") == "1":
        path.write_text(got)
    assert got == path.read_text(), (
        f"{path} differs from this run's exposition. If the change is intended, regenerate the golden "
        "files with `make golden` (UPDATE_GOLDEN=1) and review `git diff tests/golden` before committing."
    )


def http_get(url: str, headers: dict[str, str] | None = None, timeout: float = 10) -> tuple[int, bytes]:
    req = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def scrape(port: int, headers: dict[str, str] | None = None) -> tuple[int, str]:
    code, body = http_get(f"http://127.0.0.1:{port}/metrics", headers)
    return code, body.decode()


def wait_until(predicate: Callable[[], Any], timeout: float = 30.0, interval: float = 0.1, what: str = "") -> Any:
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what or predicate}; last value: {last!r}")


_SAMPLE = re.compile(r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?P<labels>.*)\})? (?P<value>\S+)$")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def parse_samples(text: str) -> list[tuple[str, dict[str, str], float]]:
    out = []
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        assert m, f"unparseable exposition line: {line!r}"
        labels = dict(_LABEL.findall(m["labels"] or ""))
        out.append((m["name"], labels, float(m["value"])))
    return out


def namespace_series(port: int, family: str, namespace: str) -> dict[tuple[tuple[str, str], ...], float]:
    """The exporter's series of ``family`` in ``namespace`` now: sorted labels -> value."""
    code, text = scrape(port)
    assert code == 200, text
    return {
        tuple(sorted(labels.items())): value
        for name, labels, value in parse_samples(text)
        if name == family and labels.get("namespace") == namespace
    }


def family_block(text: str, name: str) -> str:
    """The HELP/TYPE lines and samples of one family, as served."""
    lines = text.splitlines()
    out = [line for line in lines if line.startswith((f"# HELP {name} ", f"# TYPE {name} ", f"# UNIT {name} "))]
    out += [line for line in lines if line.startswith((name + "{", name + " "))]
    return "\n".join(out) + "\n"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def free_ports(count: int) -> int:
    """A port p such that p … p+count-1 are all free now (for commands taking a base port).

    The run is taken below the kernel's ephemeral range: ports there are handed out to every
    outgoing connection and every port-0 listener of the testbed, so a run checked free there can
    be taken again before the command binds it (a demo plugin once failed so with EADDRINUSE)."""
    low = _ephemeral_low()
    while True:
        base = random.randrange(max(1024, low - 12000), low - count)
        if all(_bindable(base + i) for i in range(count)):
            return base


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def ready_node(client: Any, name: str) -> None:
    """Create a Node and report it Ready with room for pods: there is no kubelet to do it, and the
    scheduler only binds pods to Ready nodes (the kubelet emulator's own helper)."""
    from otel_dra.kubeletsim.nodes import ensure_node

    ensure_node(client, name)


def declare_node_features(client: Any, name: str, *features: str) -> None:
    """Report node features as a kubelet that has them does (status.declaredFeatures, Kubernetes
    1.35+): kube-scheduler places a claim whose devices skip node operations only on a node that
    declares DRAOptionalNodeOperations."""
    body = {"status": {"declaredFeatures": list(features)}}
    client.send_json("PATCH", f"/api/v1/nodes/{name}/status", body, "application/merge-patch+json")


def claim_pod(name: str, namespace: str, claim: str, node: str | None = None) -> dict[str, Any]:
    """A Pod that uses an existing ResourceClaim (pinned to ``node`` through the scheduler, when given)."""
    spec: dict[str, Any] = {
        "containers": [
            {"name": "c", "image": "registry.k8s.io/pause:3.10", "resources": {"claims": [{"name": "dev"}]}}
        ],
        "resourceClaims": [{"name": "dev", "resourceClaimName": claim}],
    }
    if node is not None:
        spec["nodeSelector"] = {"kubernetes.io/hostname": node}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": namespace}, "spec": spec}


def node_slice(name: str, driver: str, node: str, count: int = 1, **spec: Any) -> dict[str, Any]:
    """A ResourceSlice of ``driver`` on ``node``, in the pool named after the node (generation 1, of
    ``count`` slices); ``spec`` adds devices, sharedCounters and the like."""
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": name},
        "spec": {
            "driver": driver,
            "nodeName": node,
            "pool": {"name": node, "generation": 1, "resourceSliceCount": count},
            **spec,
        },
    }


def driver_class(driver: str) -> dict[str, Any]:
    """A DeviceClass named after ``driver`` that selects every device of that driver."""
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "DeviceClass",
        "metadata": {"name": driver},
        "spec": {"selectors": [{"cel": {"expression": f"device.driver == '{driver}'"}}]},
    }


def device_claim(name: str, namespace: str, device_class: str, selector: str | None = None) -> dict[str, Any]:
    """A ResourceClaim for one device of ``device_class`` (matching the CEL ``selector``, if given)."""
    exactly: dict[str, Any] = {"deviceClassName": device_class}
    if selector:
        exactly["selectors"] = [{"cel": {"expression": selector}}]
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"devices": {"requests": [{"name": "dev", "exactly": exactly}]}},
    }


def pod_scheduled(client: Any, namespace: str, name: str) -> bool | None:
    """True once the pod is bound, False once the scheduler says it cannot place it, else None."""
    pod = client.get_json(f"/api/v1/namespaces/{namespace}/pods/{name}")
    if pod["spec"].get("nodeName"):
        return True
    for condition in (pod.get("status") or {}).get("conditions") or []:
        if condition.get("type") == "PodScheduled" and condition.get("reason") == "Unschedulable":
            return False
    return None


def place(client: Any, namespace: str, name: str, node: str, device_class: str, selector: str | None = None) -> bool:
    """Create a claim for one device and a pod on ``node`` using it (both called ``name``); whether
    the real scheduler placed the pod."""
    from otel_dra.fixtures import create

    create(client, device_claim(name, namespace, device_class, selector))
    create(client, claim_pod(name, namespace, name, node=node))
    return scheduler_placed(client, namespace, name)


def scheduler_placed(client: Any, namespace: str, name: str) -> bool:
    """Wait for the real scheduler's decision on pod ``name``: whether it placed it."""
    placed = wait_until(
        lambda: (lambda r: None if r is None else ("yes" if r else "no"))(pod_scheduled(client, namespace, name)),
        timeout=60,
        what=f"the scheduler to decide on pod {name}",
    )
    return bool(placed == "yes")


def state_family_objects() -> list[Any]:
    """Every cluster-state family beyond the seed (otel_dra.cluster.families.Family)."""
    from otel_dra.cluster import deviceclass, devicetaintrule, joined_families, resourceclaim, resourceslice

    return [
        *resourceclaim.STATE_FAMILIES,
        *resourceslice.STATE_FAMILIES,
        *deviceclass.STATE_FAMILIES,
        *devicetaintrule.STATE_FAMILIES,
        *joined_families.ALL_FAMILIES,
    ]


def state_families() -> dict[str, str]:
    """Prometheus name -> OTel instrument name of every cluster-state family beyond the seed."""
    return {f.prom_name: f.gauge.name for f in state_family_objects()}


def rbac_kubeconfig(testbed: Any, name: str, verbs: str, namespace: str = "rbac-test") -> str:
    """A kubeconfig for a new ServiceAccount ``namespace/name`` whose ClusterRole grants ``verbs``
    (a YAML list) on the three resources the exporter needs, and nothing else."""
    manifest = f"""
apiVersion: v1
kind: Namespace
metadata: {{name: {namespace}}}
---
apiVersion: v1
kind: ServiceAccount
metadata: {{name: {name}, namespace: {namespace}}}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRole
metadata: {{name: {name}}}
rules:
- apiGroups: [resource.k8s.io]
  resources: [resourceclaims, resourceslices, deviceclasses]
  verbs: {verbs}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata: {{name: {name}}}
roleRef: {{apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: {name}}}
subjects:
- {{kind: ServiceAccount, name: {name}, namespace: {namespace}}}
"""
    testbed.kubectl("apply", "-f", "-", input=manifest)
    token = testbed.mint_token(namespace, name)
    return str(testbed.write_kubeconfig(testbed.dir / f"{name}.kubeconfig", token))


def exporter_starter(**defaults: Any) -> Iterator[Callable[..., Any]]:
    """For a fixture: ``start(kubeconfig, **options)`` runs an in-process exporter (on a free
    loopback port, ``defaults`` under the options) and every one started is stopped afterwards."""
    from otel_dra.cli.exporter import ExporterApp, start_exporter

    apps: list[ExporterApp] = []

    def start(kubeconfig: str, **kwargs: Any) -> ExporterApp:
        kwargs = {"address": "127.0.0.1", "port": 0, **defaults, **kwargs}
        app = start_exporter(kubeconfig=kubeconfig, **kwargs)
        apps.append(app)
        return app

    yield start
    for app in apps:
        app.stop()


# The process_* families of client_python's (and client_golang's) process collector, as scraped.
PROCESS_FAMILIES = {
    "process_cpu_seconds_total": ("counter", "Total user and system CPU time spent in seconds."),
    "process_resident_memory_bytes": ("gauge", "Resident memory size in bytes."),
    "process_virtual_memory_bytes": ("gauge", "Virtual memory size in bytes."),
    "process_open_fds": ("gauge", "Number of open file descriptors."),
    "process_max_fds": ("gauge", "Maximum number of open file descriptors."),
    "process_start_time_seconds": ("gauge", "Start time of the process since unix epoch in seconds."),
}


def proc_cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def check_process_metrics(scrape_text: Callable[[], str], pid: int) -> dict[str, float]:
    """Scrape once and check the process_* families against /proc/<pid>: HELP and TYPE exactly,
    values plausible (read from /proc around the scrape). Returns the values."""
    cpu_before = proc_cpu_seconds(pid)
    text = scrape_text()
    cpu_after = proc_cpu_seconds(pid)
    values = {n: v for n, labels, v in parse_samples(text) if n in PROCESS_FAMILIES and not labels}
    assert set(values) == set(PROCESS_FAMILIES), sorted(values)
    for name, (kind, help_text) in PROCESS_FAMILIES.items():
        assert f"# HELP {name} {help_text}\n# TYPE {name} {kind}\n{name} " in text, name
    # CPU: ticks of 1/CLK_TCK s, read at the scrape, between what /proc said before and after it.
    assert cpu_before - 0.011 <= values["process_cpu_seconds_total"] <= cpu_after + 0.011
    pagesize = os.sysconf("SC_PAGE_SIZE")
    size, resident = (int(x) * pagesize for x in Path(f"/proc/{pid}/statm").read_text().split()[:2])
    assert abs(values["process_resident_memory_bytes"] - resident) <= max(0.25 * resident, 8 << 20)
    assert abs(values["process_virtual_memory_bytes"] - size) <= max(0.1 * size, 32 << 20)
    # The scrape itself holds a connection or two while it is answered.
    assert abs(values["process_open_fds"] - len(os.listdir(f"/proc/{pid}/fd"))) <= 4
    limits = Path(f"/proc/{pid}/limits").read_text().splitlines()
    [soft] = [line.split()[3] for line in limits if line.startswith("Max open files")]
    assert values["process_max_fds"] == float(soft)
    btime = next(
        int(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines() if line.startswith("btime")
    )
    start_ticks = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    started = btime + start_ticks / os.sysconf("SC_CLK_TCK")
    assert abs(values["process_start_time_seconds"] - started) < 0.02
    assert started <= time.time()
    return values
