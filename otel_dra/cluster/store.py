"""The cache: slim objects plus their exposition lines, rendered once per object change.

:class:`SeriesStore` holds keyed values and their rendered series; :class:`ObjectStore` adds what a
watched resource needs (parsing, resourceVersion checks, full relists, the shard filter, and a
listener that hears every change, which the joins in :mod:`otel_dra.cluster.joins` use).

Values are kept in key order, split into segments of about ``SEGMENT`` objects. Each segment
keeps, per family, the joined exposition of its objects (a :class:`Chunk`, with its gzip member
compressed lazily). A change marks one segment dirty; a scrape re-joins only dirty segments and
sends the rest as stored. So a scrape's work grows with the number of changes since the last one,
plus one buffer write per segment, not with Python-level work per series. See docs/design.md.

Rendered bytes (Prometheus lines, OTLP points) are held once: an entry keeps its own bytes only
until its segment is next joined; after that they live in the segment's joined buffers, found
through per-family offsets, and a re-join takes unchanged entries' bytes from the previous buffers.
Joined OTLP points are kept zlib-compressed (read only at a push; see PointGroup).
"""

from __future__ import annotations

import bisect
import contextlib
import gc
import logging
import threading
import zlib
from array import array
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from itertools import accumulate
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
    # Per family, the Prometheus exposition and the OTLP data points (points only when pushing
    # OTLP). Each is None once held by the segment's joined buffers (see _Joined).
    lines: tuple[bytes, ...] | None
    points: tuple[bytes, ...] | None


LINES, POINTS = "lines", "points"  # the two kinds of rendered bytes, as _Entry attribute names


class _Joined:
    """One kind of a segment's rendered bytes, as last joined: per family, the joined buffer and
    the length of each entry's part of it, in the order of ``built``. Kept while stale: a re-join
    takes the unchanged entries' bytes from there. ``fresh`` holds the keys whose entries got new
    bytes since; ``reshaped`` says whether keys came or went (then ``built`` no longer matches).
    ``packed`` buffers are zlib-compressed (OTLP points, read only at a push)."""

    __slots__ = ("bufs", "built", "fresh", "lengths", "packed", "reshaped", "stale")

    def __init__(self, packed: bool = False) -> None:
        self.packed = packed
        self.bufs: list[bytes] | None = None
        self.lengths: list[array[int]] = []
        self.built: list[str] = []
        self.stale = True
        self.fresh: set[str] = set()
        self.reshaped = True

    def raw(self) -> list[bytes]:
        """The buffers of the last join, unpacked if need be."""
        assert self.bufs is not None
        return [zlib.decompress(b) for b in self.bufs] if self.packed else self.bufs

    def unjoin(self) -> Iterator[tuple[str, tuple[bytes, ...]]]:
        """Every entry of the last join with its bytes, copied out of the buffers."""
        bufs = self.raw()
        offsets = [list(accumulate(lengths, initial=0)) for lengths in self.lengths]
        for i, key in enumerate(self.built):
            yield key, tuple(buf[o[i] : o[i + 1]] for buf, o in zip(bufs, offsets, strict=True))


def _unchanged_families(joined: _Joined, old: list[bytes], indexes: list[int], owns: list[Any]) -> list[bool]:
    """Per family, whether every changed entry (at ``indexes`` of the last join, in order, with
    its new bytes ``owns``) has the bytes it had there. Most changes touch a few of a resource's
    families (a reservation changes none of the allocation's): the others keep their buffer without
    a join, at the cost of comparing the changed entries' bytes."""
    out = []
    for f, buf in enumerate(old):
        was = joined.lengths[f]
        pos = at = 0
        equal = True
        for i, own in zip(indexes, owns, strict=True):
            pos += sum(was[at:i])
            at = i
            size = was[i]
            if size != len(own[f]) or buf[pos : pos + size] != own[f]:
                equal = False
                break
        out.append(equal)
    return out


