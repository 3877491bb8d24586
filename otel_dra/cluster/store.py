"""The cache: slim objects plus their exposition lines, rendered once per object change.

Objects are kept in key order, split into segments of about ``SEGMENT`` objects. Each segment
keeps, per family, the joined exposition of its objects (a :class:`Chunk`, with its gzip member
compressed lazily). A change marks one segment dirty; a scrape re-joins only dirty segments and
sends the rest as stored. So a scrape's work grows with the number of changes since the last one,
plus one buffer write per segment, not with Python-level work per series. See docs/design.md.
"""

from __future__ import annotations

import bisect
import contextlib
import gc
import logging
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from otel_dra.cluster.families import Family
from otel_dra.telemetry.exposition import Chunk, GaugeFamily
from otel_dra.telemetry.otlp_encode import MetricHeader, PointEncoder, PointGroup

log = logging.getLogger(__name__)

T = TypeVar("T")

# Objects per segment: small enough that a change re-joins and re-compresses little, large enough
# that a scrape of 10^5 objects writes a few hundred buffers per family, not 10^5.
SEGMENT = 256


@dataclass(slots=True)
class _Entry(Generic[T]):
    resource_version: str
    obj: T | None  # None: the object could not be parsed at all
    lines: tuple[bytes, ...]  # Prometheus exposition, per family
    points: tuple[bytes, ...] | None  # OTLP data points, per family (only when pushing OTLP)


class _Segment:
    __slots__ = ("chunks", "keys", "points")

    def __init__(self, keys: list[str]) -> None:
        self.keys = keys
        self.chunks: list[Chunk] | None = None  # per family; None when dirty
        # Per family, references to the entries' OTLP points (not copies: a push joins them in C).
        self.points: list[PointGroup] | None = None

    def dirty(self) -> None:
        self.chunks = None
        self.points = None


