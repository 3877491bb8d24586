"""The leak clock: claims allocated and reserved by nobody, and when their grace period ends
(kube_resourceclaim_leaked). :class:`otel_dra.cluster.joins.Joins` tells it about the claims of
its shard; the exporter ticks it before each scrape and push."""

from __future__ import annotations

import heapq
import threading
from collections.abc import Callable

from otel_dra.cluster.joined_families import LeakedClaim
from otel_dra.cluster.resourceclaim import Claim
from otel_dra.cluster.store import SeriesStore


class LeakClock:
    """Claims allocated and reserved by nobody, and when their grace period ends.

    Deadlines sit in a heap; :meth:`tick` (at each scrape or push) renders only the claims whose
    deadline passed since the last tick. Stale heap entries (a claim that changed) are skipped.
    """

    def __init__(self, store: SeriesStore[LeakedClaim], grace: float, clock: Callable[[], float]) -> None:
        self.store = store
        self.grace = grace
        self._clock = clock
        self._lock = threading.Lock()
        self._heap: list[tuple[float, str]] = []
        self._deadlines: dict[str, tuple[float, LeakedClaim]] = {}
        self._seen: dict[str, float] = {}  # first seen unreserved, when the claim gives no time

    def watch(self, key: str, claim: Claim) -> None:
        now = self._clock()
        since = claim.status_time
        if since is None:
            since = self._seen.setdefault(key, now)
        deadline = since + self.grace
        leaked = LeakedClaim(claim.namespace, claim.name)
        with self._lock:
            if self._deadlines.get(key) == (deadline, leaked):
                return
            self._deadlines[key] = (deadline, leaked)
            if deadline <= now:
                self.store.put(key, leaked)
            else:
                heapq.heappush(self._heap, (deadline, key))
                self.store.remove(key)  # a later status write restarts the clock

    def forget(self, key: str) -> None:
        self._seen.pop(key, None)
        with self._lock:
            if self._deadlines.pop(key, None) is not None:
                self.store.remove(key)

    def tick(self) -> None:
        now = self._clock()
        with self._lock:
            due = []
            while self._heap and self._heap[0][0] <= now:
                deadline, key = heapq.heappop(self._heap)
                current = self._deadlines.get(key)
                if current is not None and current[0] == deadline:
                    due.append((key, current[1]))
            if due:
                self.store.update(due)

    def __len__(self) -> int:
        return len(self._deadlines)
