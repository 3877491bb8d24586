"""``python -m bench.plugin --kubelet real``: the example kubelet plugin driven by a real kubelet
(the testbed's Kubernetes version, OTEL_DRA_KUBERNETES_VERSION) + containerd 2.x node (issue 12
item 6), side by side with the upstream Go example driver.

A testbed control plane with one real node (``otel_dra.testbed.node``; the node lock
``/tmp/otel-dra-node.flock`` is taken first, the node always goes down at the end). Three driver
variants, in alternated back-to-back rounds so that each sees the same drift of the machine:

- ``off``: ``otel-dra plugin`` without an OTLP endpoint (nothing exported);
- ``on``: ``otel-dra plugin`` exporting every span (sampler ``always_on``) over OTLP/HTTP to a
  sink process (``bench.sink``);
- ``held``: as ``on``, but the batch processor's timer and batch size never export while pods
  cycle (``OTEL_BSP_*``), so that ``on`` minus ``held`` is what the timer's exports cost the calls
  they overlap. Trees that export between calls themselves (telemetry/spans.py, from 94d8cab)
  export in ``held`` too: there it is ``on`` with other batch settings;
- ``on-before``: as ``on``, from the tree given by ``--before-source`` (a checkout of an earlier
  commit), so that a change's effect on tracing is a ratio within one run;
- ``go``: the upstream ``dra-example-kubeletplugin`` (sigs.k8s.io/dra-example-driver v0.4.0,
  built from the Go module proxy into the peer cache by
  :func:`otel_dra.testbed.build.build_upstream_driver`; bench only).

Each round starts the variant (state directories emptied, the node's old ResourceSlices deleted),
waits until the kubelet has connected to it and its slices are published, then cycles ``--pods``
busybox pods that take one device each through a ResourceClaimTemplate, ``--parallel`` at a time
(default 1): create, wait until Running, delete, wait until gone (the kubelet unprepares first);
then stops it.

Measured per variant:
- NodePrepareResources / NodeUnprepareResources per call as the kubelet times them: the kubelet's
  ``dra_plugin.go`` logs "Calling ... rpc" and "Done calling ... rpc" at V(4) (raised with
  ``--vmodule=dra_plugin=4`` only), microsecond timestamps, paired by claim UID
  (:func:`kubelet_dra_calls`); their mean is checked against the kubelet's own
  ``dra_grpc_operations_duration_seconds`` sum/count (scraped from its /metrics over loopback,
  before and after each round), whose buckets start at 100 ms and so cannot give per-call times;
- pod create -> Running, p50 / p95 (the pods' phase polled every 50 ms);
- the plugin's resident memory at the end of the round (steady: registered, slices published, a
  round served) and its CPU time for the round (from after the bench's first scrape of the
  driver's /metrics to the last pod gone; before 2026-12-06 that scrape was inside the round);
- start-up CPU: the process's CPU time at the moment the kubelet logs it connected.
"""

from __future__ import annotations

import argparse
import compileall
import contextlib
import fcntl
import json
import os
import random
import re
import shutil
import ssl
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench import write_json
from bench.exporter import free_port, machine, percentile

DRIVER = "gpu.example.com"
NAMESPACE = "default"
NODE = "bench-node"
TEMPLATE = "one-gpu"
DEVICES = 64
NODE_LOCK = Path("/tmp/otel-dra-node.flock")
BENCH_FLAG = Path("/tmp/bench-running")
# Only the DRA client code at V(4): its two lines per call, not the rest of the kubelet's V(4) noise.
KUBELET_VMODULE = "--vmodule=dra_plugin=4"
VARIANTS = ("off", "on", "held", "on-before", "go")
DEFAULT_VARIANTS = ("off", "on", "go")  # held: a diagnosis, asked for by name
TRACED_VARIANTS = ("on", "held", "on-before")  # export every span to the sink

# klog's text header: severity, MMDD, time to the microsecond, thread id, file:line.
_KLOG_CALL = re.compile(
    r"^[IWEF](?P<month>\d\d)(?P<day>\d\d) (?P<h>\d\d):(?P<m>\d\d):(?P<s>\d\d)\.(?P<us>\d{6})\s+\d+ "
    r"dra_plugin\.go:\d+\] \"(?P<phase>Calling|Done calling) "
    r"(?P<method>NodePrepareResources|NodeUnprepareResources?) rpc\""
    r"(?P<rest>.*)$"
)
_UID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


