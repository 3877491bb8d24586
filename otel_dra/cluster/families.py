"""Metric families as data, the kube-state-metrics way.

A family is a gauge (name, unit, help, labels), a stability level and a function from one cached
object to its samples; a family joined across resources also names the resources it reads. The
same definition drives the Prometheus exposition (rendered when the object changes), the OTLP
observable gauge, and the docs/metrics.md table check.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from otel_dra.telemetry.exposition import GaugeFamily

T = TypeVar("T")

Sample = tuple[Sequence[str], float]


@dataclass(frozen=True)
class Family(Generic[T]):
    gauge: GaugeFamily
    stability: str
    samples: Callable[[T], Iterable[Sample]]
    # The watched resources (plural names) whose objects the values are computed from, for the
    # families of otel_dra/cluster/joined_families.py; a per-object family reads its own resource only.
    reads: tuple[str, ...] = ()
    # The optional fields of the slim objects (the FIELDS of resourceclaim, resourceslice and pod; their
    # names are unique across the slim types) that the samples read; a store keeps only the fields
    # some served family reads.
    fields: tuple[str, ...] = ()
    # The oldest Kubernetes minor ("1.35") whose API serves what the family reads, when the family
    # names one (docs/metrics.md says it); "" for every release the exporter supports.
    kubernetes: str = ""

    @property
    def prom_name(self) -> str:
        return self.gauge.prom_name


def family(
    name: str,
    unit: str,
    description: str,
    labels: tuple[str, ...],
    samples: Callable[[T], Iterable[Sample]],
    stability: str = "stable",
    reads: tuple[str, ...] = (),
    fields: tuple[str, ...] = (),
    kubernetes: str = "",
) -> Family[T]:
    return Family(GaugeFamily(name, unit, description, labels), stability, samples, reads, fields, kubernetes)
