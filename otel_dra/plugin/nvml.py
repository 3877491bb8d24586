"""Real NVIDIA GPUs through NVML (nvidia-ml-py), published with the NVIDIA DRA driver's attribute
names (``type``, ``uuid``, ``productName``, ``brand``, ``architecture``, ``cudaComputeCapability``,
``driverVersion``, ``cudaDriverVersion``, ``pcieBusID``) and ``memory`` capacity in bytes.

- A GPU with MIG disabled is one device ``gpu-<index>`` of type ``gpu``. When it is MIG-capable,
  NVML does not answer ``nvmlDeviceGetAttributes`` for the full GPU, so its ``multiprocessors`` and
  ``decoders`` come from the full-GPU (7-slice) GPU-instance profile.
- A GPU with MIG enabled is published as its MIG devices (``gpu-<index>-mig-<gi>-<ci>``, type
  ``mig``) with ``parentUUID``, ``profile`` and the MIG capacities (``multiprocessors``,
  ``copyEngines``, ``decoders``, ``encoders``, ``jpegEngines``, ``ofaEngines``, ``memory``).

The NVML module is passed in (``pynvml`` by default, imported only when asked for), so the whole
mapping is tested everywhere against recorded NVML answers (tests/unit/fake_nvml.py).
"""

from __future__ import annotations

import logging
from typing import Any

from otel_dra.plugin.devices import Device, integer, semver, string, version

log = logging.getLogger(__name__)

ARCHITECTURES = {
    2: "Kepler",
    3: "Maxwell",
    4: "Pascal",
    5: "Volta",
    6: "Turing",
    7: "Ampere",
    8: "Ada Lovelace",
    9: "Hopper",
    10: "Blackwell",
}
BRANDS = {
    1: "Quadro",
    2: "Tesla",
    3: "NVS",
    4: "Grid",
    5: "GeForce",
    6: "Titan",
    12: "QuadroRTX",
    13: "NvidiaRTX",
    14: "Nvidia",
}
PROFILE_7_SLICE = 4  # NVML_GPU_INSTANCE_PROFILE_7_SLICE: the whole GPU as one GPU instance
MIG_ENABLED = 1  # NVML_DEVICE_MIG_ENABLE
ERROR_NOT_SUPPORTED = 3
ERROR_NOT_FOUND = 6


class DiscoveryError(RuntimeError):
    """NVML could not be loaded or answered with an error; the message says which call."""


def load_nvml() -> Any:
    try:
        import pynvml
    except ImportError as exc:  # pragma: no cover - nvidia-ml-py is a dependency
        raise DiscoveryError(f"--device-source=nvml needs the nvidia-ml-py package: {exc}") from exc
    return pynvml


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _error_code(nvml: Any, exc: BaseException) -> int | None:
    return int(exc.value) if isinstance(exc, nvml.NVMLError) and hasattr(exc, "value") else None


