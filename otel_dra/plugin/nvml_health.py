"""Health of NVIDIA GPUs from NVML events, the way NVIDIA's device plugin and DRA driver watch them.

- ``nvmlEventTypeXidCriticalError``: a critical XID makes the GPU (or the MIG device the event
  names) unhealthy, except the XIDs that application faults cause (``IGNORED_XIDS``, the list of
  NVIDIA's k8s-device-plugin: 13 graphics engine exception, 31 GPU memory page fault, 43 GPU stopped
  processing, 45 preemptive cleanup, 68 video processor exception, 109 context switch timeout).
- ``nvmlEventTypeDoubleBitEccError``: an uncorrectable (double-bit) ECC error.
- A GPU lost (``NVML_ERROR_GPU_IS_LOST``, fallen off the bus), found by a cheap query of every GPU
  at each wait timeout and whenever the event wait itself reports it.

These states are sticky, as in NVIDIA's driver: a GPU that had an XID 79 or a double-bit error
needs a reset, and the plugin reports it unhealthy until it is restarted.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from otel_dra.plugin.health import Health, HealthState

log = logging.getLogger(__name__)

IGNORED_XIDS = frozenset({13, 31, 43, 45, 68, 109})
EVENT_XID = 0x8  # nvmlEventTypeXidCriticalError
EVENT_DOUBLE_BIT_ECC = 0x2  # nvmlEventTypeDoubleBitEccError
ERROR_NOT_SUPPORTED = 3
ERROR_TIMEOUT = 10
ERROR_GPU_IS_LOST = 15
ALL_INSTANCES = 0xFFFFFFFF  # gpuInstanceId/computeInstanceId of an event about the whole GPU


def _code(exc: BaseException) -> int | None:
    value = getattr(exc, "value", None)
    return int(value) if value is not None else None


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class NvmlHealth:
    """Watches NVML events in a thread of its own and reports into a HealthState."""

    def __init__(self, state: HealthState, nvml: Any, *, wait_ms: int = 5000) -> None:
        self.state = state
        self.nvml = nvml
        self.wait_ms = wait_ms
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._events: Any = None
        self._gpus: list[tuple[int, Any, str]] = []  # index, handle, uuid
        self._by_uuid: dict[str, int] = {}

    def start(self) -> NvmlHealth:
        self.nvml.nvmlInit()  # reference-counted by NVML: discovery's own init/shutdown is independent
        try:
            self._events = self.nvml.nvmlEventSetCreate()
            for index in range(int(self.nvml.nvmlDeviceGetCount())):
                handle = self.nvml.nvmlDeviceGetHandleByIndex(index)
                uuid = _text(self.nvml.nvmlDeviceGetUUID(handle))
                self._gpus.append((index, handle, uuid))
                self._by_uuid[uuid] = index
                self._register(index, handle)
        except self.nvml.NVMLError:
            self._shutdown()
            raise
        self._thread = threading.Thread(target=self._run, name="nvml-health", daemon=True)
        self._thread.start()
        log.info("watching NVML events (critical XIDs, double-bit ECC, GPU lost) of %d GPU(s)", len(self._gpus))
        return self

    def _register(self, index: int, handle: Any) -> None:
        try:
            supported = int(self.nvml.nvmlDeviceGetSupportedEventTypes(handle))
            wanted = supported & (EVENT_XID | EVENT_DOUBLE_BIT_ECC)
            if wanted:
                self.nvml.nvmlDeviceRegisterEvents(handle, wanted, self._events)
            if wanted != EVENT_XID | EVENT_DOUBLE_BIT_ECC:
                log.info("GPU %d: NVML does not report all of XID and ECC events (supported %#x)", index, supported)
        except self.nvml.NVMLError as exc:
            if _code(exc) != ERROR_NOT_SUPPORTED:
                raise
            log.warning("GPU %d: NVML events not supported; only a lost GPU is detected", index)

    def devices_of(
        self, index: int, gpu_instance: int = ALL_INSTANCES, compute_instance: int = ALL_INSTANCES
    ) -> list[str]:
        """This node's device names for a GPU: ``gpu-<i>``, or its MIG devices (all of them, or the
        one an event names by GPU and compute instance)."""
        names = self.state.names()
        whole = [n for n in names if n == f"gpu-{index}" or n.startswith(f"gpu-{index}-mig-")]
        if gpu_instance != ALL_INSTANCES and compute_instance != ALL_INSTANCES:
            one = f"gpu-{index}-mig-{gpu_instance}-{compute_instance}"
            if one in names:
                return [one]
        return whole

    def handle_event(self, event: Any) -> None:
        try:
            uuid = _text(self.nvml.nvmlDeviceGetUUID(event.device))
        except self.nvml.NVMLError as exc:
            log.warning("NVML event %#x for a GPU that does not answer: %s", int(event.eventType), exc)
            return
        index = self._by_uuid.get(uuid)
        if index is None:
            log.warning("NVML event for GPU %s, not one of this node's", uuid)
            return
        kind, data = int(event.eventType), int(event.eventData)
        if kind == EVENT_XID:
            if data in IGNORED_XIDS:
                log.info("GPU %d (%s): XID %d, an application error: device health unchanged", index, uuid, data)
                return
            reason, message = f"xid-{data}", f"critical XID {data} reported by NVML on GPU {uuid}"
        elif kind == EVENT_DOUBLE_BIT_ECC:
            reason, message = "ecc-double-bit", f"double-bit (uncorrectable) ECC error reported by NVML on GPU {uuid}"
        else:
            return
        gi = int(getattr(event, "gpuInstanceId", ALL_INSTANCES))
        ci = int(getattr(event, "computeInstanceId", ALL_INSTANCES))
        for name in self.devices_of(index, gi, ci):
            self.state.report(name, Health.UNHEALTHY, message, reason)

    def probe(self) -> None:
        """A query every GPU must answer; a lost one answers NVML_ERROR_GPU_IS_LOST."""
        for index, handle, uuid in self._gpus:
            try:
                self.nvml.nvmlDeviceGetMemoryInfo(handle)
            except self.nvml.NVMLError as exc:
                if _code(exc) == ERROR_GPU_IS_LOST:
                    for name in self.devices_of(index):
                        self.state.report(name, Health.UNHEALTHY, f"GPU {uuid} is lost (NVML: {exc})", "gpu-lost")
                else:
                    log.warning("GPU %d (%s): NVML memory query failed: %s", index, uuid, exc)
        self.state.checked()

    def poll_once(self) -> None:
        try:
            event = self.nvml.nvmlEventSetWait_v2(self._events, self.wait_ms)
        except self.nvml.NVMLError as exc:
            code = _code(exc)
            if code not in (ERROR_TIMEOUT, ERROR_GPU_IS_LOST):
                log.warning("waiting for NVML events failed: %s", exc)
                self._stop.wait(1.0)  # no busy loop on a persistent error
            self.probe()
            return
        self.handle_event(event)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.poll_once()
            except Exception:  # keep watching
                log.exception("NVML health check failed")
                self._stop.wait(1.0)

    def _shutdown(self) -> None:
        try:
            if self._events is not None:
                self.nvml.nvmlEventSetFree(self._events)
                self._events = None
            self.nvml.nvmlShutdown()
        except self.nvml.NVMLError:
            log.debug("NVML shutdown failed", exc_info=True)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.wait_ms / 1000 + 5)
        self._shutdown()


def check(nvml: Any, seconds: float, out: Any) -> int:
    """One health check, for a real GPU machine: what discovery finds, which events each GPU
    supports, the events seen for ``seconds``, the probe's verdict. Returns the number of
    unhealthy devices."""
    import json

    from otel_dra.plugin.nvml import discover

    devices = discover(nvml)
    state = HealthState()
    state.set_devices([d.name for d in devices])
    monitor = NvmlHealth(state, nvml, wait_ms=int(min(seconds, 5.0) * 1000))
    monitor.start()
    try:
        supported = {}
        for _index, handle, uuid in monitor._gpus:
            try:
                supported[uuid] = hex(int(nvml.nvmlDeviceGetSupportedEventTypes(handle)))
            except nvml.NVMLError as exc:
                supported[uuid] = f"error: {exc}"
        monitor._stop.wait(seconds)
        monitor.probe()
    finally:
        monitor.stop()
    report = {
        "devices": [d.to_api() for d in devices],
        "supported_event_types": supported,
        "health": {
            e.device: {"health": e.health.name, "message": e.message, "reason": e.reason} for e in state.snapshot()
        },
    }
    print(json.dumps(report, indent=2), file=out)
    return sum(1 for e in state.snapshot() if e.health == Health.UNHEALTHY)


def main() -> int:
    """``python -m otel_dra.plugin.nvml_health [SECONDS]``: the health check on this node's GPUs."""
    import sys

    from otel_dra.plugin.nvml import DiscoveryError, load_nvml

    seconds = float(sys.argv[1]) if len(sys.argv) > 1 else 10.0
    try:
        unhealthy = check(load_nvml(), seconds, sys.stdout)
    except DiscoveryError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 1 if unhealthy else 0


if __name__ == "__main__":
    raise SystemExit(main())
