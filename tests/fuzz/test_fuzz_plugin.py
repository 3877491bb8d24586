"""Fuzzing the plugin's gRPC services: a real plugin server (PluginServer + Driver, as
``otel-dra plugin`` wires them, with an in-memory API server) over its unix socket, called with
generated NodePrepareResources / NodeUnprepareResources requests of both API versions: empty, huge,
duplicate, unknown, invalid and mismatched claims.

Properties: the RPC never fails (beyond gRPC's own message size limit); there is one answer per
claim UID; a claim fails or succeeds as the driver's rules say (a well-formed claim allocated to this
node succeeds, everything else gets a per-claim error); and the server keeps serving: a well-formed
request after each example succeeds.
"""

from __future__ import annotations

import random
import re
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import unquote

import grpc
import pytest
from hypothesis import given, note, settings
from hypothesis import strategies as st
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.id_generator import IdGenerator

from otel_dra._generated.dra.v1 import api_pb2 as dra_v1
from otel_dra._generated.dra.v1 import api_pb2_grpc as dra_v1_grpc
from otel_dra._generated.dra.v1beta1 import api_pb2 as dra_v1beta1
from otel_dra._generated.dra.v1beta1 import api_pb2_grpc as dra_v1beta1_grpc
from otel_dra.kube.client import ApiError
from otel_dra.plugin.cdi import CdiWriter
from otel_dra.plugin.checkpoint import Checkpoint
from otel_dra.plugin.devices import simulated_devices
from otel_dra.plugin.driver import Driver, Inventory
from otel_dra.plugin.metrics import PluginMetrics
from otel_dra.plugin.server import PluginServer
from tests.fuzz.conftest import examples
from tests.fuzz.mutations import UTF8_CHARS, huge_text, odd_text

pytestmark = pytest.mark.fuzz

DRIVER = "gpu.example.com"
NODE = "node-a"
MAX_MESSAGE = 4 * 1024 * 1024  # gRPC's default limit on a received message (the server's)

_UID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")
_NAME = re.compile(r"[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?")
_NAMESPACE = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")


def _result(device: str, driver: str = DRIVER, pool: str = NODE, request: str = "gpu") -> dict[str, Any]:
    return {"request": request, "driver": driver, "pool": pool, "device": device}


def _claim(name: str, uid: str, results: Any, namespace: str = "ns") -> dict[str, Any]:
    obj: dict[str, Any] = {"metadata": {"name": name, "namespace": namespace, "uid": uid}}
    if results is not None:
        obj["status"] = {"allocation": {"devices": {"results": results}}}
    return obj


# The API server's claims: (namespace, name) -> claim. "good-*" are allocated to this node's devices.
CLAIMS = {
    ("ns", c["metadata"]["name"]): c
    for c in [
        _claim("good-1", "uid-good-1", [_result("gpu-0")]),
        _claim("good-2", "uid-good-2", [_result("gpu-1"), _result("gpu-2", request="other"), _result("x", "o.io")]),
        _claim("other-driver", "uid-other", [_result("gpu-0", driver="other.example.com")]),
        _claim("pending", "uid-pending", None),
        _claim("wrong-pool", "uid-wrong-pool", [_result("gpu-0", pool="node-b")]),
        _claim("unknown-device", "uid-unknown-device", [_result("gpu-99")]),
        _claim("malformed", "uid-malformed", [{"driver": DRIVER}]),
        _claim("not-a-list", "uid-not-a-list", {"gpu": "gpu-0"}),
    ]
}
GOOD = {
    ("ns", "uid-good-1", "good-1"): ["gpu-0"],
    ("ns", "uid-good-2", "good-2"): ["gpu-1", "gpu-2"],
}  # (namespace, uid, name)
KNOWN = [(ns, c["metadata"]["uid"], name) for (ns, name), c in CLAIMS.items()]


