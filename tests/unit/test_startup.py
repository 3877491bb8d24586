"""What the plugin's start-up does not do, and the cheaper paths it takes (issue 12: start-up CPU
and resident memory). Each check runs in a fresh interpreter, since what a process has imported
is only meaningful from its start; none of them is a timing test."""

from __future__ import annotations

import gc
import importlib.metadata
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from otel_dra import __version__
from otel_dra.cli import main
from otel_dra.telemetry.otlp import OtlpSignalConfig, plain_http_transport
from tests.helpers import wait_until
from tests.otlp_receiver import OtlpReceiver

ROOT = Path(__file__).resolve().parents[2]


def _fresh(code: str, **env: str) -> dict[str, object]:
    """Run ``code`` in a new interpreter on this source tree; it prints one JSON value."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_") and not k.lower().endswith("_proxy")}
    environ.update(env, PYTHONPATH=str(ROOT))
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=environ, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    result: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def test_the_plugins_start_path_makes_no_dataclass_of_ours_and_reads_a_json_kubeconfig_without_yaml(tmp_path):
    # A dataclass compiles its methods with exec at import (2-3.75 M instructions each; 25 of them
    # were 9% of the plugin's start-up), records do not; yaml is a tenth of it, and JSON is YAML.
    kubeconfig = tmp_path / "kubeconfig.json"
    kubeconfig.write_text(
        json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "c", "cluster": {"server": "https://127.0.0.1:6443"}}],
                "users": [{"name": "u", "user": {"token": "t"}}],
                "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}],
                "current-context": "c",
            }
        )
    )
    code = f"""
import sys, json, dataclasses
made = []
real = dataclasses._process_class
def spy(cls, *args, **kwargs):
    made.append(cls.__module__ + "." + cls.__qualname__)
    return real(cls, *args, **kwargs)
dataclasses._process_class = spy
from otel_dra.cli import build_parser
build_parser("plugin")
import otel_dra.cli.plugin
from otel_dra.plugin import server, driver, slices, health, metrics, cdi, checkpoint, devices, config
from otel_dra.telemetry import provider, tracing, http, exposition, otlp, webconfig
from otel_dra.cli import web
from otel_dra.kube.client import load_credentials
host = load_credentials({str(kubeconfig)!r}).host
print(json.dumps({{"ours": [m for m in made if m.startswith("otel_dra.")], "yaml": "yaml" in sys.modules, "host": host}}))
"""
    assert _fresh(code) == {"ours": [], "yaml": False, "host": "https://127.0.0.1:6443"}


def test_the_version_is_a_constant_and_matches_the_installed_metadata():
    # importlib.metadata.version() scans the installed distributions at every start; pyproject.toml
    # takes the version from otel_dra.__version__, so the installed metadata says the same.
    assert __version__ == importlib.metadata.version("otel-dra")
    seen = _fresh("import sys, json, otel_dra; print(json.dumps({'m': 'importlib.metadata' in sys.modules}))")
    assert seen == {"m": False}


def test_the_plugin_command_loads_none_of_the_other_commands_modules():
    code = """
import sys, json
from otel_dra.cli import build_parser
build_parser("plugin")
import otel_dra.cli.plugin as p
from otel_dra.plugin import server, driver, slices, health, metrics, cdi, checkpoint
from otel_dra.telemetry import provider, tracing, http, exposition
from otel_dra.kube import client
print(json.dumps(sorted(m for m in sys.modules if m.split(".")[0] in
    ("kubernetes", "requests", "yaml", "pydantic") or m.startswith(("otel_dra.testbed", "otel_dra.kubeletsim",
    "otel_dra.cluster", "otel_dra.cli.demo", "otel_dra.cli.testbed", "otel_dra.cli.exporter", "otel_dra.plugin.nvml_health")))))
