"""The kubelet-facing gRPC servers: DRAPlugin (v1 and v1beta1) on ``<plugins>/<driver>/dra.sock``,
Registration on ``<registrar>/<driver>-reg.sock``, and the standard gRPC health service on a TCP
port for liveness probes.

Two instances of the plugin must never serve the same sockets: gRPC happily binds a unix socket
path that a live server is using, silently taking it over. A lock file next to ``dra.sock``
(``fcntl.flock``, released by the kernel when the process dies, so never stale) decides who owns
the sockets; only its holder removes leftover socket files, and even then a socket that still
accepts connections is left alone and reported.
"""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent import futures
from pathlib import Path
from types import ModuleType
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from opentelemetry.trace import SpanKind
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from otel_dra._generated.dra.v1 import api_pb2 as dra_v1
from otel_dra._generated.dra.v1 import api_pb2_grpc as dra_v1_grpc
from otel_dra._generated.dra.v1beta1 import api_pb2 as dra_v1beta1
from otel_dra._generated.dra.v1beta1 import api_pb2_grpc as dra_v1beta1_grpc
from otel_dra._generated.drahealth.v1 import api_pb2 as health_v1
from otel_dra._generated.drahealth.v1 import api_pb2_grpc as health_v1_grpc
from otel_dra._generated.drahealth.v1alpha1 import api_pb2 as health_v1alpha1
from otel_dra._generated.drahealth.v1alpha1 import api_pb2_grpc as health_v1alpha1_grpc
from otel_dra._generated.pluginregistration import api_pb2 as reg_pb2
from otel_dra._generated.pluginregistration import api_pb2_grpc as reg_grpc
from otel_dra.plugin import registration
from otel_dra.plugin.driver import ERROR_TYPE, ClaimRef, ClaimResult, Driver
from otel_dra.plugin.health import HEALTH_SERVICES, HealthStreams
from otel_dra.telemetry.spans import SpanHandle

log = logging.getLogger(__name__)

PLUGIN_TYPE = "DRAPlugin"
SUPPORTED_VERSIONS = ("v1.DRAPlugin", "v1beta1.DRAPlugin")

# RPC semantic conventions after v1.37.0 (release candidate): rpc.system.name, rpc.method fully
# qualified ("<package>.<Service>/<Method>"), the status as a string. The attributes of v1.37.0 and
# before (rpc.system, rpc.service, rpc.grpc.status_code as a number, network.transport) are added
# with OTEL_SEMCONV_STABILITY_OPT_IN=rpc/dup; rpc.method keeps its current, fully qualified value
# then (one key cannot hold both).
RPC_SYSTEM_NAME = "rpc.system.name"
RPC_METHOD = "rpc.method"
RPC_RESPONSE_STATUS = "rpc.response.status_code"
RPC_SYSTEM = "rpc.system"
RPC_SERVICE = "rpc.service"
RPC_GRPC_STATUS = "rpc.grpc.status_code"
NETWORK_TRANSPORT = "network.transport"
SEMCONV_OPT_IN = "OTEL_SEMCONV_STABILITY_OPT_IN"
CLAIM_COUNT = "dra.claim.count"
CLAIM_ERRORS = "dra.claim.errors"


class PluginStartError(RuntimeError):
    """The plugin cannot serve its sockets (another instance owns them, bad paths ...)."""


class AlreadyRunning(PluginStartError):
    pass


class SocketLock:
    """An exclusive ``flock`` on a file; the file holds the owner's pid for the error message."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd: int | None = None

    def acquire(self) -> None:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            try:
                owner = os.read(fd, 32).decode(errors="replace").strip() or "unknown"
            finally:
                os.close(fd)
            raise AlreadyRunning(
                f"another plugin instance (pid {owner}) holds {self.path} and serves its sockets; "
                "refusing to take them over"
            ) from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing drops the flock; the file stays (unlinking it would race)
            self._fd = None


def _socket_alive(path: Path) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(1.0)
        try:
            s.connect(str(path))
        except OSError:
            return False
        return True


def old_rpc_attributes(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether spans also carry the RPC attributes of semconv v1.37.0 (``rpc/dup``)."""
    return "rpc/dup" in {v.strip() for v in environ.get(SEMCONV_OPT_IN, "").split(",")}


def _claim_refs(request: Any) -> list[ClaimRef]:
    return [ClaimRef(namespace=c.namespace, uid=c.uid, name=c.name) for c in request.claims]


