"""One finished span as the request path leaves it: plain values, nothing to lock.

The request's task makes these when the request ends (pool/tracing/_spans.py) and
queues them; the exporter's thread encodes them to OTLP (``_otlp.py``). A record is
immutable once made, so it crosses from one thread to the other as it is.
"""

from __future__ import annotations

from typing import NamedTuple, TypeAlias

# What an attribute may hold (OpenTelemetry's primitive values and their sequences).
AttributeValue: TypeAlias = str | bool | int | float | tuple[str, ...]
Attributes: TypeAlias = tuple[tuple[str, AttributeValue], ...]

# OTLP's span kinds (opentelemetry/proto/trace/v1/trace.proto, Span.SpanKind).
KIND_INTERNAL = 1
KIND_SERVER = 2


class SpanRecord(NamedTuple):
    """A span: its ids, when, what it carries, how it ended."""

    name: str
    trace_id: bytes  # 16 bytes
    span_id: bytes  # 8 bytes
    parent_span_id: bytes  # 8 bytes; empty for a root span
    parent_is_remote: bool  # the parent is the caller's span (from its traceparent)
    kind: int
    start_ns: int  # Unix epoch nanoseconds
    end_ns: int
    attributes: Attributes
    events: tuple[tuple[str, int], ...]  # (name, Unix epoch ns)
    error: str | None  # an error span's description; None for one that did not fail
    trace_state: str | None  # the caller's ``tracestate`` header, as it came