@dataclass(frozen=True)
class DraCall:
    method: str  # NodePrepareResources or NodeUnprepareResources
    claim_uid: str
    seconds: float
    end: float  # seconds since midnight of the kubelet's clock


def _klog_seconds(match: re.Match[str]) -> float:
    return int(match["h"]) * 3600 + int(match["m"]) * 60 + int(match["s"]) + int(match["us"]) / 1e6


def kubelet_dra_calls(text: str) -> list[DraCall]:
    """Per-call durations from the kubelet's DRA client log lines (v1.34 ``dra_plugin.go``).

    The kubelet logs ``"Calling NodePrepareResources rpc" ... request=...`` before the gRPC call
    and ``"Done calling NodePrepareResources rpc" ... response=...`` after it (the unprepare start
    line says ``NodeUnprepareResource``, without the s). Calls run concurrently, so a start is
    paired with the end that names the same claim UID in its request/response; a line without a
    UID (an error answer) pairs with the oldest open call of its method. A start without an end
    (the log cut mid-call) is dropped. Raises ValueError on an end without a start: the text does
    not begin before the calls it holds, and a silently shorter list would bias the figures."""
    open_calls: dict[tuple[str, str], list[float]] = {}
    calls: list[DraCall] = []
    for line in text.splitlines():
        match = _KLOG_CALL.match(line)
        if not match:
            continue
        method = match["method"] if match["method"].endswith("s") else match["method"] + "s"
        at = _klog_seconds(match)
        rest = match["rest"]
        key_at = rest.find("request=" if match["phase"] == "Calling" else "response=")
        uid_match = _UID.search(rest, key_at if key_at >= 0 else 0)
        uid = uid_match.group(0) if uid_match else ""
        if match["phase"] == "Calling":
            open_calls.setdefault((method, uid), []).append(at)
            continue
        starts = open_calls.get((method, uid))
        if not starts and not uid:
            # An answer without a claim UID: the oldest open call of the method.
            pending = [(times[0], key) for key, times in open_calls.items() if key[0] == method and times]
            if pending:
                starts = open_calls[min(pending)[1]]
        if not starts:
            raise ValueError(f"kubelet log: {method} ended without a start: {line[:200]}")
        start = starts.pop(0)
        if at < start:  # past midnight
            at += 86400
        calls.append(DraCall(method, uid, at - start, at))
    return calls


def histogram_sums(text: str, family: str, **labels: str) -> tuple[float, float]:
    """Sum and count of the series of a Prometheus histogram ``family`` whose labels include
    ``labels`` (summed over the rest), from a text exposition."""
    wanted = {f'{k}="{v}"' for k, v in labels.items()}
    totals = {"sum": 0.0, "count": 0.0}
    pattern = re.compile(rf"^{re.escape(family)}_(sum|count)(?:\{{(.*)\}})? (\S+)$")
    for line in text.splitlines():
        match = pattern.match(line)
        if match and wanted <= set(re.findall(r'\w+="[^"]*"', match.group(2) or "")):
            totals[match.group(1)] += float(match.group(3))
    return totals["sum"], totals["count"]


def driver_histograms(port: int) -> dict[str, tuple[float, float]] | None:
    """Sum and count of the driver's prepare histogram (its work after reading the claim) and of
    its API GETs (the claim reads; rest_client_request_duration_seconds, as client-go), from its
    /metrics; None when it serves none."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
            text = resp.read().decode()
    except OSError:
        return None
    return {
        "prepare_claim": histogram_sums(text, "dra_example_driver_prepare_claim_duration_seconds"),
        "claim_get": histogram_sums(text, "rest_client_request_duration_seconds", verb="GET"),
    }


# --- processes and the node ----------------------------------------------------------------------


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for {pid}")


@contextlib.contextmanager
def node_lock() -> Iterator[None]:
    """The machine's one-node lock (as ``flock /tmp/otel-dra-node.flock`` takes it)."""
    with NODE_LOCK.open("a") as lock:
        print(f"waiting for {NODE_LOCK} ...", file=sys.stderr, flush=True)
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


@contextlib.contextmanager
def measuring() -> Iterator[None]:
    """Hold /tmp/bench-running while timing (the other engineers hold heavy work meanwhile)."""
    BENCH_FLAG.write_text(f"bench.plugin --kubelet real, pid {os.getpid()}\n")
    try:
        yield
    finally:
        BENCH_FLAG.unlink(missing_ok=True)