class _ApiServer:
    """What the driver reads: GET of a ResourceClaim."""

    host = "https://10.0.0.1:6443"
    _PATH = re.compile(r"/apis/resource\.k8s\.io/v1/namespaces/([^/]*)/resourceclaims/([^/]*)")

    def get_json(self, path: str, query: Any = None, *, headers: Any = None, timeout: Any = None) -> Any:
        match = self._PATH.fullmatch(path)
        claim = CLAIMS.get((unquote(match[1]), unquote(match[2]))) if match else None
        if claim is None:
            raise ApiError(404, "not found")
        return claim


@dataclass
class Plugin:
    v1: Any
    v1beta1: Any


class _OwnRandomIds(IdGenerator):
    """Span ids from a Random of their own: the plugin's spans are made on a worker thread, which
    with the SDK's default ids (the global ``random``) would change the global random state while
    Hypothesis draws, and Hypothesis warns that examples are then not reproducible."""

    def __init__(self) -> None:
        self._random = random.Random(7)

    def generate_span_id(self) -> int:
        return self._random.getrandbits(64) or 1

    def generate_trace_id(self) -> int:
        return self._random.getrandbits(128) or 1


@pytest.fixture(scope="module")
def plugin() -> Iterator[Plugin]:
    root = Path(tempfile.mkdtemp(prefix="fz", dir="/tmp"))  # short: unix socket paths are <= 107 bytes
    tracing = TracerProvider(id_generator=_OwnRandomIds())
    meters = MeterProvider(shutdown_on_exit=False)
    cdi = CdiWriter(root / "cdi", DRIVER, NODE)
    cdi.write_common()  # as the plugin does at start-up (it makes the CDI directory)
    driver = Driver(
        client=_ApiServer(),  # type: ignore[arg-type]
        driver_name=DRIVER,
        node_name=NODE,
        inventory=Inventory(simulated_devices(NODE, 4)),
        cdi=cdi,
        checkpoint=Checkpoint(root / "plugins" / DRIVER / "checkpoint.json"),
        metrics=PluginMetrics(meters),
        tracer_provider=tracing,
    )
    server = PluginServer(
        driver, driver_name=DRIVER, plugins_dir=root / "plugins", registrar_dir=root / "registry"
    ).start()
    channel = grpc.insecure_channel(f"unix://{server.dra_socket}")
    try:
        yield Plugin(dra_v1_grpc.DRAPluginStub(channel), dra_v1beta1_grpc.DRAPluginStub(channel))
    finally:
        channel.close()
        server.stop(grace=1)
        driver.spans.close()
        tracing.shutdown()
        meters.shutdown()
        shutil.rmtree(root, ignore_errors=True)


_VALID_NAMES = st.from_regex(r"[a-z0-9]([-a-z0-9]{0,20}[a-z0-9])?", fullmatch=True)
_VALID_UIDS = st.from_regex(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,40}", fullmatch=True)
# A field: a known value, a valid-looking one, an odd or huge one, or one that is valid but for a
# trailing newline (``$`` in a regular expression matches before it).
_FIELD = (
    _VALID_NAMES
    | odd_text(UTF8_CHARS)  # protobuf strings are UTF-8: a lone surrogate cannot be sent at all
    | huge_text(UTF8_CHARS)
    | st.sampled_from(["", "ns", "good-1", "uid-good-1", "ns\n", "good-1\n", "uid-good-1\n", "a" * 129, "../x", "a/b"])
)


@st.composite
def _refs(draw: st.DrawFn) -> list[tuple[str, str, str]]:
    """(namespace, uid, name) per claim of one request."""
    known = st.sampled_from(KNOWN)
    mismatched = st.builds(
        lambda k, field, value: tuple(value if i == field else k[i] for i in range(3)), known, st.integers(0, 2), _FIELD
    )
    unknown = st.tuples(_VALID_NAMES, _VALID_UIDS, _VALID_NAMES)
    odd = st.tuples(_FIELD, _FIELD, _FIELD)
    one = known | mismatched | unknown | odd
    refs: list[tuple[str, str, str]] = draw(st.lists(one, max_size=8))
    if refs and draw(st.booleans()):
        refs += draw(st.lists(st.sampled_from(refs), min_size=1, max_size=3))  # duplicates
    if draw(st.integers(0, 49)) == 0:  # many claims in one call (of ordinary sizes)
        refs += [draw(known | unknown) for _ in range(draw(st.sampled_from([20, 200])))] * 10
    return [tuple(r) for r in refs]  # type: ignore[misc]


