"""The binding-condition controller's metrics.

Defined as data (``INSTRUMENTS``) so that docs/metrics.md is checked against them
(tests/unit/test_docs.py). OTel names without unit suffixes: the Prometheus reader appends
``_seconds`` for unit ``s`` and ``_total`` to counters.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from opentelemetry.context import Context
from opentelemetry.metrics import CallbackOptions, MeterProvider, Observation

from otel_dra import __version__
from otel_dra.binding.claims import OUTCOMES
from otel_dra.telemetry.instruments import Instrument

SCOPE = "otel_dra.binding_controller"

# From an allocation to its binding conditions: the attachment delay (seconds, by default 2) plus
# the watch's and the write's latency; far beyond it, writes that fail and are retried. The
# scheduler's binding timeout (10 minutes by default) is the last bucket that matters.
ALLOCATION_TO_CONDITION_BUCKETS = (0.5, 1.0, 2.0, 3.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0)


CONDITIONS = Instrument(
    "otel_dra.binding_controller.conditions",
    "counter",
    "{device}",
    ("driver", "outcome"),
    "Allocated devices whose binding conditions the controller set, by outcome (attached or failed).",
)
ALLOCATION_TO_CONDITION = Instrument(
    "otel_dra.binding_controller.allocation_to_condition",
    "histogram",
    "s",
    ("driver", "outcome"),
    "Seconds from a device's allocation to the controller's write of its binding or failure condition.",
    ALLOCATION_TO_CONDITION_BUCKETS,
)
PENDING = Instrument(
    "otel_dra.binding_controller.pending",
    "gauge",
    "{allocation}",
    ("driver",),
    "Allocations with devices waiting for their binding conditions that the controller has yet to write.",
)
WRITE_ERRORS = Instrument(
    "otel_dra.binding_controller.write.errors",
    "counter",
    "{error}",
    ("code",),
    "Status writes that failed, by HTTP status (0: no answer); retried unless the claim changed or is gone.",
)
INVALID_CLAIMS = Instrument(
    "otel_dra.binding_controller.claims.invalid",
    "counter",
    "{claim}",
    (),
    "ResourceClaim versions skipped because a field had the wrong shape.",
)

INSTRUMENTS = (CONDITIONS, ALLOCATION_TO_CONDITION, PENDING, WRITE_ERRORS, INVALID_CLAIMS)


class ControllerMetrics:
    """The instruments on one MeterProvider, with the controller's recording methods."""

    def __init__(self, provider: MeterProvider, driver: str, pending: Callable[[], int]) -> None:
        meter = provider.get_meter(SCOPE, __version__)
        self.driver = driver
        self._conditions = meter.create_counter(CONDITIONS.name, CONDITIONS.unit, CONDITIONS.description)
        self._latency = meter.create_histogram(
            ALLOCATION_TO_CONDITION.name,
            ALLOCATION_TO_CONDITION.unit,
            ALLOCATION_TO_CONDITION.description,
            explicit_bucket_boundaries_advisory=ALLOCATION_TO_CONDITION.buckets,
        )
        self._write_errors = meter.create_counter(WRITE_ERRORS.name, WRITE_ERRORS.unit, WRITE_ERRORS.description)
        self._invalid = meter.create_counter(INVALID_CLAIMS.name, INVALID_CLAIMS.unit, INVALID_CLAIMS.description)

        def observe_pending(options: CallbackOptions) -> Iterable[Observation]:
            yield Observation(pending(), {"driver": driver})

        meter.create_observable_gauge(PENDING.name, [observe_pending], PENDING.unit, PENDING.description)
        # Both outcomes exist at 0 from the start: rate() and a failure ratio see them at once.
        for outcome in OUTCOMES:
            self._conditions.add(0, {"driver": driver, "outcome": outcome})
        self._invalid.add(0)

    def condition_set(self, outcome: str, seconds: float, context: Context | None = None) -> None:
        """``context``: whose current span the exemplar names (the write's span)."""
        attrs = {"driver": self.driver, "outcome": outcome}
        self._conditions.add(1, attrs)
        self._latency.record(seconds, attrs, context=context)

    def write_error(self, status: int) -> None:
        self._write_errors.add(1, {"code": str(status)})

    def invalid_claim(self) -> None:
        self._invalid.add(1)
