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
from otel_dra.testbed.releases import DEFAULT_FEATURE_GATES

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
