"""The metrics server's limits against hostile and heavy clients (issue 15): malformed and oversized
requests, slow senders, idle keep-alive connections, the connection and worker limits. Timing targets
(scrape latency under load) are measured in bench/hostile.py; these tests assert behaviour and counts."""

from __future__ import annotations

import contextlib
import re
import socket
import threading
import time
import urllib.request

import pytest

from otel_dra.cli import build_parser
from otel_dra.cli.web import web_options
from otel_dra.telemetry import httpserver
from otel_dra.telemetry.http import Endpoints, Limits, MetricsServer

BODY = b"up 1\n"


def serve(limits: Limits, scrape=None) -> MetricsServer:
    return MetricsServer(
        Endpoints(scrape or (lambda openmetrics, gzipped: [BODY]), lambda: None), "127.0.0.1", 0, limits=limits
    ).start()


@pytest.fixture
def server(request):
    srv = serve(getattr(request, "param", Limits()))
    yield srv
    srv.stop()


def connect(port: int, timeout: float = 5.0) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=timeout)


def read_all(sock: socket.socket) -> bytes:
    """Everything until the server closes the connection."""
    out = bytearray()
    while chunk := sock.recv(65536):
        out += chunk
    return bytes(out)


def status(response: bytes) -> int:
    return int(response.split(b" ", 2)[1])


def read_response(sock: socket.socket) -> bytes:
    """One response (headers and a Content-Length body) from a keep-alive connection."""
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


def exchange(port: int, data: bytes) -> bytes:
    with connect(port) as sock:
        sock.sendall(data)
        return read_all(sock)


def wait_until(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


def server_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("metrics-http")]


def test_malformed_requests_are_400_and_closed(server):
    for request in (
        b"GARBAGE\r\n\r\n",
        b"GET / HTTP/1.1 extra\r\n\r\n",
        b"GET / HTTP/x.y\r\n\r\n",
        b"POST /\r\n\r\n",
    ):
        response = exchange(server.port, request)
        assert status(response) == 400, (request, response[:100])
    # Empty lines before a request are ignored; the server still answers normally.
    assert status(exchange(server.port, b"\r\n\r\nGET /healthz HTTP/1.0\r\n\r\n")) == 200


def test_oversized_request_line_is_414_even_before_its_end(server):
    long_path = b"/" + b"a" * 9000
    assert status(exchange(server.port, b"GET " + long_path + b" HTTP/1.1\r\nHost: x\r\n\r\n")) == 414
    # A line that never ends is refused once it is too long, without waiting for the rest.
    with connect(server.port) as sock:
        sock.sendall(b"GET " + long_path)
        assert status(read_all(sock)) == 414
    just_fits = b"GET /?" + b"a" * (8192 - 20) + b" HTTP/1.1\r\n"
    assert status(exchange(server.port, just_fits + b"Connection: close\r\n\r\n")) == 200


def test_oversized_headers_are_431(server):
    headers = b"".join(b"X-Filler-%d: %s\r\n" % (i, b"v" * 1000) for i in range(70))  # ~71 KiB
    assert status(exchange(server.port, b"GET /metrics HTTP/1.1\r\n" + headers + b"\r\n")) == 431
    with connect(server.port) as sock:  # refused before the end of the headers
        sock.sendall(b"GET /metrics HTTP/1.1\r\n" + headers)
        assert status(read_all(sock)) == 431
    many = b"".join(b"X-%d: v\r\n" % i for i in range(150))  # small, but more than 100 header lines
    assert status(exchange(server.port, b"GET /metrics HTTP/1.1\r\n" + many + b"\r\n")) == 431


@pytest.mark.parametrize("server", [Limits(header_timeout=0.5)], indirect=True)
def test_a_slow_header_sender_is_cut_off_with_408(server):
    with connect(server.port) as sock:
        sock.sendall(b"GET /metrics HTTP/1.1\r\n")
        received = b""
        for i in range(100):  # one header line every 0.1 s: 10 s in all if nothing cut it off
            with contextlib.suppress(OSError):  # closed already: its answer is waiting
                sock.sendall(b"X-Slow-%d: v\r\n" % i)
            sock.settimeout(0.1)
            try:
                received = sock.recv(65536)
            except TimeoutError:
                continue
            break
        assert received.startswith(b"HTTP/1.1 408"), received
    # A connection that sends nothing at all is cut off the same way.
    with connect(server.port) as sock:
        assert read_all(sock).startswith(b"HTTP/1.1 408")
    assert server._server.timeouts == 2
    wait_until(lambda: server.connections() == 0)


@pytest.mark.parametrize("server", [Limits(idle_timeout=0.3)], indirect=True)
def test_idle_keep_alive_connections_are_closed(server):
    with connect(server.port) as sock:
        for _ in range(3):  # keep-alive: several requests on the connection
            sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
            assert read_response(sock).startswith(b"HTTP/1.1 200")
        assert server.connections() == 1
        assert sock.recv(65536) == b""  # then idle: closed by the server, without a response
    wait_until(lambda: server.connections() == 0)


