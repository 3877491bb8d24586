"""Prometheus exposition of pre-rendered gauge families next to the SDK's own output.

Why this exists: the OpenTelemetry Python SDK rebuilds every data point on every collection
(about 74 µs per point through the Prometheus reader, see docs/design.md), which is far too slow
for per-object cluster state with 10^4..10^5 series. Families that describe one series set per
Kubernetes object are therefore rendered to exposition lines once, when the object changes, and a
scrape only concatenates stored bytes. The names, units, label translation and number formatting
are those of the SDK's Prometheus reader, so the output is the same as if the instruments had
gone through it (checked by tests/test_exposition.py).

This module knows nothing about Kubernetes: it deals in families, label values and floats.
"""

from __future__ import annotations

import gzip
from collections.abc import Callable, Iterable, Sequence
from operator import itemgetter

from prometheus_client import CollectorRegistry
from prometheus_client import exposition as text_exposition
from prometheus_client.openmetrics import exposition as om_exposition
from prometheus_client.utils import floatToGoString

from otel_dra.telemetry.naming import prometheus_name, prometheus_unit, sanitize_label

TEXT_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
OPENMETRICS_CONTENT_TYPE = om_exposition.CONTENT_TYPE_LATEST


class GaugeFamily:
    """A gauge whose samples are rendered outside the SDK.

    ``name``/``unit`` are the OTel instrument name and UCUM unit; ``labels`` are the attribute
    keys, in the order in which sample label values are given. Compared and hashed by those four.
    (A plain class, not a dataclass: see otel_dra.records for what dataclasses cost at import.)
    """

    __slots__ = ("_numbers", "_sorted", "_template", "description", "labels", "name", "prom_name", "unit")

    def __init__(self, name: str, unit: str, description: str, labels: tuple[str, ...]) -> None:
        self.name = name
        self.unit = unit
        self.description = description
        self.labels = labels
        self.prom_name = prometheus_name(name, unit)
        keys = [sanitize_label(k) for k in labels]
        # The SDK's reader emits labels sorted by key; so do we, to produce identical text.
        order = tuple(sorted(range(len(keys)), key=lambda i: keys[i]))
        # One sample's line as a %-format: the name and the label keys are fixed per family, so a
        # sample costs one C-level formatting of its (escaped) label values and its number. Names
        # and keys are sanitised to [a-zA-Z0-9_:], so the template holds no other "%".
        joined = ",".join(f'{keys[i]}="%s"' for i in order)
        self._template = f"{self.prom_name}{{{joined}}} %s\n" if keys else f"{self.prom_name} %s\n"
        # The label values of a sample in output order, as a tuple.
        sorted_values: Callable[[Sequence[str]], tuple[str, ...]]
        if len(order) > 1:
            sorted_values = itemgetter(*order)
        elif order:
            only = order[0]

            def sorted_values(values: Sequence[str]) -> tuple[str, ...]:
                return (values[only],)

        else:

            def sorted_values(values: Sequence[str]) -> tuple[str, ...]:
                return ()

        self._sorted = sorted_values
        # Recent numbers of this family, formatted: capacities, counts and timestamps repeat a lot.
        self._numbers: dict[float, str] = dict(_NUMBERS)

    def _key(self) -> tuple[str, str, str, tuple[str, ...]]:
        return (self.name, self.unit, self.description, self.labels)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, GaugeFamily):
            return NotImplemented
        return self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __repr__(self) -> str:
        name, unit, description, labels = self._key()
        return f"GaugeFamily({name=!r}, {unit=!r}, {description=!r}, {labels=!r})"

    def header(self, openmetrics: bool) -> bytes:
        name = self.prom_name
        if openmetrics:
            doc = self.description.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")
            lines = [f"# HELP {name} {doc}", f"# TYPE {name} gauge"]
            unit = prometheus_unit(self.unit)
            if unit:
                lines.append(f"# UNIT {name} {unit}")
        else:
            doc = self.description.replace("\\", r"\\").replace("\n", r"\n")
            lines = [f"# HELP {name} {doc}", f"# TYPE {name} gauge"]
        return ("\n".join(lines) + "\n").encode()

    def render(self, samples: Iterable[tuple[Sequence[str], float]]) -> bytes:
        """Exposition lines (identical in text 0.0.4 and OpenMetrics for gauges)."""
        template, sorted_values, numbers = self._template, self._sorted, self._numbers
        out: list[str] = []
        for values, value in samples:
            number = numbers.get(value)
            if number is None:
                number = floatToGoString(value)
                # Not zero: 0.0 and -0.0 are one dict key but two texts. NaN never matches itself.
                if value:
                    if len(numbers) >= _CACHE_SIZE:
                        numbers.clear()  # crude, bounded: unique values (timestamps) keep cycling
                    numbers[value] = number
            texts = sorted_values(values)
            joined = "".join(texts)
            if "\\" in joined or '"' in joined or "\n" in joined:
                texts = tuple(_escape(text) for text in texts)
            out.append(template % (*texts, number))
        return "".join(out).encode()


# Formatted numbers remembered per family.
_CACHE_SIZE = 1024
# Values that info series and counts use a lot, formatted once. (Not 0.0: it would also match -0.0.)
_NUMBERS = {v: floatToGoString(v) for v in (1.0, 2.0, 3.0)}


def _escape(value: str) -> str:
    if "\\" in value or '"' in value or "\n" in value:
        return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")
    return value


def negotiate(accept: str | None) -> bool:
    """True when the client asked for OpenMetrics (same rules as prometheus_client)."""
    _, content_type = text_exposition.choose_encoder(accept or "")
    return bool(content_type.startswith("application/openmetrics-text"))


