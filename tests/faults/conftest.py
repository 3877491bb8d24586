"""Fixtures of the fault-injection suite (``tests/faults``, marker ``faults``; ``make test-faults``).

The faults are injected into real peers: a control plane of its own (``fault_testbed``: etcd and
kube-apiserver, with an audit log, so tests count the requests the API server really received,
and kill or restart it without disturbing the session's ``testbed``), etcd's own compaction, the
API server's priority and fairness; what the test writes itself is only the fault: a TCP proxy
that cuts connections or adds latency (:class:`TcpProxy`), and endpoints that answer nothing or
503 (in test_otlp.py).
"""

from __future__ import annotations

import base64
import contextlib
import json
import queue
import socket
import struct
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
import yaml

from otel_dra.kube.client import KubeClient, load_credentials
from otel_dra.testbed import Binaries, Testbed, running
from tests.helpers import exporter_starter, parse_samples, rbac_kubeconfig, scrape, wait_until

NAMESPACE = "faults"  # the ServiceAccounts of the suite's exporters (audited)

AUDIT_POLICY = f"""\
apiVersion: audit.k8s.io/v1
kind: Policy
omitStages: [RequestReceived]
rules:
- level: Metadata
  userGroups: ["system:serviceaccounts:{NAMESPACE}"]
- level: None
"""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "tests/faults/" in str(item.path).replace("\\", "/"):
            item.add_marker(pytest.mark.faults)
            item.add_marker(pytest.mark.testbed)


# --- the control plane -------------------------------------------------------------------------------


@dataclass
class FaultTestbed:
    testbed: Testbed
    audit_log: Path
    admin: KubeClient

    def exporter_kubeconfig(self, name: str, *, server: str | None = None) -> str:
        """A kubeconfig for ServiceAccount ``faults/<name>`` with list and watch on the exporter's
        resources (audited), against the API server or ``server`` (a proxy in front of it)."""
        path = Path(rbac_kubeconfig(self.testbed, name, '["list", "watch"]', namespace=NAMESPACE))
        if server is not None:
            config = yaml.safe_load(path.read_text())
            config["clusters"][0]["cluster"]["server"] = server
            path = path.with_name(f"{name}-via-proxy.kubeconfig")
            path.write_text(yaml.safe_dump(config))
        return str(path)

    def audit(self, user: str, since: float = 0.0) -> list[dict[str, Any]]:
        """The requests ServiceAccount ``faults/<user>`` made (one entry per request, received at
        or after the wall-clock time ``since``), oldest first: ``time`` (received, epoch seconds),
        ``verb``, ``uri``, ``code``."""
        username = f"system:serviceaccount:{NAMESPACE}:{user}"
        requests: dict[str, dict[str, Any]] = {}
        with contextlib.suppress(FileNotFoundError), self.audit_log.open() as log:
            for line in log:
                event = json.loads(line)
                if event.get("user", {}).get("username") != username:
                    continue
                received = datetime.fromisoformat(event["requestReceivedTimestamp"].replace("Z", "+00:00"))
                entry = requests.setdefault(
                    event["auditID"],
                    {"time": received.timestamp(), "verb": event["verb"], "uri": event["requestURI"], "code": None},
                )
                code = (event.get("responseStatus") or {}).get("code")
                if code is not None:
                    entry["code"] = code
        return sorted((r for r in requests.values() if r["time"] >= since), key=lambda r: r["time"])

    def etcd(self, method: str, body: dict[str, Any]) -> dict[str, Any]:
        """One call of etcd's v3 JSON gateway (``/v3/kv/range``, ``/v3/kv/compaction``, ...)."""
        url = f"http://127.0.0.1:{self.testbed.ports['etcd_client']}/v3/{method}"
        request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST")
        with urllib.request.urlopen(request, timeout=30) as response:
            result: dict[str, Any] = json.loads(response.read())
        return result

    def compact_etcd(self) -> int:
        """Compact etcd's history up to its current revision (physically, as the API server's own
        compaction does every 5 minutes): every older resourceVersion is gone."""
        revision = int(self.etcd("kv/range", {"key": base64.b64encode(b"/registry").decode()})["header"]["revision"])
        self.etcd("kv/compaction", {"revision": str(revision), "physical": True})
        return revision


@pytest.fixture(scope="session")
def fault_testbed(tmp_path_factory: pytest.TempPathFactory, testbed_binaries: Binaries) -> Iterator[FaultTestbed]:
    """etcd + kube-apiserver for the fault tests only, auditing the requests of ``faults/*``
    ServiceAccounts."""
    root = tmp_path_factory.mktemp("fault-testbed")
    policy = root / "audit-policy.yaml"
    policy.write_text(AUDIT_POLICY)
    audit_log = root / "audit.log"
    args = [f"--audit-policy-file={policy}", f"--audit-log-path={audit_log}", "--audit-log-maxbackup=0"]
    with running(root / "tb", binaries=testbed_binaries, apiserver_args=args) as tb:
        admin = KubeClient(load_credentials(str(tb.kubeconfig)))
        yield FaultTestbed(tb, audit_log, admin)


# --- reading an exporter --------------------------------------------------------------------------------


def state_series(port: int) -> list[tuple[str, tuple[tuple[str, str], ...], float]]:
    """The cluster-state samples (``kube_*``) of one scrape, sorted, duplicates kept."""
    code, text = scrape(port)
    assert code == 200, text[:500]
    return sorted(
        (name, tuple(sorted(labels.items())), value)
        for name, labels, value in parse_samples(text)
        if name.startswith("kube_")
    )


