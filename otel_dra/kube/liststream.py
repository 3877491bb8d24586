"""List answers read as a stream, one item at a time.

Why: the exporter's initial list asks for ``resourceVersion=0`` (what client-go's informers do),
which the API server answers from its watch cache, ignoring ``limit``: the whole list in one
answer. That costs the API server a fraction of a paginated quorum list, whose every page is a
range read from etcd: at workload L (100,000 pods on a 1.37 testbed) 7.5 s of API server CPU and
0.1 s of etcd CPU for all the pods, against 15 s and 15 s for pages of 500 (docs/benchmarks.md).
But the answer is then hundreds of MB (477 MB of protobuf for those pods); read whole, it would
double the exporter's memory. So it is decoded as it arrives: the list's metadata from its head,
then each item as soon as its bytes are in, with a buffer of about one read at a time.

Two encodings, each as the API server writes it:

- protobuf: the ``k8s\\0`` magic, then a ``runtime.Unknown`` whose ``raw`` (field 2) is the list;
  in the list, ListMeta is field 1 and each item field 2 (see :mod:`otel_dra.kube.protobuf`). The
  wire format is walked by hand (tags and lengths), so an item's bytes are handed over without
  building the list message;
- JSON: Go's encoding/json writes ``kind``, ``apiVersion``, ``metadata`` and then ``items``, so the
  metadata is read from the head and each item with ``json.JSONDecoder.raw_decode`` (the C
  scanner) from a text buffer.

Malformed input raises ``ValueError`` (``DecodeError`` for protobuf items is the item decoder's).
"""

from __future__ import annotations

import codecs
import json
import re
from collections.abc import Iterator
from typing import Any

from otel_dra._generated.k8s import meta_pb2
from otel_dra.kube import protobuf

# An item may straddle reads; past this much buffered text without a complete item, the answer is
# malformed (API objects are at most ~1.5 MiB in etcd; decoded JSON is a few times that at most).
_MAX_PENDING = 64 << 20

# The head of a JSON list as the API server writes it (Go's encoding/json: fields in struct order,
# no spaces): kind, apiVersion, then metadata, a flat object (resourceVersion, continue,
# remainingItemCount), before the items.
_JSON_HEAD = re.compile(rb'\{(?:"(?:kind|apiVersion)":"[^"\\]*",)*"metadata":(\{[^{}]*\}),"items":')
_JSON_HEAD_BYTES = 4096

# Bytes gathered per read of the answer. The API server writes a list in HTTP chunks of 2 KiB
# (urllib3 hands them over one by one), smaller than most items (a claim is ~1.6 KB of JSON, a
# slice ~3.7 KB): a JSON item was scanned again from its start at every chunk it straddled, and the
# text buffer rebuilt per chunk. Gathered, an item straddles a read once in ~100.
_GATHER = 256 << 10

# Length-delimited fields 1, 2 and 3 (wire type 2): Unknown.raw and List.items are field 2,
# List.metadata field 1, Unknown.contentEncoding field 3.
_FIELD_1, _FIELD_2, _FIELD_3 = (1 << 3) | 2, (2 << 3) | 2, (3 << 3) | 2


def json_head(data: bytes | bytearray) -> tuple[str, str | None, int] | None:
    """(resourceVersion, continue token, offset of the items) of a JSON list answer, read from its
    head without decoding the items; None when the head is not in the shape Go writes. JSON escapes
    in the metadata are decoded by json itself (ValueError when it is not JSON)."""
    m = _JSON_HEAD.match(data, 0, _JSON_HEAD_BYTES)
    if m is None:
        return None
    return (*_json_meta(json.loads(m[1])), m.end())


def _json_meta(meta: Any) -> tuple[str, str | None]:
    """(resourceVersion, continue token) of a list's JSON metadata."""
    if not isinstance(meta, dict):
        return "", None
    token = meta.get("continue")
    return str(meta.get("resourceVersion", "")), token if isinstance(token, str) and token else None


