"""The exporter (its own process) pushing OTLP to an endpoint that goes down, black-holes
requests (accepts and never answers) and answers 503, then comes back: scrapes keep their latency,
memory stays bounded, and the points of every failed push are counted.

The endpoint is the real Collector (collector-config/gateway.yaml) behind :class:`FaultyEndpoint`,
which is the fault: it forwards to the Collector, or refuses, swallows or rejects.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from otel_dra.fixtures import apply_all, create, sample_objects
from otel_dra.kube.client import ApiError
from tests.faults.conftest import FaultTestbed, TcpProxy, listen, sample_value
from tests.helpers import free_port, http_get, listening, parse_samples, scrape, wait_until

DROPPED = "otel_dra_otlp_points_dropped_total"
MODES = ("forward", "down", "blackhole", "503")


class FaultyEndpoint:
    """A loopback OTLP/HTTP endpoint whose behaviour the test switches: ``forward`` (a TCP proxy to
    the real Collector), ``down`` (nothing listens: connection refused), ``blackhole`` (accepts,
    reads, never answers) or ``503`` (answers every request 503 Service Unavailable)."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.port = free_port()
        self.mode = "down"
        self.requests = {m: 0 for m in MODES}
        self._forward: TcpProxy | None = None
        self._target = target
        self._listener: socket.socket | None = None
        self._held: list[socket.socket] = []
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()

    def set(self, mode: str) -> None:
        self._close_listener()
        with self._lock:
            held, self._held = self._held, []
        for sock in held:  # a black-holed connection stays silent until the mode changes
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()
        if self._forward is not None:
            self._forward.stop()
            self._forward = None
        self.mode = mode
        if mode == "down":
            return
        if mode == "forward":
            self._forward = TcpProxy(self._target, port=self.port)
            return
        listener = listen(self.port)
        listener.settimeout(0.2)
        self._listener = listener
        self._start(self._accept, listener, mode)

    def _start(self, target: Any, *args: Any) -> None:
        thread = threading.Thread(target=target, args=args, name=f"otlp-fault-{self.mode}", daemon=True)
        self._threads.append(thread)
        thread.start()

    def _accept(self, listener: socket.socket, mode: str) -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            conn.settimeout(None)
            with self._lock:
                self._held.append(conn)
            self._start(self._serve, conn, mode)

    def _serve(self, conn: socket.socket, mode: str) -> None:
        buffer = b""
        try:
            while True:
                while b"\r\n\r\n" not in buffer:
                    if not (data := conn.recv(65536)):
                        return
                    buffer += data
                head, buffer = buffer.split(b"\r\n\r\n", 1)
                length = next(
                    (
                        int(line.split(b":", 1)[1])
                        for line in head.split(b"\r\n")
                        if line.lower().startswith(b"content-length:")
                    ),
                    0,
                )
                while len(buffer) < length:
                    if not (data := conn.recv(65536)):
                        return
                    buffer += data
                buffer = buffer[length:]
                with self._lock:
                    self.requests[mode] += 1
                if mode == "503":
                    conn.sendall(b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\n\r\n")
                # blackhole: read the next request, if any; never answer
        except OSError:
            return

    def _close_listener(self) -> None:
        if self._listener is not None:
            self._listener.close()
            self._listener = None

    def stop(self) -> None:
        self.set("down")
        for thread in self._threads:
            thread.join(5)


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def _state_points(port: int) -> int:
    _code, text = scrape(port)
    return sum(1 for name, _labels, _v in parse_samples(text) if name.startswith("kube_"))


def test_otlp_endpoint_down_blackholed_and_503(fault_testbed: FaultTestbed, otelcol_gateway, tmp_path):
    ft = fault_testbed
    apply_all(ft.admin, sample_objects())
    with contextlib.suppress(ApiError):
        ft.admin.send_json("POST", "/api/v1/namespaces", {"metadata": {"name": "faults-otlp"}})
    for i in range(100):
        create(ft.admin, _claim(f"c{i}"))
    host, port = otelcol_gateway.endpoint(4318).split(":")
    endpoint = FaultyEndpoint((host, int(port)))
    endpoint.set("forward")
    metrics_port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env.update(
        OTEL_EXPORTER_OTLP_ENDPOINT=f"http://127.0.0.1:{endpoint.port}",
        OTEL_EXPORTER_OTLP_PROTOCOL="http/protobuf",
        OTEL_METRIC_EXPORT_INTERVAL="1000",
        OTEL_EXPORTER_OTLP_TIMEOUT="2",  # seconds: what a black-holed push waits
        OTEL_SERVICE_NAME="faults-otlp",
    )
    log = tmp_path / "exporter.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "otel_dra", "exporter", f"--kubeconfig={ft.testbed.kubeconfig}",
             "--address=127.0.0.1", f"--port={metrics_port}"],
            env=env, stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        wait_until(lambda: listening(metrics_port) and scrape(metrics_port)[0] == 200, timeout=60, what="in sync")
        prom = otelcol_gateway.endpoint(8889)

        def at_collector(name: str) -> bool:
            code, body = http_get(f"http://{prom}/metrics")
            return code == 200 and name.encode() in body

        wait_until(lambda: at_collector('resourceclaim_name="c99"'), timeout=30, what="pushed to the Collector")
        points = _state_points(metrics_port)

        phases: dict[str, dict[str, Any]] = {}
        phase_seconds = 6.0
        for mode in ("forward", "down", "blackhole", "503", "forward again"):
            if mode == "forward again":
                create(ft.admin, _claim("made-while-away"))  # only a push after the fault can carry it
            endpoint.set(mode.split()[0])
            started = time.monotonic()
            dropped_at_start = sample_value(metrics_port, DROPPED)
            latencies, rss = [], []
            settled = None
            while time.monotonic() - started < phase_seconds:
                began = time.monotonic()
                code, _text = scrape(metrics_port)
                latencies.append(time.monotonic() - began)
                assert code == 200
                rss.append(_rss_mib(proc.pid))
                if settled is None and time.monotonic() - started >= 3.0:
                    settled = sample_value(metrics_port, DROPPED)  # a push in flight at the switch is over
                time.sleep(0.05)
            latencies.sort()
            phases[mode] = {
                "p50": latencies[len(latencies) // 2],
                "p95": latencies[int(len(latencies) * 0.95)],
                "max": latencies[-1],
                "rss": max(rss),
                "rss_end": rss[-1],
                "dropped": sample_value(metrics_port, DROPPED) - dropped_at_start,
                "dropped_settled": sample_value(metrics_port, DROPPED) - (settled or 0),
            }
        print(f"\n{points} state points per push; endpoint requests {endpoint.requests}")
        for mode, p in phases.items():
            print(
                f"{mode:>13}: scrape p50 {p['p50'] * 1000:.1f} ms, p95 {p['p95'] * 1000:.1f} ms, "
                f"max {p['max'] * 1000:.1f} ms; RSS max {p['rss']:.1f} MiB; dropped points +{p['dropped']:.0f}"
            )
        base = phases["forward"]
        for mode in ("down", "blackhole", "503"):
            p = phases[mode]
            assert p["dropped"] >= points, (mode, p)  # at least one whole push lost, and counted
            assert p["dropped"] % points == 0, (mode, p["dropped"], points)  # whole requests: every point
            # Scrapes are not held up by a push waiting for its endpoint (2 s here).
            assert p["p50"] <= max(3 * base["p50"], base["p50"] + 0.02), (mode, p, base)
            assert p["max"] < 1.0, (mode, p)
        assert endpoint.requests["blackhole"] >= 1 and endpoint.requests["503"] >= 1
        # Nothing is queued for later: memory stays where it was.
        assert max(phases[m]["rss"] for m in ("down", "blackhole", "503")) - base["rss_end"] < 40, phases
        assert phases["503"]["rss_end"] - phases["down"]["rss_end"] < 20, phases
        # Back: nothing more is dropped, and the Collector gets the current state.
        assert phases["forward again"]["dropped_settled"] == 0, phases["forward again"]
        wait_until(
            lambda: at_collector('resourceclaim_name="made-while-away"'), timeout=30, what="current state pushed"
        )
        assert proc.poll() is None
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        finally:
            endpoint.stop()
    assert proc.returncode == 0, log.read_text()[-3000:]


def _claim(name: str) -> dict[str, Any]:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": "faults-otlp"},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.example.com"}}]}},
    }