def kubelet_metrics(node_dir: Path, port: int) -> str:
    """The kubelet's /metrics over loopback, with the node's own client certificate (the kubelet
    trusts the testbed CA; its serving certificate is self-signed, so it is not verified)."""
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    context.load_cert_chain(node_dir / "pki" / "node.crt", node_dir / "pki" / "node.key")
    with urllib.request.urlopen(f"https://127.0.0.1:{port}/metrics", context=context, timeout=30) as resp:
        return str(resp.read().decode())


def _grpc(text: str, method: str) -> tuple[float, float]:
    return histogram_sums(
        text,
        "dra_grpc_operations_duration_seconds",
        driver_name=DRIVER,
        method_name=f"/k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/{method}",
    )


def _pod(name: str) -> dict[str, Any]:
    from otel_dra.testbed.images import BUSYBOX_IMAGE

    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": NAMESPACE},
        "spec": {
            "terminationGracePeriodSeconds": 1,
            "containers": [
                {
                    "name": "work",
                    "image": BUSYBOX_IMAGE,
                    "imagePullPolicy": "Never",
                    # PID 1 needs a TERM handler, or deletion waits out the grace period.
                    "command": ["/bin/sh", "-c", "trap 'exit 0' TERM; while :; do sleep 3600 & wait $!; done"],
                    "resources": {"claims": [{"name": "gpu"}]},
                }
            ],
            "resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": TEMPLATE}],
        },
    }


def _wait(what: str, predicate: Any, timeout: float, interval: float = 0.05) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(interval)


