"""The sample fixture set loaded into the three stores, without an API server."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from opentelemetry.metrics import Meter, Observation

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


def register_sdk_gauges(meter: Meter, stores: list[Any], order: Callable[[Any], Any] | None = None) -> None:
    """The stores' families as real SDK observable gauges (objects in ``order`` if given): the
    reference our own exposition and OTLP encoding are compared with."""
    for store in stores:
        for fam in store.families:

            def callback(options: Any, store: Any = store, fam: Any = fam) -> Any:
                objects = store.objects()
                for obj in sorted(objects, key=order) if order is not None else objects:
                    for values, value in fam.samples(obj):
                        yield Observation(value, dict(zip(fam.gauge.labels, values, strict=True)))

            meter.create_observable_gauge(fam.gauge.name, [callback], fam.gauge.unit, fam.gauge.description)