class StreamedList:
    """The items of one list answer, decoded as the chunks arrive. ``resource_version`` and
    ``continue_token`` are known once the object is made (they precede the items); ``items()``
    yields each item: a dict for JSON, the encoded item for protobuf."""

    resource_version: str
    continue_token: str | None
    protobuf: bool

    def __init__(self, chunks: Iterator[bytes]) -> None:
        self._chunks = chunks
        self._buf = bytearray()
        self._pos = 0
        self._offset = 0  # stream offset of _buf[0]
        self._done = False
        while len(self._buf) < 4 and self._more():
            pass
        self.protobuf = bytes(self._buf[:4]) == protobuf.MAGIC
        if self.protobuf:
            self._pos = 4
            self._list_end = self._protobuf_head()
        else:
            self._json_head()

    # --- reading -------------------------------------------------------------------------------
    def _more(self) -> bool:
        """Append the next chunks, at least ``_GATHER`` bytes of them unless the answer ends first;
        False at the end of the answer."""
        if self._done:
            return False
        pieces: list[bytes] = []
        size = 0
        for chunk in self._chunks:
            if chunk:
                pieces.append(chunk)
                size += len(chunk)
                if size >= _GATHER:
                    break
        else:
            self._done = True
        if not pieces:
            return False
        if self._pos > (1 << 20):
            del self._buf[: self._pos]  # keep the buffer about one read long
            self._offset += self._pos
            self._pos = 0
        self._buf += b"".join(pieces)
        return True

    def _need(self, n: int) -> None:
        while len(self._buf) - self._pos < n:
            if not self._more():
                raise ValueError("truncated list answer")

    # --- protobuf ------------------------------------------------------------------------------
    def _varint(self) -> int:
        result = shift = 0
        while True:
            self._need(1)
            byte = self._buf[self._pos]
            self._pos += 1
            result |= (byte & 0x7F) << shift
            if byte < 0x80:
                return result
            shift += 7
            if shift > 63:
                raise ValueError("malformed protobuf list: varint too long")

    def _bytes(self, n: int) -> bytes:
        self._need(n)
        out = bytes(self._buf[self._pos : self._pos + n])
        self._pos += n
        return out

    def _skip(self, wire_type: int) -> None:
        if wire_type == 0:
            self._varint()
        elif wire_type == 1:
            self._bytes(8)
        elif wire_type == 2:
            self._bytes(self._varint())
        elif wire_type == 5:
            self._bytes(4)
        else:
            raise ValueError(f"malformed protobuf list: wire type {wire_type}")

    def _at(self) -> int:
        return self._offset + self._pos

    def _list_meta(self) -> None:
        meta = meta_pb2.ListMeta.FromString(self._bytes(self._varint()))
        self.resource_version = meta.resourceVersion
        self.continue_token = getattr(meta, "continue") or None

    def _protobuf_head(self) -> int:
        """Walks the envelope to the list, reads the list's fields up to its first item; returns
        the stream offset where the list ends."""
        while True:
            if len(self._buf) == self._pos and not self._more():
                raise ValueError("malformed protobuf list: no list in the answer")
            tag = self._varint()
            if tag == _FIELD_2:  # Unknown.raw: the list
                end = self._varint() + self._at()
                break
            self._skip(tag & 7)
        self.resource_version, self.continue_token = "", None
        self._first_item: bytes | None = None
        while self._at() < end:
            tag = self._varint()
            if tag == _FIELD_1:
                self._list_meta()
            elif tag == _FIELD_2:
                self._first_item = self._bytes(self._varint())
                break
            else:
                self._skip(tag & 7)
        return end

    def _protobuf_items(self) -> Iterator[bytes]:
        end = self._list_end
        if self._first_item is not None:
            first, self._first_item = self._first_item, None
            yield first
        while self._at() < end:
            tag = self._varint()
            if tag == _FIELD_2:
                yield self._bytes(self._varint())
            elif tag == _FIELD_1:  # ListMeta after items: not what the API server writes
                self._list_meta()
            else:
                self._skip(tag & 7)
        if self._at() != end:
            raise ValueError("malformed protobuf list: an item runs past the list")
        # The envelope's other fields follow the list (contentEncoding, contentType).
        while len(self._buf) > self._pos or self._more():
            tag = self._varint()
            if tag == _FIELD_3:
                encoding = self._bytes(self._varint())
                if encoding:
                    raise ValueError(f"protobuf answer with content encoding {encoding.decode(errors='replace')!r}")
            else:
                self._skip(tag & 7)

    # --- JSON ----------------------------------------------------------------------------------
    def _json_head(self) -> None:
        while True:
            head = json_head(self._buf)
            if head is not None or len(self._buf) >= _JSON_HEAD_BYTES or not self._more():
                break
        self._json_whole: Any = None
        if head is None:
            # Not the shape Go writes (a proxy that re-encodes, say): decoded whole, as before.
            while self._more():
                pass
            page = json.loads(bytes(self._buf))
            if not isinstance(page, dict):
                raise ValueError("list answer is not a JSON object")
            items = page.get("items")
            self._json_whole = items if isinstance(items, list) else []
            self.resource_version, self.continue_token = _json_meta(page.get("metadata"))
        else:
            self.resource_version, self.continue_token, self._pos = head

    def _json_items(self) -> Iterator[Any]:
        if self._json_whole is not None:
            yield from self._json_whole
            return
        decoder = codecs.getincrementaldecoder("utf-8")()
        text = decoder.decode(bytes(self._buf[self._pos :]))
        self._buf, self._pos = bytearray(), 0
        scan = json.JSONDecoder().raw_decode
        at = 0

        def more() -> bool:
            nonlocal text, at
            if not self._more():
                return False
            text = text[at:] + decoder.decode(bytes(self._buf))
            self._buf, self._pos, at = bytearray(), 0, 0
            if len(text) > _MAX_PENDING:
                raise ValueError("malformed JSON list: an item larger than 64 MiB")
            return True

        def skip_space() -> str:
            nonlocal at
            while True:
                while at < len(text) and text[at] in " \t\r\n":
                    at += 1
                if at < len(text):
                    return text[at]
                if not more():
                    raise ValueError("malformed JSON list: truncated")

        first = skip_space()
        if first == "n":  # "items":null
            while len(text) - at < 4 and more():
                pass
            if text[at : at + 4] != "null":
                raise ValueError("malformed JSON list: items is not an array")
            self._json_tail(text[at + 4 :], decoder)
            return
        if first != "[":
            raise ValueError("malformed JSON list: items is not an array")
        at += 1
        if skip_space() == "]":
            self._json_tail(text[at + 1 :], decoder)
            return
        while True:
            while True:
                try:
                    item, end = scan(text, at)
                    break
                except json.JSONDecodeError:
                    if not more():  # the whole answer is in and still no item: malformed
                        raise
            at = end
            yield item
            sep = skip_space()
            at += 1
            if sep == "]":
                self._json_tail(text[at:], decoder)
                return
            if sep != ",":
                raise ValueError(f"malformed JSON list: {sep!r} between items")
            skip_space()

    def _json_tail(self, rest: str, decoder: codecs.IncrementalDecoder) -> None:
        """What follows the items (Go writes only the closing brace). A field there is read as
        ``json.loads`` would read the whole answer: a second ``metadata`` wins over the head's."""
        while self._more():
            rest += decoder.decode(bytes(self._buf))
            self._buf, self._pos = bytearray(), 0
        rest += decoder.decode(b"", final=True)
        if rest.strip() == "}":
            return
        try:
            tail = json.loads('{"items":null' + rest)
        except ValueError as exc:
            raise ValueError(f"malformed JSON list after the items: {exc}") from None
        meta = tail.get("metadata") if isinstance(tail, dict) else None
        if isinstance(meta, dict):
            self.resource_version, self.continue_token = _json_meta(meta)

    def items(self) -> Iterator[Any]:
        return self._protobuf_items() if self.protobuf else self._json_items()