class Bench:
    def __init__(
        self, testbed: Any, node: Any, upstream: Path, sink_port: int, work: Path, source: Path, python: str
    ) -> None:
        from otel_dra.kube.client import KubeClient, load_credentials

        self.testbed, self.node, self.upstream, self.sink_port, self.work = testbed, node, upstream, sink_port, work
        self.source, self.python = source, python
        self.before_source: Path | None = None
        self.client = KubeClient(load_credentials(str(testbed.kubeconfig)))
        self.kubeconfig = json_kubeconfig(Path(testbed.kubeconfig), work / "plugin-kubeconfig.json")
        self.kubelet_port = int(testbed.nodes[node.name]["ports"]["kubelet"])
        self.next_pod = 0

    def _argv(self, variant: str, metrics_port: int) -> tuple[list[str], dict[str, str]]:
        node = self.node
        common = [
            f"--node-name={node.name}",
            f"--kubeconfig={self.kubeconfig}",
            f"--cdi-root={node.cdi_dir}",
            f"--kubelet-plugins-directory-path={node.plugins_dir}",
            f"--kubelet-registrar-directory-path={node.registry_dir}",
            f"--num-devices={DEVICES}",
            f"--metrics-port={metrics_port}",
        ]
        env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
        if variant == "go":
            return [str(self.upstream), *common], env
        env["PYTHONPATH"] = str(self._source(variant))
        if variant in TRACED_VARIANTS:
            env["OTEL_EXPORTER_OTLP_PROTOCOL"] = "http/protobuf"
            env["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"] = f"http://127.0.0.1:{self.sink_port}/v1/traces"
            env["OTEL_TRACES_SAMPLER"] = "always_on"
            env["OTEL_SERVICE_NAME"] = "otel-dra-plugin"
        if variant == "held":  # far more than a round's spans, and no timer within a round
            env["OTEL_BSP_SCHEDULE_DELAY"] = str(3_600_000)
            env["OTEL_BSP_MAX_QUEUE_SIZE"] = env["OTEL_BSP_MAX_EXPORT_BATCH_SIZE"] = str(1_000_000)
        return [self.python, "-m", "otel_dra", "plugin", *common], env

    def _source(self, variant: str) -> Path:
        if variant != "on-before":
            return self.source
        if self.before_source is None:
            raise ValueError("variant on-before needs --before-source")
        return self.before_source

    def _clean(self) -> None:
        """Each variant starts from empty state: no checkpoint or CDI spec of another driver's
        format, none of its ResourceSlices."""
        shutil.rmtree(self.node.plugins_dir / DRIVER, ignore_errors=True)
        for spec in self.node.cdi_dir.glob("*"):
            spec.unlink()
        path = f"/apis/resource.k8s.io/v1/resourceslices?fieldSelector=spec.nodeName={self.node.name}"
        self.client.request("DELETE", path)
        _wait("old slices gone", lambda: not self._devices(), 30)

    def _devices(self) -> int:
        path = f"/apis/resource.k8s.io/v1/resourceslices?fieldSelector=spec.nodeName={self.node.name}"
        slices = self.client.get_json(path)
        return sum(len(s["spec"].get("devices") or []) for s in slices["items"] if s["spec"].get("driver") == DRIVER)

    def _pods(self) -> dict[str, str]:
        items = self.client.get_json(f"/api/v1/namespaces/{NAMESPACE}/pods")["items"]
        return {p["metadata"]["name"]: (p.get("status") or {}).get("phase", "Pending") for p in items}

    def round(self, variant: str, pods: int, parallel: int) -> dict[str, Any]:
        self._clean()
        log = self.node.kubelet_log
        offset = log.stat().st_size
        before = kubelet_metrics(self.node.layout.dir, self.kubelet_port)
        metrics_port = free_port()
        argv, env = self._argv(variant, metrics_port)
        exports_before = self._sink_requests() if variant in TRACED_VARIANTS else 0
        out = (self.work / f"{variant}.log").open("ab")
        started = time.monotonic()
        # cwd: `python -m` puts the working directory first on sys.path, ahead of PYTHONPATH.
        cwd = self._source(variant) if variant != "go" else self.work
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=cwd, start_new_session=True)
        try:
            connected = re.compile(rf'"Connection changed" .*driverName="{re.escape(DRIVER)}" .*connected=true')
            startup_cpu = 0.0

            def registered() -> bool:
                nonlocal startup_cpu
                if proc.poll() is not None:
                    raise RuntimeError(f"{variant} driver exited {proc.returncode}: see {out.name}")
                cpu = cpu_seconds(proc.pid)  # read before the log: never later than the registration
                with log.open("rb") as f:
                    f.seek(offset)
                    if connected.search(f.read().decode(errors="replace")):
                        startup_cpu = cpu
                        return True
                return False

            _wait(f"{variant}: the kubelet to connect", registered, 60, interval=0.01)
            registered_s = time.monotonic() - started
            _wait(f"{variant}: {DEVICES} devices published", lambda: self._devices() == DEVICES, 60)
            own_before = driver_histograms(metrics_port)  # after start-up's own requests
            # After that scrape: a round's CPU is its prepares and unprepares (and what runs
            # meanwhile), not the bench's own reading of the driver's /metrics.
            cpu_before = cpu_seconds(proc.pid)
            names = [f"bench-{self.next_pod + i}" for i in range(pods)]
            created: dict[str, float] = {}
            running: dict[str, float] = {}
            # Waves of `parallel` pods: created together, all Running, deleted together, all gone.
            for first in range(0, pods, parallel):
                wave = names[first : first + parallel]
                for name in wave:
                    self.client.send_json("POST", f"/api/v1/namespaces/{NAMESPACE}/pods", _pod(name))
                    created[name] = time.monotonic()

                def all_running(wave: list[str] = wave) -> bool:
                    now = time.monotonic()
                    for name, phase in self._pods().items():
                        if phase == "Running" and name in created:
                            running.setdefault(name, now)
                        if phase == "Failed":
                            raise RuntimeError(f"pod {name} failed")
                    return all(name in running for name in wave)

                _wait(f"{variant}: {len(wave)} pods Running", all_running, 180)
                for name in wave:
                    self.client.request("DELETE", f"/api/v1/namespaces/{NAMESPACE}/pods/{name}")
                _wait(f"{variant}: pods gone", lambda: not self._pods(), 180)
            self.next_pod += pods
            cpu_round = cpu_seconds(proc.pid) - cpu_before
            rss = rss_mib(proc.pid)
            own_after = driver_histograms(metrics_port)
            own = (
                {k: (own_after[k][0] - own_before[k][0], own_after[k][1] - own_before[k][1]) for k in own_after}
                if own_before and own_after
                else None
            )
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            out.close()
        after = kubelet_metrics(self.node.layout.dir, self.kubelet_port)
        spans: dict[str, list[float]] = {}
        exports = 0
        if variant in TRACED_VARIANTS:  # stopped: the last spans are flushed
            with urllib.request.urlopen(f"http://127.0.0.1:{self.sink_port}/spans", timeout=10) as resp:
                spans = json.loads(resp.read())
            exports = self._sink_requests() - exports_before
        with log.open("rb") as f:
            f.seek(offset)
            calls = kubelet_dra_calls(f.read().decode(errors="replace"))
        histogram = {}
        for method in ("NodePrepareResources", "NodeUnprepareResources"):
            (s0, c0), (s1, c1) = _grpc(before, method), _grpc(after, method)
            histogram[method] = {"sum": s1 - s0, "count": c1 - c0}
        return {
            "prepare_s": [c.seconds for c in calls if c.method == "NodePrepareResources"],
            "unprepare_s": [c.seconds for c in calls if c.method == "NodeUnprepareResources"],
            "histogram": histogram,
            "running_s": [running[n] - created[n] for n in names],
            "rss_mib": rss,
            "cpu_s": cpu_round,
            "startup_cpu_s": startup_cpu,
            "registered_s": registered_s,
            "spans": spans,
            "exports": exports,  # OTLP requests from start to stop (the stop's flush included)
            "own": own,
        }

    def _sink_requests(self) -> int:
        """How many OTLP requests the sink has answered so far."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.sink_port}/windows", timeout=10) as resp:
            return len(json.loads(resp.read()))


def ratio_ci95(a: list[float], b: list[float], resamples: int = 2000) -> list[float]:
    """A 95 % bootstrap interval of mean(a) / mean(b) - 1 (calls resampled with replacement): how
    far a difference of means between two variants can be told from the calls' own spread."""
    rng = random.Random(12)  # fixed: the same calls give the same interval
    ratios = sorted(
        statistics.fmean(rng.choices(a, k=len(a))) / statistics.fmean(rng.choices(b, k=len(b))) - 1
        for _ in range(resamples)
    )
    return [round(ratios[int(0.025 * resamples)], 3), round(ratios[int(0.975 * resamples) - 1], 3)]


