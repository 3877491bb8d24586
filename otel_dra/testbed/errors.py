"""The testbed's errors, below every testbed module so that each can raise them."""

from __future__ import annotations


class BuildError(RuntimeError):
    """A peer could not be built (missing toolchain, module resolution or compile failure)."""


class ReleaseError(BuildError, ValueError):
    """A Kubernetes version the testbed does not build."""