class Chunk:
    """Pre-rendered exposition bytes plus their gzip member, compressed at most once.

    A gzip stream may consist of several members (RFC 1952 2.2); decoders such as Go's (which
    Prometheus uses), zlib-based ones and Python's read them as one body. So a compressed scrape
    is the concatenation of each chunk's cached member, and only chunks that changed since the
    last scrape are compressed again.
    """

    __slots__ = ("_gz", "data")

    def __init__(self, data: bytes) -> None:
        self.data = data
        self._gz: bytes | None = None

    def gzipped(self) -> bytes:
        gz = self._gz
        if gz is None:
            # Level 1: at 10^5 series latency matters more than the last few percent of size.
            gz = self._gz = gzip.compress(self.data, compresslevel=1, mtime=0)
        return gz


def sdk_exposition(registry: CollectorRegistry, openmetrics: bool) -> bytes:
    """The SDK/prometheus_client part of a scrape, without the OpenMetrics ``# EOF`` line."""
    if openmetrics:
        body: bytes = om_exposition.generate_latest(registry)
        if body.endswith(b"# EOF\n"):
            body = body[: -len(b"# EOF\n")]
        return body
    out: bytes = text_exposition.generate_latest(registry)
    return out


Blocks = Iterable[tuple[GaugeFamily, Sequence[Chunk]]]

_EOF = b"# EOF\n"
# (openmetrics, gzipped): the four bodies a scrape may ask for.
_FORMATS = ((False, False), (False, True), (True, False), (True, True))


class Assembler:
    """Builds scrape bodies, remembering per family and format the buffers it sent.

    A family's buffers (its header, then each non-empty chunk's bytes or gzip member) depend only
    on its chunks. A source that hands over the same sequence object while nothing in it changed
    (``SeriesStore.blocks``) lets a scrape reuse that family's buffers without looking at its
    chunks: a scrape of an unchanged cluster costs one pass over the families, the SDK's part and
    the sending, however many series there are; a change costs the families it touched. A
    sequence must never be altered once handed over (a changed family comes as a new object).

    Thread-safe: concurrent scrapes may both build a family's buffers; either result is right.
    """

    def __init__(self) -> None:
        # (family, openmetrics, gzipped) -> (the chunks as last seen, the buffers built from them)
        self._families: dict[tuple[GaugeFamily, bool, bool], tuple[Sequence[Chunk], list[bytes]]] = {}
        self._headers: dict[tuple[GaugeFamily, bool, bool], bytes] = {}

    def assemble(
        self, registry: CollectorRegistry, blocks: Blocks, openmetrics: bool, gzipped: bool = False
    ) -> list[bytes]:
        """A full scrape body as a list of buffers to send in order: the SDK's families, then each
        pre-rendered family with its header. With ``gzipped`` each buffer is a gzip member.

        A family with no samples is still announced (HELP/TYPE) so users can see it exists.
        """
        sdk = sdk_exposition(registry, openmetrics)
        out = [_gzip(sdk) if gzipped else sdk]
        cache = self._families
        others = [fmt for fmt in _FORMATS if fmt != (openmetrics, gzipped)]
        seen: set[tuple[GaugeFamily, bool, bool]] = set()
        for family, chunks in blocks:
            key = (family, openmetrics, gzipped)
            seen.add(key)
            cached = cache.get(key)
            if cached is None or cached[0] is not chunks:
                cached = cache[key] = (chunks, self._family(key, chunks))
                # What other formats built from older chunks would pin those chunks' bytes (up to
                # a whole body's worth after enough changes) until a scrape in that format came:
                # forgotten now, rebuilt by such a scrape if one comes.
                for other in others:
                    built = cache.get((family, *other))
                    if built is not None and built[0] is not chunks:
                        cache.pop((family, *other), None)
            out.extend(cached[1])
        # list(): a copy made in one step, while another scrape may be adding to the dict.
        stale = [key for key in list(cache) if key[1] == openmetrics and key[2] == gzipped and key not in seen]
        for key in stale:  # a family no longer served: forget its buffers
            cache.pop(key, None)
        if openmetrics:
            out.append(_GZ_EOF if gzipped else _EOF)
        return out

    def _family(self, key: tuple[GaugeFamily, bool, bool], chunks: Sequence[Chunk]) -> list[bytes]:
        family, openmetrics, gzipped = key
        header = self._headers.get(key)
        if header is None:
            header = family.header(openmetrics)
            header = self._headers[key] = _gzip(header) if gzipped else header
        # Empty chunks (segments without samples of this family) send nothing, not even an empty
        # gzip member.
        if gzipped:
            return [header, *(chunk.gzipped() for chunk in chunks if chunk.data)]
        return [header, *(chunk.data for chunk in chunks if chunk.data)]


def assemble(registry: CollectorRegistry, blocks: Blocks, openmetrics: bool, gzipped: bool = False) -> list[bytes]:
    """One scrape body without remembering anything (see :class:`Assembler`)."""
    return Assembler().assemble(registry, blocks, openmetrics, gzipped)


def _gzip(data: bytes) -> bytes:
    return gzip.compress(data, compresslevel=1, mtime=0)


_GZ_EOF = _gzip(_EOF)


def wants_gzip(accept_encoding: str | None) -> bool:
    return bool(accept_encoding) and "gzip" in str(accept_encoding).lower()


def maybe_gzip(body: bytes, accept_encoding: str | None) -> tuple[bytes, bool]:
    if wants_gzip(accept_encoding):
        return _gzip(body), True
    return body, False
