"""CDI (Container Device Interface) spec files that tell the container runtime what to inject.

As in dra-example-driver: vendor ``k8s.<driver>`` and class ``gpu`` make the kind
``k8s.<driver>/gpu``. One spec file holds the ``common`` device (node and driver name as
environment variables) and each prepared claim gets a transient spec file of its own with devices
``<claimUID>-<device>``. A container gets ``<kind>=common`` plus its claim's devices. What each
claim device sets is computed by :mod:`otel_dra.plugin.config` (upstream's variables, from the
claim's device configuration) and kept in the checkpoint, so a lost spec is rewritten the same.

Claim specs are written atomically but not fsynced: they live under /var/run/cdi (tmpfs on
nodes) and are derived from the checkpoint, which is durable; a prepare of a checkpointed claim
whose spec is missing writes it again.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from otel_dra.plugin.files import remove_file, write_atomic

CDI_VERSION = "0.5.0"
CDI_CLASS = "gpu"
COMMON_DEVICE = "common"


class CdiWriter:
    """``cdi_class``: the device profile's (gpu, cpu, net)."""

    def __init__(self, root: Path, driver_name: str, node_name: str, cdi_class: str = CDI_CLASS) -> None:
        self.root = root
        self.driver_name = driver_name
        self.node_name = node_name
        self.vendor = f"k8s.{driver_name}"
        self.cdi_class = cdi_class
        self.kind = f"{self.vendor}/{cdi_class}"

    def _spec_path(self, transient_id: str) -> Path:
        # The CDI library's transient spec name: <vendor>-<class>_<id>.
        return self.root / f"{self.vendor}-{self.cdi_class}_{transient_id}.json"

    def claim_spec_path(self, claim_uid: str) -> Path:
        return self._spec_path(claim_uid)

    def _spec(self, devices: list[dict[str, Any]]) -> bytes:
        spec = {"cdiVersion": CDI_VERSION, "kind": self.kind, "devices": devices}
        return (json.dumps(spec, indent=2, sort_keys=True) + "\n").encode()

    def write_common(self) -> Path:
        """The spec of the ``common`` device, written at start-up."""
        self.root.mkdir(parents=True, exist_ok=True)
        env = [f"KUBERNETES_NODE_NAME={self.node_name}", f"DRA_RESOURCE_DRIVER_NAME={self.driver_name}"]
        path = self._spec_path(COMMON_DEVICE)
        write_atomic(path, self._spec([{"name": COMMON_DEVICE, "containerEdits": {"env": env}}]))
        return path

    def device_ids(self, claim_uid: str, device_name: str) -> list[str]:
        """The fully qualified CDI device ids returned to the kubelet for one allocated device (or
        share of one: ``device_name`` is then ``<device>-<shareID>``). The
        device's own id first: the kubelet names the device by the first id in the pod's
        allocatedResourcesStatus (resourceID), and drops entries whose resourceID repeats, so with
        the common id first every device read ``...=common`` and a claim of two showed one."""
        return [f"{self.kind}={claim_uid}-{device_name}", f"{self.kind}={COMMON_DEVICE}"]

    def write_claim(self, claim_uid: str, devices: Sequence[tuple[str, Sequence[str]]]) -> Path:
        """The transient spec of one claim: one CDI device ``<claimUID>-<device>`` per ``(device name,
        environment)``; the variable names are unique on the node, so a container with several
        claims sees them all."""
        spec_devices = [{"name": f"{claim_uid}-{name}", "containerEdits": {"env": list(env)}} for name, env in devices]
        path = self.claim_spec_path(claim_uid)
        write_atomic(path, self._spec(spec_devices), durable=False)
        return path

    def remove_claim(self, claim_uid: str) -> bool:
        """Delete the claim's spec file; False when there was none (already unprepared)."""
        return remove_file(self.claim_spec_path(claim_uid))