class _DraServicer:
    """NodePrepareResources/NodeUnprepareResources of one API version, each RPC one SERVER span."""

    def __init__(self, pb2: ModuleType, driver: Driver) -> None:
        self.pb2 = pb2
        self.service = pb2.DESCRIPTOR.services_by_name["DRAPlugin"].full_name
        self.driver = driver
        self._propagator = TraceContextTextMapPropagator()
        self._old_attributes = old_rpc_attributes()

    @contextlib.contextmanager
    def _rpc_span(self, method: str, claims: int, context: grpc.ServicerContext) -> Iterator[SpanHandle | None]:
        if claims == 0:
            # Health probes call with no claims every few seconds; a trace of nothing is noise.
            yield None
            return
        parent = None
        if self.driver.spans.enabled:  # tracing off: no span takes the caller's context
            metadata = {k: v for k, v in context.invocation_metadata() if isinstance(v, str)}
            parent = self._propagator.extract(metadata)  # a traceparent sent by the caller, if any
        # The call's span keeps its caller's trace (or a new one); the claims' spans are in their
        # own traces and linked with this one both ways (otel_dra.plugin.driver, module notes).
        attributes: dict[str, Any] = {
            RPC_SYSTEM_NAME: "grpc",
            RPC_METHOD: f"{self.service}/{method}",
            CLAIM_COUNT: claims,
        }
        if self._old_attributes:
            attributes.update({RPC_SYSTEM: "grpc", RPC_SERVICE: self.service, NETWORK_TRANSPORT: "unix"})
        operation = "prepare" if method == "NodePrepareResources" else "unprepare"
        with (
            self.driver.metrics.in_flight(operation),
            self.driver.spans.start(
                f"{self.service}/{method}", context=parent, kind=SpanKind.SERVER, attributes=attributes
            ) as span,
        ):
            try:
                yield span
            except BaseException as exc:
                self._status(span, grpc.StatusCode.UNKNOWN)
                span.set_attribute(ERROR_TYPE, type(exc).__qualname__)
                raise
            self._status(span, grpc.StatusCode.OK)

    def _status(self, span: SpanHandle, code: grpc.StatusCode) -> None:
        span.set_attribute(RPC_RESPONSE_STATUS, code.name)  # "OK", "UNKNOWN": the string form
        if self._old_attributes:
            span.set_attribute(RPC_GRPC_STATUS, code.value[0])

    def _errors(self, span: SpanHandle | None, results: dict[str, ClaimResult]) -> None:
        if span is not None:
            failed = sum(1 for r in results.values() if not r.ok)
            span.set_attribute(CLAIM_ERRORS, failed)

    def NodePrepareResources(self, request: Any, context: grpc.ServicerContext) -> Any:
        refs = _claim_refs(request)
        with self._rpc_span("NodePrepareResources", len(refs), context) as span:
            results = self.driver.prepare(refs, span)
            self._errors(span, results)
        response = self.pb2.NodePrepareResourcesResponse()
        for uid, result in results.items():
            entry = response.claims[uid]
            if result.error:
                entry.error = result.error
                continue
            for d in result.devices:
                entry.devices.add(
                    request_names=list(d.request_names),
                    pool_name=d.pool_name,
                    device_name=d.device_name,
                    cdi_device_ids=list(d.cdi_device_ids),
                )
        return response

    def NodeUnprepareResources(self, request: Any, context: grpc.ServicerContext) -> Any:
        refs = _claim_refs(request)
        with self._rpc_span("NodeUnprepareResources", len(refs), context) as span:
            results = self.driver.unprepare(refs, span)
            self._errors(span, results)
        response = self.pb2.NodeUnprepareResourcesResponse()
        for uid, result in results.items():
            response.claims[uid].error = result.error
        return response


class _RegistrationServicer:
    def __init__(
        self, driver_name: str, endpoint: Path, on_status: Callable[[bool, str], None], versions: tuple[str, ...]
    ) -> None:
        self.info = reg_pb2.PluginInfo(
            type=PLUGIN_TYPE, name=driver_name, endpoint=str(endpoint), supported_versions=list(versions)
        )
        self.on_status = on_status

    def GetInfo(self, request: reg_pb2.InfoRequest, context: grpc.ServicerContext) -> reg_pb2.PluginInfo:
        return self.info

    def NotifyRegistrationStatus(
        self, request: reg_pb2.RegistrationStatus, context: grpc.ServicerContext
    ) -> reg_pb2.RegistrationStatusResponse:
        self.on_status(request.plugin_registered, request.error)
        return reg_pb2.RegistrationStatusResponse()


_POOLS = itertools.count(1)


