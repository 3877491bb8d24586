"""Derived trace ids and the 56-bit ratio sampler (otel_dra/telemetry/traceids.py)."""

from __future__ import annotations

import hashlib
import uuid

import pytest
from opentelemetry.sdk.trace.sampling import Decision, TraceIdRatioBased
from opentelemetry.trace import SpanContext, TraceFlags

from otel_dra.telemetry import traceids
from otel_dra.telemetry.traceids import ParentBasedTraceIdRatio, TraceIdRatio


def test_trace_id_is_the_uuid_and_the_root_is_documented_hash() -> None:
    uid = "0f8fad5b-d9cb-469f-a165-70867728950e"
    trace_id = traceids.trace_id_of(uid)
    assert trace_id is not None and f"{trace_id:032x}" == uid.replace("-", "")
    # The formula docs/tracing.md gives, computed independently here.
    expected = int.from_bytes(hashlib.sha256(b"otel-dra/root\0" + bytes.fromhex(uid.replace("-", ""))).digest()[:8])
    assert traceids.root_span_id(trace_id) == expected
    named = int.from_bytes(
        hashlib.sha256(b"otel-dra/span\0" + trace_id.to_bytes(16, "big") + b"allocation").digest()[:8]
    )
    assert traceids.named_span_id(trace_id, "allocation") == named
    assert traceids.named_span_id(trace_id, "allocation") != traceids.named_span_id(trace_id, "binding")
    root = traceids.root_context(trace_id, sampled=True)
    assert root.is_remote and root.is_valid and root.trace_flags.sampled and root.span_id == expected


@pytest.mark.parametrize("bad", ["", "not-a-uuid", "00000000-0000-0000-0000-000000000000", None, 42])
def test_not_a_uuid_has_no_trace_id(bad: object) -> None:
    assert traceids.trace_id_of(bad) is None  # type: ignore[arg-type]


def test_the_sdk_ratio_sampler_fails_on_uuids_and_ours_does_not() -> None:
    uids = [uuid.uuid4().int for _ in range(4000)]
    sdk = TraceIdRatioBased(0.5)
    sdk_sampled = sum(sdk.should_sample(None, u, "x").decision is Decision.RECORD_AND_SAMPLE for u in uids)
    assert sdk_sampled == 0  # the variant bits put every UUID's low 64 bits above 2^63
    ours = TraceIdRatio(0.5)
    sampled = sum(ours.should_sample(None, u, "x").decision is Decision.RECORD_AND_SAMPLE for u in uids)
    assert 1800 < sampled < 2200
    assert sum(TraceIdRatio(0.1).sampled(u) for u in uids) in range(300, 500)
    assert all(TraceIdRatio(1.0).sampled(u) for u in uids)
    assert not any(TraceIdRatio(0.0).sampled(u) for u in uids)


def test_ratio_ignores_the_parent_and_parent_based_follows_it() -> None:
    trace_id = next(u for u in (uuid.uuid4().int for _ in range(100)) if not TraceIdRatio(0.5).sampled(u))
    parent = traceids.parent_context(
        SpanContext(trace_id, 7, is_remote=True, trace_flags=TraceFlags(TraceFlags.SAMPLED))
    )
    assert TraceIdRatio(0.5).should_sample(parent, trace_id, "x").decision is Decision.DROP
    assert ParentBasedTraceIdRatio(0.5).should_sample(parent, trace_id, "x").decision is Decision.RECORD_AND_SAMPLE
    assert not traceids.decides_root(ParentBasedTraceIdRatio(0.5), trace_id, "x")
    with pytest.raises(ValueError):
        TraceIdRatio(1.5)
