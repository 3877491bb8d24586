"""The kubelet's plugin watcher, for one node's registry directory.

The kubelet notices a new socket in ``plugins_registry``, asks it ``GetInfo``, checks the plugin type
and versions, connects to the advertised DRA endpoint and answers ``NotifyRegistrationStatus``.
A socket that disappears (or stops answering) deregisters the plugin.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from otel_dra._generated.dra.v1 import api_pb2_grpc as dra_v1_grpc
from otel_dra._generated.dra.v1beta1 import api_pb2_grpc as dra_v1beta1_grpc
from otel_dra._generated.pluginregistration import api_pb2 as reg_pb2
from otel_dra._generated.pluginregistration import api_pb2_grpc as reg_grpc

log = logging.getLogger(__name__)

DRA_PLUGIN_TYPE = "DRAPlugin"
# In order of preference, as the kubelet picks the newest version both sides speak.
_VERSIONS: dict[str, Any] = {"v1.DRAPlugin": dra_v1_grpc, "v1beta1.DRAPlugin": dra_v1beta1_grpc}


@dataclass
class Plugin:
    node: str
    driver: str
    endpoint: str
    version: str
    channel: grpc.Channel
    stub: Any  # DRAPluginStub of ``version``; both versions have the same messages and methods

    def close(self) -> None:
        self.channel.close()


class PluginWatcher:
    """Polls ``registry_dir`` (the kubelet uses inotify; polling keeps this portable) and keeps the
    registered plugins of ``node`` by driver name."""

    def __init__(self, node: str, registry_dir: Path, *, interval: float = 0.5, rpc_timeout: float = 5.0) -> None:
        self.node = node
        self.registry_dir = registry_dir
        self.interval = interval
        self.rpc_timeout = rpc_timeout
        self._lock = threading.Lock()
        self._plugins: dict[str, Plugin] = {}  # by driver name
        self._sockets: dict[Path, str] = {}  # registration socket -> driver
        self._failed: dict[Path, str] = {}  # sockets that failed registration -> error (logged once)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"plugin-watcher-{node}", daemon=True)

    def start(self) -> PluginWatcher:
        self.registry_dir.mkdir(parents=True, exist_ok=True)
        self.scan()
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        with self._lock:
            for plugin in self._plugins.values():
                plugin.close()
            self._plugins.clear()
            self._sockets.clear()

    def plugin(self, driver: str) -> Plugin | None:
        with self._lock:
            return self._plugins.get(driver)

    def drivers(self) -> list[str]:
        with self._lock:
            return sorted(self._plugins)

    def wait_for(self, driver: str, timeout: float) -> Plugin | None:
        deadline = time.monotonic() + timeout
        while (found := self.plugin(driver)) is None and time.monotonic() < deadline:
            time.sleep(0.05)
        return found

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.scan()
            except Exception:  # the watcher must outlive a bad socket or a bug in one scan
                log.exception("node %s: plugin registry scan failed", self.node)

    def scan(self) -> None:
        present = {p for p in self.registry_dir.glob("*.sock") if p.is_socket()}
        with self._lock:
            gone = [s for s in self._sockets if s not in present]
        for sock in gone:
            self._deregister(sock, "registration socket removed")
        for sock in sorted(present):
            with self._lock:
                known = sock in self._sockets
            if not known:
                self._register(sock)
        with self._lock:
            self._failed = {s: e for s, e in self._failed.items() if s in present}

    def _register(self, sock: Path) -> None:
        channel = grpc.insecure_channel(f"unix://{sock}")
        try:
            registration = reg_grpc.RegistrationStub(channel)
            info = registration.GetInfo(reg_pb2.InfoRequest(), timeout=self.rpc_timeout)
            error = self._check(info)
            if error:
                registration.NotifyRegistrationStatus(
                    reg_pb2.RegistrationStatus(plugin_registered=False, error=error), timeout=self.rpc_timeout
                )
                self._fail(sock, error)
                return
            version = next(v for v in _VERSIONS if v in info.supported_versions)
            dra_channel = grpc.insecure_channel(f"unix://{info.endpoint}")
            plugin = Plugin(
                self.node, info.name, info.endpoint, version, dra_channel, _VERSIONS[version].DRAPluginStub(dra_channel)
            )
            registration.NotifyRegistrationStatus(
                reg_pb2.RegistrationStatus(plugin_registered=True), timeout=self.rpc_timeout
            )
        except grpc.RpcError as exc:
            self._fail(sock, f"registration RPC failed: {exc.code().name}: {exc.details()}")
            return
        finally:
            channel.close()
        with self._lock:
            old = self._plugins.get(plugin.driver)
            self._plugins[plugin.driver] = plugin
            self._sockets[sock] = plugin.driver
            self._failed.pop(sock, None)
        if old is not None:
            old.close()
        log.info("node %s: registered DRA driver %s (%s at %s)", self.node, plugin.driver, version, plugin.endpoint)

    def _check(self, info: Any) -> str:
        if info.type != DRA_PLUGIN_TYPE:
            return f"unsupported plugin type {info.type!r}"
        if not info.name:
            return "plugin advertised an empty driver name"
        if not any(v in info.supported_versions for v in _VERSIONS):
            return f"no supported DRA service version in {list(info.supported_versions)}; need one of {list(_VERSIONS)}"
        if not Path(info.endpoint).is_socket():
            return f"DRA endpoint {info.endpoint!r} is not a socket"
        return ""

    def _fail(self, sock: Path, error: str) -> None:
        with self._lock:
            first = self._failed.get(sock) != error
            self._failed[sock] = error
        if first:
            log.warning("node %s: plugin at %s not registered: %s", self.node, sock, error)

    def _deregister(self, sock: Path, reason: str) -> None:
        with self._lock:
            driver = self._sockets.pop(sock, None)
            plugin = self._plugins.pop(driver, None) if driver else None
        if plugin is not None:
            plugin.close()
            log.info("node %s: deregistered DRA driver %s: %s", self.node, plugin.driver, reason)
