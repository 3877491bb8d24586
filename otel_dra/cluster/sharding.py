"""Sharding: N exporter replicas each hold and serve a stable 1/N of the claims and slices.

Objects are assigned by FNV-1a 64 of their UID modulo the shard count (as kube-state-metrics
does): a UID never changes, so an object stays on its shard for life, and the split needs no
coordination. Every shard still lists and watches everything and renders only its own objects'
series; the saving is in memory, rendering and scrape size. DeviceClasses (few, cluster-wide) go to
shard 0 only, so that summing across shards never double counts them. Series that are not about
one object (pool aggregates) belong to the shard that a hash of their name picks
(:meth:`Shard.owns_name`).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

_FNV_OFFSET = 0xCBF29CE484222325
_FNV_PRIME = 0x100000001B3
_MASK = 2**64 - 1


def fnv1a64(data: bytes) -> int:
    h = _FNV_OFFSET
    for byte in data:
        h = ((h ^ byte) * _FNV_PRIME) & _MASK
    return h


@dataclass(frozen=True)
class Shard:
    index: int = 0
    total: int = 1

    def __post_init__(self) -> None:
        if self.total < 1:
            raise ValueError(f"--total-shards must be at least 1, got {self.total}")
        if not 0 <= self.index < self.total:
            raise ValueError(f"--shard must be in 0..{self.total - 1}, got {self.index}")

    @property
    def sharded(self) -> bool:
        return self.total > 1

    def owns(self, obj: dict[str, Any]) -> bool:
        if self.total == 1:
            return True
        meta = obj.get("metadata")
        meta = meta if isinstance(meta, dict) else {}  # malformed: must not break the list or watch
        uid = meta.get("uid") or f"{meta.get('namespace', '')}/{meta.get('name', '')}"
        return fnv1a64(str(uid).encode()) % self.total == self.index

    def owns_name(self, name: str) -> bool:
        """For series keyed by a name rather than an object (a resource pool: "driver/pool")."""
        return self.total == 1 or fnv1a64(name.encode()) % self.total == self.index

    def first_only(self) -> Callable[[dict[str, Any]], bool]:
        """For resources that only shard 0 serves."""
        first = self.index == 0
        return lambda obj: first


_ORDINAL = re.compile(r"-(\d+)$")


def ordinal_from_pod_name(pod_name: str) -> int:
    """The StatefulSet ordinal at the end of a pod name (``otel-dra-2`` -> 2)."""
    match = _ORDINAL.search(pod_name)
    if match is None:
        raise ValueError(f"cannot take a shard number from pod name {pod_name!r}: it does not end in -<ordinal>")
    return int(match[1])
