"""The example plugin (its own process) under faults, driven by the kubelet emulator on the real
control plane (kube-scheduler allocates, kube-controller-manager makes the claims): killed with
SIGKILL between prepare and unprepare, a truncated checkpoint, a read-only or full CDI directory.

The real-node half of these faults (a real kubelet and container runtime) is not covered: there
is no real kubelet in the testbed yet.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import parse_samples, scrape, wait_until
from tests.integration.test_kubelet_sim import Cluster
from tests.otlp_receiver import OtlpReceiver


@pytest.fixture
def sim(testbed_sched: Any) -> Iterator[Cluster]:
    # Traces go to the test's OTLP receiver (the Cluster's plugin environment needs one); what is
    # checked here is the plugin's files, metrics and the pods' progress.
    receiver = OtlpReceiver().start()
    root = Path(tempfile.mkdtemp(prefix="kf-"))  # short: unix socket paths are limited to 107 bytes
    cluster = Cluster(testbed_sched, root, receiver)
    try:
        yield cluster
    finally:
        cluster.teardown()
        receiver.stop()
        shutil.rmtree(root, ignore_errors=True)


def _value(cluster: Cluster, name: str, **labels: str) -> float:
    code, text = scrape(cluster.metrics_port)
    assert code == 200
    return sum(v for n, lab, v in parse_samples(text) if n == name and all(lab.get(k) == x for k, x in labels.items()))


def _prepares(cluster: Cluster, result: str) -> float:
    return _value(cluster, "dra_example_driver_prepare_claims_total", result=result)


def _unprepares(cluster: Cluster, result: str) -> float:
    return _value(cluster, "dra_example_driver_unprepare_claims_total", result=result)


def _serving(cluster: Cluster) -> bool:
    try:
        return scrape(cluster.metrics_port)[0] == 200
    except OSError:
        return False


def _dirs(cluster: Cluster) -> tuple[Path, Path]:
    base = cluster.root / cluster.node
    return base / "plugins" / cluster.driver, base / "cdi"


def _checkpoint_uids(cluster: Cluster) -> set[str]:
    plugin_dir, _cdi = _dirs(cluster)
    return set(json.loads((plugin_dir / "checkpoint.json").read_text())["claims"])


def _leftovers(directory: Path) -> list[str]:
    """Temporary files of interrupted atomic writes."""
    return sorted(p.name for p in directory.iterdir() if p.name.endswith(".tmp"))


def _running_pod(cluster: Cluster, name: str) -> str:
    """Create a pod with one GPU claim; return its claim's UID once the pod runs."""
    cluster.create_pod(name)
    pod = wait_until(lambda: cluster.running(name), 60, what=f"pod {name} Running")
    return str(cluster.claim_of(pod)["metadata"]["uid"])


def _delete_pod(cluster: Cluster, name: str, *, wait: bool = True) -> None:
    cluster.client.request("DELETE", f"/api/v1/namespaces/{cluster.namespace}/pods/{name}")
    if wait:
        wait_until(lambda: cluster.pod(name) is None, 60, what=f"pod {name} unprepared and gone")


# --- SIGKILL between prepare and unprepare ----------------------------------------------------------------


def test_plugin_sigkilled_between_prepare_and_unprepare(sim):
    sim.setup()
    uid = _running_pod(sim, "victim")
    plugin_dir, cdi = _dirs(sim)
    assert uid in _checkpoint_uids(sim) and (cdi / f"k8s.{sim.driver}-gpu_{uid}.json").exists()
    assert sim.plugin is not None
    sim.plugin.process.kill()  # SIGKILL: no cleanup of sockets, lock or anything else
    sim.plugin.process.wait(10)
    assert (plugin_dir / "dra.sock").exists()  # left behind, for the next instance to clear

    sim.start_plugin()
    wait_until(lambda: _serving(sim), 30, what="the restarted plugin serving")
    _delete_pod(sim, "victim")  # the emulator unprepares through the new process
    assert _unprepares(sim, "success") == 1 and _unprepares(sim, "error") == 0
    # The spec and the checkpoint entry go just after the answer (plugin/cleanup.py).
    wait_until(lambda: not list(cdi.glob(f"*{uid}*")), 10, what="the claim's CDI spec removed")
    wait_until(lambda: _checkpoint_uids(sim) == set(), 10, what="the checkpoint emptied")
    assert _leftovers(plugin_dir) == [] and _leftovers(cdi) == []
    # The new instance owns the sockets: a pod after the restart is prepared as usual.
    second = _running_pod(sim, "after")
    _delete_pod(sim, "after")
    wait_until(lambda: not list(cdi.glob(f"*{second}*")), 10, what="the second claim's CDI spec removed")


# --- a truncated checkpoint ------------------------------------------------------------------------------------