_gc_lock = threading.Lock()
_gc_pausers = 0
_gc_was_enabled = False


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector while a full list is turned into entries.

    A list of 10^5 objects allocates millions of containers; each allocation burst triggers
    collections that traverse everything alive, which made turning a workload-L list into entries
    ~50% slower (5.1 s vs 3.4 s). The data is acyclic (reference counting frees it), so nothing
    leaks while the collector waits. A count keeps it paused until the last of several concurrent
    relists finishes.
    """
    global _gc_pausers, _gc_was_enabled
    with _gc_lock:
        if _gc_pausers == 0:
            _gc_was_enabled = gc.isenabled()
            gc.disable()
        _gc_pausers += 1
    try:
        yield
    finally:
        with _gc_lock:
            _gc_pausers -= 1
            if _gc_pausers == 0 and _gc_was_enabled:
                gc.enable()


def object_key(obj: dict[str, Any]) -> str:
    meta = obj.get("metadata") or {}
    namespace = meta.get("namespace") or ""
    return f"{namespace}/{meta.get('name', '')}" if namespace else str(meta.get("name", ""))


# parse(raw object, report) -> slim object. ``report`` is called for each non-fatal problem.
Parser = Callable[[dict[str, Any], Callable[[str], None]], T]


def _keep_all(obj: dict[str, Any]) -> bool:
    return True


class ObjectStore(Generic[T]):
    """Thread-safe store for one resource. The reflector writes, scrapes and exports read.

    ``keep`` selects the objects this store holds (sharding); others are ignored.
    """

    def __init__(
        self,
        resource: str,
        parse: Parser[T],
        families: Sequence[Family[T]],
        *,
        on_problem: Callable[[str], None] | None = None,
        keep: Callable[[dict[str, Any]], bool] = _keep_all,
        segment_size: int = SEGMENT,
        otlp: bool = False,
    ) -> None:
        self.resource = resource
        self.families = tuple(families)
        self._parse = parse
        self._on_problem = on_problem
        self._keep = keep
        self._segment_size = segment_size
        self._encoders = tuple(PointEncoder(f.gauge.labels) for f in self.families) if otlp else None
        self._headers = tuple(MetricHeader(f.gauge.name, f.gauge.description, f.gauge.unit) for f in self.families)
        self._lock = threading.Lock()
        self._entries: dict[str, _Entry[T]] = {}
        self._segments: list[_Segment] = []
        self._firsts: list[str] = []  # first key of each segment, for bisect

    # --- writes (reflector thread) ---------------------------------------------------------
    def _build(self, key: str, obj: dict[str, Any]) -> _Entry[T]:
        rv = str((obj.get("metadata") or {}).get("resourceVersion", ""))

        def report(problem: str) -> None:
            log.warning("%s %s: %s", self.resource, key, problem)
            if self._on_problem is not None:
                self._on_problem(self.resource)

        try:
            slim = self._parse(obj, report)
            samples = [list(fam.samples(slim)) for fam in self.families]
            lines = tuple(fam.gauge.render(s) for fam, s in zip(self.families, samples, strict=True))
            points = None
            if self._encoders is not None:
                points = tuple(enc.encode(s) for enc, s in zip(self._encoders, samples, strict=True))
            return _Entry(rv, slim, lines, points)
        except Exception as exc:  # one malformed object must never break the others
            report(f"malformed object, its series are omitted: {exc}")
            empty = tuple(b"" for _ in self.families)
            return _Entry(rv, None, empty, empty if self._encoders is not None else None)

    def upsert(self, obj: dict[str, Any]) -> None:
        if not self._keep(obj):
            return
        key = object_key(obj)
        rv = str((obj.get("metadata") or {}).get("resourceVersion", ""))
        current = self._entries.get(key)
        # Unchanged objects (a relist, a duplicate event) are neither re-parsed nor re-logged.
        if current is not None and rv and current.resource_version == rv:
            return
        entry = self._build(key, obj)
        with self._lock:
            if key not in self._entries:
                self._insert_key(key)
            else:
                self._segment_of(key).dirty()
            self._entries[key] = entry

    def delete(self, obj: dict[str, Any]) -> None:
        key = object_key(obj)
        with self._lock:
            if self._entries.pop(key, None) is None:
                return
            i = self._segment_index(key)
            segment = self._segments[i]
            segment.keys.pop(bisect.bisect_left(segment.keys, key))
            segment.dirty()
            if not segment.keys:
                del self._segments[i]
                del self._firsts[i]
            else:
                self._firsts[i] = segment.keys[0]

    def replace(self, objects: Iterable[dict[str, Any]]) -> None:
        """Swap in a full list. ``objects`` may be a lazy iterator (page by page); if it raises,
        the store is left as it was."""
        fresh: dict[str, _Entry[T]] = {}
        old = self._entries  # only this thread writes; reading without the lock is safe
        with _gc_paused():
            self._fill(fresh, old, objects)
        keys = sorted(fresh)
        size = self._segment_size
        segments = [_Segment(keys[i : i + size]) for i in range(0, len(keys), size)]
        with self._lock:
            self._entries = fresh
            self._segments = segments
            self._firsts = [s.keys[0] for s in segments]

    def _fill(self, fresh: dict[str, _Entry[T]], old: dict[str, _Entry[T]], objects: Iterable[dict[str, Any]]) -> None:
        for obj in objects:
            if not self._keep(obj):
                continue
            key = object_key(obj)
            rv = str((obj.get("metadata") or {}).get("resourceVersion", ""))
            current = old.get(key)
            if current is not None and rv and current.resource_version == rv:
                fresh[key] = current
            else:
                fresh[key] = self._build(key, obj)

    # --- segment index (callers hold the lock) ------------------------------------------------
    def _segment_index(self, key: str) -> int:
        return max(0, bisect.bisect_right(self._firsts, key) - 1)

    def _segment_of(self, key: str) -> _Segment:
        return self._segments[self._segment_index(key)]

    def _insert_key(self, key: str) -> None:
        if not self._segments:
            self._segments.append(_Segment([key]))
            self._firsts.append(key)
            return
        i = self._segment_index(key)
        segment = self._segments[i]
        bisect.insort(segment.keys, key)
        segment.dirty()
        self._firsts[i] = segment.keys[0]
        if len(segment.keys) >= 2 * self._segment_size:
            half = len(segment.keys) // 2
            tail = _Segment(segment.keys[half:])
            segment.keys = segment.keys[:half]
            self._segments.insert(i + 1, tail)
            self._firsts.insert(i + 1, tail.keys[0])

    # --- reads -------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._entries)

    def objects(self) -> list[T]:
        """A snapshot of the parsed objects (for OTLP callbacks)."""
        with self._lock:
            return [e.obj for e in self._entries.values() if e.obj is not None]

    def otlp_metrics(self) -> list[tuple[MetricHeader, list[PointGroup]]]:
        """Each family's pre-encoded OTLP points in key order: per segment, references to the
        entries' buffers and their total size (joined in C by the request builder). Only segments
        changed since the last push cost Python work per entry."""
        if self._encoders is None:
            return []
        with self._lock:
            entries = self._entries
            per_family: list[list[PointGroup]] = [[] for _ in self.families]
            for segment in self._segments:
                groups = segment.points
                if groups is None:
                    rows = [entries[k].points or () for k in segment.keys]
                    groups = segment.points = []
                    for i in range(len(self.families)):
                        refs = [row[i] for row in rows if row]
                        groups.append(PointGroup(refs, sum(map(len, refs))))
                for i, group in enumerate(groups):
                    per_family[i].append(group)
            return list(zip(self._headers, per_family, strict=True))

    def blocks(self) -> list[tuple[GaugeFamily, list[Chunk]]]:
        """Each family's exposition, as one chunk per segment, ordered by object key."""
        with self._lock:
            entries = self._entries
            per_family: list[list[Chunk]] = [[] for _ in self.families]
            for segment in self._segments:
                chunks = segment.chunks
                if chunks is None:
                    rows = [entries[k].lines for k in segment.keys]
                    chunks = segment.chunks = [
                        Chunk(b"".join(row[i] for row in rows)) for i in range(len(self.families))
                    ]
                for i, chunk in enumerate(chunks):
                    per_family[i].append(chunk)
            return [(fam.gauge, per_family[i]) for i, fam in enumerate(self.families)]
