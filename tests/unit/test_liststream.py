"""Streamed list answers (otel_dra.kube.liststream): items decoded as the bytes arrive, whatever
the read boundaries; the same result as decoding the whole answer, or a clear error."""

from __future__ import annotations

import json

import pytest

from otel_dra._generated.k8s import meta_pb2
from otel_dra.kube import protobuf
from otel_dra.kube.liststream import StreamedList


def _reads(data: bytes, size: int):
    return iter([data[i : i + size] for i in range(0, len(data), size)])


def _pb_answer(names, token="", rv="42", encoding=""):
    page = meta_pb2.List(
        metadata=meta_pb2.ListMeta(resourceVersion=rv, **{"continue": token}),
        items=[meta_pb2.ObjectMeta(name=n, resourceVersion="5").SerializeToString() for n in names],
    )
    # contentEncoding and contentType (field 4, not in the trimmed message) after raw, as the API
    # server writes them (empty).
    envelope = meta_pb2.Unknown(raw=page.SerializeToString(), contentEncoding=encoding)
    return protobuf.MAGIC + envelope.SerializeToString() + b"\x22\x00"


@pytest.mark.parametrize("size", [1, 3, 7, 64, 1 << 20])
def test_protobuf_items_whatever_the_reads(size):
    names = [f"object-{i:04d}" + "x" * (i % 300) for i in range(300)]  # lengths over one varint byte
    listed = StreamedList(_reads(_pb_answer(names, token="t9"), size))
    assert listed.protobuf and listed.resource_version == "42" and listed.continue_token == "t9"
    assert [meta_pb2.ObjectMeta.FromString(b).name for b in listed.items()] == names


def test_protobuf_empty_list_and_refusals():
    listed = StreamedList(_reads(_pb_answer([]), 5))
    assert list(listed.items()) == [] and listed.continue_token is None
    with pytest.raises(ValueError, match="content encoding 'gzip'"):
        list(StreamedList(_reads(_pb_answer(["a"], encoding="gzip"), 4)).items())
    with pytest.raises(ValueError, match="truncated"):
        list(StreamedList(_reads(_pb_answer(["a", "b"])[:-12], 4)).items())


def _json_answer(items, meta=None):
    return json.dumps(
        {"kind": "PodList", "apiVersion": "v1", "metadata": meta or {"resourceVersion": "7"}, "items": items},
        separators=(",", ":"),
        ensure_ascii=False,
    ).encode()


@pytest.mark.parametrize("size", [1, 2, 5, 7, 100, 1 << 20])
def test_json_items_whatever_the_reads(size):
    # Multi-byte characters split across reads, braces and escapes inside strings, nested objects.
    items = [
        {"metadata": {"name": f"p{i}", "annotations": {"a": 'x}{"],[ü€😀\\"' * (i % 3)}}, "n": [i, {"d": None}]}
        for i in range(50)
    ]
    listed = StreamedList(_reads(_json_answer(items, {"resourceVersion": "7", "continue": "c1"}), size))
    assert not listed.protobuf and listed.resource_version == "7" and listed.continue_token == "c1"
    assert list(listed.items()) == items


@pytest.mark.parametrize("items", [[], None])
def test_json_empty_or_null_items(items):
    listed = StreamedList(_reads(_json_answer(items), 3))
    assert list(listed.items()) == []


def test_json_of_another_shape_is_decoded_whole():
    # Keys in another order than Go writes them: the head is not recognised, the answer is read whole.
    data = json.dumps({"items": [{"a": 1}], "metadata": {"resourceVersion": "3", "continue": "k"}}).encode()
    listed = StreamedList(_reads(data, 4))
    assert listed.resource_version == "3" and listed.continue_token == "k"
    assert list(listed.items()) == [{"a": 1}]


def test_malformed_json_is_an_error_not_a_short_list():
    good = _json_answer([{"a": 1}, {"b": 2}])
    for broken in (good[:-5], good.replace(b'{"b"', b'{"b" 2'), good.replace(b"},{", b"}{")):
        with pytest.raises(ValueError):
            list(StreamedList(_reads(broken, 6)).items())
