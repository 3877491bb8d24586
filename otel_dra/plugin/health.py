"""Device health: one state per device, the kubelet's DRAResourceHealth stream, the simulated
health source and the taints of sick devices.

The wire contract is ``k8s.io/kubelet/pkg/apis/dra-health/{v1,v1alpha1}/api.proto`` (vendored under
proto/). What the kubelet (v1.37.2) does with it, from its source:

- It learns that a plugin serves the stream from the registration's ``supported_versions``: an
  entry ``v1.DRAResourceHealth`` or ``v1alpha1.DRAResourceHealth`` (``<gRPC package>.<service>``);
  it picks v1 when both are there (``pickHealthService``), opens ``NodeWatchResources`` once per
  registration with feature gate ``ResourceHealthStatus`` (beta, on by default since 1.36) and
  reopens it 5 s after it ends. Unimplemented makes it stop watching.
- Each response is the complete list of the driver's devices. The kubelet stamps each entry with
  its own receive time; an entry not refreshed within its ``health_check_timeout_seconds`` reads
  Unknown. So the stream repeats the full state well within the advertised timeout.
- A stream that ends with OK (EOF) is logged at -v=4; any other error than cancellation and
  Unimplemented is logged as an error ("Error receiving from WatchResources stream"). So the plugin
  ends its streams cleanly when it stops.
- It writes the health of each device a container's claim uses into
  ``status.containerStatuses[].allocatedResourcesStatus[]{name: "claim:<claim>[/<request>]",
  resources[]{resourceID: <first CDI device ID>, health: Healthy|Unhealthy|Unknown, message}}``
  (message with ``ResourceHealthStatusMessage``, beta and on since 1.36).

Nothing here runs on the prepare/unprepare path: sources and streams have threads of their own, a
stream waits on a condition (no queue grows, a slow kubelet only gets fewer, newer snapshots), and
streams have gRPC threads of their own beyond the ones prepare/unprepare use (see PluginServer).
"""

from __future__ import annotations

import enum
import logging
import re
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import grpc

from otel_dra.kube.timestamps import format_time
from otel_dra.plugin.registration import go_to_lower
from otel_dra.records import record, replace

log = logging.getLogger(__name__)

HEALTH_SERVICES = ("v1.DRAResourceHealth", "v1alpha1.DRAResourceHealth")  # the kubelet prefers the first
DEFAULT_TIMEOUT_SECONDS = 30  # the kubelet's own default (DefaultHealthTimeout)
MAX_MESSAGE = 1024  # characters; the kubelet truncates longer ones
DEFAULT_MAX_STREAMS = 4
TAINT_EFFECTS = ("NoSchedule", "NoExecute")
# A taint value is a label value: up to 63 characters, alphanumerics and -_. inside.
_TAINT_VALUE = re.compile(r"[^A-Za-z0-9_.-]+")


class Health(enum.IntEnum):
    """The values of the proto's HealthStatus enum (the same in v1 and v1alpha1)."""

    UNKNOWN = 0
    HEALTHY = 1
    UNHEALTHY = 2

    @property
    def label(self) -> str:
        return self.name.lower()


@record(frozen=True)
class DeviceHealth:
    device: str
    health: Health
    message: str = ""
    reason: str = ""  # short and bounded (a taint value): "simulated", "xid-79", "gpu-lost" ...
    since: float = 0.0  # wall time the device entered this health
    checked: float = 0.0  # wall time its health was last determined


