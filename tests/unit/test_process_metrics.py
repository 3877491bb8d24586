"""The process_* families on the Prometheus registry of every pipeline, read from /proc at scrape."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile

from otel_dra.telemetry.exposition import assemble
from otel_dra.telemetry.provider import build_metrics_pipeline
from tests.helpers import PROCESS_FAMILIES, check_process_metrics, parse_samples


def _text(pipeline, openmetrics=False) -> str:
    return b"".join(assemble(pipeline.registry, [], openmetrics)).decode()


def test_process_families_as_client_libraries_spell_them_and_read_at_scrape_time():
    pipeline = build_metrics_pipeline(service_name="t", version="0", target_info=False)
    first = check_process_metrics(lambda: _text(pipeline), os.getpid())
    # Read at each scrape, not cached: opening files moves the count with them.
    with tempfile.TemporaryFile() as a, tempfile.TemporaryFile() as b:
        assert a.fileno() != b.fileno()
        opened = check_process_metrics(lambda: _text(pipeline), os.getpid())
    assert opened["process_open_fds"] == first["process_open_fds"] + 2
    # OpenMetrics spells the counter's family without the suffix, as client_python does.
    om = _text(pipeline, openmetrics=True)
    assert "# TYPE process_cpu_seconds counter\n" in om and "\nprocess_cpu_seconds_total " in om
    if shutil.which("promtool"):
        check = subprocess.run(["promtool", "check", "metrics"], input=_text(pipeline), capture_output=True, text=True)
        assert check.returncode == 0, check.stdout + check.stderr
    pipeline.shutdown()


def test_process_families_can_be_left_out():
    pipeline = build_metrics_pipeline(service_name="t", version="0", process_metrics=False)
    assert not {n for n, _, _ in parse_samples(_text(pipeline))} & set(PROCESS_FAMILIES)
    pipeline.shutdown()
