"""A real node for the testbed: containerd and the kubelet of the control plane's release, with
their state under the testbed's directory, joined to its API server.

What this machine's kernel and the two daemons need (measured; README.md, "A real node"): root,
overlayfs, runc and the CNI plugins from Debian; no registry (the images are made locally,
:mod:`otel_dra.testbed.images`); and, where the VM withholds
CAP_SYS_RESOURCE, ``restrict_oom_score_adj`` in containerd and ``oomScoreAdj: 0`` in the kubelet,
without which runc fails every pod sandbox.

A kubelet changes the host beyond its directories: sysctls, iptables chains, a bind mount of its
root dir, cgroups, the CNI bridge, a few fixed paths (``/var/lib/kubelet/device-plugins``,
``/var/log/containers``, ``/var/lib/cni``, ``/run/containerd``). ``start_node`` records the host's
state of each before anything starts (``node-NAME/host.json``), and ``stop_node`` deletes the
node's pods while the kubelet still runs, stops kubelet and containerd and puts back what the
record says. One node per machine: those fixed paths cannot be moved by flags.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import re
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from otel_dra.testbed.build import (
    CONTAINERD,
    BinariesMissingError,
    default_cache_root,
    resolve_cache_root,
)
from otel_dra.testbed.controlplane import (
    NODE_POD_API_IP,
    Testbed,
    TestbedError,
    component_exited,
    free_ports,
    openssl,
    process_alive,
    release_settings,
    write_private,
)
from otel_dra.testbed.images import PAUSE_IMAGE, Image, ImageError, node_images

Progress = Callable[[str], None]

# Debian's runc and containernetworking-plugins (installed by .ci/run).
RUNC = Path("/usr/sbin/runc")
CNI_BIN_DIR = Path("/usr/lib/cni")
CNI_PLUGINS = ("bridge", "host-local", "loopback")
# The pods' network: an isolated bridge with no masquerade and no routes, so pod traffic never
# leaves the machine (a CNI network is required even for host-network pods: without one the Node
# stays NotReady). The bridge holds BRIDGE_ADDRESS on the host: the kubelet's HTTP and gRPC probes
# and a Prometheus on the host reach pod IPs through it, and pods reach services the host offers on
# that address (nothing else: a pod has no default route). The address is on-link only, so nothing
# of the pods' subnet is routed anywhere but this bridge.
BRIDGE = "otel-dra0"
POD_SUBNET = "10.244.240.0/24"
BRIDGE_ADDRESS = NODE_POD_API_IP
# Paths outside the node's directory that the kubelet or containerd write and no flag moves.
OUTSIDE_PATHS = (
    "/var/lib/kubelet",
    "/var/log/containers",
    "/var/lib/cni",
    "/run/containerd",
    "/var/run/netns",
    "/etc/cni",
)
# The sysctls the kubelet sets (kernel defaults it "protects") and those the CNI bridge may set.
SYSCTLS = (
    "vm.overcommit_memory",
    "vm.panic_on_oom",
    "kernel.panic",
    "kernel.panic_on_oops",
    "kernel.keys.root_maxkeys",
    "kernel.keys.root_maxbytes",
    "net.ipv4.ip_forward",
    "net.ipv6.conf.all.forwarding",
)
IPTABLES = ("iptables", "ip6tables")
IPTABLES_TABLES = ("filter", "nat", "mangle")
# The kubelet's cgroup (cgroupfs driver, default cgroupRoot): the pods' cgroups live below it.
KUBEPODS = "kubepods"
CGROUP_ROOT = Path("/sys/fs/cgroup")
# One node per machine (see the module docstring): who holds it.
MACHINE_LOCK = Path("/run/otel-dra-testbed-node.json")
_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_CAP_SYS_RESOURCE = 24
# containerd refuses a unix socket path longer than this (Linux allows 107 bytes; containerd keeps
# to the BSDs' 104), and the kubelet dials plugin sockets under its root dir by full path.
MAX_SOCKET_PATH = 104
_POLL = 0.5
_PROGRESS_EVERY = 5.0
_STOP_TIMEOUT = 20.0


def _to_stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


@dataclass(frozen=True)
class NodeBinaries:
    kubelet: Path
    containerd: Path
    ctr: Path
    shim: Path
    runc: Path = RUNC
    cni_bin_dir: Path = CNI_BIN_DIR


def find_node_binaries(kubelet: Path, cache_root: Path | None = None) -> NodeBinaries:
    """containerd's binaries from the cache and runc and the CNI plugins from Debian, or a
    :class:`BinariesMissingError` that says how to get each missing part."""
    root = resolve_cache_root(cache_root)
    containerd_dir = CONTAINERD.bin_dir(root)
    binaries = NodeBinaries(
        kubelet=kubelet,
        containerd=containerd_dir / "containerd",
        ctr=containerd_dir / "ctr",
        shim=containerd_dir / "containerd-shim-runc-v2",
    )
    problems = []
    if not _executable(kubelet):
        problems.append(f"the kubelet ({kubelet}): run `otel-dra testbed build`")
    absent = [p.name for p in (binaries.containerd, binaries.ctr, binaries.shim) if not _executable(p)]
    if absent:
        problems.append(f"containerd ({', '.join(absent)} in {containerd_dir}): run `otel-dra testbed build --node`")
    if not _executable(RUNC):
        problems.append(f"runc ({RUNC}): `apt-get install runc`")
    absent = [name for name in CNI_PLUGINS if not _executable(CNI_BIN_DIR / name)]
    if absent:
        problems.append(
            f"the CNI plugins ({', '.join(absent)} in {CNI_BIN_DIR}): `apt-get install containernetworking-plugins`"
        )
    if problems:
        raise BinariesMissingError("a testbed node needs " + "; ".join(problems))
    return binaries


def _executable(path: Path) -> bool:
    return path.is_file() and os.access(path, os.X_OK)


# --- can this machine run a node? -------------------------------------------------------------------


@dataclass(frozen=True)
class HostSupport:
    """What the machine allows, as far as a node cares."""

    problems: tuple[str, ...]
    # False where CAP_SYS_RESOURCE is withheld: no process may lower its oom_score_adj.
    can_lower_oom_score: bool


def host_support(
    *,
    euid: int | None = None,
    filesystems: str | None = None,
    status: str | None = None,
    cgroup_root: Path = CGROUP_ROOT,
) -> HostSupport:
    """Check root, overlayfs, cgroups and the capability set (arguments: for tests; default: this
    process and machine)."""
    euid = os.geteuid() if euid is None else euid
    if filesystems is None:
        filesystems = Path("/proc/filesystems").read_text()
    if status is None:
        status = Path("/proc/self/status").read_text()
    problems = []
    if euid != 0:
        problems.append(
            f"a testbed node must run as root (euid {euid}): containerd and the kubelet mount, "
            "create cgroups and network namespaces"
        )
    if not any(line.split()[-1:] == ["overlay"] for line in filesystems.splitlines()):
        problems.append("the kernel has no overlay filesystem (containerd's snapshotter): `modprobe overlay`")
    if not (cgroup_root / "memory").is_dir() and not (cgroup_root / "cgroup.controllers").is_file():
        problems.append(f"no cgroup hierarchy with a memory controller under {cgroup_root}")
    cap_eff = next((line.split()[1] for line in status.splitlines() if line.startswith("CapEff:")), "0")
    return HostSupport(tuple(problems), bool(int(cap_eff, 16) >> _CAP_SYS_RESOURCE & 1))


# --- host state: recorded before, restored after --------------------------------------------------


def _sysctl_path(name: str) -> Path:
    return Path("/proc/sys") / name.replace(".", "/")


def _iptables_chains(binary: str, table: str) -> list[str] | None:
    """The chains of a table (`-S` lines `-N X` / `-P X`), None where the table or tool is absent."""
    if shutil.which(binary) is None:
        return None
    result = subprocess.run([binary, "-w", "-t", table, "-S"], capture_output=True, text=True)
    if result.returncode != 0:
        return None
    return [line.split()[1] for line in result.stdout.splitlines() if line.startswith(("-N ", "-P "))]


def _cgroup_hierarchies(root: Path = CGROUP_ROOT) -> list[Path]:
    """Each mounted hierarchy (cgroup v1: one per controller mount; v2: the root)."""
    if (root / "cgroup.controllers").is_file():
        return [root]
    return sorted(p for p in root.iterdir() if p.is_dir() and not p.is_symlink() and (p / "cgroup.procs").exists())


def _path_record(path: Path) -> dict[str, Any]:
    """For a fixed outside path: whether it exists and, if so, its entries (new ones are ours)."""
    if path.is_dir():
        return {"exists": True, "entries": sorted(os.listdir(path))}
    return {"exists": False, "entries": []}


def record_host() -> dict[str, Any]:
    """What a node may change, as it is now."""
    sysctls = {}
    for name in SYSCTLS:
        with contextlib.suppress(OSError):
            sysctls[name] = _sysctl_path(name).read_text().strip()
    chains = {
        f"{binary}/{table}": found
        for binary in IPTABLES
        for table in IPTABLES_TABLES
        if (found := _iptables_chains(binary, table)) is not None
    }
    return {
        "sysctls": sysctls,
        "iptables": chains,
        "cgroups": [str(h / KUBEPODS) for h in _cgroup_hierarchies() if (h / KUBEPODS).exists()],
        "bridge": Path(f"/sys/class/net/{BRIDGE}").exists(),
        "paths": {path: _path_record(Path(path)) for path in OUTSIDE_PATHS},
    }


def _restore_host(recorded: Mapping[str, Any], node_dir: Path, errors: list[str]) -> None:
    """Undo what the node did to the host beyond its directory, as far as ``recorded`` says it was."""
    _kill_cgroup_tasks(recorded, errors)
    _unmount_under(node_dir, errors)
    _remove_cgroups(recorded, errors)
    for name, value in recorded.get("sysctls", {}).items():
        path = _sysctl_path(name)
        try:
            if path.read_text().strip() != value:
                path.write_text(value + "\n")
        except OSError as exc:
            errors.append(f"sysctl {name}={value}: {exc}")
    for key, before in recorded.get("iptables", {}).items():
        binary, table = key.split("/")
        _remove_new_chains(binary, table, set(before), errors)
    if not recorded.get("bridge") and Path(f"/sys/class/net/{BRIDGE}").exists():
        result = subprocess.run(["ip", "link", "delete", BRIDGE], capture_output=True, text=True)
        if result.returncode != 0:
            errors.append(f"ip link delete {BRIDGE}: {result.stderr.strip()}")
    for path_text, before in recorded.get("paths", {}).items():
        path = Path(path_text)
        if not path.exists():
            continue
        try:
            if not before["exists"]:
                shutil.rmtree(path)
            else:
                for entry in set(os.listdir(path)) - set(before["entries"]):
                    target = path / entry
                    if target.is_dir() and not target.is_symlink():
                        shutil.rmtree(target)
                    else:
                        target.unlink()
        except OSError as exc:
            errors.append(f"removing what the node left in {path}: {exc}")


def _remove_new_chains(binary: str, table: str, before: set[str], errors: list[str]) -> None:
    """Delete the chains the kubelet added (KUBE-FIREWALL, KUBE-KUBELET-CANARY, ...) and every rule
    that jumps to them; chains that were there before are left alone."""
    result = subprocess.run([binary, "-w", "-t", table, "-S"], capture_output=True, text=True)
    if result.returncode != 0:
        return
    lines = result.stdout.splitlines()
    new = [line.split()[1] for line in lines if line.startswith("-N ") and line.split()[1] not in before]
    if not new:
        return
    for line in lines:
        words = shlex.split(line)  # comments are quoted: `-m comment --comment "..."`
        if words[:1] == ["-A"] and any(target in new for target in _jump_targets(words)):
            subprocess.run([binary, "-w", "-t", table, "-D", *words[1:]], capture_output=True)
    for chain in new:
        subprocess.run([binary, "-w", "-t", table, "-F", chain], capture_output=True)
    for chain in new:
        deleted = subprocess.run([binary, "-w", "-t", table, "-X", chain], capture_output=True, text=True)
        if deleted.returncode != 0:
            errors.append(f"{binary} -t {table} -X {chain}: {deleted.stderr.strip()}")


def _jump_targets(words: Sequence[str]) -> list[str]:
    return [words[i + 1] for i, word in enumerate(words[:-1]) if word in ("-j", "-g", "--jump", "--goto")]


def _cgroup_tree(top: Path) -> list[Path]:
    """``top`` and every cgroup below it, deepest first."""
    if not top.is_dir():
        return []
    found = [Path(dirpath) for dirpath, _, _ in os.walk(top)]
    return sorted(found, key=lambda p: len(p.parts), reverse=True)


def _new_kubepods(recorded: Mapping[str, Any]) -> list[Path]:
    before = set(recorded.get("cgroups", []))
    return [h / KUBEPODS for h in _cgroup_hierarchies() if str(h / KUBEPODS) not in before]


def _kill_cgroup_tasks(recorded: Mapping[str, Any], errors: list[str]) -> None:
    """SIGKILL whatever still runs in the pods' cgroups: containers whose shim is gone would
    otherwise keep running (reparented to init) after containerd stopped."""
    deadline = time.monotonic() + 10
    while True:
        pids: set[int] = set()
        for top in _new_kubepods(recorded):
            for cgroup in _cgroup_tree(top):
                with contextlib.suppress(OSError):
                    pids.update(int(p) for p in (cgroup / "cgroup.procs").read_text().split())
        if not pids:
            return
        if time.monotonic() > deadline:
            errors.append(f"processes {sorted(pids)} survived SIGKILL in the pods' cgroups")
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.2)


def _remove_cgroups(recorded: Mapping[str, Any], errors: list[str]) -> None:
    for top in _new_kubepods(recorded):
        for cgroup in _cgroup_tree(top):
            for attempt in range(20):
                try:
                    cgroup.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError as exc:  # EBUSY while the last task is still exiting
                    if attempt == 19:
                        errors.append(f"rmdir {cgroup}: {exc}")
                    time.sleep(0.1)


_MNT_DETACH = 2


def _mount_points() -> list[str]:
    points = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        # Field 5 is the mount point, with spaces etc. escaped as octal.
        points.append(re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), line.split()[4]))
    return points


def _unmount_under(top: Path, errors: list[str]) -> None:
    """Unmount everything at or below ``top`` (the kubelet's root-dir bind mount, pod volumes,
    containerd's rootfs and shm mounts, network namespaces), deepest first."""
    libc = ctypes.CDLL(None, use_errno=True)
    prefix = str(top).rstrip("/") + "/"
    for _ in range(5):  # a bind mount may be stacked on itself: repeat until nothing is left
        points = [p for p in _mount_points() if p == str(top) or p.startswith(prefix)]
        if not points:
            return
        for point in sorted(set(points), key=lambda p: p.count("/"), reverse=True):
            if libc.umount2(point.encode(), 0) != 0 and libc.umount2(point.encode(), _MNT_DETACH) != 0:
                errors.append(f"umount {point}: {os.strerror(ctypes.get_errno())}")
    left = [p for p in _mount_points() if p == str(top) or p.startswith(prefix)]
    if left:
        errors.append(f"still mounted: {', '.join(left)}")


# --- configuration files ------------------------------------------------------------------------


@dataclass(frozen=True)
class NodeLayout:
    """Where a node keeps what: everything under ``DIR/node-NAME``."""

    dir: Path

    @property
    def containerd_socket(self) -> Path:
        return self.dir / "containerd" / "containerd.sock"

    @property
    def kubelet_root(self) -> Path:
        return self.dir / "kubelet"

    @property
    def plugins_dir(self) -> Path:
        """Where a DRA plugin puts its dra.sock (``--kubelet-plugins-directory-path``)."""
        return self.kubelet_root / "plugins"

    @property
    def registry_dir(self) -> Path:
        """The kubelet's plugin watcher looks here and nowhere else (``plugins_registry``)."""
        return self.kubelet_root / "plugins_registry"

    @property
    def cdi_dir(self) -> Path:
        """containerd's cdi_spec_dirs: a DRA plugin's ``--cdi-root``."""
        return self.dir / "cdi"

    @property
    def pod_logs(self) -> Path:
        """The kubelet's podLogsDir: ``<namespace>_<pod>_<uid>/<container>/<restart>.log``."""
        return self.dir / "pod-logs"

    @property
    def host_record(self) -> Path:
        return self.dir / "host.json"

    def sockets(self, driver: str = "gpu.example.com") -> tuple[Path, ...]:
        """The longest unix socket paths a node and a DRA plugin of ``driver`` use."""
        return (
            Path(f"{self.containerd_socket}.ttrpc"),
            self.registry_dir / f"{driver}-reg.sock",
            self.plugins_dir / driver / "dra.sock",
        )


def check_socket_paths(layout: NodeLayout) -> None:
    """A clear error up front instead of containerd or a plugin failing later on a long ``--dir``."""
    too_long = [p for p in layout.sockets() if len(str(p).encode()) > MAX_SOCKET_PATH]
    if too_long:
        longest = max(len(str(p).encode()) for p in too_long)
        raise TestbedError(
            f"the testbed directory {layout.dir.parent} is too long for the node's unix sockets "
            f"({too_long[0]}: {longest} bytes, at most {MAX_SOCKET_PATH}): use a shorter --dir "
            f"(at most {len(str(layout.dir.parent)) - (longest - MAX_SOCKET_PATH)} characters)"
        )


def containerd_config(layout: NodeLayout, *, restrict_oom_score_adj: bool) -> str:
    base = layout.dir / "containerd"
    cri_runtime = "plugins.'io.containerd.cri.v1.runtime'"
    return f"""\
version = 3
root = "{base / "root"}"
state = "{base / "state"}"
# Off: NRI (a socket under /var/run/nri) and the host-wide tracing/metrics endpoints.
disabled_plugins = ["io.containerd.nri.v1.nri"]

[grpc]
  address = "{layout.containerd_socket}"

[ttrpc]
  address = "{layout.containerd_socket}.ttrpc"

[{cri_runtime}]
  cdi_spec_dirs = ["{layout.cdi_dir}"]
  # Where CAP_SYS_RESOURCE is withheld runc cannot lower a sandbox's oom_score_adj (-998).
  restrict_oom_score_adj = {str(restrict_oom_score_adj).lower()}
  # Network namespaces under the state dir instead of /var/run/netns.
  netns_mounts_under_state_dir = true

[{cri_runtime}.containerd]
  default_runtime_name = "runc"

[{cri_runtime}.containerd.runtimes.runc]
  runtime_type = "io.containerd.runc.v2"

[{cri_runtime}.containerd.runtimes.runc.options]
  BinaryName = "{RUNC}"
  Root = "{base / "runc"}"
  SystemdCgroup = false

[{cri_runtime}.cni]
  bin_dirs = ["{CNI_BIN_DIR}"]
  conf_dir = "{layout.dir / "cni"}"
  max_conf_num = 1

[plugins.'io.containerd.cri.v1.images']
  snapshotter = "overlayfs"

[plugins.'io.containerd.cri.v1.images'.pinned_images]
  sandbox = "{PAUSE_IMAGE}"

[plugins.'io.containerd.grpc.v1.cri']
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
"""


def cni_config(layout: NodeLayout) -> str:
    return json.dumps(
        {
            "cniVersion": "1.0.0",
            "name": "otel-dra",
            "plugins": [
                {
                    "type": "bridge",
                    "bridge": BRIDGE,
                    # The bridge gets the range's gateway address; isDefaultGateway stays off, so
                    # pods get no default route through it.
                    "isGateway": True,
                    "ipMasq": False,
                    "hairpinMode": False,
                    "ipam": {
                        "type": "host-local",
                        "ranges": [[{"subnet": POD_SUBNET, "gateway": BRIDGE_ADDRESS}]],
                        "dataDir": str(layout.dir / "cni-ipam"),
                    },
                }
            ],
        },
        indent=2,
    )


def kubelet_config(
    layout: NodeLayout,
    *,
    ca_file: Path,
    ports: Mapping[str, int],
    feature_gates: Mapping[str, bool],
) -> dict[str, Any]:
    return {
        "apiVersion": "kubelet.config.k8s.io/v1beta1",
        "kind": "KubeletConfiguration",
        "address": "127.0.0.1",
        "port": ports["kubelet"],
        "healthzBindAddress": "127.0.0.1",
        "healthzPort": ports["kubelet_healthz"],
        "readOnlyPort": 0,
        "authentication": {
            "x509": {"clientCAFile": str(ca_file)},
            "webhook": {"enabled": False},
            "anonymous": {"enabled": False},
        },
        "authorization": {"mode": "AlwaysAllow"},
        "containerRuntimeEndpoint": f"unix://{layout.containerd_socket}",
        "cgroupDriver": "cgroupfs",  # no systemd on these machines
        "failSwapOn": False,
        # The hosts are cgroup v1 (hybrid); from 1.35 on the kubelet refuses them unless told.
        "failCgroupV1": False,
        # The kubelet's own -999 cannot be set without CAP_SYS_RESOURCE either.
        "oomScoreAdj": 0,
        # Nothing can be pulled again: never collect images.
        "imageGCHighThresholdPercent": 100,
        "imageGCLowThresholdPercent": 99,
        # A shared, busy machine: do not evict test pods over disk or memory the tests do not use.
        "evictionHard": {"memory.available": "1Mi", "nodefs.available": "1%", "imagefs.available": "1%"},
        "podLogsDir": str(layout.pod_logs),
        "featureGates": dict(feature_gates),
        "registerNode": True,
        "resolvConf": "",  # pods get no DNS: nothing to resolve, and no host file leaks in
        "serializeImagePulls": False,
        "nodeStatusReportFrequency": "10s",
        "nodeStatusUpdateFrequency": "2s",
        "syncFrequency": "10s",
        "fileCheckFrequency": "5s",
        "shutdownGracePeriod": "0s",
    }


# --- starting ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Node:
    """A running testbed node, for tests and scripts."""

    name: str
    layout: NodeLayout
    kubelet_log: Path
    containerd_log: Path

    @property
    def plugins_dir(self) -> Path:
        return self.layout.plugins_dir

    @property
    def registry_dir(self) -> Path:
        return self.layout.registry_dir

    @property
    def cdi_dir(self) -> Path:
        return self.layout.cdi_dir

    @property
    def pod_logs(self) -> Path:
        return self.layout.pod_logs


def kubelet_component(name: str) -> str:
    return f"kubelet-{name}"


def containerd_component(name: str) -> str:
    return f"containerd-{name}"


def proxy_component(name: str) -> str:
    return f"apiserver-proxy-{name}"


def pod_api_server(testbed: Testbed, name: str) -> tuple[str, int]:
    """Where node ``name``'s pods reach the API server: ``KUBERNETES_SERVICE_HOST`` and
    ``KUBERNETES_SERVICE_PORT`` for them (there is no kube-proxy behind the ``kubernetes``
    Service's cluster IP). The API server's certificate names this address."""
    record = testbed.nodes.get(name)
    if record is None or "pod_api" not in record:
        raise TestbedError(f"no node {name!r} in the testbed in {testbed.dir}")
    host, port = record["pod_api"]
    return str(host), int(port)


def node_of(testbed: Testbed, name: str) -> Node:
    record = testbed.nodes.get(name)
    if record is None:
        raise TestbedError(f"no node {name!r} in the testbed in {testbed.dir}")
    layout = NodeLayout(Path(record["dir"]))
    logs = testbed.dir / "logs"
    return Node(
        name,
        layout,
        kubelet_log=logs / f"{kubelet_component(name)}.log",
        containerd_log=logs / f"{containerd_component(name)}.log",
    )


def _check_lock(dir: Path) -> None:
    """One node per machine: refuse when another testbed's node still runs."""
    try:
        holder = Path(json.loads(MACHINE_LOCK.read_text())["dir"])
    except (FileNotFoundError, ValueError, KeyError, TypeError):
        return
    if holder == dir:
        return
    try:
        other = Testbed.load(holder)
    except TestbedError:
        return  # that testbed is gone: the lock is stale
    if any(_alive(other, name) for name in other.components if name.startswith(("kubelet-", "containerd-"))):
        raise TestbedError(
            f"a testbed node already runs on this machine (testbed {holder}); a second one would share "
            f"/var/lib/kubelet/device-plugins and /run/containerd with it: run "
            f"`otel-dra testbed down --dir {holder}` first"
        )


def check_node(
    dir: Path,
    name: str,
    kubelet: Path,
    *,
    cache_root: Path | None = None,
    support: HostSupport | None = None,
) -> tuple[HostSupport, NodeBinaries, tuple[Image, Image]]:
    """Everything that can be known before starting anything: a machine that can run a node, a
    ``dir`` short enough for its sockets, the binaries and the images. ``testbed up --node`` calls
    it before the control plane starts, so that a machine that cannot run a node fails at once."""
    if not _NAME.match(name) or len(name) > 63:
        raise TestbedError(f"node name {name!r} is not a DNS label (lower-case letters, digits, '-')")
    support = support or host_support()
    if support.problems:
        raise TestbedError("this machine cannot run a testbed node: " + "; ".join(support.problems))
    dir = dir.expanduser().resolve()
    check_socket_paths(NodeLayout(dir / f"node-{name}"))
    _check_lock(dir)
    binaries = find_node_binaries(kubelet, cache_root)
    try:
        images = node_images(resolve_cache_root(cache_root) if cache_root else default_cache_root())
    except ImageError as exc:
        raise TestbedError(str(exc)) from None
    return support, binaries, images


def start_node(
    testbed: Testbed,
    name: str,
    *,
    timeout: float = 120,
    progress: Progress = _to_stderr,
    cache_root: Path | None = None,
    support: HostSupport | None = None,
    kubelet_flags: Sequence[str] = (),
) -> Node:
    """Start containerd and a kubelet that registers as Node ``name``; return once it is Ready.

    ``kubelet_flags`` go after the kubelet's own (a benchmark's ``--vmodule``, for example).
    ``progress`` gets a line every few seconds while it waits. On any failure what was started is
    stopped and the host put back, and :class:`TestbedError` carries the failing part's log tail.
    """
    if name in testbed.nodes:
        raise TestbedError(f"node {name!r} already runs in {testbed.dir}")
    if testbed.nodes:
        raise TestbedError(
            "one node per machine: the kubelet's device-plugins dir and containerd's shim sockets are fixed paths"
        )
    support, binaries, (pause, busybox) = check_node(
        testbed.dir, name, testbed.binaries.kubelet, cache_root=cache_root, support=support
    )
    layout = NodeLayout(testbed.dir / f"node-{name}")
    if not support.can_lower_oom_score:
        progress(
            "CAP_SYS_RESOURCE is withheld here: containerd gets restrict_oom_score_adj = true and the "
            "kubelet oomScoreAdj 0 (otherwise runc fails every pod sandbox)"
        )

    if layout.dir.exists():
        # Leftovers of a node that was not stopped cleanly: never reuse its state.
        errors: list[str] = []
        _unmount_under(layout.dir, errors)
        if errors:
            raise TestbedError(f"cannot clear {layout.dir}: {'; '.join(errors)}")
        shutil.rmtree(layout.dir)
    layout.dir.mkdir(parents=True)
    write_private(layout.host_record, json.dumps(record_host(), indent=2) + "\n")
    testbed.nodes[name] = {"dir": str(layout.dir)}
    testbed._save_state()
    write_private(MACHINE_LOCK, json.dumps({"dir": str(testbed.dir)}) + "\n")
    node = node_of(testbed, name)
    try:
        _start(testbed, node, binaries, (pause.tarball, busybox.tarball), support, timeout, progress, kubelet_flags)
    except BaseException:
        with contextlib.suppress(Exception):
            stop_node(testbed, name, progress=lambda _: None)
        raise
    return node


def _node_credentials(testbed: Testbed, layout: NodeLayout, name: str) -> Path:
    """A kubeconfig with a client certificate ``CN=system:node:NAME, O=system:nodes`` from the
    testbed CA, and the binding that gives that group the ``system:node`` role (the testbed
    authorizes with RBAC alone: there is no Node authorizer to do it)."""
    pki = layout.dir / "pki"
    pki.mkdir(mode=0o700)
    ca_dir = testbed.ca_file.parent
    openssl(
        "req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
        "-keyout", "node.key", "-out", "node.csr", "-subj", f"/O=system:nodes/CN=system:node:{name}",
        cwd=pki,
    )  # fmt: skip
    (pki / "node.ext").write_text(
        "basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature,keyEncipherment\nextendedKeyUsage=clientAuth\n"
    )
    openssl(
        "x509", "-req", "-in", "node.csr", "-CA", str(ca_dir / "ca.crt"), "-CAkey", str(ca_dir / "ca.key"),
        "-set_serial", "0x" + secrets.token_hex(16), "-days", "3650", "-extfile", "node.ext", "-out", "node.crt",
        cwd=pki,
    )  # fmt: skip
    kubeconfig = layout.dir / "kubeconfig"
    user = f"system:node:{name}"
    cluster = {"server": testbed.server, "certificate-authority": str(testbed.ca_file)}
    credentials = {"client-certificate": str(pki / "node.crt"), "client-key": str(pki / "node.key")}
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "testbed", "cluster": cluster}],
        "users": [{"name": user, "user": credentials}],
        "contexts": [{"name": "node", "context": {"cluster": "testbed", "user": user}}],
        "current-context": "node",
    }
    write_private(kubeconfig, yaml.safe_dump(config, sort_keys=False))
    binding = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRoleBinding",
        "metadata": {"name": "otel-dra-testbed:nodes"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "system:node"},
        "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "Group", "name": "system:nodes"}],
    }
    testbed.kubectl("apply", "-f", "-", input=json.dumps(binding))
    return kubeconfig


