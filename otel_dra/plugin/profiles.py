"""Device profiles: what kind of simulated hardware a node has, and so what it publishes.

Each profile publishes what a real driver of its kind publishes (names and shapes follow the
DRA drivers users run: the example driver's GPUs, NVIDIA's MIG-style partitions, the CPU driver's
NUMA nodes, the DRANET-style NICs):

- ``gpu`` (the default): dra-example-driver's ``gpu-<i>``, 80Gi of memory and 100 compute each.
  With ``allow_multiple`` a GPU may be allocated several times (``allowMultipleAllocations``):
  each share consumes memory and compute through their request policies.
- ``gpu-partitionable``: per physical GPU a counter set ``gpu-<i>-counters`` (memory, compute),
  the whole GPU ``gpu-<i>`` that consumes all of it and ``partitions`` devices
  ``gpu-<i>-part-<j>`` that each consume an equal part; the scheduler never gives out more than the
  counters hold. ``profile`` ("full", "1of<N>") is the slice's ``partitionTypeAttribute``.
- ``cpu``: NUMA nodes ``numa-<i>`` of ``cpus_per_numa_node`` CPUs each (16 by default), allocated
  whole, with their CPU set; each maps to that many of the node's allocatable ``cpu``
  (``nodeAllocatableResources``), which the scheduler then accounts against the node.
- ``net``: NICs ``nic-<i>`` of 100G that many claims share (``allowMultipleAllocations``), each
  share consuming bandwidth through a request policy (default 10G, whole gigabits up to the link).

``binding_conditions`` makes every device wait for an attachment before the scheduler binds its
pod (``bindingConditions``; otel-dra binding-controller sets them). What an API server cannot
hold is left out by the slice publisher (:func:`otel_dra.plugin.devices.without`).
"""

from __future__ import annotations

import uuid

from otel_dra.plugin.devices import (
    BINDING_CONDITION,
    BINDING_FAILURE_CONDITION,
    SIMULATED_DRIVER_VERSION,
    SIMULATED_MODEL,
    CounterSet,
    Device,
    Pool,
    integer,
    simulated_devices,
    string,
    version,
)
from otel_dra.records import record, replace

GPU = "gpu"
GPU_PARTITIONABLE = "gpu-partitionable"
CPU = "cpu"
NET = "net"
PROFILES = (GPU, GPU_PARTITIONABLE, CPU, NET)

# What each profile's devices are to the container: the CDI class and the environment's prefix.
CDI_CLASSES = {GPU: "gpu", GPU_PARTITIONABLE: "gpu", CPU: "cpu", NET: "net"}
ENV_PREFIXES = {GPU: "GPU", GPU_PARTITIONABLE: "GPU", CPU: "CPU", NET: "NET"}

MAX_PARTITIONS = 8
GPU_MEMORY_MI = 81920  # 80Gi, in Mi so that partitions are whole Mi
GPU_COMPUTE = 100
CPUS_PER_NUMA_NODE = 16
MAX_CPUS_PER_NUMA_NODE = 1024
NIC_BANDWIDTH = "100G"
_UUID_NAMESPACE = uuid.UUID("0c3e8a5e-2f7d-4a7b-9b61-3f0f3c1d8e42")


@record(frozen=True)
class ProfileOptions:
    """How many devices and which options; ``count`` is GPUs, NUMA nodes or NICs."""

    profile: str = GPU
    count: int = 8
    partitions: int = 2
    allow_multiple: bool = False  # gpu only: GPUs shared by several claims
    binding_conditions: bool = False
    cpus_per_numa_node: int = CPUS_PER_NUMA_NODE  # cpu only

    def __post_init__(self) -> None:
        if self.profile not in PROFILES:
            raise ValueError(f"unknown device profile {self.profile!r} (one of {', '.join(PROFILES)})")
        if not 1 <= self.partitions <= MAX_PARTITIONS:
            raise ValueError(f"partitions must be 1 to {MAX_PARTITIONS}, not {self.partitions}")
        if not 1 <= self.cpus_per_numa_node <= MAX_CPUS_PER_NUMA_NODE:
            raise ValueError(f"cpus_per_numa_node must be 1 to {MAX_CPUS_PER_NUMA_NODE}, not {self.cpus_per_numa_node}")
        if self.allow_multiple and self.profile != GPU:
            raise ValueError(f"allow_multiple is for the {GPU} profile ({NET} devices are always shared)")


def build(node_name: str, driver_name: str, options: ProfileOptions) -> Pool:
    """The pool a node of this profile publishes."""
    if options.profile == GPU:
        pool = Pool(tuple(_gpus(node_name, options)))
    elif options.profile == GPU_PARTITIONABLE:
        pool = _partitionable(node_name, driver_name, options)
    elif options.profile == CPU:
        pool = Pool(tuple(_numa_nodes(options.count, options.cpus_per_numa_node)))
    else:
        pool = Pool(tuple(_nics(node_name, options.count)))
    return with_binding_conditions(pool) if options.binding_conditions else pool


def with_binding_conditions(pool: Pool) -> Pool:
    """Every device of ``pool`` waits for its attachment (:data:`BINDING_CONDITION`) before the
    scheduler binds a pod that got it, and is given up on :data:`BINDING_FAILURE_CONDITION`."""
    devices = tuple(
        replace(d, binding_conditions=(BINDING_CONDITION,), binding_failure_conditions=(BINDING_FAILURE_CONDITION,))
        for d in pool.devices
    )
    return Pool(devices, pool.counter_sets, pool.partition_type_attribute)


