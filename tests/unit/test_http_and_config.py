from __future__ import annotations

import gzip
import urllib.error
import urllib.request

import pytest
from prometheus_client import CollectorRegistry

from otel_dra.cli import main
from otel_dra.telemetry.exposition import Chunk, GaugeFamily, assemble
from otel_dra.telemetry.http import Endpoints, MetricsServer, NotReady
from otel_dra.telemetry.otlp import ConfigError, otlp_config


@pytest.fixture(autouse=True)
def _restore_logging():
    """main() installs its own root handler on the (captured) stderr; put pytest's back."""
    import logging

    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


FAM = GaugeFamily("demo_value", "By", "A demo.", ("k",))


def _get(port, path, headers=None):
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=5) as resp:
            return resp.status, dict(resp.headers), resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read()


@pytest.fixture
def server():
    state = {"ready": False}

    def scrape(openmetrics, gzipped):
        if not state["ready"]:
            raise NotReady("resourceclaims: initial list not complete")
        chunks = [Chunk(FAM.render([(("v" * 2000,), 1.0)])), Chunk(FAM.render([(("w",), 2.0)]))]
        return assemble(CollectorRegistry(), [(FAM, chunks)], openmetrics, gzipped)

    srv = MetricsServer(Endpoints(scrape, lambda: None if state["ready"] else "not synced"), "127.0.0.1", 0).start()
    yield srv, state
    srv.stop()


def test_not_ready_is_500_without_partial_data_and_healthz_200(server):
    srv, state = server
    code, _, body = _get(srv.port, "/metrics")
    assert code == 500 and b"demo_value" not in body and b"initial list" in body
    assert _get(srv.port, "/healthz")[0] == 200
    assert _get(srv.port, "/readyz")[0] == 503
    state["ready"] = True
    assert _get(srv.port, "/readyz")[0] == 200


def test_content_negotiation_and_gzip(server):
    srv, state = server
    state["ready"] = True
    code, headers, body = _get(srv.port, "/metrics")
    assert code == 200 and headers["Content-Type"].startswith("text/plain; version=0.0.4")
    assert b"# TYPE demo_value_bytes gauge\n" in body and b"# EOF" not in body
    code, headers, body = _get(srv.port, "/metrics", {"Accept": "application/openmetrics-text; version=1.0.0"})
    assert headers["Content-Type"].startswith("application/openmetrics-text")
    assert b"# UNIT demo_value_bytes bytes\n" in body and body.endswith(b"# EOF\n")
    code, headers, body = _get(srv.port, "/metrics", {"Accept-Encoding": "gzip"})
    assert headers.get("Content-Encoding") == "gzip"
    assert b'demo_value_bytes{k="w"} 2.0' in gzip.decompress(body)
    assert _get(srv.port, "/nope")[0] == 404


def test_stop_ends_idle_keep_alive_connections():
    """A scraper keeps its HTTP/1.1 connection open between scrapes: stop() ends it and waits for its
    thread instead of leaving the thread behind."""
    import http.client
    import threading

    before = set(threading.enumerate())
    srv = MetricsServer(Endpoints(lambda openmetrics, gzipped: [], lambda: None), "127.0.0.1", 0).start()
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=5)
    try:
        conn.request("GET", "/healthz")
        assert conn.getresponse().read() == b"ok\n"
        assert len(set(threading.enumerate()) - before) == 2  # the selector's, the worker that answered
        srv.stop()
        assert not [t.name for t in threading.enumerate() if t not in before]  # the client is still connected
    finally:
        conn.close()


