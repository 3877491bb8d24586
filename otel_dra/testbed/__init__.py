"""A real local Kubernetes control plane for the demo and the integration tests.

``build`` compiles etcd and the Kubernetes binaries from Go modules into a per-machine cache;
``up``/``down``/``running`` start and stop a control plane whose state lives in one directory.
"""

from otel_dra.testbed.build import (
    Binaries,
    BinariesMissingError,
    BuildError,
    build,
    default_cache_root,
    find_binaries,
    find_or_build_binaries,
)
from otel_dra.testbed.controlplane import (
    KubectlError,
    Testbed,
    TestbedError,
    down,
    running,
    up,
)
from otel_dra.testbed.node import stop_nodes
from otel_dra.testbed.releases import DEFAULT_FEATURE_GATES
from otel_dra.testbed.state import before_down

# The control plane stops what is attached to it before itself (Testbed.down), knowing nothing of
# what that is; the nodes' teardown is registered here, where the package is put together, so that
# every process that loads a testbed (`otel-dra testbed down` in another process too) stops its
# nodes and puts the host back before the control plane goes.
before_down(stop_nodes)

__all__ = [
    "DEFAULT_FEATURE_GATES",
    "Binaries",
    "BinariesMissingError",
    "BuildError",
    "KubectlError",
    "Testbed",
    "TestbedError",
    "build",
    "default_cache_root",
    "down",
    "find_binaries",
    "find_or_build_binaries",
    "running",
    "up",
]
