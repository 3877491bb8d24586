"""A testbed node's configuration: where it keeps what (:class:`NodeLayout`, all under
``DIR/node-NAME``), containerd's, the CNI network's and the kubelet's configuration files, and the
kubelet's identity (a client certificate from the testbed CA and the RBAC binding that gives it the
``system:node`` role).

What this machine's kernel and the two daemons need (measured; README.md, "A real node"): no
registry (the images are made locally, :mod:`otel_dra.testbed.images`); and, where the VM withholds
CAP_SYS_RESOURCE, ``restrict_oom_score_adj`` in containerd and ``oomScoreAdj: 0`` in the kubelet,
without which runc fails every pod sandbox.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from otel_dra.testbed.images import PAUSE_IMAGE
from otel_dra.testbed.network import BRIDGE, BRIDGE_ADDRESS, POD_SUBNET
from otel_dra.testbed.nodehost import CNI_BIN_DIR, RUNC
from otel_dra.testbed.pki import client_certificate
from otel_dra.testbed.releases import kubernetes_release
from otel_dra.testbed.state import TestbedError, TestbedState, write_private

# containerd refuses a unix socket path longer than this (Linux allows 107 bytes; containerd keeps
# to the BSDs' 104), and the kubelet dials plugin sockets under its root dir by full path.
MAX_SOCKET_PATH = 104


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


def kubelet_gates(testbed: TestbedState) -> dict[str, bool]:
    """The control plane's gates (components must agree on which DRA fields exist)."""
    apiserver = testbed.components.get("kube-apiserver", {}).get("argv", [])
    for arg in apiserver:
        if arg.startswith("--feature-gates="):
            pairs = (item.split("=") for item in arg.removeprefix("--feature-gates=").split(",") if item)
            return {key: value == "true" for key, value in pairs}
    return dict(kubernetes_release().feature_gates)


def node_credentials(testbed: TestbedState, layout: NodeLayout, name: str) -> Path:
    """A kubeconfig with a client certificate ``CN=system:node:NAME, O=system:nodes`` from the
    testbed CA, and the binding that gives that group the ``system:node`` role (the testbed
    authorizes with RBAC alone: there is no Node authorizer to do it)."""
    pki = layout.dir / "pki"
    pki.mkdir(mode=0o700)
    certificate, key = client_certificate(
        pki, testbed.ca_file.parent, subject=f"/O=system:nodes/CN=system:node:{name}", stem="node"
    )
    kubeconfig = layout.dir / "kubeconfig"
    user = f"system:node:{name}"
    cluster = {"server": testbed.server, "certificate-authority": str(testbed.ca_file)}
    credentials = {"client-certificate": str(certificate), "client-key": str(key)}
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
