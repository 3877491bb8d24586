"""Claims decoded from protobuf parse as their JSON does (the golden claims of every shape).

The reflector lists claims as protobuf and ``resourceclaim.from_protobuf`` turns each into the dict
the parser reads. Here each golden claim (allocated, with binding conditions, consumable-capacity
shares, device status conditions, skipped node operations, as in the golden test) is encoded with
the trimmed messages and decoded again; the real API server's protobuf is compared with its JSON in
tests/integration/test_protobuf_lists.py.
"""

from __future__ import annotations

from typing import Any

import pytest
from google.protobuf import json_format

from otel_dra._generated.k8s import meta_pb2, resource_pb2
from otel_dra.cluster import resourceclaim
from otel_dra.cluster.fields import parse_time
from otel_dra.kube import protobuf
from tests.fuzz.world import seeds

# JSON fields that are a metav1.Time (an RFC 3339 string in JSON, {seconds, nanos} in protobuf).
_TIMES = frozenset({"creationTimestamp", "time", "allocationTimestamp", "lastTransitionTime"})


def _as_protobuf_json(value: Any, key: str = "") -> Any:
    """The JSON object reshaped as json_format reads our messages: times as {seconds}, quantities
    as {string}."""
    if key in _TIMES and isinstance(value, str):
        return {"seconds": int(parse_time(value))}
    if key == "consumedCapacity" and isinstance(value, dict):
        return {name: {"string": q} for name, q in value.items()}
    if isinstance(value, dict):
        return {k: _as_protobuf_json(v, k) for k, v in value.items()}
    if isinstance(value, list):
        return [_as_protobuf_json(v, key) for v in value]
    return value


CLAIMS = [obj for kind, obj in seeds() if kind == "ResourceClaim"]


def _with_history(obj: dict[str, Any]) -> dict[str, Any]:
    """The golden claim as the API server lists it: a creation time and managedFields."""
    meta = {
        **obj["metadata"],
        "uid": "u-" + obj["metadata"]["name"],
        "resourceVersion": "42",
        "creationTimestamp": "2026-11-30T03:26:06Z",
        "managedFields": [
            {"manager": "kubectl", "operation": "Update", "time": "2026-11-30T03:26:06Z", "fieldsType": "FieldsV1"},
            {"manager": "kube-scheduler", "time": "2026-11-30T03:27:01Z", "subresource": "status"},
        ],
    }
    return {**obj, "metadata": meta}


@pytest.mark.parametrize("obj", [_with_history(c) for c in CLAIMS], ids=[c["metadata"]["name"] for c in CLAIMS])
def test_a_claim_decoded_from_protobuf_parses_as_its_json(obj: dict[str, Any]) -> None:
    message = json_format.ParseDict(_as_protobuf_json(obj), resource_pb2.ResourceClaim(), ignore_unknown_fields=True)
    decoded = resourceclaim.from_protobuf(message.SerializeToString())
    from_pb: list[str] = []
    from_json: list[str] = []
    assert resourceclaim.parse(decoded, from_pb.append) == resourceclaim.parse(obj, from_json.append)
    assert from_pb == from_json


def test_the_golden_claims_cover_what_the_decoder_converts() -> None:
    # Not an empty comparison: the shapes the conversion handles are all in the golden set.
    results = [
        r for c in CLAIMS for r in c.get("status", {}).get("allocation", {}).get("devices", {}).get("results", [])
    ]
    assert any("consumedCapacity" in r for r in results)
    assert any("bindingConditions" in r for r in results)
    assert any("shareID" in r for r in results)
    assert any(c.get("status", {}).get("devices") for c in CLAIMS)
    assert any(c.get("status", {}).get("reservedFor") for c in CLAIMS)
    assert any("firstAvailable" in r for c in CLAIMS for r in c["spec"]["devices"]["requests"])


def test_a_malformed_protobuf_claim_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="malformed protobuf ResourceClaim"):
        resourceclaim.from_protobuf(b"\x0a\x05ab")


def test_times_read_as_their_json_form() -> None:
    assert protobuf.time_text(meta_pb2.Time(seconds=1_796_009_166)) == "2026-11-30T03:26:06Z"
    # JSON has seconds only; an unset non-pointer metav1.Time (Go's zero time) is null there.
    assert protobuf.time_text(meta_pb2.Time(seconds=1_796_009_166, nanos=5)) == "2026-11-30T03:26:06Z"
    assert protobuf.time_text(meta_pb2.Time(seconds=-62135596800)) is None
    assert protobuf.time_text(meta_pb2.Time(seconds=2**62)) is None  # beyond gmtime: unset, not a crash
