"""Scrapes come first: the OTLP pusher waits (bounded) while a scrape is in flight."""

from __future__ import annotations

import threading
import time
import urllib.request

from opentelemetry.sdk.resources import Resource

from otel_dra.telemetry.http import Endpoints, MetricsServer
from otel_dra.telemetry.otlp_encode import RequestBuilder
from otel_dra.telemetry.otlp_push import PreEncodedPusher
from otel_dra.telemetry.priority import ScrapePriority
from tests.unit.sample_stores import sample_stores


class SmallRequests(RequestBuilder):
    """Splits the sample state into many small requests, as 10^5 claims split into ~30."""

    def counted(self, metrics, time_unix_nano, limit=600):  # type: ignore[no-untyped-def,override]
        return super().counted(metrics, time_unix_nano, limit)


class RecordingSender:
    def __init__(self) -> None:
        self.sent: list[float] = []

    def send(self, request: bytes) -> bool:
        self.sent.append(time.monotonic())
        return True

    def shutdown(self) -> None:
        pass


def _pusher(priority: ScrapePriority, sender: RecordingSender, max_defer_s: float) -> PreEncodedPusher:
    stores = sample_stores(otlp=True, segment_size=2)
    metrics = [m for s in stores for m in s.otlp_metrics()]
    return PreEncodedPusher(
        lambda: metrics,
        SmallRequests(Resource.create({"service.name": "t"}), "s", "v"),
        sender,
        interval_s=3600,
        pace_s=0,
        priority=priority,
        max_defer_s=max_defer_s,
    )


def test_wait_idle_returns_at_once_without_scrapes():
    assert ScrapePriority().wait_idle(5.0) == 0.0


def test_push_waits_for_a_scrape_in_flight_then_sends_everything():
    priority, sender = ScrapePriority(), RecordingSender()
    pusher = _pusher(priority, sender, max_defer_s=30)
    with priority.scraping():
        done = threading.Thread(target=pusher.export)
        done.start()
        time.sleep(0.3)
        assert sender.sent == []  # nothing built or sent while the scrape runs
        released = time.monotonic()
    done.join(5)
    assert len(sender.sent) > 3
    assert min(sender.sent) >= released


def test_a_push_is_deferred_at_most_max_defer_in_total():
    priority, sender = ScrapePriority(), RecordingSender()
    pusher = _pusher(priority, sender, max_defer_s=0.2)
    with priority.scraping():  # a scrape that never ends must not starve the push
        start = time.monotonic()
        assert pusher.export()
        took = time.monotonic() - start
    assert len(sender.sent) > 3
    assert 0.2 <= took < 2.0


class SlowSender(RecordingSender):
    def send(self, request: bytes) -> bool:
        time.sleep(0.02)
        return super().send(request)


def test_once_its_deferral_is_spent_a_push_takes_at_most_a_fifth_of_the_time_while_scrapes_run():
    priority, sender = ScrapePriority(), SlowSender()
    pusher = _pusher(priority, sender, max_defer_s=0.05)
    with priority.scraping():
        assert pusher.export()
    gaps = [b - a for a, b in zip(sender.sent, sender.sent[1:], strict=False)]
    assert len(gaps) > 3
    # Each send takes >= 20 ms; a fifth of the time means >= 4 x that between sends.
    assert min(gaps) >= 0.02 * 5 * 0.9
    # Without scrapes the same push goes at full speed.
    sender = SlowSender()
    pusher = _pusher(priority, sender, max_defer_s=0.05)
    assert pusher.export()
    assert min(b - a for a, b in zip(sender.sent, sender.sent[1:], strict=False)) < 0.06


def test_metrics_server_marks_scrapes_in_flight():
    priority = ScrapePriority()
    waited: list[float] = []

    def scrape(openmetrics: bool, gzipped: bool) -> list[bytes]:
        # From another thread, as the pusher would: it must find a scrape in flight.
        t = threading.Thread(target=lambda: waited.append(priority.wait_idle(0.1)))
        t.start()
        t.join()
        return [b"up 1\n"]

    srv = MetricsServer(Endpoints(scrape, lambda: None, None, priority), "127.0.0.1", 0).start()
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{srv.port}/metrics") as resp:
            assert resp.read() == b"up 1\n"
    finally:
        srv.stop()
    assert waited and waited[0] >= 0.09
    assert priority.wait_idle(1.0) == 0.0  # and none once the scrape has been served


class FailingSender(RecordingSender):
    """Takes every other request; records the points of each request it is handed."""

    def __init__(self) -> None:
        super().__init__()
        self.taken: list[int] = []
        self.refused: list[int] = []

    def send(self, request: bytes) -> bool:
        from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest

        super().send(request)
        decoded = ExportMetricsServiceRequest.FromString(request)
        points = sum(
            len(m.gauge.data_points) for rm in decoded.resource_metrics for sm in rm.scope_metrics for m in sm.metrics
        )
        ok = len(self.sent) % 2 == 0
        (self.taken if ok else self.refused).append(points)
        return ok


def test_points_of_failed_requests_are_counted_as_dropped():
    stores = sample_stores(otlp=True, segment_size=2)
    metrics = [m for s in stores for m in s.otlp_metrics()]
    sender, dropped = FailingSender(), []
    pusher = PreEncodedPusher(
        lambda: metrics,
        SmallRequests(Resource.create({"service.name": "t"}), "s", "v"),
        sender,
        interval_s=3600,
        pace_s=0,
        on_dropped=dropped.append,
    )
    assert pusher.export() is False
    assert len(sender.sent) >= 4 and sender.refused and sender.taken
    assert dropped == sender.refused  # one call per failed request, with its points
    assert sum(sender.taken) + sum(dropped) == sum(len(list(_points(m))) for m in metrics)


def _points(metric):  # type: ignore[no-untyped-def]
    """The points of one (header, groups) pair, decoded."""
    from opentelemetry.proto.metrics.v1.metrics_pb2 import Gauge

    _header, groups = metric
    for group in groups:
        for buffer in group.raw():
            yield from Gauge.FromString(buffer).data_points
