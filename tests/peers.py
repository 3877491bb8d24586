"""The real observability peers for end-to-end tests: Prometheus, the OpenTelemetry Collector, Jaeger.

Each runs as an ordinary process on free loopback ports with its config, data and log under a
temporary directory. ``start_*`` returns once the peer answers its readiness check; a peer that dies
or never gets ready raises with the tail of its log. While a peer runs it is listed in ``RUNNING`` so
that a failing test's report carries the peers' logs (see the hook in tests/conftest.py).

The binaries: Prometheus from Debian (/usr/bin/prometheus), the Collector and Jaeger built from Go
modules by ``otel-dra testbed build --otelcol --jaeger`` (``make peers``).
"""

from __future__ import annotations

import copy
import functools
import json
import os
import re
import shutil
import signal
import subprocess
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ParamSpec, TypeVar

import yaml

from tests.helpers import free_port, wait_until

ROOT = Path(__file__).resolve().parents[1]
COLLECTOR_CONFIGS = ROOT / "collector-config"

_LOG_TAIL_LINES = 60
RUNNING: list[Peer] = []


class PeerError(RuntimeError):
    """A peer did not start, or died."""


class PortTaken(PeerError):
    """A peer could not bind a port picked for it: another process took it after free_port()."""


_P = ParamSpec("_P")
_T = TypeVar("_T")


def _fresh_ports_on_clash(start: Callable[_P, _T]) -> Callable[_P, _T]:
    """Run a ``start_*`` function again (it picks new free ports) when the peer lost a port race;
    free_port() can only say a port was free a moment ago."""

    @functools.wraps(start)
    def again(*args: _P.args, **kwargs: _P.kwargs) -> _T:
        for attempt in range(3):
            try:
                return start(*args, **kwargs)
            except PortTaken:
                if attempt == 2:
                    raise
        raise AssertionError("unreachable")

    return again


@dataclass
class Peer:
    """A running peer process; ``stop()`` ends it (SIGTERM, then SIGKILL) and keeps its log."""

    name: str
    proc: subprocess.Popen[bytes]
    dir: Path
    log: Path
    ports: dict[str, int] = field(default_factory=dict)

    def log_tail(self, lines: int = _LOG_TAIL_LINES) -> str:
        try:
            text = self.log.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def alive(self) -> bool:
        return self.proc.poll() is None

    def url(self, port: str, path: str = "") -> str:
        return f"http://127.0.0.1:{self.ports[port]}{path}"

    def stop(self) -> None:
        if self in RUNNING:
            RUNNING.remove(self)
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _get(url: str, timeout: float = 5.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def _start(
    name: str,
    cmd: list[str],
    workdir: Path,
    ready: Callable[[Peer], bool],
    *,
    ports: dict[str, int],
    env: Mapping[str, str] | None = None,
    timeout: float = 60.0,
) -> Peer:
    workdir.mkdir(parents=True, exist_ok=True)
    log = workdir / f"{name}.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            cmd,
            cwd=workdir,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
            start_new_session=True,
        )
    peer = Peer(name, proc, workdir, log, ports)
    RUNNING.append(peer)

    def started() -> bool:
        if not peer.alive():
            peer.stop()
            tail = peer.log_tail()
            error = PortTaken if "address already in use" in tail else PeerError
            raise error(f"{name} exited with {proc.returncode} while starting; log {log}:\n{tail}")
        try:
            return bool(ready(peer))
        except OSError:
            return False  # not listening yet

    try:
        wait_until(started, timeout=timeout, interval=0.2, what=f"{name} ready")
    except AssertionError:
        peer.stop()
        raise PeerError(f"{name} not ready after {timeout:.0f}s; log {log}:\n{peer.log_tail()}") from None
    return peer


# --- Prometheus --------------------------------------------------------------------------------