def test_truncated_checkpoint_fails_each_claim_until_moved_away(sim):
    """No crash loop: the plugin keeps running and registered, every prepare fails with the path
    and the way out, and the emulator keeps retrying; moving the file away (the documented way
    out) lets the retry succeed without a restart, and the claim prepared before the damage is
    still unprepared cleanly."""
    sim.setup()
    before = _running_pod(sim, "before")
    plugin_dir, cdi = _dirs(sim)
    sim.stop_plugin()
    checkpoint = plugin_dir / "checkpoint.json"
    intact = checkpoint.read_bytes()
    checkpoint.write_bytes(intact[: len(intact) // 2])  # a write the disk lost half of

    sim.start_plugin()
    assert sim.plugin is not None
    pid = sim.plugin.process.pid
    wait_until(lambda: _serving(sim), 30, what="the plugin serving despite its checkpoint")
    sim.create_pod("blocked")
    wait_until(lambda: _prepares(sim, "error") >= 2, 60, what="prepare failing and retried")
    assert sim.running("blocked") is None
    time.sleep(1)
    assert sim.plugin.process.poll() is None, "the plugin exited"
    log = sim.plugin.log_path.read_text()
    assert f"checkpoint {checkpoint} is unreadable" in log, log[-2000:]
    assert f"mv {checkpoint} {checkpoint}.broken" in log
    assert checkpoint.read_bytes() == intact[: len(intact) // 2], "the plugin must not rewrite it"

    checkpoint.rename(checkpoint.with_name("checkpoint.json.broken"))  # the way out
    pod = wait_until(lambda: sim.running("blocked"), 60, what="the retried prepare to succeed")
    blocked = str(sim.claim_of(pod)["metadata"]["uid"])
    assert sim.plugin.process.pid == pid and sim.plugin.process.poll() is None  # no restart
    _delete_pod(sim, "before")  # prepared before the damage, unknown to the new checkpoint
    _delete_pod(sim, "blocked")
    for uid in (before, blocked):
        wait_until(lambda u=uid: not list(cdi.glob(f"*{u}*")), 10, what=f"claim {uid}'s CDI spec removed")
    wait_until(lambda: _checkpoint_uids(sim) == set(), 10, what="the checkpoint emptied")
    assert _leftovers(plugin_dir) == []


# --- a read-only or full CDI directory ---------------------------------------------------------------------------


def _userns_works() -> bool:
    return (
        subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "true"], capture_output=True).returncode == 0
    )


@pytest.mark.skipif(not _userns_works(), reason="needs user and mount namespaces (unshare -rm)")
@pytest.mark.parametrize("fault", ["read-only", "full"])
def test_cdi_directory_read_only_or_full_fails_per_claim_and_recovers(sim, fault):
    """The plugin's CDI directory is a small tmpfs of its own (a mount namespace); remounted
    read-only, or filled up, it fails the claims that need a write there, each with the system's
    reason, while the plugin, its other claims and its registration carry on; the emulator's
    retries succeed once the directory is writable again, and no temporary file is left."""
    sim.setup()  # with the plugin as usual, then again on the tmpfs
    sim.stop_plugin()
    _plugin_dir, cdi = _dirs(sim)
    mount = 'mount -t tmpfs -o size=1m otel-dra-cdi "$0" && exec "$@"'
    sim.start_plugin(prefix=["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", mount, str(cdi)])
    assert sim.plugin is not None
    pid = sim.plugin.process.pid
    inside = Path(f"/proc/{pid}/root{cdi}")  # the tmpfs, seen from outside its mount namespace

    def nsenter(*command: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["nsenter", "-t", str(pid), "-U", "-m", "--preserve-credentials", *command], capture_output=True, text=True
        )

    assert "otel-dra-cdi" in nsenter("findmnt", "-n", "-o", "SOURCE", str(cdi)).stdout
    first = _running_pod(sim, "first")
    assert (inside / f"k8s.{sim.driver}-gpu_{first}.json").exists()

    if fault == "read-only":
        assert nsenter("mount", "-o", "remount,ro", str(cdi)).returncode == 0
        reason = "Read-only file system"
    else:
        nsenter("sh", "-c", f"cat /dev/zero > {cdi}/filler")  # ends with "No space left on device"
        reason = "No space left on device"
    sim.create_pod("second")
    wait_until(lambda: _prepares(sim, "error") >= 2, 60, what="prepare failing and retried")
    assert sim.running("second") is None and sim.running("first") is not None
    first_spec = inside / f"k8s.{sim.driver}-gpu_{first}.json"
    if fault == "read-only":
        # The unprepare answers once the devices are free; the spec's removal follows after the
        # answer (plugin/cleanup.py), fails, is counted and logged, and is tried again.
        _delete_pod(sim, "first")
        assert _unprepares(sim, "error") == 0
        wait_until(
            lambda: (
                _value(sim, "otel_dra_plugin_claim_errors_total", operation="unprepare", error_type="CDIRemoveFailed")
                >= 2
            ),
            60,
            what="the spec's removal failing and retried",
        )
        assert first_spec.exists()
    log = sim.plugin.log_path.read_text()
    assert "CDI spec" in log and reason in log, log[-2000:]
    assert sim.plugin.process.poll() is None
    assert _leftovers(inside) == []

    if fault == "read-only":
        assert nsenter("mount", "-o", "remount,rw", str(cdi)).returncode == 0
    else:
        (inside / "filler").unlink()
    pod = wait_until(lambda: sim.running("second"), 60, what="the retried prepare to succeed")
    second = str(sim.claim_of(pod)["metadata"]["uid"])
    _delete_pod(sim, "second")
    if fault == "read-only":  # unprepared while the directory was read-only: the retry goes through now
        wait_until(lambda: not first_spec.exists(), 60, what="the retried removal of the first claim's spec")
    else:
        _delete_pod(sim, "first")

    def specs_left() -> list[str]:
        return [p.name for p in inside.iterdir() if first in p.name or second in p.name]

    wait_until(lambda: not specs_left(), 10, what="the CDI specs of the unprepared claims removed")
    assert _leftovers(inside) == []