class _GrpcServer:
    """A grpc.Server and the thread pool it runs handlers on, stopped together: ``grpc.Server.stop``
    leaves the pool's threads waiting for work until the process exits."""

    def __init__(self, max_workers: int, thread_name_prefix: str) -> None:
        # A prefix of this pool's own (several servers may run in one process, tests' plugins say),
        # by which stop() finds its workers without the pool's private thread set.
        self._thread_prefix = f"{thread_name_prefix}-{next(_POOLS)}"
        self.pool = futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix=self._thread_prefix)
        self.server = grpc.server(self.pool)

    def stop(self, grace: float) -> None:
        """In-flight RPCs get ``grace`` seconds; waits at most ``grace + 2`` seconds in all."""
        deadline = time.monotonic() + grace + 2
        self.server.stop(grace).wait(grace + 1)
        self.pool.shutdown(wait=False, cancel_futures=True)
        # shutdown(wait=True) would wait without a bound for a handler that never returns.
        for thread in threading.enumerate():
            if thread.name.startswith(self._thread_prefix + "_"):
                thread.join(max(0.0, deadline - time.monotonic()))


class PluginServer:
    """Owns the plugin's sockets: lock, stale-socket cleanup, the gRPC server behind both."""

    def __init__(
        self,
        driver: Driver,
        *,
        driver_name: str,
        plugins_dir: Path,
        registrar_dir: Path,
        max_workers: int = 8,
        on_registered: Callable[[], None] | None = None,
        health: HealthStreams | None = None,
    ) -> None:
        """``on_registered`` is called (from a gRPC thread; must not block) each time the kubelet
        confirms a registration: after a kubelet restart too. With ``health`` the DRAResourceHealth
        services are served too, and advertised in the registration (the kubelet looks there)."""
        self.on_registered = on_registered
        self.health = health
        self.supported_versions = SUPPORTED_VERSIONS + (HEALTH_SERVICES if health is not None else ())
        self.driver = driver
        self.driver_name = driver_name
        # What the kubelet would refuse to register is refused here, before any socket exists.
        problem = registration.startup_problem(driver_name, plugins_dir, registrar_dir)
        if problem is not None:
            raise PluginStartError(problem)
        self.plugin_dir = plugins_dir / driver_name
        self.registrar_dir = registrar_dir
        self.dra_socket = registration.dra_socket(plugins_dir, driver_name)
        self.registration_socket = registration.registration_socket(registrar_dir, driver_name)
        self._lock = SocketLock(self.plugin_dir / "plugin.lock")
        self._max_workers = max_workers
        self._server: _GrpcServer | None = None
        self.registered = threading.Event()
        self.registration_error = ""

    def _on_registration(self, registered: bool, error: str) -> None:
        self.registration_error = error
        if registered:
            log.info("registered with the kubelet as %s (%s)", self.driver_name, ", ".join(self.supported_versions))
            self.registered.set()
            if self.on_registered is not None:
                try:
                    self.on_registered()
                except Exception:  # the kubelet's RPC must not fail for what we do with the news
                    log.exception("handling the registration failed")
        else:
            log.error("the kubelet rejected the registration: %s", error or "(no reason given)")
            self.registered.clear()

    def _clear_stale(self, path: Path) -> None:
        if not path.exists() and not path.is_symlink():
            return
        if _socket_alive(path):
            raise AlreadyRunning(f"{path} is served by another process; refusing to take it over")
        log.info("removing stale socket %s", path)
        path.unlink()

    def start(self) -> PluginServer:
        self.plugin_dir.mkdir(parents=True, exist_ok=True)
        self.registrar_dir.mkdir(parents=True, exist_ok=True)
        self._lock.acquire()
        try:
            self._clear_stale(self.dra_socket)
            self._clear_stale(self.registration_socket)
            # A health stream holds its gRPC thread for as long as it lasts: the streams get threads
            # of their own (one spare for the moment a new stream replaces the oldest), so that
            # prepare/unprepare always have max_workers.
            spare = self.health.max_streams + 1 if self.health is not None else 0
            # One server for both sockets: each Python gRPC server has a poll thread that wakes
            # five times a second, idle or not (docs/benchmarks-log.md, issue 29). Both sockets
            # then offer every service; both live in directories only the kubelet reaches.
            server = _GrpcServer(self._max_workers + spare, "dra-grpc")
            dra_v1_grpc.add_DRAPluginServicer_to_server(_DraServicer(dra_v1, self.driver), server.server)
            dra_v1beta1_grpc.add_DRAPluginServicer_to_server(_DraServicer(dra_v1beta1, self.driver), server.server)
            if self.health is not None:
                health_v1_grpc.add_DRAResourceHealthServicer_to_server(self.health.servicer(health_v1), server.server)
                health_v1alpha1_grpc.add_DRAResourceHealthServicer_to_server(
                    self.health.servicer(health_v1alpha1), server.server
                )
            reg_grpc.add_RegistrationServicer_to_server(
                _RegistrationServicer(
                    self.driver_name, self.dra_socket, self._on_registration, self.supported_versions
                ),
                server.server,
            )
            self._server = server
            # Both listen from here on, dra.sock first; connections wait in the backlog until
            # start(), so the kubelet, which dials the registration socket once it appears, is
            # answered once dra.sock serves.
            self._bind(server.server, self.dra_socket)
            self._bind(server.server, self.registration_socket)
            server.server.start()
        except BaseException:
            self.stop()
            raise
        log.info("serving DRAPlugin on %s, registration on %s", self.dra_socket, self.registration_socket)
        return self

    @staticmethod
    def _bind(server: grpc.Server, path: Path) -> None:
        # "unix:" and the path, not "unix://": gRPC's server binds what follows "unix:" (only
        # percent-decoded, and the registration rules keep '%' out), so "unix:///x" binds "///x",
        # two bytes longer, and a 106- or 107-byte path, which the kubelet takes, would not fit.
        try:
            server.add_insecure_port(f"unix:{path}")
        except RuntimeError as exc:
            raise PluginStartError(f"cannot listen on {path}: {exc}") from exc

    def stop(self, grace: float = 5.0) -> None:
        """Unregister first: the registration socket's file goes, which the kubelet's plugin watcher
        takes as the plugin leaving; then stop serving claims (in-flight calls get ``grace``).
        Health streams end just before: cleanly, which the kubelet takes as EOF, not as an error."""
        server, self._server = self._server, None
        if server is not None:  # else nothing of ours listens: the socket files are not ours
            with contextlib.suppress(FileNotFoundError):
                self.registration_socket.unlink()
            if self.health is not None:
                self.health.state.close()
            server.stop(grace)
            with contextlib.suppress(FileNotFoundError):
                self.dra_socket.unlink()
        self._lock.release()


