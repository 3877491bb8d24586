"""The admission webhook (``otel-dra webhook``): decoding AdmissionReviews, the verdicts, the HTTPS
server against malformed and hostile clients, the request bodies of the connection engine, the
command's flags. Against the real API server: tests/integration/test_webhook.py."""

from __future__ import annotations

import contextlib
import json
import re
import socket
import ssl
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from otel_dra.admission import review as rv
from otel_dra.admission.metrics import WebhookMetrics
from otel_dra.admission.server import WebhookServer, webhook_limits
from otel_dra.cli import main
from otel_dra.cli.webhook import start_webhook, tls_contexts
from otel_dra.plugin.config import ConfigError, configs_by_request, refuse_configs
from otel_dra.telemetry.httpserver import HttpServer, Limits, RequestHandler, body_length
from tests.pki import CA, make_ca

DRIVER = "gpu.example.com"
GOOD = {"apiVersion": "gpu.resource.example.com/v1alpha1", "kind": "GpuConfig", "sharing": {"strategy": "TimeSlicing"}}
BAD_STRATEGY = {**GOOD, "sharing": {"strategy": "Bogus"}}
BAD_FIELD = {**GOOD, "sharingg": {}}
BAD_KIND = {**GOOD, "kind": "NpuConfig"}


def opaque(parameters: Any, driver: str = DRIVER, requests: list[str] | None = None) -> dict[str, Any]:
    entry: dict[str, Any] = {"opaque": {"driver": driver, "parameters": parameters}}
    if requests is not None:
        entry["requests"] = requests
    return entry


def claim(*entries: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": "c", "namespace": "ns"},
        "spec": {"devices": {"requests": [{"name": "gpu"}], "config": list(entries)}},
    }


def template(*entries: dict[str, Any]) -> dict[str, Any]:
    return {"kind": "ResourceClaimTemplate", "spec": {"spec": {"devices": {"config": list(entries)}}}}


def device_class(*entries: dict[str, Any]) -> dict[str, Any]:
    return {"kind": "DeviceClass", "spec": {"config": list(entries)}}


def review_doc(
    obj: Any, kind: str = "ResourceClaim", operation: str = "CREATE", old: Any = None, uid: str = "u-1", **extra: Any
) -> dict[str, Any]:
    request = {
        "uid": uid,
        "kind": {"group": "resource.k8s.io", "version": "v1", "kind": kind},
        "resource": {"group": "resource.k8s.io", "version": "v1", "resource": kind.lower() + "s"},
        "operation": operation,
        "namespace": "ns",
        "name": "c",
        "object": obj,
        "oldObject": old,
        **extra,
    }
    return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": request}


def verdict(obj: Any, kind: str = "ResourceClaim", **kwargs: Any) -> rv.Verdict:
    return rv.judge(rv.decode_review(json.dumps(review_doc(obj, kind, **kwargs)).encode()), DRIVER)


def prepare_reason(parameters: Any) -> str:
    """What prepare says of the same parameters (otel_dra.plugin.config), without its entry prefix."""
    with pytest.raises(ConfigError) as err:
        configs_by_request([{"source": "FromClaim", **opaque(parameters)}], DRIVER, ["gpu"])
    return str(err.value).split(": ", 1)[1]


# --- decoding ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        (b"", "not JSON"),
        (b"{", "not JSON"),
        (b"\xff\xfe{}", "not JSON"),
        (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
        (b'{"n": ' + b"9" * 5000 + b"}", "not JSON"),  # beyond int()'s digit limit
        (b"[1, 2]", "JSON array, not an AdmissionReview"),
        (b'"review"', "JSON string"),
        (b'{"apiVersion": "admission.k8s.io/v1beta1", "kind": "AdmissionReview"}', "admissionReviewVersions"),
        (b'{"apiVersion": "admission.k8s.io/v1", "kind": "Pod"}', "not an admission.k8s.io/v1 AdmissionReview"),
        (b'{"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview"}', "no request"),
        (b'{"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": []}', "no request"),
        (b'{"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {}}', "no uid"),
        (
            b'{"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {"uid": 7}}',
            "no uid",
        ),
        (
            b'{"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {"uid": "u"}}',
            "no operation",
        ),
        (
            b'{"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", '
            b'"request": {"uid": "u", "operation": "CREATE", "kind": "ResourceClaim"}}',
            "no kind object",
        ),
    ],
)
def test_what_is_not_an_admission_review_is_refused_with_the_reason(body: bytes, reason: str) -> None:
    with pytest.raises(rv.ReviewError, match=re.escape(reason)):
        rv.decode_review(body)


