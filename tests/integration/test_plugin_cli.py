"""``otel-dra plugin`` as a process: flags from the environment, metrics on a random port, traces
over OTLP to a real OTLP receiver with an incoming W3C traceparent honoured, clean SIGTERM, and a
second instance refused."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from otel_dra.telemetry.traceids import root_span_id
from tests.helpers import scrape, wait_until
from tests.integration.plugin_helpers import DRIVER, Dirs, Kubelet, ensure_namespace, make_claim, metric, ref, result
from tests.otlp_receiver import OtlpReceiver

NS = "plugin-cli"


class PluginProcess:
    """``python -m otel_dra plugin`` with its stderr collected line by line."""

    def __init__(self, args: list[str], env: dict[str, str]) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "otel_dra", "plugin", *args],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.append(line.rstrip("\n"))

    def log(self) -> str:
        return "\n".join(self.lines)

    def wait_for_line(self, pattern: str, timeout: float = 60) -> re.Match[str]:
        regex = re.compile(pattern)

        def found() -> re.Match[str] | None:
            assert self.proc.poll() is None or any(regex.search(x) for x in self.lines), self.log()
            return next((m for m in map(regex.search, self.lines) if m), None)

        return wait_until(found, timeout=timeout, what=pattern)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(30)
        except subprocess.TimeoutExpired:
            # Say where it hung: its log up to now, then a traceback of every thread (SIGABRT makes
            # faulthandler, on through PYTHONFAULTHANDLER in _env, print them), instead of only the timeout.
            self.proc.send_signal(signal.SIGABRT)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(10)
            self.proc.kill()
            self.proc.wait(10)
            self._reader.join(5)
            raise AssertionError(f"the plugin did not stop within 30 s of SIGTERM:\n{self.log()}") from None
        self._reader.join(5)
        return code


@pytest.fixture
def dirs() -> Iterator[Dirs]:
    root = Path(tempfile.mkdtemp(prefix="odc-", dir="/tmp"))
    yield Dirs(root)
    shutil.rmtree(root, ignore_errors=True)


def _env(testbed, dirs: Dirs, node: str, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env.update(
        {
            "PYTHONFAULTHANDLER": "1",  # a plugin that hangs on stop shows its threads (PluginProcess.stop)
            "NODE_NAME": node,
            "KUBECONFIG": str(testbed.kubeconfig),
            "CDI_ROOT": str(dirs.cdi),
            "KUBELET_PLUGINS_DIRECTORY_PATH": str(dirs.plugins),
            "KUBELET_REGISTRAR_DIRECTORY_PATH": str(dirs.registry),
            "METRICS_PORT": "0",
            "NUM_DEVICES": "4",
        }
    )
    env.update(extra)
    return env


def _spans(receiver: OtlpReceiver) -> list:
    out = []
    for request in list(receiver.traces):
        for rs in request.resource_spans:
            resource = {a.key: a.value.string_value for a in rs.resource.attributes}
            for ss in rs.scope_spans:
                out.extend((resource, span) for span in ss.spans)
    return out


def _attrs(span) -> dict:
    out = {}
    for a in span.attributes:
        kind = a.value.WhichOneof("value")
        out[a.key] = (
            getattr(a.value, kind) if kind != "array_value" else [v.string_value for v in a.value.array_value.values]
        )
    return out


@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
def test_cli_traces_to_otlp_with_incoming_traceparent(testbed, admin_client, dirs, protocol):
    ensure_namespace(admin_client, NS)
    receiver = OtlpReceiver().start()
    node = f"cli-{uuid.uuid4().hex[:8]}"
    port = receiver.grpc_port if protocol == "grpc" else receiver.http_port
    env = _env(
        testbed,
        dirs,
        node,
        OTEL_EXPORTER_OTLP_TRACES_ENDPOINT=f"http://127.0.0.1:{port}" + ("" if protocol == "grpc" else "/v1/traces"),
        OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=protocol,
        OTEL_BSP_SCHEDULE_DELAY="100",
        OTEL_SERVICE_NAME="plugin-under-test",
        HEALTHCHECK_PORT="0",
    )
    plugin = PluginProcess([], env)
    kubelet = Kubelet(dirs)
    try:
        metrics_port = int(plugin.wait_for_line(r"serving metrics on [0-9.]+:(\d+)").group(1))
        plugin.wait_for_line(r"serving gRPC health on :(\d+)")
        assert metric(metrics_port, "dra_example_driver_prepare_claims_total", result="success") == 0

        claim = make_claim(admin_client, NS, f"traced-{node}", [result(node, "gpu-0")])
        uid = claim["metadata"]["uid"]
        trace_id, caller_span = uuid.uuid4().hex, uuid.uuid4().hex[:16]
        response = kubelet.prepare([ref(claim)], traceparent=f"00-{trace_id}-{caller_span}-01")
        assert response.claims[uid].error == ""
        assert dirs.cdi_spec(uid).exists()
        assert metric(metrics_port, "dra_example_driver_prepare_claims_total", result="success") == 1
        assert metric(metrics_port, "dra_example_driver_prepare_claim_duration_seconds_count", result="success") == 1
        code, text = scrape(metrics_port)
        if shutil.which("promtool"):
            check = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True)
            assert check.returncode == 0, check.stdout + check.stderr

        # Two traces: the call's (the caller's trace id) holds the RPC span; the claim's (trace id =
        # its UID) holds the claim span, a child of the claim's derived root, and its three steps.
        claim_trace = uuid.UUID(uid).hex

        def ours() -> list:
            received = _spans(receiver)
            call = [(r, s) for r, s in received if s.trace_id.hex() == trace_id]
            claims = [(r, s) for r, s in received if s.trace_id.hex() == claim_trace]
            return call + claims if len(call) >= 1 and len(claims) >= 4 else []

        spans = wait_until(ours, timeout=30, what="the call's span and the claim's four")
        by_name = {s.name: (r, s) for r, s in spans}
        resource, rpc = by_name["k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/NodePrepareResources"]
        assert resource["service.name"] == "plugin-under-test"
        assert rpc.parent_span_id.hex() == caller_span  # joined the caller's trace
        assert rpc.kind == rpc.SPAN_KIND_SERVER
        # RPC semantic conventions after v1.37.0 by default (OTEL_SEMCONV_STABILITY_OPT_IN unset).
        assert _attrs(rpc)["rpc.system.name"] == "grpc"
        assert _attrs(rpc)["rpc.method"] == "k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/NodePrepareResources"
        assert _attrs(rpc)["rpc.response.status_code"] == "OK"
        assert "rpc.system" not in _attrs(rpc) and "rpc.grpc.status_code" not in _attrs(rpc)
        assert rpc.trace_id.hex() == trace_id
        _, claim_span = by_name["prepare claim"]
        assert claim_span.trace_id.hex() == claim_trace
        assert claim_span.parent_span_id == root_span_id(uuid.UUID(uid).int).to_bytes(8, "big")
        assert [(link.trace_id, link.span_id) for link in claim_span.links] == [(rpc.trace_id, rpc.span_id)]
        (link,) = rpc.links
        assert (link.trace_id, link.span_id) == (claim_span.trace_id, claim_span.span_id)
        assert {a.key: a.value.string_value for a in link.attributes} == {"k8s.resourceclaim.uid": uid}
        assert _attrs(claim_span)["dra.claim.uid"] == uid and _attrs(claim_span)["dra.devices"] == ["gpu-0"]
        for step in (
            "GET /apis/resource.k8s.io/v1/namespaces/{namespace}/resourceclaims/{name}",
            "write CDI spec",
            "write checkpoint",
        ):
            assert by_name[step][1].parent_span_id == claim_span.span_id, step

        # A second instance on the same directories refuses and leaves the first one serving.
        second = PluginProcess([], env)
        assert second.proc.wait(60) == 1
        second._reader.join(5)
        assert "another plugin instance" in second.log(), second.log()
        assert kubelet.get_info().name == DRIVER
    finally:
        kubelet.close()
        code = plugin.stop()
        receiver.stop()
    assert code == 0, plugin.log()
    assert not dirs.dra_socket.exists() and not dirs.registration_socket.exists()
    assert "stopped in" in plugin.log()


def test_cli_sampler_off_exports_no_spans(testbed, admin_client, dirs):
    ensure_namespace(admin_client, NS)
    receiver = OtlpReceiver().start()
    node = f"cli-{uuid.uuid4().hex[:8]}"
    env = _env(
        testbed,
        dirs,
        node,
        OTEL_EXPORTER_OTLP_TRACES_ENDPOINT=f"http://127.0.0.1:{receiver.grpc_port}",
        OTEL_EXPORTER_OTLP_TRACES_PROTOCOL="grpc",
        OTEL_BSP_SCHEDULE_DELAY="100",
        OTEL_TRACES_SAMPLER="always_off",
        REMOVE_SLICES_ON_EXIT="true",
    )
    plugin = PluginProcess([], env)
    kubelet = Kubelet(dirs)
    try:
        plugin.wait_for_line(r"serving DRAPlugin on")
        claim = make_claim(admin_client, NS, f"unsampled-{node}", [result(node, "gpu-1")])
        assert kubelet.prepare([ref(claim)]).claims[claim["metadata"]["uid"]].error == ""
        wait_until(
            lambda: admin_client.get_json(
                "/apis/resource.k8s.io/v1/resourceslices", {"fieldSelector": f"spec.nodeName={node}"}
            )["items"],
            what="slice",
        )
    finally:
        kubelet.close()
        code = plugin.stop()
    receiver.stop()
    assert code == 0, plugin.log()
    assert _spans(receiver) == []  # SIGTERM flushed whatever there was: nothing was sampled
    # REMOVE_SLICES_ON_EXIT: the node's slices are gone after a clean shutdown.
    assert (
        admin_client.get_json("/apis/resource.k8s.io/v1/resourceslices", {"fieldSelector": f"spec.nodeName={node}"})[
            "items"
        ]
        == []
    )
