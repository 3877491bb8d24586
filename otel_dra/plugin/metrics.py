"""The plugin's metrics: the dra-example-driver set, byte for byte in the Prometheus exposition.

The instruments are defined as data (``INSTRUMENTS``) so that docs/metrics.md can be checked
against them. OTel names carry no unit suffix; the Prometheus reader appends ``_total`` to
counters and ``_seconds`` for unit ``s`` (shared/reference/metrics.md §4), which gives exactly the
upstream names. HELP texts are upstream's, with its stability prefix: ``[BETA] `` for the driver's
families (dra-example-driver's pkg/metrics), ``[ALPHA] `` for ``rest_client_*`` (client-go's, as
k8s.io/component-base/metrics/prometheus/restclient registers them).
"""

from __future__ import annotations

from dataclasses import dataclass

from opentelemetry.metrics import Counter, Histogram, MeterProvider

from otel_dra import __version__
from otel_dra.kube.client import RequestRecord

SCOPE = "otel_dra.plugin"

SUCCESS = "success"
ERROR = "error"
RESULTS = (SUCCESS, ERROR)

# The example driver's buckets for prepare/unprepare durations (seconds).
CLAIM_DURATION_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
# client-go's rest_client_request_duration_seconds buckets.
REST_DURATION_BUCKETS = (0.005, 0.025, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 15.0, 30.0, 60.0)


@dataclass(frozen=True)
class Instrument:
    name: str  # OTel instrument name
    kind: str  # "counter" or "histogram"
    unit: str
    labels: tuple[str, ...]
    description: str
    buckets: tuple[float, ...] = ()


PREPARE_CLAIMS = Instrument(
    "dra_example_driver_prepare_claims",
    "counter",
    "{claim}",
    ("result",),
    "[BETA] Total number of resource claim prepare operations handled by the driver.",
)
UNPREPARE_CLAIMS = Instrument(
    "dra_example_driver_unprepare_claims",
    "counter",
    "{claim}",
    ("result",),
    "[BETA] Total number of resource claim unprepare operations handled by the driver.",
)
PREPARE_DURATION = Instrument(
    "dra_example_driver_prepare_claim_duration",
    "histogram",
    "s",
    ("result",),
    "[BETA] Latency in seconds of resource claim prepare operations handled by the driver.",
    CLAIM_DURATION_BUCKETS,
)
UNPREPARE_DURATION = Instrument(
    "dra_example_driver_unprepare_claim_duration",
    "histogram",
    "s",
    ("result",),
    "[BETA] Latency in seconds of resource claim unprepare operations handled by the driver.",
    CLAIM_DURATION_BUCKETS,
)
FATAL_ERRORS = Instrument(
    "dra_example_driver_fatal_background_errors",
    "counter",
    "{error}",
    (),
    "[BETA] Total number of fatal background errors reported by the driver.",
)
REST_REQUESTS = Instrument(
    "rest_client_requests",
    "counter",
    "{request}",
    ("code", "host", "method"),
    "[ALPHA] Number of HTTP requests, partitioned by status code, method, and host.",
)
REST_DURATION = Instrument(
    "rest_client_request_duration",
    "histogram",
    "s",
    ("host", "verb"),
    "[ALPHA] Request latency in seconds. Broken down by verb, and host.",
    REST_DURATION_BUCKETS,
)
REST_RETRIES = Instrument(
    "rest_client_request_retries",
    "counter",
    "{retry}",
    ("code", "host", "verb"),
    "[ALPHA] Number of request retries, partitioned by status code, verb, and host.",
)

INSTRUMENTS = (
    PREPARE_CLAIMS,
    UNPREPARE_CLAIMS,
    PREPARE_DURATION,
    UNPREPARE_DURATION,
    FATAL_ERRORS,
    REST_REQUESTS,
    REST_DURATION,
    REST_RETRIES,
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
        # Present at 0 before any work, as upstream: dashboards and rate() see the series at once.
        for result in RESULTS:
            self._prepare.add(0, {"result": result})
            self._unprepare.add(0, {"result": result})
        self._fatal.add(0)

    def prepared(self, ok: bool, seconds: float) -> None:
        attrs = {"result": SUCCESS if ok else ERROR}
        self._prepare.add(1, attrs)
        self._prepare_duration.record(seconds, attrs)

    def unprepared(self, ok: bool, seconds: float) -> None:
        attrs = {"result": SUCCESS if ok else ERROR}
        self._unprepare.add(1, attrs)
        self._unprepare_duration.record(seconds, attrs)

    def fatal_error(self) -> None:
        self._fatal.add(1)

    def observe_request(self, record: RequestRecord) -> None:
        """The KubeClient observer: every attempt of every API request of the plugin's client."""
        code = str(record.status) if record.status else NO_ANSWER_CODE
        self._rest_requests.add(1, {"code": code, "host": record.host, "method": record.method})
        self._rest_duration.record(record.seconds, {"host": record.host, "verb": record.method})
        if record.retried:
            self._rest_retries.add(1, {"code": code, "host": record.host, "verb": record.method})