def _start(
    testbed: Testbed,
    node: Node,
    binaries: NodeBinaries,
    images: Sequence[Path],
    support: HostSupport,
    timeout: float,
    progress: Progress,
    kubelet_flags: Sequence[str] = (),
) -> None:
    layout = node.layout
    started = time.monotonic()
    kubeconfig = _node_credentials(testbed, layout, node.name)
    for sub in ("containerd", "cni", "cdi", "pod-logs", "kubelet", "kubelet-certs"):
        (layout.dir / sub).mkdir(parents=True, exist_ok=True)
    config = layout.dir / "containerd" / "config.toml"
    config.write_text(containerd_config(layout, restrict_oom_score_adj=not support.can_lower_oom_score))
    (layout.dir / "cni" / "10-otel-dra.conflist").write_text(cni_config(layout))
    ports = dict(zip(("kubelet", "kubelet_healthz"), free_ports(2), strict=True))
    kubelet_config_file = layout.dir / "kubelet-config.yaml"
    kubelet_config_file.write_text(
        yaml.safe_dump(
            kubelet_config(
                layout,
                ca_file=testbed.ca_file,
                ports=ports,
                feature_gates=_kubelet_gates(testbed),
            ),
            sort_keys=False,
        )
    )

    # containerd finds its shim on PATH.
    env = {**os.environ, "PATH": f"{binaries.shim.parent}{os.pathsep}{os.environ.get('PATH', '/usr/bin:/bin')}"}
    ctd = containerd_component(node.name)
    testbed._spawn(ctd, [str(binaries.containerd), f"--config={config}", "--log-level=info"], env=env)
    ctr = [str(binaries.ctr), f"--address={layout.containerd_socket}", "--namespace=k8s.io"]
    _wait(
        f"containerd for node {node.name}",
        lambda: _ctr_ready(ctr),
        testbed,
        ctd,
        timeout,
        progress,
    )
    for image in images:
        result = subprocess.run([*ctr, "images", "import", str(image)], capture_output=True, text=True, timeout=120)
        if result.returncode != 0:
            raise TestbedError(f"ctr images import {image} failed: {result.stderr.strip()}")
    progress(f"node {node.name}: containerd ready, images loaded ({time.monotonic() - started:.1f}s)")

    # The API server for the node's pods (they cannot reach the host's loopback): see forward.py.
    [proxy_port] = free_ports(1)
    api_port = int(testbed.server.rpartition(":")[2])
    testbed._spawn(
        proxy_component(node.name),
        [
            sys.executable, "-m", "otel_dra.testbed.forward",
            f"--listen={BRIDGE_ADDRESS}:{proxy_port}", f"--connect=127.0.0.1:{api_port}",
        ],
        # This checkout's otel_dra first, whatever the interpreter has installed.
        env={**os.environ, "PYTHONPATH": os.pathsep.join(
            p for p in (str(Path(__file__).resolve().parents[2]), os.environ.get("PYTHONPATH", "")) if p
        )},
    )  # fmt: skip
    testbed.nodes[node.name]["pod_api"] = [BRIDGE_ADDRESS, proxy_port]

    kubelet = kubelet_component(node.name)
    testbed._spawn(
        kubelet,
        [
            str(binaries.kubelet),
            f"--config={kubelet_config_file}",
            f"--kubeconfig={kubeconfig}",
            f"--root-dir={layout.kubelet_root}",
            f"--cert-dir={layout.dir / 'kubelet-certs'}",
            f"--hostname-override={node.name}",
            "--v=2",
            *kubelet_flags,
        ],
        env=env,
    )
    testbed.nodes[node.name]["ports"] = ports
    testbed._save_state()
    _wait(f"node {node.name} Ready", lambda: _kubelet_ready(testbed, node.name), testbed, kubelet, timeout, progress)
    proxy = testbed.components[proxy_component(node.name)]
    if component_exited(int(proxy["pid"]), proxy.get("start_time")):
        raise TestbedError(f"the pods' API server forwarder exited\n{testbed._log_tail(proxy_component(node.name))}")
    progress(f"node {node.name} Ready after {time.monotonic() - started:.1f}s")


