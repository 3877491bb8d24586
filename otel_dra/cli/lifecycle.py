"""Start/stop helpers shared by the long-running commands: signals in, a blocking wait."""

from __future__ import annotations

import logging
import signal
import threading

log = logging.getLogger("otel_dra")


def stop_on_signals() -> threading.Event:
    """An event set by SIGTERM or SIGINT; install it before starting anything long-lived."""
    stop = threading.Event()

    def handler(signum: int, frame: object) -> None:
        log.info("received %s, shutting down", signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
    return stop


def wait_for(stop: threading.Event) -> None:
    """Block the main thread until ``stop`` is set (by a signal handler or a fatal error)."""
    while not stop.wait(3600):
        pass