def test_otlp_env_parsing():
    assert otlp_config("metrics", {}) is None
    cfg = otlp_config("metrics", {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"})
    assert cfg is not None and cfg.protocol == "http/protobuf"
    cfg = otlp_config(
        "metrics",
        {
            "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT": "http://c:4317",
            "OTEL_EXPORTER_OTLP_METRICS_PROTOCOL": "grpc",
        },
    )
    assert cfg is not None and cfg.protocol == "grpc"
    with pytest.raises(ConfigError, match="http/json"):
        otlp_config("metrics", {"OTEL_EXPORTER_OTLP_ENDPOINT": "x", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"})
    with pytest.raises(ConfigError, match="OTEL_METRIC_EXPORT_INTERVAL"):
        otlp_config("metrics", {"OTEL_EXPORTER_OTLP_ENDPOINT": "x", "OTEL_METRIC_EXPORT_INTERVAL": "soon"})
    with pytest.raises(ConfigError, match="OTEL_EXPORTER_OTLP_TIMEOUT"):
        otlp_config("metrics", {"OTEL_EXPORTER_OTLP_ENDPOINT": "x", "OTEL_EXPORTER_OTLP_TIMEOUT": "-1"})


def test_invalid_flags_and_env_fail_clearly(monkeypatch, capsys):
    monkeypatch.setenv("OTEL_DRA_PORT", "99999")
    assert main(["exporter"]) == 2
    assert "OTEL_DRA_PORT" in capsys.readouterr().err
    monkeypatch.delenv("OTEL_DRA_PORT")
    monkeypatch.setenv("OTEL_DRA_LOG_FORMAT", "xml")
    assert main(["exporter"]) == 2
    assert "OTEL_DRA_LOG_FORMAT" in capsys.readouterr().err
    monkeypatch.delenv("OTEL_DRA_LOG_FORMAT")
    with pytest.raises(SystemExit) as exc:
        main(["exporter", "--stale-after", "never"])
    assert exc.value.code == 2
    assert "never" in capsys.readouterr().err
    monkeypatch.setenv("OTEL_DRA_DEVICE_ATTRIBUTES", "productName,not an attribute")
    assert main(["exporter"]) == 2
    err = capsys.readouterr().err
    assert "OTEL_DRA_DEVICE_ATTRIBUTES" in err and "'not an attribute' is not a device attribute name" in err
    monkeypatch.delenv("OTEL_DRA_DEVICE_ATTRIBUTES")
    with pytest.raises(SystemExit) as exc:
        main(["exporter", "--leak-grace-period", "-5"])
    assert exc.value.code == 2
    assert "-5" in capsys.readouterr().err


def test_missing_credentials_fail_clearly(monkeypatch, tmp_path, capsys):
    monkeypatch.delenv("KUBECONFIG", raising=False)
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert main(["exporter", "--port", "0"]) == 2
    assert "no Kubernetes credentials" in capsys.readouterr().err
    assert main(["exporter", "--port", "0", "--kubeconfig", str(tmp_path / "missing")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_send_buffers_handles_partial_sends():
    import socket
    import threading

    from otel_dra.telemetry.httpserver import send_buffers

    a, b = socket.socketpair()
    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    parts = [bytes([i % 251]) * (1 + (i * 7919) % 20000) for i in range(1500)] + [b""]
    expected = b"".join(parts)
    received = bytearray()

    def read():
        while len(received) < len(expected):
            received.extend(b.recv(65536))

    reader = threading.Thread(target=read)
    reader.start()
    send_buffers(a, parts)
    reader.join(10)
    a.close()
    b.close()
    assert bytes(received) == expected


def test_connections_send_without_waiting_for_delayed_acks():
    """Headers and body are separate writes: with Nagle's algorithm a small response's body waits
    for the client's delayed ACK (~40 ms a scrape). Accepted sockets have TCP_NODELAY."""
    import http.client
    import socket

    srv = MetricsServer(Endpoints(lambda openmetrics, gzipped: [], lambda: None), "127.0.0.1", 0).start()
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=5)
    try:
        conn.request("GET", "/healthz")
        assert conn.getresponse().read() == b"ok\n"
        (accepted,) = srv._server._connections  # the keep-alive connection, still open
        assert accepted.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0
    finally:
        conn.close()
        srv.stop()