def _expected_prepare(ref: tuple[str, str, str]) -> list[str] | None:
    """The devices a prepare of this claim returns, None for an error."""
    return GOOD.get(ref)


def _expected_unprepare(ref: tuple[str, str, str]) -> bool:
    """Whether an unprepare of this claim succeeds: any valid UID (with a valid or no name and
    namespace) does, prepared or not (unprepare is idempotent)."""
    namespace, uid, name = ref
    if not _UID.fullmatch(uid):
        return False
    return not (namespace or name) or bool(_NAMESPACE.fullmatch(namespace) and _NAME.fullmatch(name))


# Each example is up to three RPCs over the socket: a quarter of a watched kind's count in CI.
@settings(max_examples=examples(4))
@given(refs=_refs(), version=st.sampled_from(["v1", "v1beta1"]), operation=st.sampled_from(["prepare", "unprepare"]))
def test_requests_get_per_claim_answers_and_the_server_keeps_serving(
    plugin: Plugin, refs: list[tuple[str, str, str]], version: str, operation: str
) -> None:
    pb2, stub = (dra_v1, plugin.v1) if version == "v1" else (dra_v1beta1, plugin.v1beta1)
    claims = [pb2.Claim(namespace=ns, uid=uid, name=name) for ns, uid, name in refs]
    if operation == "prepare":
        request: Any = pb2.NodePrepareResourcesRequest(claims=claims)
        call = stub.NodePrepareResources
    else:
        request = pb2.NodeUnprepareResourcesRequest(claims=claims)
        call = stub.NodeUnprepareResources
    note(f"{version} {operation}: {len(refs)} claims, {request.ByteSize()} bytes")
    try:
        response = call(request, timeout=60)
    except grpc.RpcError as exc:
        # gRPC refuses a message over its size limit before the servicer sees it; nothing else may fail.
        assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and request.ByteSize() > MAX_MESSAGE, exc
    else:
        assert set(response.claims) == {uid for _ns, uid, _name in refs}, "one answer per claim UID"
        for uid, answer in response.claims.items():
            # Several claims of one UID in a request (the kubelet never sends that): one of them answers.
            same = [r for r in refs if r[1] == uid]
            if operation == "prepare":
                got = None if answer.error else [d.device_name for d in answer.devices]
                assert got in [_expected_prepare(r) for r in same], (uid, answer.error or got)
                if got is None:
                    assert answer.error and not answer.devices
            else:
                ok = not answer.error
                assert ok in [_expected_unprepare(r) for r in same], (uid, answer.error)
    # Still serving: a well-formed prepare and unprepare of a good claim succeed.
    good = pb2.Claim(namespace="ns", uid="uid-good-1", name="good-1")
    answer = stub.NodePrepareResources(pb2.NodePrepareResourcesRequest(claims=[good]), timeout=30)
    assert not answer.claims["uid-good-1"].error and [d.device_name for d in answer.claims["uid-good-1"].devices] == [
        "gpu-0"
    ]
    answer = stub.NodeUnprepareResources(pb2.NodeUnprepareResourcesRequest(claims=[good]), timeout=30)
    assert not answer.claims["uid-good-1"].error


def test_empty_requests_answer_nothing(plugin: Plugin) -> None:
    for pb2, stub in ((dra_v1, plugin.v1), (dra_v1beta1, plugin.v1beta1)):
        assert not stub.NodePrepareResources(pb2.NodePrepareResourcesRequest(), timeout=10).claims
        assert not stub.NodeUnprepareResources(pb2.NodeUnprepareResourcesRequest(), timeout=10).claims