def load_image(testbed: Testbed, name: str, archive: Path, *, image_name: str | None = None) -> str:
    """Import an OCI archive (``buildah push ... oci-archive:``, :mod:`otel_dra.testbed.imagebuild`)
    into node ``name``'s containerd, in the k8s.io namespace the kubelet uses; return the image name
    pods refer to, as containerd lists it.

    ctr names an imported image after its ``io.containerd.image.name`` annotation, else after the
    ``org.opencontainers.image.ref.name`` that buildah writes, but only when that name starts with
    ``--base-name`` (a full name otherwise gets dropped and the image stays unnamed): so the
    repository of the archive's own name is passed as the base name.
    """
    from otel_dra.testbed.imagebuild import archive_image_name

    record = testbed.nodes.get(name)
    if record is None:
        raise TestbedError(f"no node {name!r} in the testbed in {testbed.dir}")
    image_name = image_name or archive_image_name(archive)
    ctr = ctr_argv(testbed, NodeLayout(Path(record["dir"])), name)
    result = subprocess.run(
        [*ctr, "images", "import", f"--base-name={image_name.rpartition(':')[0]}", str(archive)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    if result.returncode != 0:
        raise TestbedError(f"ctr images import {archive} failed: {result.stderr.strip()}")
    listed = subprocess.run([*ctr, "images", "ls", "--quiet"], capture_output=True, text=True, timeout=60)
    if image_name not in listed.stdout.split():
        raise TestbedError(
            f"ctr images import {archive} did not name the image {image_name} (containerd has: "
            f"{', '.join(listed.stdout.split()) or 'nothing'})"
        )
    return image_name


def ctr_argv(testbed: Testbed, layout: NodeLayout, name: str) -> list[str]:
    """`ctr` against node ``name``'s containerd, in the k8s.io namespace (the kubelet's)."""
    argv = testbed.components.get(containerd_component(name), {}).get("argv") or []
    if not argv:
        raise TestbedError(f"node {name!r} has no containerd in {testbed.dir}")
    return [str(Path(argv[0]).with_name("ctr")), f"--address={layout.containerd_socket}", "--namespace=k8s.io"]


def _kubelet_gates(testbed: Testbed) -> dict[str, bool]:
    """The control plane's gates (components must agree on which DRA fields exist)."""
    apiserver = testbed.components.get("kube-apiserver", {}).get("argv", [])
    for arg in apiserver:
        if arg.startswith("--feature-gates="):
            pairs = (item.split("=") for item in arg.removeprefix("--feature-gates=").split(",") if item)
            return {key: value == "true" for key, value in pairs}
    return dict(release_settings().feature_gates)


def _ctr_ready(ctr: Sequence[str]) -> tuple[bool, str]:
    result = subprocess.run([*ctr, "version"], capture_output=True, text=True, timeout=10)
    return result.returncode == 0, result.stderr.strip().splitlines()[-1] if result.stderr.strip() else "starting"


def _api_get(testbed: Testbed, path: str) -> Any:
    opener = urllib.request.build_opener(
        urllib.request.ProxyHandler({}), urllib.request.HTTPSHandler(context=testbed.api_ssl_context())
    )
    request = urllib.request.Request(testbed.server + path, headers={"Authorization": f"Bearer {testbed.token}"})
    with opener.open(request, timeout=5) as response:
        return json.load(response)


def _kubelet_ready(testbed: Testbed, name: str) -> tuple[bool, str]:
    """The kubelet answers its healthz (a Node object left Ready by the previous kubelet does not
    count) and the Node is Ready."""
    port = testbed.nodes[name]["ports"]["kubelet_healthz"]
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(f"http://127.0.0.1:{port}/healthz", timeout=5) as response:
            if response.status != 200:
                return False, f"kubelet healthz: HTTP {response.status}"
    except urllib.error.HTTPError as err:
        return False, f"kubelet healthz: HTTP {err.code}"
    except (urllib.error.URLError, OSError) as err:
        return False, f"kubelet healthz: {err}"
    return _node_ready(testbed, name)


def _node_ready(testbed: Testbed, name: str) -> tuple[bool, str]:
    try:
        node = _api_get(testbed, f"/api/v1/nodes/{name}")
    except urllib.error.HTTPError as err:
        return False, "not registered yet" if err.code == 404 else f"HTTP {err.code}"
    except (urllib.error.URLError, OSError) as err:
        return False, str(err)
    for condition in node.get("status", {}).get("conditions", []):
        if condition.get("type") == "Ready":
            ok = condition.get("status") == "True"
            return ok, f"Ready={condition.get('status')}: {condition.get('message', '')}"
    return False, "registered, no Ready condition yet"


def _wait(
    what: str,
    check: Callable[[], tuple[bool, str]],
    testbed: Testbed,
    component: str,
    timeout: float,
    progress: Progress,
) -> None:
    """Poll ``check`` until it passes; fail fast when ``component`` exits, time out with its log."""
    started = time.monotonic()
    last_report = started
    while True:
        comp = testbed.components[component]
        if component_exited(int(comp["pid"]), comp.get("start_time")):
            raise TestbedError(f"{component} exited while waiting for {what}\n{testbed._log_tail(component)}")
        try:
            ok, state = check()
        except subprocess.TimeoutExpired:
            ok, state = False, "no answer"
        if ok:
            return
        now = time.monotonic()
        if now - started > timeout:
            raise TestbedError(f"{what}: not after {timeout:.0f}s ({state})\n{testbed._log_tail(component)}")
        if now - last_report >= _PROGRESS_EVERY:
            progress(f"waiting for {what} ({now - started:.0f}s): {state}")
            last_report = now
        time.sleep(_POLL)


def restart_kubelet(testbed: Testbed, name: str, *, timeout: float = 120, progress: Progress = _to_stderr) -> None:
    """Stop the node's kubelet (SIGTERM) and start it again with the same flags; return once the
    Node is Ready again. Pods keep running in containerd meanwhile, as on a real node."""
    component = kubelet_component(name)
    comp = testbed.components.get(component)
    if comp is None:
        raise TestbedError(f"no kubelet of node {name!r} in {testbed.dir}")
    testbed._stop(component, _STOP_TIMEOUT)
    binaries_dir = Path(testbed.components[containerd_component(name)]["argv"][0]).parent
    env = {**os.environ, "PATH": f"{binaries_dir}{os.pathsep}{os.environ.get('PATH', '/usr/bin:/bin')}"}
    testbed._spawn(component, comp["argv"], append_log=True, env=env)
    _wait(f"node {name} Ready again", lambda: _kubelet_ready(testbed, name), testbed, component, timeout, progress)


# --- stopping ----------------------------------------------------------------------------------------


def stop_node(testbed: Testbed, name: str, *, progress: Progress = _to_stderr, timeout: float = 30) -> None:
    """Delete the node's pods (while its kubelet runs), stop kubelet and containerd, and put back
    every host change they made. Raises :class:`TestbedError` listing what could not be undone."""
    record = testbed.nodes.get(name)
    if record is None:
        return
    layout = NodeLayout(Path(record["dir"]))
    errors: list[str] = []
    kubelet, ctd = kubelet_component(name), containerd_component(name)
    started = time.monotonic()
    if _alive(testbed, kubelet) and _alive(testbed, "kube-apiserver"):
        _delete_pods(testbed, name, timeout, progress, errors)
    testbed._stop(kubelet, _STOP_TIMEOUT)
    if _alive(testbed, ctd):
        _remove_containers(layout, testbed, name)
    testbed._stop(ctd, _STOP_TIMEOUT)
    testbed._stop(proxy_component(name), _STOP_TIMEOUT)
    _kill_shims(layout)
    recorded: dict[str, Any] = {}
    with contextlib.suppress(FileNotFoundError, ValueError):
        recorded = json.loads(layout.host_record.read_text())
    _restore_host(recorded, layout.dir, errors)
    if not errors:
        # The bulky state (image snapshots, pod dirs); configs, certificates and logs stay.
        for sub in ("containerd/root", "containerd/state", "containerd/runc", "kubelet", "cni-ipam"):
            shutil.rmtree(layout.dir / sub, ignore_errors=True)
    with contextlib.suppress(FileNotFoundError, ValueError):
        if Path(json.loads(MACHINE_LOCK.read_text()).get("dir", "")) == testbed.dir:
            MACHINE_LOCK.unlink()
    testbed.nodes.pop(name, None)
    testbed.components.pop(kubelet, None)
    testbed.components.pop(ctd, None)
    testbed.components.pop(proxy_component(name), None)
    testbed._save_state()
    progress(f"node {name} stopped and the host restored in {time.monotonic() - started:.1f}s")
    if errors:
        raise TestbedError(f"node {name}: could not undo every host change:\n" + "\n".join(errors))


def _alive(testbed: Testbed, component: str) -> bool:
    comp = testbed.components.get(component)
    return bool(comp and comp.get("pid") and process_alive(int(comp["pid"]), comp.get("start_time")))


def _node_pods(testbed: Testbed, name: str) -> list[tuple[str, str]]:
    pods = _api_get(testbed, f"/api/v1/pods?fieldSelector=spec.nodeName%3D{name}")
    return [(p["metadata"]["namespace"], p["metadata"]["name"]) for p in pods.get("items", [])]


def _delete_pods(testbed: Testbed, name: str, timeout: float, progress: Progress, errors: list[str]) -> None:
    """Delete every pod bound to the node and wait until the kubelet has confirmed each: a pod the
    kubelet never stopped would leave its containers behind the kubelet's exit."""
    try:
        pods = _node_pods(testbed, name)
    except (urllib.error.URLError, OSError) as exc:
        errors.append(f"listing the pods of node {name}: {exc}")
        return
    if not pods:
        return
    progress(f"node {name}: deleting {len(pods)} pod(s)")
    for namespace, pod in pods:
        testbed.kubectl(
            "delete", "pod", pod, f"--namespace={namespace}", "--grace-period=1", "--wait=false", check=False
        )
    deadline = time.monotonic() + timeout
    while (left := _node_pods(testbed, name)) and time.monotonic() < deadline:
        time.sleep(_POLL)
    if left:
        # Not an error of the teardown: a pod whose claims' DRA plugin is gone cannot be unprepared,
        # so the kubelet keeps it. Its containers go below (ctr, cgroups) all the same; the objects
        # must not outlive the node.
        progress(
            f"node {name}: the kubelet did not finish deleting {left} within {timeout:.0f}s (a DRA plugin "
            "gone?): removing their containers directly"
        )
        for namespace, pod in left:
            testbed.kubectl(
                "delete", "pod", pod, f"--namespace={namespace}", "--grace-period=0", "--force", check=False
            )


def _remove_containers(layout: NodeLayout, testbed: Testbed, name: str) -> None:
    """Tasks and containers the kubelet left in containerd (stopped sandboxes await its GC)."""
    state = testbed.components.get(containerd_component(name), {})
    argv = state.get("argv") or []
    containerd_bin = Path(argv[0]) if argv else None
    if containerd_bin is None:
        return
    ctr = [str(containerd_bin.with_name("ctr")), f"--address={layout.containerd_socket}", "--namespace=k8s.io"]

    def ids(*what: str) -> list[str]:
        result = subprocess.run([*ctr, *what, "ls", "-q"], capture_output=True, text=True, timeout=30)
        return result.stdout.split() if result.returncode == 0 else []

    for task in ids("tasks"):
        subprocess.run([*ctr, "tasks", "kill", "--signal", "SIGKILL", task], capture_output=True, timeout=30)
    for task in ids("tasks"):
        subprocess.run([*ctr, "tasks", "delete", "--force", task], capture_output=True, timeout=30)
    containers = ids("containers")
    if containers:
        subprocess.run([*ctr, "containers", "delete", *containers], capture_output=True, timeout=60)


def _kill_shims(layout: NodeLayout) -> None:
    """Shims detach from containerd's process group; end those of this node's containerd."""
    address = str(layout.containerd_socket).encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if b"containerd-shim" in cmdline and address in cmdline:
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(entry.name), signal.SIGKILL)


def stop_nodes(testbed: Testbed, progress: Progress = _to_stderr) -> None:
    """Stop every node of the testbed (``Testbed.down`` does, before the control plane)."""
    errors = []
    for name in list(testbed.nodes):
        try:
            stop_node(testbed, name, progress=progress)
        except TestbedError as exc:
            errors.append(str(exc))
    if errors:
        raise TestbedError("\n".join(errors))


def processes_of(dir: Path) -> list[int]:
    """Pids whose command line mentions ``dir`` (a check that nothing of a node is left running)."""
    needle = str(dir).encode()
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            with contextlib.suppress(OSError):
                if needle in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
    return found


__all__ = [
    "Node",
    "NodeLayout",
    "host_support",
    "load_image",
    "pod_api_server",
    "record_host",
    "restart_kubelet",
    "start_node",
    "stop_node",
    "stop_nodes",
]