def test_a_review_is_decoded() -> None:
    review = rv.decode_review(json.dumps(review_doc(claim(), operation="UPDATE", old=claim())).encode())
    assert (review.uid, review.kind, review.operation, review.namespace, review.name) == (
        "u-1",
        "ResourceClaim",
        "UPDATE",
        "ns",
        "c",
    )
    assert review.object == claim() and review.old_object == claim()
    assert review.what == "ResourceClaim ns/c"
    # Another group, or a kind the webhook does not judge: "other".
    doc = review_doc({}, "Pod")
    doc["request"]["kind"]["group"] = ""
    assert rv.decode_review(json.dumps(doc).encode()).kind == rv.OTHER
    doc = review_doc({}, "ResourceClaim")
    doc["request"]["kind"]["group"] = "example.com"
    assert rv.decode_review(json.dumps(doc).encode()).kind == rv.OTHER


# --- verdicts ---------------------------------------------------------------------------------------


def test_good_configs_and_no_configs_are_allowed() -> None:
    assert verdict(claim()) == rv.Verdict(True)
    assert verdict(
        claim(
            opaque(GOOD),
            opaque({"apiVersion": GOOD["apiVersion"], "kind": "GpuConfig"}),
            opaque({**GOOD, "sharing": None}),
        )
    ) == rv.Verdict(True, checked=3)
    partitioned = {
        **GOOD,
        "sharing": {"strategy": "SpacePartitioning", "spacePartitioningConfig": {"partitionCount": 4}},
    }
    assert verdict(claim(opaque(partitioned, requests=["gpu"]))).allowed
    # No spec, no devices, a null config: nothing to judge.
    for obj in (
        {"kind": "ResourceClaim"},
        {"spec": None},
        {"spec": {"devices": None}},
        {"spec": {"devices": {"config": None}}},
    ):
        assert verdict(obj) == rv.Verdict(True)


@pytest.mark.parametrize(
    "parameters",
    [
        BAD_STRATEGY,
        BAD_FIELD,
        BAD_KIND,
        "GpuConfig",
        {**GOOD, "sharing": {"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Forever"}}},
    ],
)
@pytest.mark.parametrize(
    ("make", "kind", "where"),
    [
        (claim, "ResourceClaim", "spec.devices.config"),
        (template, "ResourceClaimTemplate", "spec.spec.devices.config"),
        (device_class, "DeviceClass", "spec.config"),
    ],
)
def test_a_bad_config_is_denied_naming_the_entry_in_preparations_words(make, kind, where, parameters) -> None:
    result = verdict(make(opaque(GOOD), opaque(parameters)), kind)
    assert not result.allowed and result.checked == 2
    assert result.message == f"{where}[1].opaque.parameters (driver {DRIVER}): {prepare_reason(parameters)}"


def test_the_reasons_are_the_decoders() -> None:
    assert verdict(claim(opaque(BAD_STRATEGY))).message.endswith(
        "unknown GPU sharing strategy: 'Bogus' (one of TimeSlicing, SpacePartitioning)"
    )
    assert verdict(claim(opaque(BAD_FIELD))).message.endswith("unknown field(s) in GpuConfig: sharingg")
    assert verdict(claim(opaque(BAD_KIND))).message.endswith(
        "parameters are 'gpu.resource.example.com/v1alpha1'/'NpuConfig', this driver decodes only "
        "gpu.resource.example.com/v1alpha1/GpuConfig"
    )


def test_other_drivers_and_other_kinds_of_config_pass() -> None:
    assert verdict(claim(opaque(BAD_STRATEGY, driver="nic.example.com"), {"future": {"x": 1}})) == rv.Verdict(True)
    assert verdict(claim(opaque(BAD_STRATEGY)), "Pod") == rv.Verdict(True)