def _gpus(node_name: str, options: ProfileOptions) -> list[Device]:
    gpus = simulated_devices(node_name, options.count)
    if not options.allow_multiple:
        return gpus
    # A share that asks for nothing gets an eighth; asked, whole Gi of memory and whole compute units.
    policy = {
        "memory": {"default": f"{GPU_MEMORY_MI // 8}Mi", "validRange": {"min": "1Gi", "step": "1Gi"}},
        "compute": {"default": str(GPU_COMPUTE // 8), "validRange": {"min": "1", "step": "1"}},
    }
    return [replace(d, allow_multiple_allocations=True, request_policy=policy) for d in gpus]


def _partition_uuid(node_name: str, index: int, part: int) -> str:
    return f"gpu-{uuid.uuid5(_UUID_NAMESPACE, f'{node_name}/{index}/part-{part}')}"


def _partitionable(node_name: str, driver_name: str, options: ProfileOptions) -> Pool:
    n = options.partitions
    whole = {"memory": f"{GPU_MEMORY_MI}Mi", "compute": str(GPU_COMPUTE)}
    part = {"memory": f"{GPU_MEMORY_MI // n}Mi", "compute": str(GPU_COMPUTE // n)}
    devices: list[Device] = []
    counter_sets: list[CounterSet] = []
    for gpu in simulated_devices(node_name, options.count):
        index = int(gpu.attributes["index"]["int"])
        parent_uuid = str(gpu.attributes["uuid"]["string"])
        counters = f"{gpu.name}-counters"
        counter_sets.append(CounterSet(counters, whole))
        devices.append(
            replace(
                gpu,
                attributes={**gpu.attributes, "type": string("gpu"), "profile": string("full")},
                consumes_counters={counters: whole},
                env={"PROFILE": "full"},
            )
        )
        for j in range(n):
            part_uuid = _partition_uuid(node_name, index, j)
            devices.append(
                Device(
                    name=f"{gpu.name}-part-{j}",
                    attributes={
                        "index": integer(index),
                        "uuid": string(part_uuid),
                        "parentUUID": string(parent_uuid),
                        "model": string(SIMULATED_MODEL),
                        "driverVersion": version(SIMULATED_DRIVER_VERSION),
                        "type": string("partition"),
                        "profile": string(f"1of{n}"),
                    },
                    capacity=part,
                    consumes_counters={counters: part},
                    partition=True,
                    parent=gpu.name,
                    env={
                        "PARENT": gpu.name,
                        "PROFILE": f"1of{n}",
                        "MEMORY": part["memory"],
                        "COMPUTE": part["compute"],
                    },
                    data={"uuid": part_uuid, "parentUUID": parent_uuid},
                )
            )
    return Pool(tuple(devices), tuple(counter_sets), f"{driver_name}/profile")


def cpu_set(index: int, cpus: int = CPUS_PER_NUMA_NODE) -> str:
    first = index * cpus
    return f"{first}-{first + cpus - 1}" if cpus > 1 else str(first)


def _numa_nodes(count: int, cpus: int) -> list[Device]:
    return [
        Device(
            name=f"numa-{i}",
            attributes={
                "numaNode": integer(i),
                "socket": integer(i // 2),
                "cpuSet": string(cpu_set(i, cpus)),
                "model": string("EXAMPLE-CPU"),
            },
            capacity={"cpus": str(cpus), "memory": "64Gi"},
            # Each allocated NUMA node is that many of the node's allocatable cpu (the scheduler
            # counts it against the node, the kubelet sizes the pod's cgroup by it, where
            # DRANodeAllocatableResources is on).
            node_allocatable={"cpu": {"mapping": {"deviceMultiplier": str(cpus)}}},
            env={"CPUSET": cpu_set(i, cpus), "NUMA_NODE": str(i)},
            data={"cpuSet": cpu_set(i, cpus), "numaNode": i},
        )
        for i in range(count)
    ]


def mac_address(node_name: str, index: int) -> str:
    """Deterministic per node and NIC, locally administered (02:...)."""
    digest = uuid.uuid5(_UUID_NAMESPACE, f"{node_name}/nic-{index}").bytes
    return ":".join(f"{b:02x}" for b in (0x02, *digest[:5]))


def _nics(node_name: str, count: int) -> list[Device]:
    devices = []
    for i in range(count):
        interface, mac, pci = f"dranet{i}", mac_address(node_name, i), f"0000:{0x81 + i:02x}:00.0"
        devices.append(
            Device(
                name=f"nic-{i}",
                attributes={
                    "interfaceName": string(interface),
                    "macAddress": string(mac),
                    "pciAddress": string(pci),
                    "model": string("EXAMPLE-NIC"),
                    "linkSpeed": string(NIC_BANDWIDTH),
                },
                capacity={"bandwidth": NIC_BANDWIDTH},
                request_policy={"bandwidth": {"default": "10G", "validRange": {"min": "1G", "step": "1G"}}},
                allow_multiple_allocations=True,
                env={"INTERFACE": interface, "MAC": mac},
                data={"pciAddress": pci},
                network_data={"interfaceName": interface, "hardwareAddress": mac},
            )
        )
    return devices
