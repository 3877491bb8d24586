"""OTLP metric payloads encoded once per object change, sent as stored bytes.

The SDK path costs ~24 µs to collect and ~18 µs to encode each data point on every export: about
20 s of CPU per interval at half a million series. Like the Prometheus side
(:mod:`otel_dra.telemetry.exposition`), per-object gauge points are therefore encoded to protobuf
wire format when the object changes. An export then concatenates stored bytes, which protobuf
allows for repeated fields, and stamps the collection time into every point with one
``bytes.replace`` (C speed): each stored point carries an 8-byte placeholder timestamp whose
9-byte field cannot occur anywhere else in our encoding (see :data:`_PLACEHOLDER`).

Wire layout (opentelemetry-proto v1, field numbers from the .proto files)::

    ExportMetricsServiceRequest { repeated ResourceMetrics resource_metrics = 1; }
    ResourceMetrics { Resource resource = 1; repeated ScopeMetrics scope_metrics = 2; }
    ScopeMetrics { InstrumentationScope scope = 1; repeated Metric metrics = 2; }
    Metric { string name = 1; string description = 2; string unit = 3; Gauge gauge = 5; }
    Gauge { repeated NumberDataPoint data_points = 1; }
    NumberDataPoint { fixed64 time_unix_nano = 3; double as_double = 4; repeated KeyValue attributes = 7; }
    KeyValue { string key = 1; AnyValue value = 2; }   AnyValue { string string_value = 1; }

``tests/unit/test_otlp_encode.py`` decodes our bytes with the official generated classes and
compares them with what the SDK's own encoder produces.
"""

from __future__ import annotations

import logging
import struct
import zlib
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import chain
from typing import NamedTuple

from opentelemetry.proto.common.v1.common_pb2 import AnyValue, ArrayValue, InstrumentationScope, KeyValue, KeyValueList
from opentelemetry.proto.resource.v1.resource_pb2 import Resource as ResourceProto
from opentelemetry.sdk.resources import Resource

log = logging.getLogger(__name__)

# time_unix_nano field (tag 3, fixed64 = 0x19) with a placeholder value. The value bytes contain
# 0xC3 followed by 0x3C, which is invalid UTF-8 (a lead byte needs a continuation byte), so the
# sequence cannot occur inside any string we encode; it cannot occur inside the 8-byte double
# either, because it is 9 bytes long and the double is the last field of every point, followed by
# the next point's 0x0A tag (absent from the placeholder).
_PLACEHOLDER = b"\x19" + b"\xa5\x5a\xc3\x3c\x96\x69\xf0\x0f"
_DOUBLE = struct.Struct("<d")
_FIXED64 = struct.Struct("<Q")

# Values remembered per attribute key by a PointEncoder.
_CACHE_SIZE = 1024

# Requests are split so that none exceeds this size: gRPC servers (the Collector's OTLP receiver
# included) refuse messages above 4 MiB by default.
MAX_REQUEST_BYTES = 3 * 1024 * 1024


def _varint(n: int) -> bytes:
    if n < 0x80:
        return bytes((n,))
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _field(tag: int, payload: bytes) -> bytes:
    """A length-delimited field: tag byte (field << 3 | 2), length, payload."""
    return bytes((tag,)) + _varint(len(payload)) + payload


def _utf8(text: str) -> bytes:
    return text.encode("utf-8", "replace")


