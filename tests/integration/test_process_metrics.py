"""Both binaries, as processes, serve the process_* families about themselves on /metrics."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers import check_process_metrics, free_port, scrape, wait_until

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def processes() -> Iterator[list[subprocess.Popen[bytes]]]:
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for proc in started:
        proc.terminate()
        proc.wait(timeout=30)


def _spawn(processes: list[subprocess.Popen[bytes]], *args: str) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "otel_dra", *args],
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    processes.append(proc)
    return proc


def _scraped(proc: subprocess.Popen[bytes], port: int) -> str:
    def ok() -> str | None:
        assert proc.poll() is None, f"exited with {proc.returncode}"
        try:
            code, text = scrape(port)
        except OSError:
            return None
        return text if code == 200 else None

    text: str = wait_until(ok, timeout=60, what=f"/metrics on port {port}")
    return text


def test_exporter_and_plugin_serve_their_own_process_metrics(testbed, processes):
    port = free_port()
    exporter = _spawn(
        processes, "exporter", f"--kubeconfig={testbed.kubeconfig}", "--address=127.0.0.1", f"--port={port}"
    )
    _scraped(exporter, port)
    values = check_process_metrics(lambda: scrape(port)[1], exporter.pid)
    assert values["process_resident_memory_bytes"] > 10 << 20  # a Python process with its imports

    root = Path(tempfile.mkdtemp(prefix="odpm-", dir="/tmp"))  # short: unix socket paths
    try:
        plugin_port = free_port()
        plugin = _spawn(
            processes,
            "plugin",
            f"--node-name=pm-{uuid.uuid4().hex[:8]}",
            f"--kubeconfig={testbed.kubeconfig}",
            f"--cdi-root={root / 'cdi'}",
            f"--kubelet-plugins-directory-path={root / 'plugins'}",
            f"--kubelet-registrar-directory-path={root / 'registry'}",
            f"--metrics-port={plugin_port}",
            "--remove-slices-on-exit=true",
        )
        _scraped(plugin, plugin_port)
        check_process_metrics(lambda: scrape(plugin_port)[1], plugin.pid)
        plugin.terminate()
        plugin.wait(timeout=30)
    finally:
        shutil.rmtree(root, ignore_errors=True)
