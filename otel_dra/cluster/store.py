"""The cache: slim objects plus their exposition lines, rendered once per object change.

A scrape joins stored bytes (one ``bytes.join`` per family, redone only when something changed),
so its cost does not depend on Python-level work per series. See docs/design.md.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from otel_dra.cluster.families import Family
from otel_dra.telemetry.exposition import GaugeFamily

log = logging.getLogger(__name__)

T = TypeVar("T")


class ObjectProblem(Exception):
    """A problem with one object (or part of one) that the user should hear about once."""


@dataclass(slots=True)
class _Entry(Generic[T]):
    resource_version: str
    obj: T | None  # None: the object could not be parsed at all
    lines: tuple[bytes, ...]


def object_key(obj: dict[str, Any]) -> str:
    meta = obj.get("metadata") or {}
    namespace = meta.get("namespace") or ""
    return f"{namespace}/{meta.get('name', '')}" if namespace else str(meta.get("name", ""))


# parse(raw object, report) -> slim object. ``report`` is called for each non-fatal problem.
Parser = Callable[[dict[str, Any], Callable[[str], None]], T]


class ObjectStore(Generic[T]):
    """Thread-safe store for one resource. The reflector writes, scrapes and exports read."""

    def __init__(
        self,
        resource: str,
        parse: Parser[T],
        families: Sequence[Family[T]],
        *,
        on_problem: Callable[[str], None] | None = None,
    ) -> None:
        self.resource = resource
        self.families = tuple(families)
        self._parse = parse
        self._on_problem = on_problem
        self._lock = threading.Lock()
        self._entries: dict[str, _Entry[T]] = {}
        self._sorted_keys: list[str] | None = []
        self._blocks: list[tuple[GaugeFamily, bytes]] | None = None

    # --- writes (reflector thread) ---------------------------------------------------------
    def _build(self, key: str, obj: dict[str, Any]) -> _Entry[T]:
        rv = str((obj.get("metadata") or {}).get("resourceVersion", ""))

        def report(problem: str) -> None:
            log.warning("%s %s: %s", self.resource, key, problem)
            if self._on_problem is not None:
                self._on_problem(self.resource)

        try:
            slim = self._parse(obj, report)
            lines = tuple(fam.gauge.render(fam.samples(slim)) for fam in self.families)
            return _Entry(rv, slim, lines)
        except Exception as exc:  # one malformed object must never break the others
            report(f"malformed object, its series are omitted: {exc}")
            return _Entry(rv, None, tuple(b"" for _ in self.families))

    def upsert(self, obj: dict[str, Any]) -> None:
        key = object_key(obj)
        rv = str((obj.get("metadata") or {}).get("resourceVersion", ""))
        with self._lock:
            current = self._entries.get(key)
        # Unchanged objects (a relist, a duplicate event) are neither re-parsed nor re-logged.
        if current is not None and rv and current.resource_version == rv:
            return
        entry = self._build(key, obj)
        with self._lock:
            if key not in self._entries:
                self._sorted_keys = None
            self._entries[key] = entry
            self._blocks = None

    def delete(self, obj: dict[str, Any]) -> None:
        key = object_key(obj)
        with self._lock:
            if self._entries.pop(key, None) is not None:
                self._sorted_keys = None
                self._blocks = None

    def replace(self, objects: list[dict[str, Any]]) -> None:
        fresh: dict[str, _Entry[T]] = {}
        with self._lock:
            old = dict(self._entries)
        for obj in objects:
            key = object_key(obj)
            rv = str((obj.get("metadata") or {}).get("resourceVersion", ""))
            current = old.get(key)
            fresh[key] = (
                current if current is not None and rv and current.resource_version == rv else self._build(key, obj)
            )
        with self._lock:
            self._entries = fresh
            self._sorted_keys = None
            self._blocks = None

    # --- reads -------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._entries)

    def objects(self) -> list[T]:
        """A snapshot of the parsed objects (for OTLP callbacks)."""
        with self._lock:
            return [e.obj for e in self._entries.values() if e.obj is not None]

    def blocks(self) -> list[tuple[GaugeFamily, bytes]]:
        """Each family's exposition lines, ordered by object key."""
        with self._lock:
            if self._blocks is None:
                if self._sorted_keys is None:
                    self._sorted_keys = sorted(self._entries)
                entries = [self._entries[k] for k in self._sorted_keys]
                self._blocks = [
                    (fam.gauge, b"".join(e.lines[i] for e in entries)) for i, fam in enumerate(self.families)
                ]
            return self._blocks