class _HealthServicer(health_pb2_grpc.HealthServicer):
    """Like dra-example-driver's: SERVING when both of the plugin's sockets answer."""

    KNOWN = ("", "liveness")

    def __init__(self, driver_name: str, dra_socket: Path, registration_socket: Path, timeout: float) -> None:
        self.driver_name = driver_name
        self.timeout = timeout
        self._reg_channel = grpc.insecure_channel(f"unix://{registration_socket}")
        self._dra_channel = grpc.insecure_channel(f"unix://{dra_socket}")
        self._reg = reg_grpc.RegistrationStub(self._reg_channel)
        self._dra = dra_v1_grpc.DRAPluginStub(self._dra_channel)

    def Check(
        self, request: health_pb2.HealthCheckRequest, context: grpc.ServicerContext
    ) -> health_pb2.HealthCheckResponse:
        if request.service not in self.KNOWN:
            context.abort(grpc.StatusCode.NOT_FOUND, f"unknown service {request.service!r}")
        try:
            info = self._reg.GetInfo(reg_pb2.InfoRequest(), timeout=self.timeout)
            if info.name == self.driver_name:
                self._dra.NodePrepareResources(dra_v1.NodePrepareResourcesRequest(), timeout=self.timeout)
                return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)
            log.warning("health check: the registration socket names driver %r", info.name)
        except grpc.RpcError as exc:
            log.warning("health check failed: %s", exc)
        return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.NOT_SERVING)

    def close(self) -> None:
        self._reg_channel.close()
        self._dra_channel.close()


class HealthServer:
    """``grpc.health.v1.Health`` on a TCP port (0: a free one, see :attr:`port`)."""

    def __init__(self, plugin: PluginServer, port: int, address: str = "[::]", timeout: float = 5.0) -> None:
        self._servicer = _HealthServicer(plugin.driver_name, plugin.dra_socket, plugin.registration_socket, timeout)
        self._grpc = _GrpcServer(2, "health-grpc")
        self._server = self._grpc.server
        health_pb2_grpc.add_HealthServicer_to_server(self._servicer, self._server)
        try:
            self.port = self._server.add_insecure_port(f"{address}:{port}")
        except RuntimeError as exc:
            raise PluginStartError(f"--healthcheck-port {port}: cannot listen: {exc}") from exc

    def start(self) -> HealthServer:
        self._server.start()
        return self

    def stop(self) -> None:
        self._grpc.stop(1)
        self._servicer.close()