def test_pipelined_requests_are_answered_in_order(server):
    with connect(server.port) as sock:
        sock.sendall(
            b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\nGET /nope HTTP/1.1\r\nHost: x\r\n\r\nGET /metrics HTTP/1.1\r\n"
        )
        sock.sendall(b"Host: x\r\nConnection: close\r\n\r\n")
        response = read_all(sock)
    codes = [int(code) for code in re.findall(rb"HTTP/1\.1 (\d{3}) ", response)]
    assert codes == [200, 404, 200] and response.endswith(BODY)


def test_a_client_that_stops_reading_is_dropped_after_the_write_timeout():
    big = [b"x" * (1 << 20)] * 256  # 256 MiB from one buffer: more than any socket buffer holds
    srv = serve(Limits(max_workers=1, write_timeout=0.5), lambda openmetrics, gzipped: big)
    try:
        with connect(srv.port) as stalled:
            stalled.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")  # and never read
            wait_until(lambda: srv.connections() == 0, timeout=20)  # its one worker is free again
            assert status(exchange(srv.port, b"GET /healthz HTTP/1.1\r\nConnection: close\r\n\r\n")) == 200
    finally:
        srv.stop()


def test_a_request_with_a_body_is_refused_and_its_connection_closed(server):
    response = exchange(server.port, b"POST /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nhello")
    assert status(response) == 501


@pytest.mark.parametrize("server", [Limits(max_connections=3, header_timeout=60)], indirect=True)
def test_connections_beyond_the_limit_wait_until_one_closes(server):
    idle = [connect(server.port) for _ in range(3)]
    try:
        wait_until(lambda: server.connections() == 3)
        with connect(server.port) as waiting:  # accepted by the kernel, not by the server
            waiting.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            waiting.settimeout(0.5)
            with pytest.raises(TimeoutError):
                waiting.recv(65536)
            assert server.connections() == 3
            idle.pop().close()
            waiting.settimeout(5)
            assert status(read_all(waiting)) == 200
    finally:
        for sock in idle:
            sock.close()


class _BlockedScrape:
    """A scrape callback that waits for ``gate``, counting the scrapes in it now and at most."""

    def __init__(self) -> None:
        self.gate, self.in_flight, self.most = threading.Event(), [0], [0]
        self._lock = threading.Lock()

    def __call__(self, openmetrics, gzipped):
        with self._lock:
            self.in_flight[0] += 1
            self.most[0] = max(self.most[0], self.in_flight[0])
        self.gate.wait(10)
        with self._lock:
            self.in_flight[0] -= 1
        return [BODY]


def test_requests_served_at_once_are_bounded_by_the_workers(monkeypatch):
    monkeypatch.setattr(httpserver, "_WORKER_IDLE", 0.2)
    scrape = _BlockedScrape()
    gate, in_flight, most = scrape.gate, scrape.in_flight, scrape.most

    srv = serve(Limits(max_workers=4, max_requests_per_client=100), scrape)
    results: list[int] = []

    def client():
        with urllib.request.urlopen(f"http://127.0.0.1:{srv.port}/metrics", timeout=20) as resp:
            results.append(resp.status)

    clients = [threading.Thread(target=client) for _ in range(10)]
    try:
        for c in clients:
            c.start()
        wait_until(lambda: in_flight[0] == 4)
        wait_until(lambda: srv.connections() == 10)  # the other six wait for a worker
        time.sleep(0.1)
        assert in_flight[0] == 4 and len(server_threads()) == 1 + 4
        gate.set()
        for c in clients:
            c.join(20)
        assert results == [200] * 10 and most[0] == 4
        wait_until(lambda: len(server_threads()) == 1)  # idle workers end; started again when needed
        with urllib.request.urlopen(f"http://127.0.0.1:{srv.port}/metrics", timeout=5) as resp:
            assert resp.read() == BODY
    finally:
        gate.set()
        srv.stop()


def test_one_client_address_gets_at_most_its_share_of_the_workers():
    """Six requests at once from 127.0.0.2: two are served, four wait for them, and a request from
    another address (127.0.0.3, still loopback) is served at once instead of behind them."""
    scrape = _BlockedScrape()
    gate, in_flight, most = scrape.gate, scrape.in_flight, scrape.most

    srv = serve(Limits(max_workers=8, max_requests_per_client=2), scrape)
    results: dict[str, list[bytes]] = {"127.0.0.2": [], "127.0.0.3": []}

    def client(source: str) -> None:
        with socket.create_connection(("127.0.0.1", srv.port), timeout=20, source_address=(source, 0)) as sock:
            sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            results[source].append(read_all(sock))

    heavy = [threading.Thread(target=client, args=("127.0.0.2",)) for _ in range(6)]
    other = threading.Thread(target=client, args=("127.0.0.3",))
    try:
        for c in heavy:
            c.start()
        wait_until(lambda: srv._server.parked == 4)
        assert in_flight[0] == 2
        # Probes are not held: the kubelet's come from the node's address, which may also scrape.
        with socket.create_connection(("127.0.0.1", srv.port), timeout=5, source_address=("127.0.0.2", 0)) as sock:
            sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            assert status(read_all(sock)) == 200
        other.start()
        wait_until(lambda: in_flight[0] == 3)  # not parked behind 127.0.0.2's four
        gate.set()
        for c in [*heavy, other]:
            c.join(20)
        assert [status(r) for r in results["127.0.0.2"]] == [200] * 6
        assert [status(r) for r in results["127.0.0.3"]] == [200]
        assert most[0] == 3 and srv._server.parked == 4
        assert srv._server._in_flight == {} and srv._server._parked == {}  # nothing left counted
    finally:
        gate.set()
        srv.stop()