class HealthState:
    """The health of every device of this node; thread-safe. Sources call :meth:`report` and
    :meth:`checked`; streams wait for :attr:`version` to change; listeners (taints) are called
    after each change, outside the lock, from the reporting thread, and must not block."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self.condition = threading.Condition()
        self._devices: dict[str, DeviceHealth] = {}
        self.version = 0
        self.closed = False
        self._listeners: list[Callable[[], None]] = []
        # When a source last found nothing new on every device: one number, not a new entry per
        # device, since a source that polls each second would otherwise rebuild all of them each
        # time (0.8 ms a poll for 64 devices, most of the plugin's idle CPU). An entry's checked
        # time is the later of its own and this.
        self._all_checked = 0.0

    def add_listener(self, listener: Callable[[], None]) -> None:
        self._listeners.append(listener)

    def set_devices(self, names: Sequence[str]) -> None:
        """The devices discovery found: new ones start healthy (no problem seen), gone ones go."""
        now = self._clock()
        with self.condition:
            current = self._devices
            devices = {n: current.get(n) or DeviceHealth(n, Health.HEALTHY, since=now, checked=now) for n in names}
            changed = set(devices) != set(current)
            self._devices = devices
            if changed:
                self._changed()
        if changed:
            self._notify()

    def report(self, device: str, health: Health, message: str = "", reason: str = "") -> bool:
        """Record what a source found; True when it changed the device's health or message."""
        now = self._clock()
        message = message[:MAX_MESSAGE]
        with self.condition:
            old = self._devices.get(device)
            if old is None:
                return False  # not (or no longer) published: nothing to tell
            if (old.health, old.message, old.reason) == (health, message, reason):
                self._devices[device] = replace(old, checked=now)
                return False
            since = old.since if old.health == health else now
            self._devices[device] = DeviceHealth(device, health, message, reason, since, now)
            self._changed()
        log.log(
            logging.WARNING if health != Health.HEALTHY else logging.INFO,
            "device %s is %s%s",
            device,
            health.label,
            f": {message}" if message else "",
        )
        self._notify()
        return True

    def checked(self, devices: Sequence[str] | None = None) -> None:
        """A source looked at these devices (all: None) and found nothing new."""
        now = self._clock()
        with self.condition:
            if devices is None:
                self._all_checked = now
                return
            for name in devices:
                entry = self._devices.get(name)
                if entry is not None:
                    self._devices[name] = replace(entry, checked=now)

    def _current(self, entry: DeviceHealth) -> DeviceHealth:
        return entry if entry.checked >= self._all_checked else replace(entry, checked=self._all_checked)

    def snapshot(self) -> list[DeviceHealth]:
        with self.condition:
            return [self._current(e) for e in self._devices.values()]

    def names(self) -> list[str]:
        """The devices' names (cheaper than a snapshot)."""
        with self.condition:
            return list(self._devices)

    def get(self, device: str) -> DeviceHealth | None:
        with self.condition:
            entry = self._devices.get(device)
            return None if entry is None else self._current(entry)

    def close(self) -> None:
        """Wake every stream so that it ends (cleanly: the kubelet sees EOF, not an error)."""
        with self.condition:
            self.closed = True
            self.condition.notify_all()

    def _changed(self) -> None:  # with the condition held
        self.version += 1
        self.condition.notify_all()

    def _notify(self) -> None:
        for listener in self._listeners:
            try:
                listener()
            except Exception:  # a listener's trouble must not stop health reporting
                log.exception("a device health listener failed")


# --- the kubelet's stream ---------------------------------------------------------------------------


class _Stream:
    __slots__ = ("ended", "peer", "started")

    def __init__(self, peer: str) -> None:
        self.peer = peer
        self.started = time.monotonic()
        self.ended = False