def sample_value(port: int, name: str, **labels: str) -> float:
    """The sum of a self-metric's samples matching ``labels`` (0 when absent)."""
    _code, text = scrape(port)
    return sum(v for n, lab, v in parse_samples(text) if n == name and all(lab.get(k) == x for k, x in labels.items()))


# --- the TCP proxy -----------------------------------------------------------------------------------------


class TcpProxy:
    """A loopback TCP proxy in front of ``target``: the fault between a client and a real server.

    ``latency``: seconds added to every chunk in each direction (without limiting throughput: a
    slow network or an overloaded server, as seen from the client). ``cut()``: reset every open
    connection and every new one (a network partition) until ``heal()``. Counts connections."""

    def __init__(self, target: tuple[str, int], latency: float = 0.0, port: int = 0) -> None:
        self.target = target
        self.latency = latency
        self.connections = 0
        self._cut = False
        self._lock = threading.Lock()
        self._open: set[socket.socket] = set()
        self._threads: list[threading.Thread] = []
        self._stopping = threading.Event()
        self._listener = listen(port)
        self._listener.settimeout(0.2)
        self.port = int(self._listener.getsockname()[1])
        self._start(self._accept, "proxy-accept")

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.port}"

    def _start(self, target: Any, name: str, *args: Any) -> None:
        thread = threading.Thread(target=target, args=args, name=name, daemon=True)
        with self._lock:
            self._threads.append(thread)
        thread.start()

    def _accept(self) -> None:
        while not self._stopping.is_set():
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            with self._lock:
                self.connections += 1
                cut = self._cut
            if cut:
                _reset(client)
                continue
            try:
                upstream = socket.create_connection(self.target, timeout=5)
            except OSError:
                _reset(client)
                continue
            # Blocking, no timeout: an idle watch is silent for minutes.
            client.settimeout(None)
            upstream.settimeout(None)
            with self._lock:
                self._open.update((client, upstream))
            for src, dst, label in ((client, upstream, "up"), (upstream, client, "down")):
                chunks: queue.Queue[tuple[float, bytes] | None] = queue.Queue()
                self._start(self._read, f"proxy-read-{label}", src, chunks)
                self._start(self._write, f"proxy-write-{label}", dst, chunks)

    def _read(self, src: socket.socket, chunks: queue.Queue[tuple[float, bytes] | None]) -> None:
        try:
            while data := src.recv(65536):
                chunks.put((time.monotonic() + self.latency, data))
        except OSError:
            pass
        chunks.put(None)

    def _write(self, dst: socket.socket, chunks: queue.Queue[tuple[float, bytes] | None]) -> None:
        try:
            while (item := chunks.get()) is not None:
                due, data = item
                if (wait := due - time.monotonic()) > 0:
                    time.sleep(wait)
                dst.sendall(data)
            dst.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        finally:
            self._close(dst)

    def _close(self, sock: socket.socket) -> None:
        with self._lock:
            self._open.discard(sock)
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)  # wakes the reader of the other direction
        _reset(sock)

    def cut(self) -> None:
        with self._lock:
            self._cut = True
            victims = list(self._open)
        for sock in victims:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def heal(self) -> None:
        with self._lock:
            self._cut = False

    def stop(self) -> None:
        self._stopping.set()
        self.cut()
        self._listener.close()

        def all_ended() -> bool:
            # Read again each time: a connection accepted just before the listener closed may
            # still be starting its reader and writer.
            with self._lock:
                threads = list(self._threads)
            alive = [t for t in threads if t.is_alive()]
            for t in alive:
                t.join(0.1)
            return not alive

        wait_until(all_ended, timeout=10, interval=0, what="the proxy's threads to end")


def listen(port: int = 0) -> socket.socket:
    """A loopback listener on ``port``; a port just given up by another listener of this test may
    take a moment to be free again."""
    if not port:
        return socket.create_server(("127.0.0.1", 0))  # any port: nothing to wait for

    def bound() -> socket.socket | None:
        try:
            return socket.create_server(("127.0.0.1", port))
        except OSError:
            return None

    listener: socket.socket = wait_until(bound, timeout=10, what=f"port {port} to be free again")
    return listener


def _reset(sock: socket.socket) -> None:
    """Close with a TCP reset (SO_LINGER 0), as a dropped connection looks to the peer."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    with contextlib.suppress(OSError):
        sock.close()


@pytest.fixture
def proxy(fault_testbed: FaultTestbed) -> Iterator[Any]:
    """``proxy(latency=0.0)``: a TcpProxy in front of the fault testbed's API server, stopped
    after the test."""
    proxies: list[TcpProxy] = []

    def make(latency: float = 0.0) -> TcpProxy:
        p = TcpProxy(("127.0.0.1", fault_testbed.testbed.ports["apiserver"]), latency)
        proxies.append(p)
        return p

    yield make
    for p in proxies:
        p.stop()


@pytest.fixture
def exporters() -> Iterator[Any]:
    """``exporters(kubeconfig, **options)``: in-process exporters on free loopback ports (pods not
    watched: the suite's ServiceAccounts may list only the DRA resources), stopped after the test."""
    yield from exporter_starter(watch_pods=False)