def test_a_profile_without_opaque_parameters_refuses_every_entry_of_its_driver() -> None:
    """--opaque-config none (the plugin's cpu and net profiles): even a good GpuConfig is refused,
    in the words prepare uses (refuse_configs); other drivers' entries still pass."""
    review = rv.decode_review(
        json.dumps(review_doc(claim(opaque(GOOD), opaque(GOOD, driver="nic.example.com")))).encode()
    )
    result = rv.judge(review, DRIVER, gpu_config=False)
    with pytest.raises(ConfigError) as prepare:
        refuse_configs([opaque(GOOD)], DRIVER)
    reason = str(prepare.value).split(": ", 1)[1]
    assert reason == "this driver's device profile takes no opaque parameters"
    assert result == rv.Verdict(False, f"spec.devices.config[0].opaque.parameters (driver {DRIVER}): {reason}", 1)
    assert rv.judge(rv.decode_review(json.dumps(review_doc(claim())).encode()), DRIVER, gpu_config=False).allowed


def test_every_bad_entry_is_listed_up_to_a_limit() -> None:
    result = verdict(claim(opaque(BAD_STRATEGY), opaque(GOOD), opaque(BAD_FIELD)))
    assert result.message.count("spec.devices.config[") == 2
    assert "config[0]" in result.message and "config[2]" in result.message
    many = verdict(claim(*[opaque(BAD_STRATEGY)] * (rv.MAX_LISTED + 3)))
    assert many.message.count("unknown GPU sharing strategy") == rv.MAX_LISTED
    assert many.message.endswith("; and 3 more")


def test_shapes_the_api_server_never_sends_are_denied_not_crashed() -> None:
    assert verdict({"spec": {"devices": {"config": {"a": 1}}}}) == rv.Verdict(
        False, "spec.devices.config must be a list"
    )
    assert verdict({"spec": []}) == rv.Verdict(False, "spec.devices.config must be a list")
    assert verdict(claim(7)).message == "spec.devices.config[0]: must be an object"
    assert verdict(claim({"opaque": "x"})).message == "spec.devices.config[0].opaque: must be an object"
    # A value nested as deep as the JSON decoder goes: quoting it in the decoder's message (repr)
    # may run out of stack; either way a denial, not an exception.
    for depth in (900, 990, 5000):
        body = json.dumps(review_doc(claim(opaque({"apiVersion": "@"})))).replace('"@"', "[" * depth + "]" * depth)
        try:
            review = rv.decode_review(body.encode())
        except rv.ReviewError as exc:
            assert "nested too deeply" in str(exc)
            continue
        message = rv.judge(review, DRIVER).message
        assert message.endswith(("nested too deeply", "…")), message[-100:]
    long = verdict(claim(opaque({"apiVersion": "v" * 10_000}))).message
    assert len(long) < 500 and long.endswith("…")


def test_an_update_is_judged_on_the_entries_it_brings() -> None:
    bad = claim(opaque(BAD_STRATEGY))
    # Created before the webhook, changed in its labels or finalizers only: allowed.
    assert verdict(bad, operation="UPDATE", old=bad).allowed
    # A new bad entry, or a good one made bad: denied; a bad one made good: allowed.
    assert not verdict(claim(opaque(BAD_STRATEGY), opaque(BAD_FIELD)), operation="UPDATE", old=bad).allowed
    assert not verdict(bad, operation="UPDATE", old=claim(opaque(GOOD))).allowed
    assert verdict(claim(opaque(GOOD)), operation="UPDATE", old=bad).allowed
    # Without an old object, everything is new.
    assert not verdict(bad, operation="UPDATE").allowed


def test_delete_connect_and_subresources_are_allowed() -> None:
    bad = claim(opaque(BAD_STRATEGY))
    assert verdict(None, operation="DELETE", old=bad).allowed
    assert verdict(bad, operation="CONNECT").allowed
    assert verdict(bad, operation="UPDATE", subResource="status").allowed


def test_a_hostile_update_costs_its_length_not_its_square() -> None:
    entries = [opaque({**GOOD, "n": i}) for i in range(20_000)]  # each one bad (an unknown field)
    start = time.perf_counter()
    result = verdict(claim(*entries), operation="UPDATE", old=claim(*reversed(entries)))
    assert result.allowed and time.perf_counter() - start < 5


def test_the_response_echoes_the_uid_and_gives_422() -> None:
    allowed = json.loads(rv.response("u-9", rv.Verdict(True)))
    assert allowed == {
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "response": {"uid": "u-9", "allowed": True},
    }
    denied = json.loads(rv.response("u-9", rv.Verdict(False, "why")))["response"]
    assert denied == {
        "uid": "u-9",
        "allowed": False,
        "status": {"status": "Failure", "code": 422, "reason": "Invalid", "message": "why"},
    }


