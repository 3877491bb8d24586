"""The demo's trace link (otel_dra/cli/demo.py): which claim it shows, the link and the lines it
prints, and the workload keeping that claim's pod; no control plane (tests/integration/test_demo_e2e.py
runs the demo with a real Jaeger)."""

from __future__ import annotations

import argparse
import math
import subprocess
import uuid
from pathlib import Path
from typing import Any

import pytest

from otel_dra.cli import build_parser
from otel_dra.cli.demo import (
    JAEGER_UI,
    TRACING_OFF,
    Workload,
    claim_trace_lines,
    pick_claim,
    reserving_pod,
    trace_id_command,
    trace_link,
    tracing_off_lines,
)
from otel_dra.cli.flags import http_url
from otel_dra.telemetry.traceids import TraceIdRatio

UID = "0f8fad5b-d9cb-469f-a165-70867728950e"
KUBECTL = "KUBECONFIG=/tmp/d/testbed/kubeconfig /cache/bin/kubectl"


def claim(
    name: str,
    *,
    uid: str | None = None,
    created: str = "2025-01-01T00:00:00Z",
    allocated: bool = True,
    pods: tuple[str, ...] = ("worker-0",),
    deleting: bool = False,
) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "name": name,
        "namespace": "demo",
        "uid": uid or str(uuid.uuid5(uuid.NAMESPACE_URL, name)),
        "creationTimestamp": created,
    }
    if deleting:
        meta["deletionTimestamp"] = "2025-01-01T00:01:00Z"
    status: dict[str, Any] = {"reservedFor": [{"resource": "pods", "name": p, "uid": f"uid-{p}"} for p in pods]}
    if allocated:
        status["allocation"] = {"devices": {"results": [{"driver": "gpu.example.com", "pool": "node-0"}]}}
    return {"metadata": meta, "status": status}


def test_the_link_is_the_ui_and_the_uid_without_dashes() -> None:
    assert trace_link("http://127.0.0.1:16686", UID) == "http://127.0.0.1:16686/trace/0f8fad5bd9cb469fa16570867728950e"
    assert trace_link("https://jaeger.example/ui/", UID.upper()) == (
        "https://jaeger.example/ui/trace/0f8fad5bd9cb469fa16570867728950e"
    )
    with pytest.raises(ValueError):
        trace_link(JAEGER_UI, "not-a-uid")


def test_the_claim_shown_is_the_oldest_allocated_reserved_and_alive() -> None:
    early, late = "2025-01-01T00:00:01Z", "2025-01-01T00:00:09Z"
    claims = [
        claim("pending", created="2025-01-01T00:00:00Z", allocated=False),
        claim("unreserved", created="2025-01-01T00:00:00Z", pods=()),
        claim("deleting", created="2025-01-01T00:00:00Z", deleting=True),
        claim("bad-uid", uid="x", created="2025-01-01T00:00:00Z"),
        claim("b-late", created=late, pods=("worker-2",)),
        claim("b-early", created=early, pods=("worker-1",)),
        claim("a-early", created=early, pods=("worker-3",)),
    ]
    assert pick_claim(claims)["metadata"]["name"] == "a-early"  # type: ignore[index]
    assert pick_claim(claims, pods={"worker-1", "worker-2"})["metadata"]["name"] == "b-early"  # type: ignore[index]
    assert pick_claim(claims, pods=set()) is None
    assert pick_claim(claims[:4]) is None
    assert pick_claim([]) is None
    # Only a claim whose trace is sampled: the rest of its trace would be nowhere.
    unsampled = {uuid.UUID(c["metadata"]["uid"]).int for c in claims[-2:]}
    assert pick_claim(claims, sampled=lambda t: t not in unsampled)["metadata"]["name"] == "b-late"  # type: ignore[index]
    assert pick_claim(claims, sampled=TraceIdRatio(0.0).sampled) is None


def test_reserving_pod_is_the_first_pod_consumer() -> None:
    shared = claim("c", pods=("worker-5", "worker-6"))
    shared["status"]["reservedFor"].insert(0, {"resource": "deployments", "name": "d", "uid": "u"})
    assert reserving_pod(shared) == "worker-5"
    assert reserving_pod(claim("c", pods=())) is None
    assert reserving_pod({"metadata": {}}) is None


def test_the_lines_printed_with_tracing_name_the_claim_its_link_and_the_uid_command() -> None:
    text = claim_trace_lines(
        KUBECTL, "http://127.0.0.1:16686", claim("worker-3-gpu-abcde", uid=UID, pods=("worker-3",))
    )
    lines = text.splitlines()
    assert lines[0].startswith("claim demo/worker-3-gpu-abcde (pod worker-3, kept running until Ctrl-C) is one trace")
    assert lines[1] == "  http://127.0.0.1:16686/trace/0f8fad5bd9cb469fa16570867728950e"
    assert lines[2] == (
        f"  {KUBECTL} get resourceclaim -n demo worker-3-gpu-abcde -o jsonpath='{{.metadata.uid}}' | tr -d -"
        "   # any claim's trace id"
    )


def test_the_lines_printed_without_tracing_say_how_to_turn_it_on_in_one_line() -> None:
    lines = tracing_off_lines(KUBECTL).splitlines()
    assert lines == [TRACING_OFF, f"  {trace_id_command(KUBECTL)}   # any claim's trace id"]
    assert "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT=" in TRACING_OFF and "\n" not in TRACING_OFF


def test_the_uid_command_prints_the_trace_id_through_a_shell(tmp_path: Path) -> None:
    """The printed line, run by a shell, hands kubectl the jsonpath intact and strips the dashes
    (a script in kubectl's place answers only that exact request)."""
    kubectl = tmp_path / "kubectl"
    kubectl.write_text(
        "#!/bin/sh\n"
        '[ "$*" = "get resourceclaim -n demo c1 -o jsonpath={.metadata.uid}" ] || { echo "args: $*" >&2; exit 1; }\n'
        f"printf %s {UID}\n"
    )
    kubectl.chmod(0o755)
    out = subprocess.run(
        ["sh", "-c", trace_id_command(f"KUBECONFIG=/dev/null {kubectl}", "c1")],
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout == uuid.UUID(UID).hex


def test_a_kept_pod_lives_until_the_workload_stops() -> None:
    workload = Workload(client=None, pods=2)  # type: ignore[arg-type]  # not started: no request is made
    workload._deadlines.update({"worker-0": 5.0, "worker-1": 7.0})
    assert workload.pods_alive() == {"worker-0", "worker-1"}
    assert workload.keep("worker-1")
    assert workload._deadlines == {"worker-0": 5.0, "worker-1": math.inf}
    assert not workload.keep("worker-9")  # deleted already: nothing to keep


def _demo_args(*argv: str) -> argparse.Namespace:
    return build_parser("demo").parse_args(["demo", *argv])


def test_the_jaeger_ui_flag_and_its_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OTEL_DRA_DEMO_JAEGER_UI", raising=False)
    assert _demo_args().jaeger_ui == "http://127.0.0.1:16686" == JAEGER_UI
    assert _demo_args("--jaeger-ui", "https://jaeger.example/").jaeger_ui == "https://jaeger.example"
    monkeypatch.setenv("OTEL_DRA_DEMO_JAEGER_UI", "http://10.0.0.5:16686/")
    assert _demo_args().jaeger_ui == "http://10.0.0.5:16686"


@pytest.mark.parametrize("bad", ["", "127.0.0.1:16686", "ftp://host", "http://", "http://h/?q=1", "http://h/#x"])
def test_http_url_refuses_what_is_not_a_base_url(bad: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError):
        http_url(bad)