"""
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == []


_GRPC_DEFAULTS = """
import os, sys, json
from otel_dra.cli import build_parser
build_parser("plugin")
from otel_dra.cli.plugin import GRPC_EXPERIMENTS, grpc_defaults
before = "grpc" in sys.modules  # the command line parsed: gRPC not imported yet
environ = {k: v for k, v in os.environ.items() if k != "GRPC_EXPERIMENTS"}
ours = grpc_defaults(environ), environ.get("GRPC_EXPERIMENTS") == GRPC_EXPERIMENTS
users = {"GRPC_EXPERIMENTS": ""}
kept = grpc_defaults(users), users
import grpc
late = {}
print(json.dumps({"before": before, "ours": ours, "kept": kept, "late": [grpc_defaults(late), late]}))
"""


def test_the_plugin_sets_its_grpc_experiments_before_grpc_is_imported_unless_the_user_did():
    done = subprocess.run(
        [sys.executable, "-c", _GRPC_DEFAULTS],
        cwd=ROOT,
        env={k: v for k, v in os.environ.items() if k != "GRPC_EXPERIMENTS"} | {"PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {
        "before": False,
        "ours": [True, True],
        "kept": [False, {"GRPC_EXPERIMENTS": ""}],  # the user's own (here: grpcio's defaults)
        "late": [False, {}],  # gRPC read the variable already: nothing to set
    }


_TRACES_WITH = """
import sys, json
from otel_dra.telemetry.tracing import build_tracing_pipeline
pipeline = build_tracing_pipeline(service_name="s", version="1")
print(json.dumps({"enabled": pipeline.enabled, "requests": "requests" in sys.modules}))
pipeline.shutdown()
"""


@pytest.mark.parametrize(
    ("env", "requests_loaded"),
    [
        ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://127.0.0.1:9/v1/traces"}, False),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "HTTP://127.0.0.1:9"}, False),
        ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "https://127.0.0.1:9/v1/traces"}, True),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9", "HTTPS_PROXY": "http://127.0.0.1:8"}, True),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9", "no_proxy": "*", "http_proxy": "http://p:3"}, True),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9", "NETRC": "/dev/null"}, True),
    ],
)
def test_otlp_http_traces_use_requests_only_where_it_would_send_something_else(env, requests_loaded, tmp_path):
    # HOME without a netrc file, so that the answer does not depend on the account running this.
    seen = _fresh(_TRACES_WITH, HOME=str(tmp_path), **env)
    assert seen == {"enabled": True, "requests": requests_loaded}


def test_plain_http_transport_conditions(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    http = OtlpSignalConfig("traces", "http/protobuf", "http://collector:4318")
    assert plain_http_transport(http, {}) is not None
    assert plain_http_transport(OtlpSignalConfig("traces", "grpc", "http://collector:4317"), {}) is None
    assert plain_http_transport(OtlpSignalConfig("traces", "http/protobuf", "https://collector:4318"), {}) is None
    assert plain_http_transport(http, {"ALL_PROXY": "socks5://p:1080"}) is None
    assert plain_http_transport(http, {"http_proxy": ""}) is not None  # empty: no proxy
    provider = "OTEL_PYTHON_EXPORTER_OTLP_HTTP_TRACES_CREDENTIAL_PROVIDER"
    assert plain_http_transport(http, {provider: "mine"}) is None
    assert plain_http_transport(OtlpSignalConfig("metrics", "http/protobuf", "http://c:4318"), {provider: "x"})
    (tmp_path / ".netrc").write_text("machine collector login a password b\n")
    assert plain_http_transport(http, {}) is None


def test_spans_reach_a_real_receiver_over_the_urllib3_transport(monkeypatch, tmp_path):
    from otel_dra.telemetry.tracing import build_tracing_pipeline

    monkeypatch.setenv("HOME", str(tmp_path))
    receiver = OtlpReceiver().start()
    try:
        env = {
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": f"http://127.0.0.1:{receiver.http_port}/v1/traces",
        }
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        pipeline = build_tracing_pipeline(service_name="startup-test", version="1", env=env)
        # The SDK's private layout (opentelemetry-exporter-otlp 1.45, pinned): which transport it got.
        processor = pipeline.tracer_provider._active_span_processor._span_processors[0]
        assert type(processor._batch_processor._exporter._client._transport).__name__ == "Urllib3HTTPTransport"
        with pipeline.tracer_provider.get_tracer("t").start_as_current_span("the-span"):
            pass
        pipeline.shutdown()  # flushes the batch
        wait_until(lambda: receiver.traces, timeout=10, interval=0.05, what="the span at the receiver")
        names = [s.name for r in receiver.traces for rs in r.resource_spans for ss in rs.scope_spans for s in ss.spans]
        assert names == ["the-span"]
        resource = {a.key: a.value.string_value for a in receiver.traces[0].resource_spans[0].resource.attributes}
        assert resource["service.name"] == "startup-test"
    finally:
        receiver.stop()


def test_main_keeps_the_gc_off_through_start_up_only(capsys, monkeypatch):
    monkeypatch.delenv("NODE_NAME", raising=False)
    assert gc.isenabled()
    assert main(["plugin"]) == 2  # no --node-name: a usage error, after the parser was built
    assert gc.isenabled()
    gc.disable()
    try:
        assert main(["plugin"]) == 2
        assert not gc.isenabled()  # the caller's setting is restored, not forced on
    finally:
        gc.enable()
    assert "--node-name" in capsys.readouterr().err


def test_otlp_http_metrics_pushers_skip_requests_too(tmp_path):
    # The SDK reader's exporter (plugin and exporter) and the exporter's pre-encoded pusher.
    code = """
import sys, json
from otel_dra.telemetry.otlp import otlp_config
from otel_dra.telemetry.otlp_push import raw_sender
from otel_dra.telemetry.provider import build_metrics_pipeline
pipeline = build_metrics_pipeline(service_name="s", version="1")
sender = raw_sender(otlp_config("metrics"))
print(json.dumps({"otlp": pipeline.otlp is not None, "requests": "requests" in sys.modules}))
sender.shutdown()
pipeline.shutdown()
"""
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9", "HOME": str(tmp_path)}
    assert _fresh(code, **env) == {"otlp": True, "requests": False}
    assert _fresh(code, **env, OTEL_EXPORTER_OTLP_METRICS_ENDPOINT="https://127.0.0.1:9") == {
        "otlp": True,
        "requests": True,
    }