class Prometheus(Peer):
    """A real Prometheus; scrape jobs are set with :meth:`set_jobs` (config rewrite + reload)."""

    jobs: dict[str, dict[str, Any]]

    @property
    def base(self) -> str:
        return self.url("web")

    def set_jobs(self, jobs: Mapping[str, Mapping[str, Any]]) -> None:
        """Replace the scrape jobs (name -> scrape_config without job_name) and wait until Prometheus
        has loaded them (each job's targets listed in /api/v1/targets)."""
        self.jobs = {name: dict(job) for name, job in jobs.items()}
        _write_prometheus_config(self.dir / "prometheus.yml", self.jobs)
        req = urllib.request.Request(self.base + "/-/reload", method="POST")
        with urllib.request.urlopen(req, timeout=10) as resp:
            assert resp.status == 200
        expected = set(self.jobs)

        def loaded() -> bool:
            return expected <= {t["labels"].get("job") for t in self.api("/api/v1/targets")["activeTargets"]}

        try:
            wait_until(loaded, timeout=30, interval=0.2, what="Prometheus to load the jobs")
        except AssertionError:
            raise PeerError(f"Prometheus did not load jobs {sorted(expected)}; log:\n{self.log_tail()}") from None

    def api(self, path: str, **params: str) -> Any:
        """GET an API path; returns ``data`` of a success answer, raises with Prometheus' error."""
        status, body = self.api_raw(path, **params)
        answer = json.loads(body)
        if status != 200 or answer.get("status") != "success":
            raise PeerError(f"Prometheus {path} {params}: HTTP {status} {answer}")
        return answer["data"]

    def api_raw(self, path: str, **params: str) -> tuple[int, bytes]:
        query = urllib.parse.urlencode(params)
        return _get(f"{self.base}{path}?{query}" if query else f"{self.base}{path}", timeout=15)

    def query(self, expr: str) -> list[dict[str, Any]]:
        data = self.api("/api/v1/query", query=expr)
        result: list[dict[str, Any]] = data["result"]
        return result

    def metric_names(self, selector: str) -> set[str]:
        """Names of the series matching ``selector`` (e.g. ``{path="direct"}``) now."""
        return set(self.api("/api/v1/label/__name__/values", **{"match[]": selector}))

    def targets_up(self, job: str) -> bool:
        targets = [t for t in self.api("/api/v1/targets")["activeTargets"] if t["labels"].get("job") == job]
        return bool(targets) and all(t["health"] == "up" for t in targets)


def _write_prometheus_config(path: Path, jobs: Mapping[str, Mapping[str, Any]]) -> None:
    config = {
        # One-second scrapes keep the tests short; evaluation is not used.
        "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
        "scrape_configs": [{"job_name": name, **job} for name, job in jobs.items()],
    }
    tmp = path.with_suffix(".tmp")
    tmp.write_text(yaml.safe_dump(config, sort_keys=False))
    tmp.replace(path)


def prometheus_binary() -> str:
    binary = shutil.which("prometheus")
    if binary is None:
        raise PeerError("prometheus is not installed (Debian package `prometheus`; .ci/run installs it)")
    return binary


@_fresh_ports_on_clash
def start_prometheus(workdir: Path, jobs: Mapping[str, Mapping[str, Any]] | None = None) -> Prometheus:
    port = free_port()
    _write_prometheus_config(workdir / "prometheus.yml", jobs or {})
    (workdir / "data").mkdir(parents=True, exist_ok=True)
    cmd = [
        prometheus_binary(),
        f"--config.file={workdir / 'prometheus.yml'}",
        f"--storage.tsdb.path={workdir / 'data'}",
        f"--web.listen-address=127.0.0.1:{port}",
        "--web.enable-lifecycle",  # POST /-/reload after set_jobs()
        "--log.level=info",
    ]
    peer = _start(
        "prometheus",
        cmd,
        workdir,
        lambda p: _get(p.url("web", "/-/ready"))[0] == 200,
        ports={"web": port},
    )
    prom = Prometheus(peer.name, peer.proc, peer.dir, peer.log, peer.ports)
    prom.jobs = dict(jobs or {})
    RUNNING[RUNNING.index(peer)] = prom
    return prom


