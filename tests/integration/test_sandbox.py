"""The README's run command: `otel-dra sandbox` serves the sample state and leaves nothing behind."""

from __future__ import annotations

import signal
import subprocess
import sys

from otel_dra.testbed import Testbed
from tests.helpers import SEED_FAMILIES, free_port, scrape, wait_until


def test_sandbox_serves_sample_state_and_cleans_up(testbed_binaries, tmp_path):
    port = free_port()
    directory = tmp_path / "sandbox"
    # Output to a file: a pipe nobody reads while it runs would fill up and block it.
    log = (tmp_path / "command.log").open("w+")
    proc = subprocess.Popen(
        [sys.executable, "-m", "otel_dra", "sandbox", "--dir", str(directory), "--port", str(port)],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:

        def ready():
            try:
                code, text = scrape(port)
            except OSError:
                return None
            return text if code == 200 else None

        text = wait_until(ready, timeout=90, what="sandbox exporter")
        for name in SEED_FAMILIES:
            assert f"# TYPE {name} gauge" in text
        assert 'resourceclaim_name="training-0"' in text
        pids = Testbed.load(directory).pids
        assert pids
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
        log.seek(0)
        output = log.read()
        log.close()
    assert proc.returncode == 0, output
    assert f"curl -s http://127.0.0.1:{port}/metrics" in output
    for pid in pids.values():
        try:
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
            assert state == "Z", f"process {pid} still running after the sandbox stopped"
        except FileNotFoundError:
            pass
