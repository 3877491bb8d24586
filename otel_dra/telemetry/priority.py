"""Scrapes first: background exports step aside while a scrape is being served.

A Prometheus scrape is latency-sensitive (it has a timeout and its duration is charted); an OTLP push
of the full cluster state is not (it runs once per export interval, 60 s by default). Both need the
GIL for the Python parts of their work, and on a busy node they share a CPU. So the pusher asks
:meth:`ScrapePriority.wait_idle` before building each request and waits, bounded, while scrapes are
in flight; a push then runs in the gaps between scrapes instead of stretching them. Once a push
has waited its bound and scrapes still run (:meth:`ScrapePriority.busy`), it goes on at a
throttled pace rather than at full speed (see ``PreEncodedPusher``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager


class ScrapePriority:
    def __init__(self) -> None:
        self._active = 0
        self._idle = threading.Condition()

    @contextmanager
    def scraping(self) -> Iterator[None]:
        """Mark a scrape in flight for the duration of the block."""
        with self._idle:
            self._active += 1
        try:
            yield
        finally:
            with self._idle:
                self._active -= 1
                if not self._active:
                    self._idle.notify_all()

    def busy(self) -> bool:
        """Whether a scrape is in flight now."""
        with self._idle:
            return self._active > 0

    def wait_idle(self, timeout: float) -> float:
        """Wait until no scrape is in flight, at most ``timeout`` seconds; return the time waited."""
        with self._idle:
            if not self._active or timeout <= 0:
                return 0.0
            start = time.monotonic()
            self._idle.wait_for(lambda: not self._active, timeout)
            return time.monotonic() - start