# --- OpenTelemetry Collector -------------------------------------------------------------------

_ENDPOINT = re.compile(r"^(0\.0\.0\.0|localhost|127\.0\.0\.1):(\d+)$")


def localize_ports(config: Any) -> tuple[Any, dict[int, int]]:
    """A copy of a Collector config with every listening ``host:port`` endpoint (0.0.0.0, localhost)
    moved to 127.0.0.1 and a free port, and the telemetry reader's host/port likewise.

    Returns the new config and ``{original port: new port}``. Endpoints the Collector connects to
    (exporters) are left alone: tests point them elsewhere through the config's ``${env:...}``.
    """
    config = copy.deepcopy(config)
    mapping: dict[int, int] = {}

    def new_port(old: int) -> int:
        if old not in mapping:
            mapping[old] = free_port()
        return mapping[old]

    def walk(node: Any) -> Any:
        if isinstance(node, dict):
            return {key: walk(value) for key, value in node.items()}
        if isinstance(node, list):
            return [walk(value) for value in node]
        if isinstance(node, str):
            m = _ENDPOINT.match(node)
            if m:
                return f"127.0.0.1:{new_port(int(m.group(2)))}"
        return node

    for section in ("receivers", "extensions"):
        if section in config:
            config[section] = walk(config[section])
    for name, exporter in (config.get("exporters") or {}).items():
        # Only exporters that listen (prometheus) have a bare endpoint without a scheme.
        if name.split("/")[0] == "prometheus":
            config["exporters"][name] = walk(exporter)
    telemetry = config.get("service", {}).get("telemetry", {})
    for reader in telemetry.get("metrics", {}).get("readers", []):
        prom = reader.get("pull", {}).get("exporter", {}).get("prometheus")
        if prom is not None:
            prom["host"] = "127.0.0.1"
            prom["port"] = new_port(int(prom["port"]))
    return config, mapping


def load_collector_config(name: str) -> Any:
    return yaml.safe_load((COLLECTOR_CONFIGS / name).read_text())


@dataclass
class Collector:
    peer: Peer
    config: Any
    ports: dict[int, int]  # port in the shipped config -> port in this run

    def endpoint(self, config_port: int) -> str:
        return f"127.0.0.1:{self.ports[config_port]}"

    def stop(self) -> None:
        self.peer.stop()


def validate_collector_config(otelcol: Path, config: Path, env: Mapping[str, str] | None = None) -> str:
    """``otelcol validate``; returns its output, raises PeerError when the config is rejected."""
    result = subprocess.run(
        [str(otelcol), "validate", f"--config={config}"],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        timeout=60,
    )
    if result.returncode != 0:
        raise PeerError(f"otelcol validate {config} failed ({result.returncode}):\n{result.stdout}{result.stderr}")
    return result.stdout + result.stderr


@_fresh_ports_on_clash
def start_collector(
    otelcol: Path,
    workdir: Path,
    config: Any,
    *,
    env: Mapping[str, str] | None = None,
    health_port: int = 13133,
) -> Collector:
    """Run the Collector with ``config`` (a shipped config as loaded; its ports are localized) and
    wait until its health_check extension reports the pipelines ready."""
    local, mapping = localize_ports(config)
    workdir.mkdir(parents=True, exist_ok=True)
    path = workdir / "collector.yaml"
    path.write_text(yaml.safe_dump(local, sort_keys=False))
    validate_collector_config(otelcol, path, env)
    health = mapping[health_port]
    peer = _start(
        "otelcol",
        [str(otelcol), f"--config={path}"],
        workdir,
        lambda p: _get(f"http://127.0.0.1:{health}/")[0] == 200,
        ports={"health": health},
        env=env,
    )
    return Collector(peer, local, mapping)