def summarize(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    ms = lambda v: round(v * 1000, 2)  # noqa: E731
    out: dict[str, Any] = {}
    for op, method in (("prepare", "NodePrepareResources"), ("unprepare", "NodeUnprepareResources")):
        values = [x for r in rounds for x in r[f"{op}_s"]]
        h_sum = sum(r["histogram"][method]["sum"] for r in rounds)
        h_count = sum(r["histogram"][method]["count"] for r in rounds)
        out[f"{op}_calls"] = len(values)
        out[f"{op}_mean_ms"] = ms(statistics.fmean(values))
        out[f"{op}_p50_ms"] = ms(statistics.median(values))
        out[f"{op}_p99_ms"] = ms(percentile(values, 0.99))
        out[f"{op}_histogram_count"] = int(h_count)
        out[f"{op}_histogram_mean_ms"] = ms(h_sum / h_count) if h_count else None
    running = [x for r in rounds for x in r["running_s"]]
    out["pod_running_p50_s"] = round(statistics.median(running), 3)
    out["pod_running_p95_s"] = round(percentile(running, 0.95), 3)
    out["rss_mib"] = round(statistics.median(r["rss_mib"] for r in rounds), 1)
    out["cpu_s_per_round"] = round(statistics.median(r["cpu_s"] for r in rounds), 3)
    out["startup_cpu_s"] = round(statistics.median(r["startup_cpu_s"] for r in rounds), 3)
    out["startup_cpu_s_rounds"] = [r["startup_cpu_s"] for r in rounds]  # clock ticks: 10 ms steps
    out["registered_after_s"] = round(statistics.median(r["registered_s"] for r in rounds), 2)
    # The driver's own histograms (same names in ours and upstream's): where a prepare's time goes
    # without spans, so that tracing off and on can be compared part by part.
    for part in ("prepare_claim", "claim_get"):
        pairs = [r["own"][part] for r in rounds if r.get("own")]
        count = sum(c for _, c in pairs)
        out[f"{part}_mean_ms"] = ms(sum(s for s, _ in pairs) / count) if count else None
    spans: dict[str, list[float]] = {}
    for r in rounds:
        for name, seconds in r.get("spans", {}).items():
            spans.setdefault(name, []).extend(seconds)
    if any(r.get("exports") for r in rounds):
        out["exports_per_round"] = statistics.median(r.get("exports", 0) for r in rounds)
    if spans:
        # Where the time goes inside the plugin (tracing on): mean per span name.
        out["span_mean_ms"] = {name: ms(statistics.fmean(v)) for name, v in sorted(spans.items())}
        out["span_count"] = {name: len(v) for name, v in sorted(spans.items())}
    return out


RATIO_KEYS = (
    "prepare_mean_ms",
    "prepare_p50_ms",
    "prepare_p99_ms",
    "unprepare_mean_ms",
    "pod_running_p50_s",
    "pod_running_p95_s",
    "rss_mib",
    "cpu_s_per_round",
    "startup_cpu_s",
)


def json_kubeconfig(kubeconfig: Path, out: Path) -> Path:
    """The testbed's kubeconfig rewritten as JSON (valid YAML, what ``kubectl config view -o json``
    writes), for the drivers: the plugin reads a JSON kubeconfig without importing yaml (a tenth
    of its start-up), as it reads a pod's service account, which is how it runs on a cluster. The
    Go driver reads either the same."""
    import yaml

    out.write_text(json.dumps(yaml.safe_load(kubeconfig.read_text())))
    out.chmod(0o600)  # it holds the testbed's client key
    return out


def precompile(source: Path) -> int:
    """Byte-compile ``source``'s otel_dra package in place (``__pycache__``, as the plugin's
    interpreter looks them up) and return how many modules it holds.

    The image's ``pip install`` byte-compiles the package; a source tree run with
    ``PYTHONDONTWRITEBYTECODE=1`` in the environment (as where these benchmarks ran; the plugin
    inherits it) would instead compile every module from source at every start: about 0.1 s of
    the start-up CPU measured here before this (issue 12), which no installed plugin pays."""
    package = source / "otel_dra"
    if not compileall.compile_dir(str(package), quiet=1):
        raise RuntimeError(f"cannot byte-compile {package}")
    return sum(1 for _ in package.rglob("*.py"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.plugin --kubelet real", description=__doc__)
    parser.add_argument("--rounds", type=int, default=3, help="rounds per variant (after one warm-up of each)")
    parser.add_argument("--pods", type=int, default=10, help="pods per round")
    parser.add_argument(
        "--parallel",
        type=int,
        default=1,
        help="pods in flight at once (default 1: each pod created, Running, deleted and gone before "
        "the next, so that each call times the driver's path rather than the machine's queue "
        "behind 12 sandboxes starting on 2 cores)",
    )
    parser.add_argument("--variants", default=",".join(DEFAULT_VARIANTS), help=f"of {','.join(VARIANTS)}")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--keep", type=Path, default=None, help="copy the kubelet and driver logs here")
    parser.add_argument(
        "--before-source",
        type=Path,
        default=None,
        help="the tree of variant on-before (e.g. `git worktree add /tmp/before <commit>`)",
    )
    parser.add_argument(
        "--plugin-source",
        type=Path,
        default=Path(__file__).resolve().parents[1],
        help="the source tree whose otel_dra the plugin variants run (default: this one; another "
        "commit's `git archive` to compare before/after on the same machine state)",
    )
    parser.add_argument(
        "--plugin-python",
        default=sys.executable,
        help="the interpreter the plugin variants run (default: this one). The dev environment's "
        "editable install puts a finder in site that every start runs (about 50 M instructions); a "
        "venv with `pip install .` starts as the image does",
    )
    args = parser.parse_args(argv)
    variants = [v for v in args.variants.split(",") if v]
    if not set(variants) <= set(VARIANTS):
        parser.error(f"--variants: of {','.join(VARIANTS)}")
    if ("on-before" in variants) != (args.before_source is not None):
        parser.error("--before-source and variant on-before go together")

    from otel_dra.fixtures import create
    from otel_dra.testbed import find_binaries, running
    from otel_dra.testbed.build import (
        CONTAINERD_VERSION,
        UPSTREAM_DRIVER_VERSION,
        build_upstream_driver,
        kubernetes_release,
    )
    from otel_dra.testbed.node import host_support, start_node

    problems = host_support().problems
    if problems:
        print("this machine cannot run a testbed node: " + "; ".join(problems), file=sys.stderr)
        return 2
    upstream = build_upstream_driver() if "go" in variants else Path("/nonexistent")
    if set(variants) - {"go"}:
        precompile(args.plugin_source.resolve())
    if args.before_source is not None:
        precompile(args.before_source.resolve())
    sink_port = free_port()
    sink = subprocess.Popen([sys.executable, "-m", "bench.sink", str(sink_port)], stdout=subprocess.PIPE, text=True)
    rounds: dict[str, list[dict[str, Any]]] = {v: [] for v in variants}
    try:
        with (
            node_lock(),
            tempfile.TemporaryDirectory(prefix="otel-dra-bp-", dir="/tmp") as tmp,  # short: unix sockets
            running(Path(tmp) / "tb", scheduler=True, controller_manager=True, binaries=find_binaries()) as testbed,
        ):
            try:
                node = start_node(testbed, NODE, kubelet_flags=[KUBELET_VMODULE])
                bench = Bench(
                    testbed, node, upstream, sink_port, Path(tmp), args.plugin_source.resolve(), args.plugin_python
                )
                if args.before_source is not None:
                    bench.before_source = args.before_source.resolve()
                from otel_dra.cli.demo import demo_objects

                device_class, _, template = demo_objects(DRIVER)
                template["metadata"]["namespace"] = NAMESPACE
                create(bench.client, device_class)
                create(bench.client, template)
                with measuring():
                    for variant in variants:  # warm-up: page cache, .pyc files, first connections
                        bench.round(variant, 2, args.parallel)
                    for r in range(args.rounds):
                        # Rotate the order so no variant always follows the same one.
                        for variant in variants[r % len(variants) :] + variants[: r % len(variants)]:
                            result = bench.round(variant, args.pods, args.parallel)
                            rounds[variant].append(result)
                            print(variant, {k: v for k, v in summarize([result]).items()}, flush=True)
            finally:
                if args.keep:
                    args.keep.mkdir(parents=True, exist_ok=True)
                    for log in Path(tmp).glob("*.log"):
                        shutil.copy(log, args.keep / log.name)
                    with contextlib.suppress(Exception):
                        shutil.copy(node.kubelet_log, args.keep / "kubelet.log")
    finally:
        sink.terminate()
        sink.wait()
    out: dict[str, Any] = {
        "machine": machine(),
        "date": time.strftime("%Y-%m-%d"),
        "kubelet": f"real (testbed node: kubelet {kubernetes_release().version}, containerd {CONTAINERD_VERSION})",
        "upstream": f"sigs.k8s.io/dra-example-driver {UPSTREAM_DRIVER_VERSION} cmd/dra-example-kubeletplugin",
        "pods_per_round": args.pods,
        "pods_in_flight": args.parallel,
        "rounds_per_variant": args.rounds,
        "devices": DEVICES,
        "plugin_source": str(args.plugin_source),
        "before_source": str(args.before_source) if args.before_source else None,
        "plugin_python": args.plugin_python,
        "plugin_kubeconfig": "JSON (read without yaml, as a pod's service account is)",
        "plugin_bytecode": "byte-compiled before the rounds, as pip install does in the image",
    }
    names = {
        "off": "ours_tracing_off",
        "on": "ours_tracing_on",
        "held": "ours_tracing_held",
        "on-before": "before_tracing_on",
        "go": "upstream_go",
    }
    for variant in variants:
        out[names[variant]] = summarize(rounds[variant])
    if "go" in variants:
        go = out["upstream_go"]
        for variant in (v for v in variants if v != "go"):
            ours = out[names[variant]]
            out[f"ratio_{names[variant]}_vs_upstream"] = {
                k: round(ours[k] / go[k], 3) for k in RATIO_KEYS if go.get(k) and ours.get(k) is not None
            }
    overheads = (
        ("on", "tracing_overhead_prepare_mean"),
        ("held", "tracing_held_overhead_prepare_mean"),
        ("on-before", "before_tracing_overhead_prepare_mean"),
    )
    for variant, key in overheads:
        if "off" in variants and variant in variants:
            off, traced = out["ours_tracing_off"], out[names[variant]]
            out[key] = round(traced["prepare_mean_ms"] / off["prepare_mean_ms"] - 1, 3)
            out[f"{key}_ci95"] = ratio_ci95(
                [x for r in rounds[variant] for x in r["prepare_s"]], [x for r in rounds["off"] for x in r["prepare_s"]]
            )
    print(json.dumps(out, indent=2))
    if args.json:
        write_json(args.json, out)
    return 0