class HealthStreams:
    """``DRAResourceHealth.NodeWatchResources`` of each API version, from one HealthState.

    At most ``max_streams`` streams are served at once: a new one ends the oldest (after a kubelet
    restart the old stream may linger until TCP... here a unix socket, notices), so that health
    streams never hold more than their own gRPC threads."""

    def __init__(
        self,
        state: HealthState,
        pool_name: str,
        *,
        timeout_seconds: int = DEFAULT_TIMEOUT_SECONDS,
        refresh_seconds: float | None = None,
        max_streams: int = DEFAULT_MAX_STREAMS,
        on_streams: Callable[[int], None] | None = None,
    ) -> None:
        if timeout_seconds < 1:
            raise ValueError(f"health check timeout must be at least 1 s, not {timeout_seconds}")
        self.state = state
        self.pool_name = pool_name
        self.timeout_seconds = timeout_seconds
        # A third of the timeout: two refreshes may be late or lost before the kubelet says Unknown.
        self.refresh_seconds = refresh_seconds if refresh_seconds is not None else timeout_seconds / 3
        self.max_streams = max_streams
        self._on_streams = on_streams
        self._streams: list[_Stream] = []
        self.opened = 0  # streams served since start (tests, logs)

    @property
    def active(self) -> int:
        with self.state.condition:
            return len(self._streams)

    def servicer(self, pb2: ModuleType) -> Any:
        return _HealthServicer(self, pb2)

    def response(self, pb2: ModuleType) -> Any:
        out = pb2.NodeWatchResourcesResponse()
        for entry in self.state.snapshot():
            out.devices.add(
                device=pb2.DeviceIdentifier(pool_name=self.pool_name, device_name=entry.device),
                health=int(entry.health),
                last_updated_time=int(entry.checked),
                health_check_timeout_seconds=self.timeout_seconds,
                message=entry.message,
            )
        return out

    def _open(self, peer: str) -> _Stream:
        stream = _Stream(peer)
        with self.state.condition:
            while len(self._streams) >= self.max_streams:
                oldest = self._streams.pop(0)
                oldest.ended = True
                log.info("health stream from %s ended: a newer one replaces it", oldest.peer or "the kubelet")
            self._streams.append(stream)
            self.opened += 1
            count = len(self._streams)
            self.state.condition.notify_all()
        self._report(count)
        return stream

    def _close(self, stream: _Stream) -> None:
        with self.state.condition:
            stream.ended = True
            if stream in self._streams:
                self._streams.remove(stream)
            count = len(self._streams)
            self.state.condition.notify_all()
        self._report(count)

    def _report(self, count: int) -> None:
        if self._on_streams is not None:
            self._on_streams(count)

    def watch(self, pb2: ModuleType, context: grpc.ServicerContext) -> Iterator[Any]:
        stream = self._open(context.peer())
        cond = self.state.condition

        def cancelled() -> None:
            with cond:
                stream.ended = True
                cond.notify_all()

        context.add_callback(cancelled)
        log.info("the kubelet watches device health (%s, %s)", pb2.DESCRIPTOR.package, context.peer())
        try:
            with cond:
                version = self.state.version
            yield self.response(pb2)  # the current state of every device, at once
            while True:
                deadline = time.monotonic() + self.refresh_seconds
                with cond:
                    while not (stream.ended or self.state.closed or self.state.version != version):
                        left = deadline - time.monotonic()
                        if left <= 0:
                            break
                        cond.wait(left)
                    if stream.ended or self.state.closed:
                        return
                    version = self.state.version
                yield self.response(pb2)  # a change, or the refresh the kubelet's timeout needs
        finally:
            self._close(stream)
            log.info("health stream from %s ended", context.peer())


