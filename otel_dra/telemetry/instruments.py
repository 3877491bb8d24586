"""An OTel instrument as data: what a meter creates from it, and what docs/metrics.md documents for
it (tests compare the two). The plugin, the binding controller and the webhook declare theirs so."""

from __future__ import annotations

from otel_dra.records import record


@record(frozen=True)
class Instrument:
    name: str  # OTel instrument name
    kind: str  # "counter", "updowncounter", "histogram" or "gauge"
    unit: str
    labels: tuple[str, ...]
    description: str
    buckets: tuple[float, ...] = ()  # a histogram's explicit bucket boundaries (advisory)
    stability: str = "experimental"  # ours; the plugin's upstream families are "beta"
