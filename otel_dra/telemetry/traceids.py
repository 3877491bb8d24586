"""Trace and span ids that several processes derive from one shared 128-bit key, and the sampler
that decides by those ids alone.

Why: a trace that several processes add to, at different times and with nothing passed between
them (an object's life as one process watches it, and the work another process does for it), can
only be one trace if every side computes the same ids from something they all know. A UUID is
128 bits, the width of a W3C trace id, so the key's bits *are* the trace id, and the trace's root
span id is a hash of it: every side parents its spans to that root without asking anyone.

Ids (documented in docs/tracing.md, so that other tools can compute them):

- trace id: the UUID's 128 bits (``uuid.UUID(key).int``), the UUID's hex digits without dashes;
- the root span id: the first 8 bytes of ``SHA-256(b"otel-dra/root\\0" + trace id, 16 bytes)``;
- a named span of the trace (a phase that may be emitted again after a restart, with the same id
  so that a backend can tell it is the same span): the first 8 bytes of
  ``SHA-256(b"otel-dra/span\\0" + trace id + name)``.

A hash of all zeros (never seen, but invalid as a span id) becomes 1.

Sampling: the SDK's ``TraceIdRatioBased`` compares the trace id's low 64 bits with the ratio. A
random (version 4) UUID is random in only 122 of its bits: byte 8 holds the variant, ``10`` in its
top bits, so its low 64 bits always lie in [2^63, 2^63 + 2^62) and that sampler at ratio 0.5
samples no UUID at all, at 0.75 every one. :class:`TraceIdRatio` compares the low 56 bits instead,
which are random in a version 4 UUID and in every trace id the W3C "random" flag covers (trace
context level 2; the same bits the OpenTelemetry specification's consistent probability sampling
reads). Every process that samples this way samples one trace whole or not at all.

Nothing here knows what the keys are.
"""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import Sequence

from opentelemetry import context as context_api
from opentelemetry import trace
from opentelemetry.sdk.trace.sampling import Decision, ParentBased, Sampler, SamplingResult
from opentelemetry.trace import Link, SpanContext, SpanKind, TraceFlags
from opentelemetry.util.types import Attributes

_ROOT = b"otel-dra/root\0"
_SPAN = b"otel-dra/span\0"
RANDOM_BITS = 56
_MASK = (1 << RANDOM_BITS) - 1


def trace_id_of(key: str) -> int | None:
    """The trace id of a UUID (any of the spellings ``uuid.UUID`` reads); None when ``key`` is
    not one, or is the nil UUID (an all-zero trace id is invalid)."""
    try:
        value = uuid.UUID(key).int
    except (ValueError, TypeError, AttributeError):
        return None
    return value or None


def _hash64(prefix: bytes, trace_id: int, name: bytes = b"") -> int:
    digest = hashlib.sha256(prefix + trace_id.to_bytes(16, "big") + name).digest()
    return int.from_bytes(digest[:8], "big") or 1


def root_span_id(trace_id: int) -> int:
    """The span id of a derived trace's root, the same in every process."""
    return _hash64(_ROOT, trace_id)


def named_span_id(trace_id: int, name: str) -> int:
    """The span id of the span ``name`` of a derived trace (``name`` unique within the trace)."""
    return _hash64(_SPAN, trace_id, name.encode())


def root_context(trace_id: int, sampled: bool) -> SpanContext:
    """The root's context, as a remote parent: what a span joins a derived trace with."""
    flags = TraceFlags.SAMPLED if sampled else TraceFlags.DEFAULT
    return SpanContext(trace_id, root_span_id(trace_id), is_remote=True, trace_flags=TraceFlags(flags))


def parent_context(span_context: SpanContext) -> context_api.Context:
    """A context whose current span is ``span_context`` (for a span's parent, or a measurement's
    exemplar)."""
    return trace.set_span_in_context(trace.NonRecordingSpan(span_context))


class TraceIdRatio(Sampler):
    """Samples a trace when the low 56 bits of its trace id are below ``ratio`` * 2^56, whatever
    its parent says (see the module notes for why not the SDK's 64 bits)."""

    def __init__(self, ratio: float) -> None:
        if not 0.0 <= ratio <= 1.0:
            raise ValueError("ratio must be between 0 and 1")
        self.ratio = ratio
        self.bound = round(ratio * (1 << RANDOM_BITS))

    def sampled(self, trace_id: int) -> bool:
        return (trace_id & _MASK) < self.bound

    def should_sample(
        self,
        parent_context: context_api.Context | None,
        trace_id: int,
        name: str,
        kind: SpanKind | None = None,
        attributes: Attributes = None,
        links: Sequence[Link] | None = None,
        trace_state: trace.TraceState | None = None,
    ) -> SamplingResult:
        if trace_state is None:
            trace_state = trace.get_current_span(parent_context).get_span_context().trace_state
        if self.sampled(trace_id):
            return SamplingResult(Decision.RECORD_AND_SAMPLE, attributes, trace_state)
        return SamplingResult(Decision.DROP, None, trace_state)

    def get_description(self) -> str:
        return f"TraceIdRatio56{{{self.ratio}}}"


class ParentBasedTraceIdRatio(ParentBased):
    """The parent's decision where there is a parent, else :class:`TraceIdRatio`."""

    def __init__(self, ratio: float) -> None:
        super().__init__(root=TraceIdRatio(ratio))


def decides_root(sampler: Sampler, trace_id: int, name: str) -> bool:
    """Whether ``sampler`` samples a root span of ``trace_id``: the flag a derived root context
    gets, so that a parent-based sampler asked about its children agrees with one asked about
    the root itself."""
    result = sampler.should_sample(None, trace_id, name)
    return result.decision is Decision.RECORD_AND_SAMPLE
