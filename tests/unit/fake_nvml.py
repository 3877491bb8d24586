"""Recorded NVML answers, served through the nvidia-ml-py (pynvml) calling convention.

The H200 figures are the ones read with pynvml on one NVIDIA H200 (driver 580.159.04, CUDA 13.0,
MIG disabled; shared/reference/dra-api.md §4): name, memory total, compute capability,
architecture, NotSupported for nvmlDeviceGetAttributes on the full GPU, and the GPU-instance
profile figures. The MIG-enabled variant combines those profile figures into MIG devices the way
NVML reports them for MIG device handles; it is not a recording of a MIG-enabled H200.

Errors are the real pynvml exception classes, so the discovery code's error handling is the one
that runs against a real library.
"""

from __future__ import annotations

import queue
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pynvml

H200_NAME = "NVIDIA H200"
H200_UUID = "GPU-4f3a2b1c-9d8e-7f6a-5b4c-3d2e1f0a9b8c"
H200_MEMORY = 150754820096
H200_PCI_BUS_ID = "00000000:19:00.0"
DRIVER_VERSION = "580.159.04"
CUDA_DRIVER_VERSION = 13000
# nvmlDeviceGetGpuInstanceProfileInfo(h, profile) on the H200: profile -> (slices, SMs, copy engines,
# decoders, encoders, jpeg, ofa, memory MB). 4 = the 7-slice (full GPU) profile: all of its figures
# and the SM counts of the smaller profiles are recorded; the other figures of the smaller profiles
# are illustrative (chosen so that the profile names come out as 1g.18gb, 2g.35gb, ...).
H200_PROFILES = {
    0: (1, 16, 1, 1, 0, 1, 0, 17920),
    1: (2, 32, 2, 2, 0, 2, 0, 35840),
    2: (3, 60, 3, 3, 0, 3, 0, 71680),
    3: (4, 64, 4, 4, 0, 4, 0, 71680),
    4: (7, 132, 8, 7, 0, 7, 1, 143360),
}


def nvml_error(code: int) -> pynvml.NVMLError:
    return pynvml.NVMLError(code)


@dataclass
class FakeGpu:
    name: str = H200_NAME
    uuid: str = H200_UUID
    memory: int = H200_MEMORY
    compute_capability: tuple[int, int] = (9, 0)
    architecture: int = pynvml.NVML_DEVICE_ARCH_HOPPER
    brand: int = pynvml.NVML_BRAND_NVIDIA
    pci_bus_id: str = H200_PCI_BUS_ID
    mig_capable: bool = True
    mig_enabled: bool = False
    # (gpu instance id, compute instance id, profile id) of each MIG device, by slot
    mig_devices: list[tuple[int, int, int] | None] = field(default_factory=list)
    # Health: the event types NVML supports for it (0: NotSupported), and a GPU fallen off the bus.
    supported_events: int = pynvml.nvmlEventTypeXidCriticalError | pynvml.nvmlEventTypeDoubleBitEccError | 0x1
    lost: bool = False


@dataclass(frozen=True)
class _MigHandle:
    gpu: FakeGpu
    slot: int