class _Segment:
    __slots__ = ("chunks", "groups", "keys", "lines", "points")

    def __init__(self, keys: list[str]) -> None:
        self.keys = keys
        self.lines = _Joined()
        self.points = _Joined(packed=True)
        # The joined buffers as served: Chunks (with their cached gzip members) and PointGroups.
        self.chunks: list[Chunk] = []
        self.groups: list[PointGroup] = []

    def joined(self, kind: str) -> _Joined:
        return self.lines if kind == LINES else self.points

    def dirty(self, key: str | None = None) -> None:
        """``key``: the entry of this key has new bytes; None: keys came or went."""
        for joined in (self.lines, self.points):
            joined.stale = True
            if key is None:
                joined.reshaped = True
            elif joined.bufs is not None:  # never joined (OTLP off): nothing to track
                joined.fresh.add(key)


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

    When the last one finishes, what is alive is frozen (``gc.freeze``) before the collector
    resumes: every container allocated during the pause is still in the youngest generation, and
    the first collection after it would traverse them all (0.25 s per million, measured; workload
    L allocates tens of millions), then again as they age. The cache is long-lived and freed by
    reference counting, which freezing does not stop. The cost: cyclic garbage that exists at
    that moment (other threads' tracebacks, say) is never collected, a few objects per list.
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
                gc.freeze()
                gc.enable()


def metadata(obj: dict[str, Any]) -> dict[str, Any]:
    """The object's metadata, or {} when it has none or it is not an object. Read outside the
    parsers' error handling (for the key and resourceVersion), so a malformed metadata must not
    raise there: it would break the whole list or watch, not just drop this object (found by
    tests/fuzz: ``metadata: "0"``)."""
    meta = obj.get("metadata")
    return meta if isinstance(meta, dict) else {}


def object_key(obj: dict[str, Any]) -> str:
    meta = metadata(obj)
    namespace = meta.get("namespace") or ""
    return f"{namespace}/{meta.get('name', '')}" if namespace else str(meta.get("name", ""))


# parse(raw object, report) -> slim object. ``report`` is called for each non-fatal problem.
Parser = Callable[[dict[str, Any], Callable[[str], None]], T]

# (key, old slim object, new slim object, owned): what a listener hears about each change. ``None``
# stands for "absent" (not there before, deleted, or unparseable). ``owned`` says whether this
# replica renders the object's series (sharding); listeners hear about every object either way.
Change = tuple[str, T | None, T | None, bool]
Listener = Callable[[list[Change[T]]], None]


def _keep_all(obj: dict[str, Any]) -> bool:
    return True


def _ignore(problem: str) -> None:
    pass


class SeriesStore(Generic[T]):
    """Keyed values and their rendered series, in key order, split into segments.

    One writer thread; scrapes and exports read concurrently. A value is rendered once, when it is
    put; a read joins the stored bytes per segment, re-joining only segments changed since.
    """

    def __init__(
        self,
        resource: str,
        families: Sequence[Family[T]],
        *,
        segment_size: int = SEGMENT,
        otlp: bool = False,
    ) -> None:
        self.resource = resource
        self.families = tuple(families)
        self._segment_size = segment_size
        self._encoders = tuple(PointEncoder(f.gauge.labels) for f in self.families) if otlp else None
        # OTLP points are encoded from the first push on; until then (the initial list) only the
        # lines are rendered, so that the exporter is ready as soon as it can serve a scrape. At
        # workload L the points are ~7 s of CPU: the first push pays them (segment by segment,
        # see otlp_metrics), an interval after start, instead of the initial sync.
        self._points_wanted = False
        self._renderers = tuple((f.samples, f.gauge.render) for f in self.families)
        self._headers = tuple(MetricHeader(f.gauge.name, f.gauge.description, f.gauge.unit) for f in self.families)
        self._lock = threading.Lock()
        self._entries: dict[str, _Entry[T]] = {}
        self._segments: list[_Segment] = []
        self._firsts: list[str] = []  # first key of each segment, for bisect
        # What blocks() served last, per family its chunks in key order, and whether an entry or a
        # segment changed since. A family's list is a new object only when one of its chunks
        # changed, never altered once served: so a scrape can reuse what it built from an
        # unchanged list (the same object) without looking inside (telemetry.exposition.Assembler).
        self._served: list[list[Chunk]] | None = None
        self._lines_changed = True

    def _render(self, rv: str, value: T, report: Callable[[str], None]) -> _Entry[T]:
        try:
            if self._encoders is not None and self._points_wanted:
                samples = [list(fam.samples(value)) for fam in self.families]
                lines = tuple(fam.gauge.render(s) for fam, s in zip(self.families, samples, strict=True))
                points = tuple(enc.encode(s) for enc, s in zip(self._encoders, samples, strict=True))
                return _Entry(rv, value, lines, points)
            # Lines only (no OTLP, or before the first push): the samples go straight to the
            # renderer; this runs for every object of a list (10^5 at workload L).
            return _Entry(rv, value, tuple([render(samples(value)) for samples, render in self._renderers]), None)
        except Exception as exc:  # one malformed object must never break the others
            report(f"malformed object, its series are omitted: {exc}")
            return self._empty(rv)

    def _points(self, entry: _Entry[T], key: str) -> tuple[bytes, ...]:
        """The OTLP points of an entry rendered before points were wanted."""
        assert self._encoders is not None
        if entry.obj is not None:
            try:
                return tuple(
                    enc.encode(fam.samples(entry.obj)) for enc, fam in zip(self._encoders, self.families, strict=True)
                )
            except Exception as exc:  # its lines rendered from the same samples, so not expected
                log.warning("%s %s: its OTLP points are omitted: %s", self.resource, key, exc)
        return tuple(b"" for _ in self.families)

    def _empty(self, rv: str) -> _Entry[T]:
        empty = tuple(b"" for _ in self.families)
        return _Entry(rv, None, empty, empty if self._encoders is not None else None)

    def _logger(self, key: str) -> Callable[[str], None]:
        def report(problem: str) -> None:
            log.warning("%s %s: %s", self.resource, key, problem)

        return report

    # --- writes of derived values (no parsing, no resourceVersion) -------------------------------
    def update(self, items: Iterable[tuple[str, T | None]]) -> None:
        """Put (a value) or remove (None) several keys. A value equal to the stored one is
        skipped, so its segment stays clean."""
        rendered: list[tuple[str, _Entry[T] | None]] = []
        entries = self._entries  # only the writer thread changes it
        for key, value in items:
            current = entries.get(key)
            if value is None:
                if current is not None:
                    rendered.append((key, None))
            elif current is None or current.obj != value:
                rendered.append((key, self._render("", value, self._logger(key))))
        if not rendered:
            return
        with self._lock:
            for key, entry in rendered:
                if entry is None:
                    self._drop(key)
                else:
                    self._store(key, entry)

    def put(self, key: str, value: T) -> None:
        self.update([(key, value)])

    def remove(self, key: str) -> None:
        self.update([(key, None)])

    def get(self, key: str) -> T | None:
        entry = self._entries.get(key)
        return entry.obj if entry is not None else None

    # --- entry bookkeeping (callers hold the lock) -----------------------------------------------
    def _store(self, key: str, entry: _Entry[T]) -> None:
        self._lines_changed = True
        if entry.points is None and self._points_wanted:
            # Rendered before the first push began (outside the lock), stored after: every entry
            # stored from then on has its points, so that a joined segment's buffers hold them all.
            entry.points = self._points(entry, key)
        if key not in self._entries:
            self._insert_key(key)
        else:
            self._segment_of(key).dirty(key)
        self._entries[key] = entry

    def _drop(self, key: str) -> bool:
        if self._entries.pop(key, None) is None:
            return False
        self._lines_changed = True
        i = self._segment_index(key)
        segment = self._segments[i]
        segment.keys.pop(bisect.bisect_left(segment.keys, key))
        segment.dirty()
        if not segment.keys:
            del self._segments[i]
            del self._firsts[i]
        else:
            self._firsts[i] = segment.keys[0]
        return True

    def _kinds(self) -> tuple[str, ...]:
        return (LINES, POINTS) if self._encoders is not None and self._points_wanted else (LINES,)

    def _swap(self, fresh: dict[str, _Entry[T]], segments: list[_Segment] | None = None) -> None:
        """Install ``fresh`` (segmented here, unless ``segments`` already covers it in order)."""
        if segments is None:
            keys = sorted(fresh)
            size = self._segment_size
            segments = [_Segment(keys[i : i + size]) for i in range(0, len(keys), size)]
        with self._lock:
            # Entries carried over from the old segments take their bytes back before those go.
            for segment in self._segments:
                self._materialize(segment, keep=fresh)
                segment.keys = []  # retired (a first push may still hold it: see otlp_metrics)
            self._entries = fresh
            self._segments = segments
            self._lines_changed = True
            self._firsts = [s.keys[0] for s in segments]
            # Join now rather than at the next scrape or push: the entries' own copies are freed
            # before the joins of this relist allocate, which then reuse that memory (a lower peak).
            for segment in segments:
                for kind in self._kinds():
                    if segment.joined(kind).stale:
                        self._join(segment, kind)

    def _materialize(
        self,
        segment: _Segment,
        keep: dict[str, _Entry[T]] | None = None,
        entries: dict[str, _Entry[T]] | None = None,
    ) -> None:
        """Give the segment's entries (those in ``keep``, if given) their own bytes again, before
        the segment is split or replaced."""
        entries = self._entries if entries is None else entries
        for kind in self._kinds():
            joined = segment.joined(kind)
            if joined.bufs is None:
                continue
            for key, own in joined.unjoin():
                entry = entries.get(key)
                if entry is None or getattr(entry, kind) is not None:
                    continue
                if keep is not None and keep.get(key) is not entry:
                    continue
                setattr(entry, kind, own)

    def _join(self, segment: _Segment, kind: str, entries: dict[str, _Entry[T]] | None = None) -> None:
        """Re-join one kind of a stale segment's bytes (callers hold the lock). Unchanged entries
        are taken from the previous buffers as runs of consecutive entries (zero-copy views until
        the final join); when no key came or went, the runs are found from the changed keys alone.
        So the Python work grows with the number of changed entries, not with the segment's size.
        A family whose bytes did not change keeps its buffer object, and with it its Chunk (and
        cached gzip member) or PointGroup."""
        entries = self._entries if entries is None else entries
        joined = segment.joined(kind)
        stored = joined.bufs
        old = joined.raw() if stored is not None else None
        keys = segment.keys
        # The plan, shared by all families: an entry's own bytes (a tuple), or a run [first, last]
        # of consecutive entries of the previous join (a list), in key order.
        plan: list[Any] = []
        changed: list[str] = []
        same: list[bool] | None = None  # per family: no changed entry's bytes differ (keys unchanged)
        if old is not None and not joined.reshaped:  # keys == built
            at = 0
            indexes = sorted(bisect.bisect_left(keys, k) for k in joined.fresh)
            for i in indexes:
                if i > at:
                    plan.append([at, i - 1])
                own = getattr(entries[keys[i]], kind)
                assert own is not None, "a fresh entry has its own bytes"
                plan.append(own)
                changed.append(keys[i])
                at = i + 1
            if at < len(keys):
                plan.append([at, len(keys) - 1])
            same = _unchanged_families(joined, old, indexes, [getattr(entries[k], kind) for k in changed])
        else:
            index = {k: i for i, k in enumerate(joined.built)} if old is not None else {}
            previous = -2
            for key in keys:
                own = getattr(entries[key], kind)
                if own is None and old is None and kind == POINTS:
                    # Never joined: the entry's points were deferred (see _points_wanted).
                    own = entries[key].points = self._points(entries[key], key)
                if own is not None:
                    plan.append(own)
                    changed.append(key)
                    previous = -2
                    continue
                i = index[key]
                if i == previous + 1:
                    plan[-1][1] = i
                else:
                    plan.append([i, i])
                previous = i
        bufs: list[bytes] = []
        all_lengths: list[array[int]] = []
        for f in range(len(self.families)):
            if same is not None and same[f]:
                assert stored is not None
                bufs.append(stored[f])  # the same bytes: nothing to join, the same Chunk / PointGroup
                all_lengths.append(joined.lengths[f])
                continue
            parts: list[bytes | memoryview] = []
            lengths = array("I")  # 4 bytes each: a segment's buffer stays far below 4 GiB
            if old is not None:
                view, was = memoryview(old[f]), joined.lengths[f]
            pos = at = 0  # byte position and entry index in the previous buffer
            for item in plan:
                if isinstance(item, tuple):
                    part = item[f]
                    parts.append(part)
                    lengths.append(len(part))
                else:
                    first, last = item
                    if first > at:
                        pos += sum(was[at:first])
                    run = was[first : last + 1]
                    size = sum(run)
                    parts.append(view[pos : pos + size])
                    lengths.extend(run)
                    pos += size
                    at = last + 1
            data = b"".join(parts)
            if stored is not None and old is not None and old[f] == data:
                bufs.append(stored[f])  # unchanged: the same object keeps its Chunk / PointGroup
            else:
                bufs.append(zlib.compress(data, 1) if joined.packed else data)
            all_lengths.append(lengths)
        for key in changed:
            setattr(entries[key], kind, None)
        if kind == LINES:
            served = {id(c.data): c for c in segment.chunks}
            segment.chunks = [served.get(id(buf)) or Chunk(buf) for buf in bufs]
        else:
            kept = {id(g.buffers[0]): g for g in segment.groups if g.buffers}
            segment.groups = [
                kept.get(id(buf)) or PointGroup([buf], sum(lengths), packed=True)
                for buf, lengths in zip(bufs, all_lengths, strict=True)
            ]
        joined.bufs, joined.lengths, joined.built = bufs, all_lengths, list(keys)
        joined.stale, joined.reshaped = False, False
        joined.fresh = set()

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
            self._materialize(segment)  # its last join does not describe the halves
            segment.lines, segment.points = _Joined(), _Joined(packed=True)
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
        """Each family's pre-encoded OTLP points in key order, one PointGroup per segment (joined
        again only for segments changed since the last push)."""
        if self._encoders is None:
            return []
        with self._lock:
            deferred = [] if self._points_wanted else list(self._segments)
            self._points_wanted = True
        # The first push encodes the points the initial list deferred, taking the lock for one
        # segment at a time, so that a scrape waits for one segment's encoding at most.
        for segment in deferred:
            with self._lock:
                if segment.points.stale:  # a retired segment (no keys) joins nothing
                    self._join(segment, POINTS)
        with self._lock:
            return list(zip(self._headers, self._per_family(POINTS), strict=True))

    def blocks(self) -> list[tuple[GaugeFamily, list[Chunk]]]:
        """Each family's exposition, as one chunk per segment, ordered by object key. Nothing
        changed since the last call: the same lists (objects) again. Otherwise a family whose
        chunks are all the ones served before keeps its list object too."""
        with self._lock:
            served = self._served
            if served is None or self._lines_changed:
                per_family: list[list[Chunk]] = self._per_family(LINES)
                if served is not None:
                    per_family = [
                        self._keep_served(i, old, new)
                        for i, (old, new) in enumerate(zip(served, per_family, strict=True))
                    ]
                served = self._served = per_family
                self._lines_changed = False
            return [(fam.gauge, served[i]) for i, fam in enumerate(self.families)]

    def _per_family(self, kind: str) -> list[list[Any]]:
        """Per family, the segments' served buffers of one kind (Chunks or PointGroups) in key
        order, stale segments joined first (callers hold the lock)."""
        per_family: list[list[Any]] = [[] for _ in self.families]
        for segment in self._segments:
            if segment.joined(kind).stale:
                self._join(segment, kind)
            for i, served in enumerate(segment.chunks if kind == LINES else segment.groups):
                per_family[i].append(served)
        return per_family

    def _keep_served(self, family: int, old: list[Chunk], new: list[Chunk]) -> list[Chunk]:
        """The list served before when ``new`` holds the same chunks (callers hold the lock).

        Compared element by element by identity (a Chunk has no __eq__), in C. Where the segments
        are as many as before (a relist rebuilds them all, mostly with the same bytes) a chunk
        whose bytes equal the one served at its place is replaced by that one, in the segment too:
        its gzip member is not compressed again, and the new copy of the bytes is let go."""
        if old == new:
            return old
        if len(old) == len(new):
            for j, (was, now) in enumerate(zip(old, new, strict=True)):
                if was is not now and was.data == now.data:
                    new[j] = was
                    segment = self._segments[j]
                    segment.chunks[family] = was
                    if segment.lines.bufs is not None:
                        segment.lines.bufs[family] = was.data
            if old == new:
                return old
        return new


class ObjectStore(SeriesStore[T]):
    """The store of one watched resource. The reflector writes; scrapes and exports read.

    ``keep`` selects the objects whose series this replica renders (sharding). With a
    ``listener``, the others are parsed too (and kept slim, without series) so that the listener
    hears about every object; without one they are ignored.
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
        listener: Listener[T] | None = None,
        listen_to_others: bool = True,
    ) -> None:
        """``listen_to_others`` False: the listener hears of this replica's own objects only (the
        others are then not parsed at all)."""
        super().__init__(resource, families, segment_size=segment_size, otlp=otlp)
        self._parse = parse
        self._on_problem = on_problem
        self._keep = keep
        self._listener = listener
        self._others_wanted = listener is not None and listen_to_others
        # Objects of other shards, for the listener: key -> (resourceVersion, slim object).
        self._others: dict[str, tuple[str, T | None]] = {}

    # --- writes (reflector thread) ---------------------------------------------------------
    def _reporter(self, key: str) -> Callable[[str], None]:
        def report(problem: str) -> None:
            log.warning("%s %s: %s", self.resource, key, problem)
            if self._on_problem is not None:
                self._on_problem(self.resource)

        return report

    def _build(self, key: str, obj: dict[str, Any]) -> _Entry[T]:
        rv = str(metadata(obj).get("resourceVersion", ""))
        report = self._reporter(key)
        try:
            slim = self._parse(obj, report)
        except Exception as exc:  # one malformed object must never break the others
            report(f"malformed object, its series are omitted: {exc}")
            return self._empty(rv)
        return self._render(rv, slim, report)

    def _parse_other(self, obj: dict[str, Any]) -> T | None:
        """Another shard's object: parsed for the listener, problems left to that shard to report."""
        try:
            return self._parse(obj, _ignore)
        except Exception:
            return None

    def _old(self, key: str) -> tuple[str, T | None] | None:
        current = self._entries.get(key)
        if current is not None:
            return current.resource_version, current.obj
        return self._others.get(key)

    def upsert(self, obj: dict[str, Any]) -> None:
        owned = self._keep(obj)
        if not owned and not self._others_wanted:
            return
        key = object_key(obj)
        rv = str(metadata(obj).get("resourceVersion", ""))
        old = self._old(key)
        # Unchanged objects (a relist, a duplicate event) are neither re-parsed nor re-logged.
        if old is not None and rv and old[0] == rv:
            return
        new: T | None
        if owned:
            entry = self._build(key, obj)
            new = entry.obj
            self._others.pop(key, None)
            with self._lock:
                self._store(key, entry)
        else:
            new = self._parse_other(obj)
            self._others[key] = (rv, new)
            if key in self._entries:  # the name was reused by an object of another shard
                with self._lock:
                    self._drop(key)
        if self._listener is not None:
            self._listener([(key, old[1] if old else None, new, owned)])

    def delete(self, obj: dict[str, Any]) -> None:
        key = object_key(obj)
        old = self._old(key)
        if old is None:
            return
        owned = key in self._entries
        if owned:
            with self._lock:
                self._drop(key)
        else:
            del self._others[key]
        if self._listener is not None:
            self._listener([(key, old[1], None, owned)])

    def replace(self, objects: Iterable[dict[str, Any]]) -> None:
        """Swap in a full list. ``objects`` may be a lazy iterator (page by page); if it raises,
        the store is left as it was."""
        fresh: dict[str, _Entry[T]] = {}
        others: dict[str, tuple[str, T | None]] = {}
        changes: list[Change[T]] = []
        with _gc_paused():
            segments = self._fill(fresh, others, changes, objects)
        if self._listener is not None:
            for key, entry in self._entries.items():
                if key not in fresh and key not in others:
                    changes.append((key, entry.obj, None, True))
            for key, (_rv, slim) in self._others.items():
                if key not in fresh and key not in others:
                    changes.append((key, slim, None, False))
        self._others = others
        self._swap(fresh, segments)
        if self._listener is not None and changes:
            with _gc_paused():  # a relist's joins allocate as much as its entries did
                self._listener(changes)

    def _fill(
        self,
        fresh: dict[str, _Entry[T]],
        others: dict[str, tuple[str, T | None]],
        changes: list[Change[T]],
        objects: Iterable[dict[str, Any]],
    ) -> list[_Segment] | None:
        """Build the entries of a full list. Into an empty store (the initial list), entries
        arriving in key order -- as the API server lists them -- are segmented and joined as they
        come, so at most one segment's worth of per-entry bytes exists at a time (a much lower
        memory peak than holding every object's bytes until the end); the segments are returned.
        Returns None when the list is to be segmented by :meth:`_swap`."""
        listening = self._listener is not None
        others_wanted = self._others_wanted
        entries = self._entries  # only this thread writes; reading without the lock is safe
        streaming = not entries
        segments: list[_Segment] = []
        batch: list[str] = []
        last: str | None = None
        for obj in objects:
            owned = self._keep(obj)
            if not owned and not others_wanted:
                continue
            key = object_key(obj)
            rv = str(metadata(obj).get("resourceVersion", ""))
            old = self._old(key) if listening else None
            if owned:
                current = entries.get(key)
                if current is not None and rv and current.resource_version == rv:
                    fresh[key] = current
                    continue
                entry = fresh[key] = self._build(key, obj)
                new = entry.obj
                if streaming:
                    if last is not None and key <= last:  # not in key order after all
                        streaming = False
                        for segment in segments:
                            self._materialize(segment, entries=fresh)
                    else:
                        batch.append(key)
                        last = key
                        if len(batch) == self._segment_size:
                            segments.append(self._joined_segment(batch, fresh))
                            batch = []
            else:
                if old is not None and rv and old[0] == rv and key in self._others:
                    others[key] = old
                    continue
                new = self._parse_other(obj)
                others[key] = (rv, new)
            if listening:
                changes.append((key, old[1] if old else None, new, owned))
        if not streaming:
            return None
        if batch:
            segments.append(self._joined_segment(batch, fresh))
        return segments

    def _joined_segment(self, keys: list[str], entries: dict[str, _Entry[T]]) -> _Segment:
        segment = _Segment(keys)
        for kind in self._kinds():
            self._join(segment, kind, entries)
        return segment
