"""``otel-dra kubelet-sim`` as a command: creates Ready Nodes, stops cleanly, rejects bad flags."""

from __future__ import annotations

import secrets
import signal
import subprocess
import sys

from otel_dra.kube.client import KubeClient, load_credentials
from tests.helpers import wait_until


def test_kubelet_sim_command_reports_nodes_ready(testbed, tmp_path):
    node = f"cli-node-{secrets.token_hex(3)}"
    client = KubeClient(load_credentials(str(testbed.kubeconfig)))
    proc = subprocess.Popen(
        [
            sys.executable, "-m", "otel_dra", "kubelet-sim", "--kubeconfig", str(testbed.kubeconfig),
            "--node", f"{node}={tmp_path / 'registry'}",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )  # fmt: skip
    try:

        def ready() -> bool:
            try:
                obj = client.get_json(f"/api/v1/nodes/{node}")
            except Exception:
                return False
            conditions = {c["type"]: c["status"] for c in obj.get("status", {}).get("conditions", [])}
            return conditions.get("Ready") == "True" and obj["status"]["allocatable"]["pods"] == "110"

        wait_until(ready, 30, what="Node created and Ready")
        assert (tmp_path / "registry").is_dir()  # created for plugins to register in
    finally:
        proc.send_signal(signal.SIGTERM)
        output, _ = proc.communicate(timeout=30)
        client.request("DELETE", f"/api/v1/nodes/{node}")
    assert proc.returncode == 0, output
    assert "Traceback" not in output


def test_kubelet_sim_rejects_bad_flags():
    for argv, message in (
        (["--node", "a/b"], "expected NAME or NAME=REGISTRY_DIR"),
        (["--node", "x", "--node", "x"], "a node was given twice"),
        ([], "--node"),
    ):
        proc = subprocess.run(
            [sys.executable, "-m", "otel_dra", "kubelet-sim", *argv], capture_output=True, text=True, timeout=60
        )
        assert proc.returncode == 2, (argv, proc.stderr)
        assert message in proc.stderr, (argv, proc.stderr)
