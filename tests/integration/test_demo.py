"""The README's run command: `otel-dra demo` runs the whole DRA path, its counters move, the
exporter's view matches the workload, and Ctrl-C leaves nothing running."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import IO

from otel_dra.kube.client import KubeClient, load_credentials
from otel_dra.testbed import Testbed
from tests.helpers import free_port, free_ports, parse_samples, scrape, wait_until


def _counter(port: int, name: str, result: str) -> float:
    code, text = scrape(port)
    assert code == 200
    return sum(v for n, labels, v in parse_samples(text) if n == name and labels.get("result") == result)


def _processes_under(directory: Path) -> list[int]:
    """PIDs whose command line mentions ``directory`` (the demo's plugins and control plane)."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if str(directory) in cmdline and state != "Z":
            found.append(int(proc.name))
    return found


def _stop(proc: subprocess.Popen[bytes], log: IO[str]) -> str:
    """Ctrl-C the demo, wait for it, and return everything it printed."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
    proc.wait(timeout=90)
    log.seek(0)
    with log:
        return log.read()


def test_demo_runs_the_dra_path_and_cleans_up(testbed_binaries):
    plugin_port = free_ports(2)  # one metrics port per node, from this base
    port = free_port()
    while plugin_port <= port < plugin_port + 2:
        port = free_port()
    # Short: the plugins' unix sockets live under it (107-byte limit).
    directory = Path(tempfile.mkdtemp(prefix="demo-"))
    # Output to a file: a pipe nobody reads while it runs would fill up and block it.
    log = (directory / "command.log").open("w+")
    proc = subprocess.Popen(
        [
            sys.executable, "-m", "otel_dra", "demo", "--dir", str(directory), "--nodes", "2", "--pods", "4",
            "--port", str(port), "--plugin-metrics-port", str(plugin_port),
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        kubeconfig = wait_until(
            lambda: (directory / "testbed" / "kubeconfig").is_file() and directory / "testbed" / "kubeconfig",
            timeout=120,
            what="demo control plane",
        )
        client = KubeClient(load_credentials(str(kubeconfig)))

        def prepared(p: int) -> float:
            try:
                return _counter(p, "dra_example_driver_prepare_claims_total", "success")
            except OSError:
                return 0.0

        # Both nodes' plugins prepare claims, and keep doing so as the workload cycles.
        first = wait_until(lambda: prepared(plugin_port) >= 1 and prepared(plugin_port + 1) >= 1 and
                           prepared(plugin_port) + prepared(plugin_port + 1), 120, what="claims prepared")  # fmt: skip
        wait_until(lambda: prepared(plugin_port) + prepared(plugin_port + 1) >= first + 4, 90, what="counters moving")
        for p in (plugin_port, plugin_port + 1):
            assert _counter(p, "dra_example_driver_prepare_claims_total", "error") == 0

        # The exporter's allocations and reservations match the Running pods the API reports.
        def consistent() -> bool:
            pods = client.get_json("/api/v1/namespaces/demo/pods")["items"]
            running = {
                (s["resourceClaimName"], p["metadata"]["name"])
                for p in pods
                if p["status"].get("phase") == "Running" and not p["metadata"].get("deletionTimestamp")
                for s in p["status"].get("resourceClaimStatuses", [])
            }
            code, text = scrape(port)
            if code != 200:
                return False
            samples = parse_samples(text)
            reserved = {
                (labels["resourceclaim_name"], labels["pod_name"])
                for n, labels, v in samples
                if n == "kube_resourceclaim_status_reserved_for_pod" and labels["namespace"] == "demo"
            }
            allocated = {
                labels["resourceclaim_name"]
                for n, labels, v in samples
                if n == "kube_resourceclaim_status_allocated_device" and labels["driver"] == "gpu.example.com"
            }
            return len(running) == 4 and reserved == running and {c for c, _ in running} <= allocated

        wait_until(consistent, 90, interval=0.5, what="exporter state matching the Running pods")
        pids = list(Testbed.load(directory / "testbed").pids.values())
    except AssertionError as exc:
        output = _stop(proc, log)
        logs = "".join(f"\n--- {p}\n{p.read_text()[-3000:]}" for p in directory.glob("nodes/*/plugin.log"))
        raise AssertionError(f"{exc}\n--- demo output:\n{output[-6000:]}{logs}") from None
    output = _stop(proc, log)
    assert proc.returncode == 0, output
    assert f"curl -s http://127.0.0.1:{port}/metrics" in output
    assert f"curl -s http://127.0.0.1:{plugin_port}/metrics" in output
    assert "Traceback" not in output, output
    assert pids and not _processes_under(directory), json.dumps(_processes_under(directory))
    shutil.rmtree(directory, ignore_errors=True)