class _HealthServicer:
    def __init__(self, streams: HealthStreams, pb2: ModuleType) -> None:
        self._streams = streams
        self._pb2 = pb2

    def NodeWatchResources(self, request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
        return self._streams.watch(self._pb2, context)


# --- simulated devices ------------------------------------------------------------------------------

SIMULATED_REASON = "simulated"
_WORDS = {"healthy": Health.HEALTHY, "unhealthy": Health.UNHEALTHY, "unknown": Health.UNKNOWN}


def parse_health_file(text: str) -> tuple[Health, str]:
    """``unhealthy[: message]``, ``unknown[: message]`` or ``healthy``; an empty file is unhealthy."""
    first, _, rest = text.strip().partition("\n")[0].partition(":")
    word = first.strip().lower() or "unhealthy"
    if word not in _WORDS:
        raise ValueError(f"starts with {first.strip()!r}, not one of healthy, unhealthy, unknown")
    return _WORDS[word], rest.strip()


class SimulatedHealth:
    """Health of simulated devices from a directory: a file named after a device makes it
    unhealthy (or what the file says, see parse_health_file) until the file is removed. The same
    role as the upstream example driver's ``health.example.com/<device>`` pod annotations, without
    API access: ``echo 'unhealthy: ECC storm' > <dir>/gpu-1``, ``rm <dir>/gpu-1``."""

    def __init__(self, state: HealthState, directory: Path, *, poll_seconds: float = 1.0) -> None:
        self.state = state
        self.directory = directory
        self.poll_seconds = poll_seconds
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._warned: dict[str, str] = {}  # file -> the problem already logged
        # Devices that had a file at the last poll: only these go back to healthy when theirs is
        # gone (every other device is healthy already, as far as this source knows).
        self._had_file: set[str] = set()

    def start(self) -> SimulatedHealth:
        self.directory.mkdir(parents=True, exist_ok=True)
        self.poll()
        self._thread = threading.Thread(target=self._run, name="simulated-health", daemon=True)
        self._thread.start()
        log.info("simulated device health: a file per sick device in %s", self.directory)
        return self

    def _warn_once(self, name: str, problem: str) -> None:
        if self._warned.get(name) != problem:
            self._warned[name] = problem
            log.error("%s: %s", self.directory / name, problem)

    def poll(self) -> None:
        try:
            files = {p.name: p for p in self.directory.iterdir() if p.is_file() and not p.name.startswith(".")}
        except OSError as exc:
            self._warn_once("", f"cannot list the health directory: {exc}")
            return
        known = set(self.state.names())
        for name in files.keys() - known:
            self._warn_once(name, f"no device {name} on this node; the file is ignored")
        for name in self._had_file - files.keys():
            self.state.report(name, Health.HEALTHY)
        self._had_file = files.keys() & known
        for name in sorted(self._had_file):
            path = files[name]
            try:
                health, message = parse_health_file(path.read_text(errors="replace"))
            except OSError as exc:
                self._warn_once(name, f"cannot read: {exc}")
                continue
            except ValueError as exc:
                self._warn_once(name, f"{exc}; device health left as it was")
                continue
            self._warned.pop(name, None)
            if not message and health != Health.HEALTHY:
                message = f"marked {health.label} in {path}"
            self.state.report(name, health, message, SIMULATED_REASON if health != Health.HEALTHY else "")
        self.state.checked()

    def _run(self) -> None:
        while not self._stop.wait(self.poll_seconds):
            try:
                self.poll()
            except Exception:  # keep watching; the next poll may succeed
                log.exception("simulated health poll failed")

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)


# --- taints of sick devices -------------------------------------------------------------------------


def taint_key(driver_name: str) -> str:
    # A taint key's prefix must be a lower case DNS subdomain; the driver name may have upper case.
    return f"{go_to_lower(driver_name)}/unhealthy"


def taint_value(reason: str) -> str:
    value = _TAINT_VALUE.sub("-", reason)[:63].strip("-_.")
    return value or "unhealthy"


class DeviceTaints:
    """The taint an unhealthy device gets in the ResourceSlice: ``<driver>/unhealthy=<reason>``
    with the configured effect, ``timeAdded`` = when it became unhealthy (so that republishing for
    another reason does not move it). Unknown is not sick: no taint."""

    def __init__(self, state: HealthState, driver_name: str, effect: str = "NoSchedule") -> None:
        if effect not in TAINT_EFFECTS:
            raise ValueError(f"taint effect must be one of {', '.join(TAINT_EFFECTS)}, not {effect!r}")
        self.state = state
        self.key = taint_key(driver_name)
        self.effect = effect

    def __call__(self) -> Mapping[str, list[dict[str, str]]]:
        return {
            e.device: [
                {
                    "key": self.key,
                    "value": taint_value(e.reason),
                    "effect": self.effect,
                    "timeAdded": format_time(e.since),
                }
            ]
            for e in self.state.snapshot()
            if e.health == Health.UNHEALTHY
        }