# --- the connection engine's request bodies (plain HTTP) --------------------------------------------


@pytest.mark.parametrize(
    ("head", "length"),
    [
        (b"POST / HTTP/1.1\r\nHost: x\r\n\r\n", 0),
        (b"POST / HTTP/1.1\r\ncontent-length:  12 \r\n\r\n", 12),
        (b"POST / HTTP/1.1\r\nContent-Length: 5\r\nContent-Length: 5\r\n\r\n", 5),
        (b"POST / HTTP/1.1\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\n", -400),
        (b"POST / HTTP/1.1\r\nContent-Length: -5\r\n\r\n", -400),
        (b"POST / HTTP/1.1\r\nContent-Length: 5, 5\r\n\r\n", -400),
        (b"POST / HTTP/1.1\r\nContent-Length: " + b"9" * 19 + b"\r\n\r\n", -400),
        (b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n", -411),
        (b"POST /Content-Length:7 HTTP/1.1\r\n\r\n", 0),  # the request line is not a header
    ],
)
def test_body_length(head: bytes, length: int) -> None:
    assert body_length(head) == length


class Echo(RequestHandler):
    """Answers a POST with the body it received, and its length."""

    def do_POST(self) -> None:
        body = self.rfile.read()
        answer = b"%d:" % len(body) + body
        self.send_response(200)
        self.send_header("Content-Length", str(len(answer)))
        self.end_headers()
        self.wfile.write(answer)


@pytest.fixture
def echo(request: pytest.FixtureRequest) -> Iterator[HttpServer]:
    limits = getattr(request, "param", Limits(max_body_bytes=1000, max_pending_body_bytes=2500, header_timeout=2))
    server = HttpServer(("127.0.0.1", 0), Echo, limits=limits, name="echo-http").start()
    yield server
    server.stop()


def connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=10)


def read_all(sock: socket.socket) -> bytes:
    out = bytearray()
    while chunk := sock.recv(65536):
        out += chunk
    return bytes(out)


def read_response(sock: socket.socket) -> bytes:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, data
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(re.search(rb"Content-Length: (\d+)", head)[1])  # type: ignore[index]
    while len(body) < length:
        body += sock.recv(65536)
    return head + b"\r\n\r\n" + body


def status(response: bytes) -> int:
    return int(response.split(b" ", 2)[1])


def post(path: bytes, body: bytes, content_type: bytes = b"application/json", close: bool = False) -> bytes:
    return (
        b"POST " + path + b" HTTP/1.1\r\nHost: x\r\nContent-Type: " + content_type + b"\r\n"
        + (b"Connection: close\r\n" if close else b"")
        + b"Content-Length: %d\r\n\r\n" % len(body) + body
    )  # fmt: skip


def test_bodies_arrive_whole_and_keep_alive_and_pipelining_work(echo: HttpServer) -> None:
    with connect(echo.port) as sock:
        # In pieces, with a pause: the selector waits for the rest; then two pipelined requests.
        request = post(b"/", b"x" * 900)
        sock.sendall(request[:50])
        time.sleep(0.2)
        sock.sendall(request[50:])
        assert read_response(sock).endswith(b"900:" + b"x" * 900)
        sock.sendall(post(b"/", b"first") + post(b"/", b"second") + post(b"/", b"", close=True))
        answers = read_all(sock)  # three responses, then the server closes
        assert re.findall(rb"HTTP/1.1 200 OK\r\n.*?\r\n\r\n(\d+:[a-z]*)", answers, re.S) == [
            b"5:first",
            b"6:second",
            b"0:",
        ]


