"""The plugin's metrics: the dra-example-driver set, byte for byte in the Prometheus exposition.

The instruments are defined as data (``INSTRUMENTS``) so that docs/metrics.md can be checked
against them. OTel names carry no unit suffix; the Prometheus reader appends ``_total`` to
counters and ``_seconds`` for unit ``s`` (shared/reference/metrics.md §4), which gives exactly the
upstream names. HELP texts are upstream's, with its stability prefix: ``[BETA] `` for the driver's
families (dra-example-driver's pkg/metrics), ``[ALPHA] `` for ``rest_client_*`` (client-go's, as
k8s.io/component-base/metrics/prometheus/restclient registers them).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager

from opentelemetry.context import Context
from opentelemetry.metrics import CallbackOptions, Counter, Histogram, MeterProvider, Observation

from otel_dra import __version__
from otel_dra.kube.client import RequestRecord
from otel_dra.telemetry.instruments import Instrument

SCOPE = "otel_dra.plugin"

SUCCESS = "success"
ERROR = "error"
RESULTS = (SUCCESS, ERROR)
OPERATIONS = ("prepare", "unprepare")

# The example driver's buckets for prepare/unprepare durations (seconds), and three more: a GPU
# reset or a passthrough (VFIO rebind) in prepare/unprepare takes up to a minute, which upstream's
# last bucket (10 s) cannot tell from a hang.
CLAIM_DURATION_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
# client-go's rest_client_request_duration_seconds buckets.
REST_DURATION_BUCKETS = (0.005, 0.025, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 15.0, 30.0, 60.0)
# From a claim's allocation to its prepare: the pod's binding, the kubelet's admission and sandbox,
# then the prepare (seconds when all goes well; minutes behind an image pull of an init container or
# a busy node; beyond half an hour, stuck). The times compared are whole seconds.
ALLOCATION_TO_PREPARED_BUCKETS = (0.5, 1.0, 2.0, 3.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0)

PREPARE_CLAIMS = Instrument(
    "dra_example_driver_prepare_claims",
    "counter",
    "{claim}",
    ("result",),
    "[BETA] Total number of resource claim prepare operations handled by the driver.",
    stability="beta",
)
UNPREPARE_CLAIMS = Instrument(
    "dra_example_driver_unprepare_claims",
    "counter",
    "{claim}",
    ("result",),
    "[BETA] Total number of resource claim unprepare operations handled by the driver.",
    stability="beta",
)
PREPARE_DURATION = Instrument(
    "dra_example_driver_prepare_claim_duration",
    "histogram",
    "s",
    ("result",),
    "[BETA] Latency in seconds of resource claim prepare operations handled by the driver.",
    CLAIM_DURATION_BUCKETS,
    stability="beta",
)
UNPREPARE_DURATION = Instrument(
    "dra_example_driver_unprepare_claim_duration",
    "histogram",
    "s",
    ("result",),
    "[BETA] Latency in seconds of resource claim unprepare operations handled by the driver.",
    CLAIM_DURATION_BUCKETS,
    stability="beta",
)
FATAL_ERRORS = Instrument(
    "dra_example_driver_fatal_background_errors",
    "counter",
    "{error}",
    (),
    "[BETA] Total number of fatal background errors reported by the driver.",
    stability="beta",
)
REST_REQUESTS = Instrument(
    "rest_client_requests",
    "counter",
    "{request}",
    ("code", "host", "method"),
    "[ALPHA] Number of HTTP requests, partitioned by status code, method, and host.",
    stability="beta",
)
REST_DURATION = Instrument(
    "rest_client_request_duration",
    "histogram",
    "s",
    ("host", "verb"),
    "[ALPHA] Request latency in seconds. Broken down by verb, and host.",
    REST_DURATION_BUCKETS,
    stability="beta",
)
REST_RETRIES = Instrument(
    "rest_client_request_retries",
    "counter",
    "{retry}",
    ("code", "host", "verb"),
    "[ALPHA] Number of request retries, partitioned by status code, verb, and host.",
    stability="beta",
)

# The SLIs driver teams ask for, beyond upstream's set (issue 14): ours, hence experimental.
IN_FLIGHT = Instrument(
    "otel_dra_plugin_requests_in_flight",
    "updowncounter",
    "{request}",
    ("operation",),
    "NodePrepareResources/NodeUnprepareResources requests with claims being handled now.",
    stability="experimental",
)
PREPARED_DEVICES = Instrument(
    "otel_dra_plugin_prepared_devices",
    "gauge",
    "{device}",
    (),
    "Devices of prepared claims, from the checkpoint (what stays prepared across restarts).",
    stability="experimental",
)
CLAIM_ERRORS = Instrument(
    "otel_dra_plugin_claim_errors",
    "counter",
    "{error}",
    ("operation", "error_type"),
    "Claims whose prepare or unprepare failed, and failed tries to remove an unprepared claim's files "
    "(after its answer), by error type (a bounded set).",
    stability="experimental",
)
DEVICE_HEALTH = Instrument(
    "otel_dra_plugin_device_health",
    "gauge",
    "1",
    ("pool", "device_name", "health"),
    "Health of each published device: 1 for its current state (Healthy, Unhealthy, Unknown), 0 for the others.",
    stability="experimental",
)
HEALTH_STREAMS = Instrument(
    "otel_dra_plugin_health_streams",
    "gauge",
    "{stream}",
    (),
    "DRAResourceHealth.NodeWatchResources streams open now (the kubelet keeps one).",
    stability="experimental",
)
ALLOCATION_TO_PREPARED = Instrument(
    "otel_dra.plugin.claim.allocation_to_prepared",
    "histogram",
    "s",
    ("driver", "deviceclass_name"),
    "Seconds from a claim's allocation to the end of its first successful prepare on this node.",
    ALLOCATION_TO_PREPARED_BUCKETS,
    stability="experimental",
)
PUBLISHED_DEVICES = Instrument(
    "otel_dra_plugin_published_devices",
    "gauge",
    "{device}",
    ("profile", "partition"),
    "Devices this node publishes in its ResourceSlices, by device profile and whether they are partitions of another.",
    stability="experimental",
)
FEATURES_LEFT_OUT = Instrument(
    "otel_dra_plugin_features_left_out",
    "gauge",
    "1",
    ("feature", "feature_gate"),
    "1 per DRA feature of the device profile that the API server does not take, left out of the published pool.",
    stability="experimental",
)
DEVICE_STATUS_WRITES = Instrument(
    "otel_dra_plugin_device_status_writes",
    "counter",
    "{write}",
    ("operation", "result"),
    "Writes of prepared devices' status into their ResourceClaims (status.devices), by result.",
    stability="experimental",
)
# Its label values: operation apply (after a prepare) or clear (after an unprepare); result
# success, error (retried with backoff) or gone (no claim of that name with that UID any more).
APPLY = "apply"
CLEAR = "clear"
GONE = "gone"
DEVICE_STATUS_OPERATIONS = (APPLY, CLEAR)

# The error types of otel_dra.plugin.state.ClaimError; HTTP<code> is folded into its class.
ERROR_TYPES = frozenset(
    {
        "APIUnavailable",
        "CDIRemoveFailed",
        "CDIWriteFailed",
        "CheckpointUnreadable",
        "CheckpointWriteFailed",
        "HTTP4xx",
        "HTTP5xx",
        "Internal",
        "InvalidClaim",
        "InvalidConfig",
        "InvalidRequest",
        "InvalidResponse",
        "NoResultsForDriver",
        "NotAllocated",
        "NotFound",
        "UIDMismatch",
        "UnknownDevice",
        "WrongPool",
    }
)
HEALTH_LABELS = ("Healthy", "Unhealthy", "Unknown")  # as the kubelet writes them in pod status


def error_type(kind: str) -> str:
    """A ClaimError kind as a bounded label value: HTTP409 -> HTTP4xx; anything unknown -> Other."""
    if kind.startswith("HTTP") and kind[4:].isdigit():
        kind = f"HTTP{kind[4]}xx"
    return kind if kind in ERROR_TYPES else "Other"


INSTRUMENTS = (
    PREPARE_CLAIMS,
    UNPREPARE_CLAIMS,
    PREPARE_DURATION,
    UNPREPARE_DURATION,
    FATAL_ERRORS,
    REST_REQUESTS,
    REST_DURATION,
    REST_RETRIES,
    IN_FLIGHT,
    PREPARED_DEVICES,
    CLAIM_ERRORS,
    DEVICE_HEALTH,
    HEALTH_STREAMS,
    ALLOCATION_TO_PREPARED,
    DEVICE_STATUS_WRITES,
    PUBLISHED_DEVICES,
    FEATURES_LEFT_OUT,
)

# client-go's code label when there was no HTTP answer.
NO_ANSWER_CODE = "<error>"


class PluginMetrics:
    """The instruments on one MeterProvider, with the plugin's recording methods."""

    def __init__(self, provider: MeterProvider) -> None:
        meter = provider.get_meter(SCOPE, __version__)

        def counter(i: Instrument) -> Counter:
            return meter.create_counter(i.name, i.unit, i.description)

        def histogram(i: Instrument) -> Histogram:
            return meter.create_histogram(i.name, i.unit, i.description, explicit_bucket_boundaries_advisory=i.buckets)

        self._prepare = counter(PREPARE_CLAIMS)
        self._unprepare = counter(UNPREPARE_CLAIMS)
        self._prepare_duration = histogram(PREPARE_DURATION)
        self._unprepare_duration = histogram(UNPREPARE_DURATION)
        self._fatal = counter(FATAL_ERRORS)
        self._rest_requests = counter(REST_REQUESTS)
        self._rest_duration = histogram(REST_DURATION)
        self._rest_retries = counter(REST_RETRIES)
        self._meter = meter
        self._in_flight = meter.create_up_down_counter(IN_FLIGHT.name, IN_FLIGHT.unit, IN_FLIGHT.description)
        self._claim_errors = counter(CLAIM_ERRORS)
        self._allocation_to_prepared = histogram(ALLOCATION_TO_PREPARED)
        self._device_status_writes = counter(DEVICE_STATUS_WRITES)
        # Present at 0 before any work, as upstream: dashboards and rate() see the series at once.
        for result in RESULTS:
            self._prepare.add(0, {"result": result})
            self._unprepare.add(0, {"result": result})
        self._fatal.add(0)
        for operation in OPERATIONS:
            self._in_flight.add(0, {"operation": operation})
        for operation in DEVICE_STATUS_OPERATIONS:
            for result in RESULTS:
                self._device_status_writes.add(0, {"operation": operation, "result": result})

    @contextmanager
    def in_flight(self, operation: str) -> Iterator[None]:
        attrs = {"operation": operation}
        self._in_flight.add(1, attrs)
        try:
            yield
        finally:
            self._in_flight.add(-1, attrs)

    def claim_error(self, operation: str, kind: str) -> None:
        self._claim_errors.add(1, {"operation": operation, "error_type": error_type(kind)})

    def observe_state(
        self,
        prepared_devices: Callable[[], int],
        device_health: Callable[[], Iterable[tuple[str, str, str]]],
        health_streams: Callable[[], int] | None,
    ) -> None:
        """Gauges read at collection time: devices prepared (checkpoint), (pool, device, health) of
        each device, open health streams (None: health is off, no series)."""

        def prepared(options: CallbackOptions) -> Iterable[Observation]:
            yield Observation(prepared_devices())

        def health(options: CallbackOptions) -> Iterable[Observation]:
            for pool, device, state in device_health():
                for label in HEALTH_LABELS:
                    attrs = {"pool": pool, "device_name": device, "health": label}
                    yield Observation(1 if label == state else 0, attrs)

        def streams(options: CallbackOptions) -> Iterable[Observation]:
            if health_streams is not None:
                yield Observation(health_streams())

        for instrument, callback in ((PREPARED_DEVICES, prepared), (DEVICE_HEALTH, health), (HEALTH_STREAMS, streams)):
            self._meter.create_observable_gauge(instrument.name, [callback], instrument.unit, instrument.description)

    def observe_pool(
        self,
        profile: str,
        published: Callable[[], Iterable[bool]],
        left_out: Callable[[], Iterable[tuple[str, str]]],
    ) -> None:
        """Gauges of the published pool: ``published`` gives, per published device, whether it is a
        partition; ``left_out`` the (feature, feature gate) pairs the API server did not take."""

        def devices(options: CallbackOptions) -> Iterable[Observation]:
            partitions = list(published())
            whole = sum(1 for p in partitions if not p)
            yield Observation(whole, {"profile": profile, "partition": "false"})
            if len(partitions) > whole:
                yield Observation(len(partitions) - whole, {"profile": profile, "partition": "true"})

        def features(options: CallbackOptions) -> Iterable[Observation]:
            for feature, gate in left_out():
                yield Observation(1, {"feature": feature, "feature_gate": gate})

        for instrument, callback in ((PUBLISHED_DEVICES, devices), (FEATURES_LEFT_OUT, features)):
            self._meter.create_observable_gauge(instrument.name, [callback], instrument.unit, instrument.description)

    def prepared(self, ok: bool, seconds: float) -> None:
        attrs = {"result": SUCCESS if ok else ERROR}
        self._prepare.add(1, attrs)
        self._prepare_duration.record(seconds, attrs)

    def unprepared(self, ok: bool, seconds: float) -> None:
        attrs = {"result": SUCCESS if ok else ERROR}
        self._unprepare.add(1, attrs)
        self._unprepare_duration.record(seconds, attrs)

    def allocation_to_prepared(
        self, seconds: float, driver: str, device_class: str, context: Context | None = None
    ) -> None:
        """``context``: whose current span the exemplar names (the claim's span; kept by the SDK's
        default, trace-based, exemplar filter only when that span is sampled)."""
        attrs = {"driver": driver, "deviceclass_name": device_class}
        self._allocation_to_prepared.record(seconds, attrs, context=context)

    def device_status_write(self, operation: str, result: str) -> None:
        """One write of a claim's status.devices (otel_dra.plugin.devicestatus)."""
        self._device_status_writes.add(1, {"operation": operation, "result": result})

    def fatal_error(self) -> None:
        self._fatal.add(1)

    def observe_request(self, record: RequestRecord) -> None:
        """The KubeClient observer: every attempt of every API request of the plugin's client."""
        code = str(record.status) if record.status else NO_ANSWER_CODE
        self._rest_requests.add(1, {"code": code, "host": record.host, "method": record.method})
        self._rest_duration.record(record.seconds, {"host": record.host, "verb": record.method})
        if record.retried:
            self._rest_retries.add(1, {"code": code, "host": record.host, "verb": record.method})