# --- Jaeger ------------------------------------------------------------------------------------


def jaeger_config(otlp_grpc: int, otlp_http: int, query_http: int, query_grpc: int) -> dict[str, Any]:
    """Jaeger v2 all-in-one with memory storage on the given loopback ports (its built-in config
    listens on fixed ports that clash with a Collector's)."""
    return {
        "service": {
            "extensions": ["jaeger_storage", "jaeger_query"],
            "pipelines": {
                "traces": {
                    "receivers": ["otlp"],
                    "processors": ["batch"],
                    "exporters": ["jaeger_storage_exporter"],
                }
            },
            "telemetry": {"metrics": {"level": "none"}, "logs": {"level": "info"}},
        },
        "extensions": {
            "jaeger_storage": {"backends": {"memstore": {"memory": {"max_traces": 10000}}}},
            "jaeger_query": {
                "storage": {"traces": "memstore"},
                # On by default in Jaeger v2: it would send the query service's own traces to
                # whatever listens on localhost:4317.
                "enable_tracing": False,
                "http": {"endpoint": f"127.0.0.1:{query_http}"},
                "grpc": {"endpoint": f"127.0.0.1:{query_grpc}"},
            },
        },
        "receivers": {
            "otlp": {
                "protocols": {
                    "grpc": {"endpoint": f"127.0.0.1:{otlp_grpc}"},
                    "http": {"endpoint": f"127.0.0.1:{otlp_http}"},
                }
            }
        },
        "processors": {"batch": {"timeout": "200ms"}},
        "exporters": {"jaeger_storage_exporter": {"trace_storage": "memstore"}},
    }


class Jaeger(Peer):
    @property
    def otlp_grpc(self) -> str:
        return f"127.0.0.1:{self.ports['otlp_grpc']}"

    def services(self) -> list[str]:
        status, body = _get(self.url("query", "/api/services"))
        assert status == 200, body
        data: list[str] = json.loads(body).get("data") or []
        return data

    def traces(self, service: str, **params: str) -> list[dict[str, Any]]:
        """``GET /api/traces?service=...``: the traces Jaeger holds for a service ([] when none)."""
        query = urllib.parse.urlencode({"service": service, "limit": "20", **params})
        status, body = _get(self.url("query", f"/api/traces?{query}"))
        if status != 200:
            return []  # e.g. a service Jaeger has not seen yet; callers wait and report the last answer
        data: list[dict[str, Any]] = json.loads(body).get("data") or []
        return data

    def trace(self, trace_id: str) -> dict[str, Any] | None:
        """``GET /api/traces/<id>``: one trace by its 32 hex digits (None when Jaeger has none)."""
        status, body = _get(self.url("query", f"/api/traces/{trace_id}"))
        if status != 200:
            return None
        data: list[dict[str, Any]] = json.loads(body).get("data") or []
        return data[0] if data else None


@_fresh_ports_on_clash
def start_jaeger(jaeger: Path, workdir: Path) -> Jaeger:
    ports = {name: free_port() for name in ("otlp_grpc", "otlp_http", "query", "query_grpc")}
    workdir.mkdir(parents=True, exist_ok=True)
    path = workdir / "jaeger.yaml"
    path.write_text(
        yaml.safe_dump(jaeger_config(ports["otlp_grpc"], ports["otlp_http"], ports["query"], ports["query_grpc"]))
    )
    peer = _start(
        "jaeger",
        [str(jaeger), f"--config={path}"],
        workdir,
        lambda p: _get(p.url("query", "/api/services"))[0] == 200,
        ports=ports,
    )
    j = Jaeger(peer.name, peer.proc, peer.dir, peer.log, peer.ports)
    RUNNING[RUNNING.index(peer)] = j
    return j


def stop_all(peers: Iterable[Peer | Collector]) -> None:
    for peer in peers:
        peer.stop()
