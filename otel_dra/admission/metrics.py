"""The admission webhook's metrics.

Defined as data (``INSTRUMENTS``) so that docs/metrics.md is checked against them
(tests/unit/test_docs.py). OTel names without unit suffixes: the Prometheus reader appends
``_seconds`` for unit ``s`` and ``_total`` to counters.
"""

from __future__ import annotations

from opentelemetry.metrics import MeterProvider

from otel_dra import __version__
from otel_dra.admission.review import KINDS, OTHER, VERDICTS
from otel_dra.telemetry.instruments import Instrument

SCOPE = "otel_dra.webhook"

# Decoding and judging one review: tens of microseconds for a claim of a few configs, a few
# milliseconds for a body at --max-review-bytes. The API server's webhook timeout (10 s by default)
# is far beyond the last bucket.
REVIEW_DURATION_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25)


REVIEWS = Instrument(
    "otel_dra.webhook.reviews",
    "counter",
    "{review}",
    ("kind", "verdict"),
    "AdmissionReviews answered, by the kind of object under review and the verdict (allowed or denied).",
)
REVIEW_DURATION = Instrument(
    "otel_dra.webhook.review.duration",
    "histogram",
    "s",
    ("kind",),
    "Seconds to decode and judge one AdmissionReview (from its body received to its answer built).",
    REVIEW_DURATION_BUCKETS,
)
REQUESTS_INVALID = Instrument(
    "otel_dra.webhook.requests.invalid",
    "counter",
    "{request}",
    ("code",),
    "HTTP requests answered with an error instead of a verdict, by HTTP status.",
)

INSTRUMENTS = (REVIEWS, REVIEW_DURATION, REQUESTS_INVALID)


class WebhookMetrics:
    """The instruments on one MeterProvider, with the server's recording methods."""

    def __init__(self, provider: MeterProvider) -> None:
        meter = provider.get_meter(SCOPE, __version__)
        self._reviews = meter.create_counter(REVIEWS.name, REVIEWS.unit, REVIEWS.description)
        self._duration = meter.create_histogram(
            REVIEW_DURATION.name,
            REVIEW_DURATION.unit,
            REVIEW_DURATION.description,
            explicit_bucket_boundaries_advisory=REVIEW_DURATION.buckets,
        )
        self._invalid = meter.create_counter(REQUESTS_INVALID.name, REQUESTS_INVALID.unit, REQUESTS_INVALID.description)
        # Every kind and verdict exists at 0 from the start: a denial ratio sees them at once.
        for kind in KINDS:
            for verdict in VERDICTS:
                self._reviews.add(0, {"kind": kind, "verdict": verdict})

    def review(self, kind: str, verdict: str, seconds: float) -> None:
        """``kind``: one of KINDS or OTHER; ``verdict``: one of VERDICTS."""
        self._reviews.add(1, {"kind": kind if kind in KINDS else OTHER, "verdict": verdict})
        self._duration.record(seconds, {"kind": kind if kind in KINDS else OTHER})

    def invalid_request(self, code: int) -> None:
        self._invalid.add(1, {"code": str(code)})
