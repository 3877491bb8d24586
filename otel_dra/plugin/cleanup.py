"""Work done after the kubelet has its answer: an unprepare's CDI spec removal and checkpoint write.

An unprepare frees the claim's devices as soon as the checkpoint's in-memory state forgets the
claim; the files only follow. Removing the spec and rewriting the checkpoint took about 0.7 ms of
an unprepare of 2.6 ms on the real kubelet (docs/benchmarks-log.md, issue 29), time the kubelet
waited for nothing it uses. :class:`Deferred` runs such work on a thread of its own, a short moment
after the call (the unprepares of that moment in one batch: one checkpoint write for all of them),
and tries what failed again later: after 5 s, then twice as long each time, up to 5 minutes.

What this gives up: a failure to remove a spec or write the checkpoint is no longer the kubelet's
error to retry; it is logged, counted (``otel_dra_plugin_claim_errors_total``, operation
``unprepare``) and retried here until it works (a log line each try). A plugin killed before the
work ran leaves the claim's entry in the checkpoint file, as a machine crash could before (the
removal is not fsynced): the restarted plugin reads every claim of its checkpoint and drops the
entries of claims that are gone or allocated other devices (``Driver.forget_gone_claim``). A stop
runs what is pending first.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable

log = logging.getLogger(__name__)


class Deferred:
    """Calls ``work(keys)`` on a worker thread ``delay`` seconds after the first of those keys was
    submitted; ``work`` returns the keys that failed, tried again ``retry`` seconds later, then
    after twice as long each time up to ``max_retry`` (a directory read-only for hours is tried,
    and logged by ``work``, a few times an hour, not every few seconds). A key submitted anew goes
    with the next batch after ``delay``, whatever its earlier failures. The thread starts with the
    first key. Thread-safe."""

    def __init__(
        self,
        work: Callable[[list[str]], Iterable[str]],
        *,
        delay: float = 0.2,
        retry: float = 5.0,
        max_retry: float = 300.0,
        name: str = "deferred",
    ) -> None:
        self._work = work
        self._delay = delay
        self._retry = retry
        self._max_retry = max_retry
        self._name = name
        self._cond = threading.Condition()
        self._pending: dict[str, None] = {}  # in submission order
        self._due: float | None = None  # when the pending keys are run
        self._busy = False  # work is running on the worker
        self._rounds = 0  # calls of work finished
        self._failed: dict[str, int] = {}  # keys whose last try failed: how many tries failed in a row
        self._closed = False
        self._thread: threading.Thread | None = None

    def submit(self, key: str) -> bool:
        """Queue ``key``; False once closed (a call still finishing at shutdown): the caller does
        the work itself, in its own thread, where it may hold locks that ``work`` takes."""
        with self._cond:
            if self._closed:
                return False
            self._pending[key] = None
            self._failed.pop(key, None)  # submitted anew: a fresh start, not a backed-off retry
            # Not later than the delay, even with retries of other keys due far off.
            due = time.monotonic() + self._delay
            self._due = due if self._due is None else min(self._due, due)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
            self._cond.notify_all()
            return True

    def retry_wait(self, tries: int) -> float:
        """Seconds before the next try of a key whose last ``tries`` tries failed."""
        return float(min(self._retry * 2 ** min(tries - 1, 32), self._max_retry))

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
                self._due = time.monotonic()
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
                while not self._closed and (self._due is None or time.monotonic() < self._due):
                    self._cond.wait(None if self._due is None else max(0.0, self._due - time.monotonic()))
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
                earlier = {k: self._failed.pop(k, 0) for k in keys}
                tries = {k: earlier.get(k, 0) + 1 for k in failed}
                if failed and closing:
                    log.warning("%s: left undone at stop: %s", self._name, ", ".join(failed))
                elif failed:
                    self._failed.update(tries)
                    self._pending.update(dict.fromkeys(failed))
                    # The keys of a batch are tried together: the batch waits as long as its
                    # freshest failure asks.
                    due = time.monotonic() + self.retry_wait(min(tries.values()))
                    self._due = due if self._due is None else min(self._due, due)
                self._cond.notify_all()
                if closing and not self._pending:
                    return

    def _call(self, keys: list[str]) -> list[str]:
        try:
            return list(self._work(keys))
        except Exception:  # a bug in work: logged, and the keys tried again rather than lost
            log.exception("%s failed for %s", self._name, ", ".join(keys))
            return keys