class _Discovery:
    def __init__(self, nvml: Any) -> None:
        self.nvml = nvml

    def call(self, name: str, *args: Any, optional: bool = False) -> Any:
        """One NVML call; with ``optional``, NotSupported/NotFound give None instead of an error."""
        try:
            return getattr(self.nvml, name)(*args)
        except self.nvml.NVMLError as exc:
            if optional and _error_code(self.nvml, exc) in (ERROR_NOT_SUPPORTED, ERROR_NOT_FOUND):
                return None
            raise DiscoveryError(f"NVML {name}: {exc}") from exc

    def devices(self) -> list[Device]:
        driver = semver(_text(self.call("nvmlSystemGetDriverVersion")))
        cuda = self.call("nvmlSystemGetCudaDriverVersion", optional=True)
        common: dict[str, dict[str, Any]] = {"driverVersion": version(driver)}
        if cuda:
            common["cudaDriverVersion"] = version(f"{int(cuda) // 1000}.{int(cuda) % 1000 // 10}.0")
        out: list[Device] = []
        for index in range(int(self.call("nvmlDeviceGetCount"))):
            handle = self.call("nvmlDeviceGetHandleByIndex", index)
            out.extend(self.gpu(index, handle, common))
        return out

    def gpu(self, index: int, handle: Any, common: dict[str, dict[str, Any]]) -> list[Device]:
        uuid = _text(self.call("nvmlDeviceGetUUID", handle))
        parent: dict[str, dict[str, Any]] = {
            "productName": string(_text(self.call("nvmlDeviceGetName", handle))),
            **common,
        }
        brand = self.call("nvmlDeviceGetBrand", handle, optional=True)
        if brand is not None:
            parent["brand"] = string(BRANDS.get(int(brand), "Unknown"))
        arch = self.call("nvmlDeviceGetArchitecture", handle, optional=True)
        if arch is not None:
            parent["architecture"] = string(ARCHITECTURES.get(int(arch), "Unknown"))
        cc = self.call("nvmlDeviceGetCudaComputeCapability", handle, optional=True)
        if cc is not None:
            parent["cudaComputeCapability"] = version(f"{int(cc[0])}.{int(cc[1])}.0")
        mig_mode = self.call("nvmlDeviceGetMigMode", handle, optional=True)
        if mig_mode is not None and int(mig_mode[0]) == MIG_ENABLED:
            return self.mig_devices(index, handle, uuid, parent)

        attributes = {"type": string("gpu"), "uuid": string(uuid), "index": integer(index), **parent}
        pci = self.call("nvmlDeviceGetPciInfo", handle, optional=True)
        if pci is not None:
            attributes["pcieBusID"] = string(_text(pci.busId).lower())
        capacity = {"memory": str(int(self.call("nvmlDeviceGetMemoryInfo", handle).total))}
        if mig_mode is not None:  # MIG-capable: the full-GPU profile tells SMs and decoders
            profile = self.call("nvmlDeviceGetGpuInstanceProfileInfo", handle, PROFILE_7_SLICE, optional=True)
            if profile is not None:
                capacity["multiprocessors"] = str(int(profile.multiprocessorCount))
                capacity["decoders"] = str(int(profile.decoderCount))
        return [Device(name=f"gpu-{index}", attributes=attributes, capacity=capacity)]

    def mig_devices(self, index: int, handle: Any, parent_uuid: str, parent: dict[str, dict[str, Any]]) -> list[Device]:
        out = []
        for slot in range(int(self.call("nvmlDeviceGetMaxMigDeviceCount", handle))):
            mig = self.call("nvmlDeviceGetMigDeviceHandleByIndex", handle, slot, optional=True)
            if mig is None:  # an empty slot
                continue
            gi = int(self.call("nvmlDeviceGetGpuInstanceId", mig))
            ci = int(self.call("nvmlDeviceGetComputeInstanceId", mig))
            attrs = self.call("nvmlDeviceGetAttributes", mig)
            memory_mb = int(attrs.memorySizeMB)
            # The NVIDIA driver's profile names round the memory up to whole GB: 1g.18gb, 7g.141gb.
            profile = f"{int(attrs.gpuInstanceSliceCount)}g.{(memory_mb + 1023) // 1024}gb"
            attributes = {
                "type": string("mig"),
                "uuid": string(_text(self.call("nvmlDeviceGetUUID", mig))),
                "parentUUID": string(parent_uuid),
                "profile": string(profile),
                "index": integer(slot),
                **parent,
            }
            capacity = {
                "multiprocessors": str(int(attrs.multiprocessorCount)),
                "copyEngines": str(int(attrs.sharedCopyEngineCount)),
                "decoders": str(int(attrs.sharedDecoderCount)),
                "encoders": str(int(attrs.sharedEncoderCount)),
                "jpegEngines": str(int(attrs.sharedJpegCount)),
                "ofaEngines": str(int(attrs.sharedOfaCount)),
                "memory": str(memory_mb * 2**20),
            }
            out.append(Device(name=f"gpu-{index}-mig-{gi}-{ci}", attributes=attributes, capacity=capacity))
        return out


def discover(nvml: Any | None = None) -> list[Device]:
    """The GPUs (or their MIG devices) NVML reports, in NVML index order."""
    nvml = load_nvml() if nvml is None else nvml
    try:
        nvml.nvmlInit()
    except nvml.NVMLError as exc:
        raise DiscoveryError(f"NVML could not be initialised (no NVIDIA driver on this node?): {exc}") from exc
    try:
        return _Discovery(nvml).devices()
    finally:
        try:
            nvml.nvmlShutdown()
        except nvml.NVMLError:  # nothing to do about it; the devices were read
            log.debug("nvmlShutdown failed", exc_info=True)


def main() -> int:
    """``python -m otel_dra.plugin.nvml``: print what this node would publish, as JSON."""
    import json
    import sys

    try:
        devices = discover()
    except DiscoveryError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(json.dumps([d.to_api() for d in devices], indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