@dataclass(frozen=True)
class PointEncoder:
    """Encodes the samples of one gauge family (fixed attribute keys) as NumberDataPoints."""

    keys: tuple[str, ...]
    _key_fields: tuple[bytes, ...] = field(init=False, repr=False)
    # Per key, encoded attribute fields of recent values: label values repeat a lot (namespaces,
    # drivers, pools, states, and each object's name across its families).
    _cache: tuple[dict[str, bytes], ...] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_key_fields", tuple(_field(0x0A, _utf8(k)) for k in self.keys))
        object.__setattr__(self, "_cache", tuple({} for _ in self.keys))

    def _attribute(self, i: int, text: str) -> bytes:
        string = _field(0x0A, _utf8(text))  # AnyValue.string_value = 1
        kv = self._key_fields[i] + b"\x12" + _varint(len(string)) + string  # KeyValue.value = 2
        encoded = b"\x3a" + _varint(len(kv)) + kv  # NumberDataPoint.attributes = 7
        cache = self._cache[i]
        if len(cache) >= _CACHE_SIZE:
            cache.clear()  # crude, bounded: unique values (object names) keep cycling through
        cache[text] = encoded
        return encoded

    def encode(self, samples: Iterable[tuple[Sequence[str], float]]) -> bytes:
        out = []
        caches = self._cache
        for values, value in samples:
            parts = [_PLACEHOLDER]
            for i, (cache, text) in enumerate(zip(caches, values, strict=True)):
                encoded = cache.get(text)
                parts.append(encoded if encoded is not None else self._attribute(i, text))
            parts.append(b"\x21" + _DOUBLE.pack(value))  # as_double = 4, last (see _PLACEHOLDER)
            point = b"".join(parts)
            out.append(b"\x0a" + _varint(len(point)) + point)  # Gauge.data_points = 1
        return b"".join(out)


def _split_points(blob: bytes, limit: int) -> list[bytes]:
    """Split concatenated ``data_points`` fields at point boundaries into pieces <= ``limit``."""
    if len(blob) <= limit:
        return [blob]
    pieces = []
    start = pos = 0
    n = len(blob)
    while pos < n:
        # Each point: 0x0A, varint length, payload.
        length = 0
        shift = 0
        i = pos + 1
        while True:
            byte = blob[i]
            length |= (byte & 0x7F) << shift
            i += 1
            if byte < 0x80:
                break
            shift += 7
        end = i + length
        if end - start > limit and pos > start:
            pieces.append(blob[start:pos])
            start = pos
        pos = end
    pieces.append(blob[start:])
    return pieces


class PointGroup(NamedTuple):
    """Encoded points kept as separate buffers (no copy) with their total size (uncompressed).

    ``packed`` groups hold their buffers zlib-compressed: stored points are only read at a push
    (every interval, 60 s by default), and the points of one cache segment compress ~20-30x, so a
    cache holds them packed and a push pays ~1.5 ms of CPU per MB to unpack them (zlib releases the
    GIL meanwhile). See docs/design.md, "OTLP points are stored compressed"."""

    buffers: list[bytes]
    size: int
    packed: bool = False

    @classmethod
    def of(cls, blob: bytes) -> PointGroup:
        return cls([blob], len(blob))

    def raw(self) -> list[bytes]:
        """The buffers as points, unpacked if need be."""
        return [zlib.decompress(b) for b in self.buffers] if self.packed else self.buffers


@dataclass(frozen=True)
class MetricHeader:
    name: str
    description: str
    unit: str

    def fields(self) -> bytes:
        return _field(0x0A, _utf8(self.name)) + _field(0x12, _utf8(self.description)) + _field(0x1A, _utf8(self.unit))


def _any_value(value: object) -> AnyValue:
    """An attribute value as the SDK's OTLP encoder writes it (its private ``_encode_value``, same
    type tests in the same order: bool before int, str and bytes before sequences)."""
    if value is None:
        return AnyValue()
    if isinstance(value, bool):
        return AnyValue(bool_value=value)
    if isinstance(value, str):
        return AnyValue(string_value=value)
    if isinstance(value, int):
        return AnyValue(int_value=value)
    if isinstance(value, float):
        return AnyValue(double_value=value)
    if isinstance(value, bytes):
        return AnyValue(bytes_value=value)
    if isinstance(value, Sequence):
        return AnyValue(array_value=ArrayValue(values=[_any_value(v) for v in value]))
    if isinstance(value, Mapping):
        return AnyValue(
            kvlist_value=KeyValueList(values=[KeyValue(key=str(k), value=_any_value(v)) for k, v in value.items()])
        )
    raise TypeError(f"invalid type {type(value).__name__} of value {value!r}")