@pytest.mark.parametrize(
    ("request_bytes", "code"),
    [
        (post(b"/", b"y" * 1001), 413),
        (b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n", 411),
        (b"POST / HTTP/1.1\r\nContent-Length: 3\r\nContent-Length: 4\r\n\r\nabcd", 400),
        (b"POST / HTTP/1.1\r\nContent-Length: 1e3\r\n\r\n", 400),
    ],
)
def test_refused_bodies_are_answered_at_once_and_closed(echo: HttpServer, request_bytes: bytes, code: int) -> None:
    with connect(echo.port) as sock:
        sock.sendall(request_bytes.split(b"\r\n\r\n", 1)[0] + b"\r\n\r\n")  # the head only: no wait for a body
        assert status(read_all(sock)) == code


def test_a_stalled_body_is_cut_off_and_the_bodies_in_flight_are_bounded(echo: HttpServer) -> None:
    stalled = [connect(echo.port) for _ in range(2)]
    try:
        for sock in stalled:  # 2 x 1000 of the 2500 bytes reserved, and nothing more sent
            sock.sendall(post(b"/", b"z" * 1000)[:-10])
        time.sleep(0.2)
        with connect(echo.port) as third:  # 1000 more would pass 2500: refused at once
            third.sendall(post(b"/", b"z" * 1000))
            assert status(read_all(third)) == 503
        with connect(echo.port) as small:  # 400 more fit
            small.sendall(post(b"/", b"s" * 400))
            assert read_response(small).endswith(b"400:" + b"s" * 400)
        for sock in stalled:  # the header deadline (2 s) covers the body: 408, then the budget is free
            assert status(read_all(sock)) == 408
        with connect(echo.port) as again:
            again.sendall(post(b"/", b"z" * 1000))
            assert read_response(again).endswith(b"1000:" + b"z" * 1000)
    finally:
        for sock in stalled:
            sock.close()


class Gate(RequestHandler):
    """Holds each POST until the test opens the gate."""

    gate = threading.Event()

    def do_POST(self) -> None:
        self.gate.wait(10)
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()


def test_bodies_waiting_for_a_worker_count_until_answered() -> None:
    """A body handed to a worker (queued or being served) stays reserved: clients that send bodies
    faster than the workers answer them are held to max_pending_body_bytes too."""
    limits = Limits(max_workers=1, max_body_bytes=1000, max_pending_body_bytes=2500)
    server = HttpServer(("127.0.0.1", 0), Gate, limits=limits, name="gate-http").start()
    Gate.gate.clear()
    held = [connect(server.port) for _ in range(2)]
    try:
        for sock in held:  # one being served, one waiting for the only worker
            sock.sendall(post(b"/", b"q" * 1000))
        time.sleep(0.3)
        with connect(server.port) as third:
            third.sendall(post(b"/", b"q" * 1000))
            assert status(read_all(third)) == 503
        Gate.gate.set()
        for sock in held:
            assert status(read_response(sock)) == 200
        with connect(server.port) as again:
            again.sendall(post(b"/", b"q" * 1000, close=True))
            assert status(read_all(again)) == 200
    finally:
        Gate.gate.set()
        for sock in held:
            sock.close()
        server.stop()


# --- the webhook over HTTPS -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def ca(tmp_path_factory: pytest.TempPathFactory) -> CA:
    ca = make_ca(tmp_path_factory.mktemp("webhook-pki"))
    ca.issue("webhook")
    ca.issue("apiserver", client=True, san="")
    return ca


@pytest.fixture
def webhook(ca: CA, request: pytest.FixtureRequest) -> Iterator[tuple[WebhookServer, InMemoryMetricReader]]:
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    limits = getattr(request, "param", webhook_limits())
    tls = tls_contexts(str(ca.dir / "webhook.crt"), str(ca.dir / "webhook.key"))
    server = WebhookServer(DRIVER, tls, address="127.0.0.1", port=0, metrics=WebhookMetrics(provider), limits=limits)
    server.start()
    yield server, reader
    server.stop()
    provider.shutdown()


def tls_connect(port: int, ca: CA, cert: tuple[Path, Path] | None = None) -> ssl.SSLSocket:
    context = ssl.create_default_context(cafile=str(ca.cert))
    if cert is not None:
        context.load_cert_chain(str(cert[0]), str(cert[1]))
    raw = socket.create_connection(("127.0.0.1", port), timeout=10)
    return context.wrap_socket(raw, server_hostname="127.0.0.1")


def exchange(port: int, ca: CA, data: bytes) -> bytes:
    with tls_connect(port, ca) as sock:
        sock.sendall(data)
        return read_response(sock)


def body_of(response: bytes) -> bytes:
    return response.split(b"\r\n\r\n", 1)[1]


def points(reader: InMemoryMetricReader) -> dict[tuple[str, tuple[tuple[str, Any], ...]], float]:
    out = {}
    for rm in reader.get_metrics_data().resource_metrics:
        for sm in rm.scope_metrics:
            for metric in sm.metrics:
                for point in metric.data.data_points:
                    value = getattr(point, "value", None)
                    if value is None:
                        value = point.count
                    out[(metric.name, tuple(sorted(point.attributes.items())))] = value
    return out


def test_reviews_over_https_with_their_verdicts_and_metrics(webhook, ca: CA) -> None:
    server, reader = webhook
    good = json.dumps(review_doc(claim(opaque(GOOD)), uid="good")).encode()
    bad = json.dumps(review_doc(device_class(opaque(BAD_STRATEGY)), "DeviceClass", uid="bad")).encode()
    with tls_connect(server.port, ca) as sock:  # one keep-alive connection, as the API server's
        sock.sendall(post(b"/validate?timeout=10s", good))
        answer = read_response(sock)
        assert status(answer) == 200 and b"Content-Type: application/json" in answer
        assert json.loads(body_of(answer))["response"] == {"uid": "good", "allowed": True}
        sock.sendall(post(b"/validate", bad, content_type=b"application/json; charset=utf-8"))
        denied = json.loads(body_of(read_response(sock)))["response"]
        assert denied["uid"] == "bad" and denied["allowed"] is False and denied["status"]["code"] == 422
        assert "spec.config[0].opaque.parameters" in denied["status"]["message"]
    got = points(reader)
    assert got[("otel_dra.webhook.reviews", (("kind", "ResourceClaim"), ("verdict", "allowed")))] == 1
    assert got[("otel_dra.webhook.reviews", (("kind", "DeviceClass"), ("verdict", "denied")))] == 1
    assert got[("otel_dra.webhook.reviews", (("kind", "ResourceClaimTemplate"), ("verdict", "denied")))] == 0
    assert got[("otel_dra.webhook.review.duration", (("kind", "ResourceClaim"),))] == 1


def test_malformed_requests_get_a_clear_error_and_the_server_goes_on(webhook, ca: CA) -> None:
    server, reader = webhook
    for data, code, says in [
        (post(b"/validate", b"{not json"), 400, b"invalid AdmissionReview: body is not JSON"),
        (post(b"/validate", b"[" * 200_000 + b"]" * 200_000), 400, b"nested too deeply"),
        (
            post(b"/validate", b'{"apiVersion": "v1", "kind": "Pod"}'),
            400,
            b"not an admission.k8s.io/v1 AdmissionReview",
        ),
        (post(b"/validate", b"{}", content_type=b"text/plain"), 415, b"expected Content-Type: application/json"),
        (post(b"/other", b"{}"), 404, b"not found"),
        (b"GET /validate HTTP/1.1\r\nHost: x\r\n\r\n", 405, b"use POST"),
        (b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n", 200, b"ok\n"),
        (b"GET /readyz HTTP/1.1\r\nHost: x\r\n\r\n", 200, b"ok\n"),
    ]:
        answer = exchange(server.port, ca, data)
        assert status(answer) == code and says in body_of(answer), answer[:300]
    # Too large for --max-review-bytes: refused on its head, without reading the body.
    with tls_connect(server.port, ca) as sock:
        sock.sendall(
            b"POST /validate HTTP/1.1\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % (4 << 20)
        )
        assert status(read_all(sock)) == 413
    # A plain-HTTP client gets no answer (a TLS alert, or a reset) and is closed.
    with connect(server.port) as plain:
        plain.sendall(post(b"/validate", b"{}"))
        with contextlib.suppress(ConnectionResetError):
            assert read_all(plain)[:5] != b"HTTP/"
    got = points(reader)
    assert {
        code: got.get(("otel_dra.webhook.requests.invalid", (("code", code),)))
        for code in ("400", "404", "405", "413", "415")
    } == {
        "400": 3,
        "404": 1,
        "405": 1,
        "413": 1,
        "415": 1,
    }
    good = json.dumps(review_doc(claim(opaque(GOOD)))).encode()
    assert json.loads(body_of(exchange(server.port, ca, post(b"/validate", good))))["response"]["allowed"] is True


@pytest.mark.parametrize("webhook", [webhook_limits(4096)], indirect=True)
def test_many_hostile_clients_at_once(webhook, ca: CA) -> None:
    """Slow senders, oversized and garbage bodies from many connections: each gets its error or its
    deadline, and a real review in the middle of them is answered at once."""
    server, _ = webhook
    stop = threading.Event()
    errors: list[BaseException] = []

    def hostile(i: int) -> None:
        try:
            while not stop.is_set():
                with tls_connect(server.port, ca) as sock:
                    if i % 3 == 0:
                        sock.sendall(post(b"/validate", b"[" * 4000)[:-100])  # stalls inside its body
                        sock.settimeout(10)
                        read_all(sock)
                    elif i % 3 == 1:
                        sock.sendall(post(b"/validate", b"x" * 5000))
                        read_all(sock)
                    else:
                        sock.sendall(post(b"/validate", bytes(range(256)) * 8))
                        read_response(sock)
        except (OSError, AssertionError) as exc:
            if not stop.is_set():
                errors.append(exc)

    threads = [threading.Thread(target=hostile, args=(i,), name=f"hostile-{i}") for i in range(12)]
    for thread in threads:
        thread.start()
    try:
        time.sleep(1)
        good = json.dumps(review_doc(claim(opaque(GOOD)))).encode()
        for _ in range(5):
            start = time.monotonic()
            answer = exchange(server.port, ca, post(b"/validate", good))
            assert json.loads(body_of(answer))["response"]["allowed"] is True
            assert time.monotonic() - start < 2
    finally:
        stop.set()
        for thread in threads:
            thread.join(20)
    assert not errors, errors[:3]


def test_client_certificates_when_a_client_ca_is_given(ca: CA) -> None:
    app = start_webhook(
        cert_file=str(ca.dir / "webhook.crt"),
        key_file=str(ca.dir / "webhook.key"),
        client_ca_file=str(ca.cert),
        address="127.0.0.1",
        port=0,
    )
    try:
        good = post(b"/validate", json.dumps(review_doc(claim())).encode())
        with tls_connect(app.port, ca, (ca.dir / "apiserver.crt", ca.dir / "apiserver.key")) as sock:
            sock.sendall(good)
            assert status(read_response(sock)) == 200
        with pytest.raises((ssl.SSLError, ConnectionError)), tls_connect(app.port, ca) as sock:
            sock.sendall(good)
            assert not sock.recv(100)  # TLS 1.3: the refusal arrives with the first read
    finally:
        app.stop()


# --- the command ------------------------------------------------------------------------------------


def test_the_command_refuses_to_start_without_tls_or_with_bad_files(ca: CA, tmp_path: Path, capsys) -> None:
    assert main(["webhook"]) == 2
    assert "--tls-cert-file and --tls-private-key-file are required" in capsys.readouterr().err
    assert main(["webhook", "--tls-cert-file", str(tmp_path / "none.crt"), "--tls-private-key-file", "k"]) == 2
    assert f"--tls-cert-file {tmp_path / 'none.crt'}: cannot read it" in capsys.readouterr().err
    assert (
        main(["webhook", "--tls-cert-file", str(ca.cert), "--tls-private-key-file", str(ca.dir / "webhook.key")]) == 2
    )
    assert "--tls-cert-file/--tls-private-key-file:" in capsys.readouterr().err
    cert, key = str(ca.dir / "webhook.crt"), str(ca.dir / "webhook.key")
    assert main(["webhook", "--tls-cert-file", cert, "--tls-private-key-file", key, "--tls-client-ca-file", key]) == 2
    assert "--tls-client-ca-file:" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        main(["webhook", "--max-review-bytes", "10"])
    assert exit_.value.code == 2 and "--max-review-bytes: 10 is outside 4096..67108864" in capsys.readouterr().err


def test_metrics_are_served_and_the_size_flag_reaches_the_server(ca: CA) -> None:
    from tests.helpers import scrape

    app = start_webhook(
        cert_file=str(ca.dir / "webhook.crt"),
        key_file=str(ca.dir / "webhook.key"),
        address="127.0.0.1",
        port=0,
        metrics_port=0,
        metrics_address="127.0.0.1",
        max_review_bytes=8192,
    )
    try:
        assert app.server.limits.max_body_bytes == 8192
        bad = json.dumps(review_doc(template(opaque(BAD_FIELD)), "ResourceClaimTemplate")).encode()
        assert json.loads(body_of(exchange(app.port, ca, post(b"/validate", bad))))["response"]["allowed"] is False
        code, text = scrape(app.metrics_port)
        assert code == 200
        assert 'otel_dra_webhook_reviews_total{kind="ResourceClaimTemplate",verdict="denied"} 1.0' in text
        assert "otel_dra_webhook_review_duration_seconds_bucket" in text and "process_cpu_seconds_total" in text
    finally:
        app.stop()
