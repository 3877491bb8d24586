"""The sample fixture set loaded into the three stores, without an API server."""

from __future__ import annotations

from typing import Any

from otel_dra.cluster import deviceclass, resourceclaim, resourceslice
from otel_dra.cluster.store import ObjectStore
from otel_dra.fixtures import sample_objects


def sample_stores(**store_options: Any) -> list[ObjectStore[Any]]:
    stores: list[ObjectStore[Any]] = [
        ObjectStore("resourceclaims", resourceclaim.parse, resourceclaim.FAMILIES, **store_options),
        ObjectStore("resourceslices", resourceslice.parse, resourceslice.FAMILIES, **store_options),
        ObjectStore("deviceclasses", deviceclass.parse, deviceclass.FAMILIES, **store_options),
    ]
    kinds = {"ResourceClaim": stores[0], "ResourceSlice": stores[1], "DeviceClass": stores[2]}
    for i, obj in enumerate(sample_objects()):
        if obj["kind"] in kinds:
            obj["metadata"]["resourceVersion"] = str(i + 1)
            kinds[obj["kind"]].upsert(obj)
    return stores