def test_stop_closes_requests_waiting_for_their_clients_earlier_ones():
    gate = threading.Event()
    srv = serve(Limits(max_requests_per_client=1), lambda openmetrics, gzipped: [BODY] if gate.wait(10) else [])
    socks = [connect(srv.port) for _ in range(3)]
    try:
        for sock in socks:
            sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        wait_until(lambda: srv._server.parked == 2)
        stopper = threading.Thread(target=srv.stop)
        stopper.start()
        for sock in socks[1:]:  # the waiting two are closed, unanswered
            sock.settimeout(5)
            with contextlib.suppress(ConnectionResetError):
                assert read_all(sock) == b""
        gate.set()
        stopper.join(10)
        assert not server_threads()
        socks[0].settimeout(5)
        assert status(read_all(socks[0])) == 200  # the one being served is finished
    finally:
        gate.set()
        for sock in socks:
            sock.close()


@pytest.mark.parametrize("server", [Limits(header_timeout=60)], indirect=True)
def test_500_slow_connections_take_no_threads_and_a_normal_scrape_is_still_served(server):
    slow = []
    try:
        for i in range(500):
            sock = connect(server.port)
            sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\nX-Slow: %d\r\n" % i)  # never finished
            slow.append(sock)
        wait_until(lambda: server.connections() == 500)
        for _ in range(5):
            with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=5) as resp:
                assert resp.status == 200 and resp.read() == BODY
        assert len(server_threads()) <= 2  # the selector and the one worker that served the scrapes
    finally:
        for sock in slow:
            sock.close()
    wait_until(lambda: server.connections() == 0)


def test_stop_closes_connections_waiting_for_a_request():
    srv = serve(Limits(header_timeout=60))
    socks = [connect(srv.port) for _ in range(20)]
    try:
        socks[0].sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        assert read_response(socks[0]).startswith(b"HTTP/1.1 200")
        socks[1].sendall(b"GET /metrics HTTP/1.1\r\n")  # half a request
        wait_until(lambda: srv.connections() == 20)
        srv.stop()
        assert not server_threads()
        for sock in socks:
            sock.settimeout(5)
            # Closed with the half request still unread, a connection ends with a reset.
            with contextlib.suppress(ConnectionResetError):
                assert read_all(sock) == b""
    finally:
        for sock in socks:
            sock.close()


def test_limits_flags_and_environment(monkeypatch):
    args = build_parser().parse_args(
        [
            *("exporter", "--web-max-connections", "100", "--web-max-requests", "8", "--web-header-timeout", "5s"),
            *("--web-max-requests-per-client", "2"),
        ]
    )
    limits = web_options(args).limits
    assert (limits.max_connections, limits.max_workers, limits.header_timeout) == (100, 8, 5.0)
    assert limits.max_requests_per_client == 2
    assert web_options(build_parser().parse_args(["exporter"])).limits.max_requests_per_client == 1
    assert (limits.idle_timeout, limits.write_timeout) == (Limits().idle_timeout, Limits().write_timeout)
    monkeypatch.setenv("OTEL_DRA_WEB_IDLE_TIMEOUT", "30")
    assert web_options(build_parser().parse_args(["plugin", "--node-name", "n"])).limits.idle_timeout == 30.0
    with pytest.raises(SystemExit):
        build_parser().parse_args(["exporter", "--web-max-requests", "0"])


def _wakeups(native_id: int) -> int:
    """Times the thread has been scheduled (the third field of its schedstat)."""
    with open(f"/proc/self/task/{native_id}/schedstat") as f:
        return int(f.read().split()[2])


def test_an_idle_server_sleeps_until_something_happens(server):
    """Nothing open, nothing to time out: the selector thread does not wake (it swept four times
    a second before, most of an idle plugin's CPU). With a keep-alive connection open it wakes
    for its deadline, and still closes it (test_idle_keep_alive_connections_are_closed)."""
    selector = next(t for t in threading.enumerate() if t.name == "metrics-http")
    assert selector.native_id is not None
    exchange(server.port, b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    wait_until(lambda: server.connections() == 0)
    time.sleep(0.3)  # the last sweep after the connection closed
    before = _wakeups(selector.native_id)
    time.sleep(1.5)
    assert _wakeups(selector.native_id) - before <= 1
    # ... and it still serves at once.
    assert status(exchange(server.port, b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")) == 200
