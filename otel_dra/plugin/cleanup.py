"""Work done after the kubelet has its answer: an unprepare's CDI spec removal and checkpoint write.

An unprepare frees the claim's devices as soon as the checkpoint's in-memory state forgets the
claim; the files only follow. Removing the spec and rewriting the checkpoint took about 0.7 ms of
an unprepare of 2.6 ms on the real kubelet (docs/benchmarks-log.md, issue 29), time the kubelet
waited for nothing it uses. :class:`Deferred` runs such work on a thread of its own, a short moment
after the call (the unprepares of that moment in one batch: one checkpoint write for all of them),
and tries what failed again later.

What this gives up: a failure to remove a spec or write the checkpoint is no longer the kubelet's
error to retry; it is logged, counted (``otel_dra_plugin_claim_errors_total``, operation
``unprepare``) and retried here until it works. A plugin killed before the work ran leaves the
claim's entry in the checkpoint file, as a machine crash could before (the removal is not fsynced):
the restarted plugin reads every claim of its checkpoint and drops the entries of claims that are
gone or allocated other devices (``Driver.forget_gone_claim``). A stop runs what is pending first.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable

log = logging.getLogger(__name__)


class Deferred:
    """Calls ``work(keys)`` on a worker thread ``delay`` seconds after the first of those keys was
    submitted; ``work`` returns the keys that failed, tried again ``retry`` seconds later. The
    thread starts with the first key. Thread-safe."""

    def __init__(
        self,
        work: Callable[[list[str]], Iterable[str]],
        *,
        delay: float = 0.2,
        retry: float = 5.0,
        name: str = "deferred",
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._work = work
        self._delay = delay
        self._retry = retry
        self._name = name
        self._clock = clock
        self._cond = threading.Condition()
        self._pending: dict[str, None] = {}  # in submission order
        self._due: float | None = None  # when the pending keys are run
        self._busy = False  # work is running on the worker
        self._rounds = 0  # calls of work finished
        self._failed: set[str] = set()  # keys whose last try failed, waiting for the next
        self._closed = False
        self._thread: threading.Thread | None = None

    def submit(self, key: str) -> bool:
        """Queue ``key``; False once closed (a call still finishing at shutdown): the caller does
        the work itself, in its own thread, where it may hold locks that ``work`` takes."""
        with self._cond:
            if self._closed:
                return False
            self._pending[key] = None
            if self._due is None:
                self._due = self._clock() + self._delay
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
            self._cond.notify_all()
            return True

    def pending(self) -> int:
        with self._cond:
            return len(self._pending) + (1 if self._busy else 0)

    def flush(self, timeout: float = 10.0) -> bool:
        """Run what is pending now and wait for it; False if some of it failed (it is tried again
        later) or did not finish within ``timeout``."""
        with self._cond:
            if not self._pending and not self._busy:
                return not self._failed
            # The round running now took its keys already; the pending ones go in the next.
            target = self._rounds + (2 if self._busy and self._pending else 1)
            if self._pending:
                self._due = self._clock()
                self._cond.notify_all()
            if not self._cond.wait_for(lambda: self._rounds >= target, timeout):
                return False
            return not self._failed

    def close(self, timeout: float = 5.0) -> None:
        """Run what is pending now (once: what fails is logged and left), then stop the thread."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join(timeout)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._closed and (self._due is None or self._clock() < self._due):
                    self._cond.wait(None if self._due is None else max(0.0, self._due - self._clock()))
                if not self._pending:
                    return  # closed, nothing left
                keys = list(self._pending)
                self._pending.clear()
                self._due = None
                self._busy = True
                closing = self._closed
            failed = self._call(keys)
            with self._cond:
                self._busy = False
                self._rounds += 1
                self._failed.difference_update(keys)
                if failed and closing:
                    log.warning("%s: left undone at stop: %s", self._name, ", ".join(failed))
                elif failed:
                    self._failed.update(failed)
                    self._pending.update(dict.fromkeys(failed))
                    if self._due is None:
                        self._due = self._clock() + self._retry
                self._cond.notify_all()
                if closing and not self._pending:
                    return

    def _call(self, keys: list[str]) -> list[str]:
        try:
            return list(self._work(keys))
        except Exception:  # a bug in work: logged, and the keys tried again rather than lost
            log.exception("%s failed for %s", self._name, ", ".join(keys))
            return keys