class FakeNvml:
    """A module-like object with the pynvml functions the discovery uses."""

    NVMLError = pynvml.NVMLError

    def __init__(self, gpus: list[FakeGpu], *, init_error: int | None = None) -> None:
        self.gpus = gpus
        self.init_error = init_error
        self.initialised = False
        self.init_count = 0
        self.calls: list[str] = []
        self.events: queue.Queue[Any] = queue.Queue()
        self.registered: dict[int, int] = {}  # id(gpu) -> event mask registered

    def _call(self, name: str) -> None:
        self.calls.append(name)
        if name not in ("nvmlInit", "nvmlShutdown") and not self.initialised:
            raise nvml_error(pynvml.NVML_ERROR_UNINITIALIZED)

    def nvmlInit(self) -> None:
        self._call("nvmlInit")
        if self.init_error is not None:
            raise nvml_error(self.init_error)
        self.init_count += 1  # NVML counts init/shutdown pairs
        self.initialised = True

    def nvmlShutdown(self) -> None:
        self._call("nvmlShutdown")
        self.init_count = max(0, self.init_count - 1)
        self.initialised = self.init_count > 0

    def nvmlSystemGetDriverVersion(self) -> str:
        self._call("nvmlSystemGetDriverVersion")
        return DRIVER_VERSION

    def nvmlSystemGetCudaDriverVersion(self) -> int:
        self._call("nvmlSystemGetCudaDriverVersion")
        return CUDA_DRIVER_VERSION

    def nvmlDeviceGetCount(self) -> int:
        self._call("nvmlDeviceGetCount")
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> FakeGpu:
        self._call("nvmlDeviceGetHandleByIndex")
        if not 0 <= index < len(self.gpus):
            raise nvml_error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return self.gpus[index]

    def nvmlDeviceGetName(self, h: FakeGpu) -> str:
        self._call("nvmlDeviceGetName")
        return h.name

    def nvmlDeviceGetUUID(self, h: FakeGpu | _MigHandle) -> str:
        self._call("nvmlDeviceGetUUID")
        if isinstance(h, _MigHandle):
            return f"MIG-{h.gpu.uuid[4:-4]}{h.slot:04d}"
        return h.uuid

    def nvmlDeviceGetMemoryInfo(self, h: FakeGpu) -> Any:
        self._call("nvmlDeviceGetMemoryInfo")
        if h.lost:
            raise nvml_error(pynvml.NVML_ERROR_GPU_IS_LOST)
        return SimpleNamespace(total=h.memory, free=h.memory - 2**29, used=2**29)

    def nvmlDeviceGetCudaComputeCapability(self, h: FakeGpu) -> tuple[int, int]:
        self._call("nvmlDeviceGetCudaComputeCapability")
        return h.compute_capability

    def nvmlDeviceGetArchitecture(self, h: FakeGpu) -> int:
        self._call("nvmlDeviceGetArchitecture")
        return h.architecture

    def nvmlDeviceGetBrand(self, h: FakeGpu) -> int:
        self._call("nvmlDeviceGetBrand")
        return h.brand

    def nvmlDeviceGetPciInfo(self, h: FakeGpu) -> Any:
        self._call("nvmlDeviceGetPciInfo")
        return SimpleNamespace(busId=h.pci_bus_id.encode())  # a char array in pynvml: bytes

    def nvmlDeviceGetMigMode(self, h: FakeGpu) -> list[int]:
        self._call("nvmlDeviceGetMigMode")
        if not h.mig_capable:
            raise nvml_error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        mode = pynvml.NVML_DEVICE_MIG_ENABLE if h.mig_enabled else pynvml.NVML_DEVICE_MIG_DISABLE
        return [mode, mode]

    def nvmlDeviceGetGpuInstanceProfileInfo(self, h: FakeGpu, profile: int) -> Any:
        self._call("nvmlDeviceGetGpuInstanceProfileInfo")
        if not h.mig_capable:
            raise nvml_error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        slices, sms, ce, dec, enc, jpeg, ofa, mem = H200_PROFILES[profile]
        return SimpleNamespace(
            id=profile,
            sliceCount=slices,
            multiprocessorCount=sms,
            copyEngineCount=ce,
            decoderCount=dec,
            encoderCount=enc,
            jpegCount=jpeg,
            ofaCount=ofa,
            memorySizeMB=mem,
        )

    def nvmlDeviceGetAttributes(self, h: FakeGpu | _MigHandle) -> Any:
        self._call("nvmlDeviceGetAttributes")
        if not isinstance(h, _MigHandle):
            raise nvml_error(pynvml.NVML_ERROR_NOT_SUPPORTED)  # as on the real H200
        entry = h.gpu.mig_devices[h.slot]
        assert entry is not None
        slices, sms, ce, dec, enc, jpeg, ofa, mem = H200_PROFILES[entry[2]]
        return SimpleNamespace(
            multiprocessorCount=sms,
            sharedCopyEngineCount=ce,
            sharedDecoderCount=dec,
            sharedEncoderCount=enc,
            sharedJpegCount=jpeg,
            sharedOfaCount=ofa,
            gpuInstanceSliceCount=slices,
            computeInstanceSliceCount=slices,
            memorySizeMB=mem,
        )

    def nvmlDeviceGetMaxMigDeviceCount(self, h: FakeGpu) -> int:
        self._call("nvmlDeviceGetMaxMigDeviceCount")
        return 7 if h.mig_capable else 0

    def nvmlDeviceGetMigDeviceHandleByIndex(self, h: FakeGpu, slot: int) -> _MigHandle:
        self._call("nvmlDeviceGetMigDeviceHandleByIndex")
        if slot >= len(h.mig_devices) or h.mig_devices[slot] is None:
            raise nvml_error(pynvml.NVML_ERROR_NOT_FOUND)
        return _MigHandle(h, slot)

    def nvmlDeviceGetGpuInstanceId(self, h: _MigHandle) -> int:
        self._call("nvmlDeviceGetGpuInstanceId")
        entry = h.gpu.mig_devices[h.slot]
        assert entry is not None
        return entry[0]

    def nvmlDeviceGetComputeInstanceId(self, h: _MigHandle) -> int:
        self._call("nvmlDeviceGetComputeInstanceId")
        entry = h.gpu.mig_devices[h.slot]
        assert entry is not None
        return entry[1]

    # --- events (health), as nvmlEventSetWait_v2 hands them out -------------------------------------
    def nvmlEventSetCreate(self) -> object:
        self._call("nvmlEventSetCreate")
        return object()

    def nvmlEventSetFree(self, event_set: object) -> None:
        self._call("nvmlEventSetFree")

    def nvmlDeviceGetSupportedEventTypes(self, h: FakeGpu) -> int:
        self._call("nvmlDeviceGetSupportedEventTypes")
        if not h.supported_events:
            raise nvml_error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return h.supported_events

    def nvmlDeviceRegisterEvents(self, h: FakeGpu, event_types: int, event_set: object) -> None:
        self._call("nvmlDeviceRegisterEvents")
        if event_types & ~h.supported_events:
            raise nvml_error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        self.registered[id(h)] = event_types

    def nvmlEventSetWait_v2(self, event_set: object, timeout_ms: int) -> Any:
        self._call("nvmlEventSetWait_v2")
        try:
            item = self.events.get(timeout=timeout_ms / 1000)
        except queue.Empty:
            raise nvml_error(pynvml.NVML_ERROR_TIMEOUT) from None
        if isinstance(item, pynvml.NVMLError):
            raise item
        return item

    def inject(self, gpu: FakeGpu, event_type: int, data: int = 0, gi: int = 0xFFFFFFFF, ci: int = 0xFFFFFFFF) -> None:
        """An event as NVML reports it (pynvml's c_nvmlEventData_t fields), for a registered type."""
        if self.registered.get(id(gpu), 0) & event_type:
            self.events.put(
                SimpleNamespace(
                    device=gpu, eventType=event_type, eventData=data, gpuInstanceId=gi, computeInstanceId=ci
                )
            )
