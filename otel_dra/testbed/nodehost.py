"""The machine a testbed node runs on: what it must offer (root, overlayfs, cgroups, the
capability set; runc and the CNI plugins from Debian, containerd from the cache) and what a node
changes on it beyond its own directory.

A kubelet changes the host beyond its directories: sysctls, iptables chains, a bind mount of its
root dir, cgroups, the CNI bridge, a few fixed paths (``/var/lib/kubelet/device-plugins``,
``/var/log/containers``, ``/var/lib/cni``, ``/run/containerd``). :func:`record_host` records the
host's state of each before anything starts (``node-NAME/host.json``), and :func:`restore_host`
puts back what the record says. One node per machine (:data:`MACHINE_LOCK`): those fixed paths
cannot be moved by flags.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from otel_dra.testbed.build import CONTAINERD, BinariesMissingError, resolve_cache_root
from otel_dra.testbed.network import BRIDGE
from otel_dra.testbed.state import write_private

# Debian's runc and containernetworking-plugins (installed by .ci/run).
RUNC = Path("/usr/sbin/runc")
CNI_BIN_DIR = Path("/usr/lib/cni")
CNI_PLUGINS = ("bridge", "host-local", "loopback")

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
_CAP_SYS_RESOURCE = 24


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


def restore_host(recorded: Mapping[str, Any], node_dir: Path, errors: list[str]) -> None:
    """Undo what the node did to the host beyond its directory, as far as ``recorded`` says it was."""
    _kill_cgroup_tasks(recorded, errors)
    unmount_under(node_dir, errors)
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


def unmount_under(top: Path, errors: list[str]) -> None:
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


# --- one node per machine ------------------------------------------------------------------------


def machine_lock_holder() -> Path | None:
    """The directory of the testbed whose node holds this machine, if any says so."""
    try:
        return Path(json.loads(MACHINE_LOCK.read_text())["dir"])
    except (FileNotFoundError, ValueError, KeyError, TypeError):
        return None


def take_machine_lock(dir: Path) -> None:
    write_private(MACHINE_LOCK, json.dumps({"dir": str(dir)}) + "\n")


def release_machine_lock(dir: Path) -> None:
    """Remove the lock if testbed ``dir`` holds it (another testbed's lock stays)."""
    with contextlib.suppress(FileNotFoundError, ValueError):
        if Path(json.loads(MACHINE_LOCK.read_text()).get("dir", "")) == dir:
            MACHINE_LOCK.unlink()