def encode_resource(resource: Resource) -> bytes:
    """The OTLP ``Resource`` message of ``resource``, serialised: what the SDK's exporters send
    (an attribute it cannot encode is left out and logged, as the SDK does)."""
    attributes = []
    for key, value in resource.attributes.items():
        try:
            attributes.append(KeyValue(key=key, value=_any_value(value)))
        except (TypeError, ValueError) as exc:  # ValueError: an int beyond 64 bits
            log.warning("resource attribute %s left out of OTLP: %s", key, exc)
    return ResourceProto(attributes=attributes).SerializeToString()


class RequestBuilder:
    """Builds ExportMetricsServiceRequest messages from pre-encoded points."""

    def __init__(self, resource: Resource, scope_name: str, scope_version: str) -> None:
        self._resource = _field(0x0A, encode_resource(resource))
        scope = InstrumentationScope(name=scope_name, version=scope_version).SerializeToString()
        self._scope = _field(0x0A, scope)

    def requests(
        self,
        metrics: Iterable[tuple[MetricHeader, Sequence[PointGroup]]],
        time_unix_nano: int,
        limit: int = MAX_REQUEST_BYTES,
    ) -> Iterator[bytes]:
        """Requests carrying every point, none much larger than ``limit`` bytes, built one at a
        time as they are consumed (see :meth:`counted`)."""
        for request, _points in self.counted(metrics, time_unix_nano, limit):
            yield request

    def counted(
        self,
        metrics: Iterable[tuple[MetricHeader, Sequence[PointGroup]]],
        time_unix_nano: int,
        limit: int = MAX_REQUEST_BYTES,
    ) -> Iterator[tuple[bytes, int]]:
        """As :meth:`requests`, each request with the number of data points it carries (what a
        failed send drops). Each point buffer is copied three times in all (joined, stamped,
        framed), after packed groups are unpacked (without the GIL): these copies run in C while
        holding the GIL, so fewer copies means less delay for concurrent scrapes. Points are
        counted by their timestamp placeholder (one per point, see ``_PLACEHOLDER``), a C scan of
        the joined buffer just before the stamping replaces it."""
        stamp = b"\x19" + _FIXED64.pack(time_unix_nano)
        parts: list[bytes] = []  # fragments of the ScopeMetrics.metrics fields of the current request
        size = 0
        points = 0  # in the current request

        def request() -> tuple[bytes, int]:
            # ResourceMetrics { resource = 1; scope_metrics = 2 { scope = 1; metrics = 2... } }
            scope_metrics_len = len(self._scope) + size
            rm_len = len(self._resource) + 1 + len(_varint(scope_metrics_len)) + scope_metrics_len
            head = [b"\x0a", _varint(rm_len), self._resource, b"\x12", _varint(scope_metrics_len), self._scope]
            return b"".join(head + parts), points

        def metric(head: bytes, groups: list[PointGroup]) -> Iterator[tuple[bytes, int]]:
            nonlocal parts, size, points
            joined = b"".join(chain.from_iterable(g.raw() for g in groups))
            count = joined.count(_PLACEHOLDER)
            blob = joined.replace(_PLACEHOLDER, stamp)
            del joined
            gauge_field = b"\x2a" + _varint(len(blob))  # Metric.gauge = 5
            metric_len = len(head) + len(gauge_field) + len(blob)
            framing = b"\x12" + _varint(metric_len)  # ScopeMetrics.metrics = 2
            if size and size + len(framing) + metric_len > limit:
                yield request()
                parts, size, points = [], 0, 0
            parts += [framing, head, gauge_field, blob]
            size += len(framing) + metric_len
            points += count

        for header, groups in metrics:
            head = header.fields()
            # Group whole groups (one per cache segment) into pieces of at most ``limit`` bytes;
            # only a group that is itself too large is split point by point.
            piece: list[PointGroup] = []
            piece_size = 0
            for group in groups:
                if not group.size:
                    continue
                if group.size > limit:
                    for part in _split_points(b"".join(group.raw()), limit):
                        yield from metric(head, [PointGroup.of(part)])
                    continue
                if piece_size + group.size > limit:
                    yield from metric(head, piece)
                    piece, piece_size = [], 0
                piece.append(group)
                piece_size += group.size
            if piece:
                yield from metric(head, piece)
        if parts:
            yield request()
