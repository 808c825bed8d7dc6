"""OTLP/protobuf encoding of span records: the body of a ``POST /v1/traces``.

Written straight to the protobuf wire format rather than through message objects:
the SDK's encoder builds a Python protobuf message per span and per attribute, about
55 us a span on the pool's machine, more than the whole CPU budget of a traced
request (#29, benchmarks/tracing.py). The resource and the instrumentation scope are
encoded once; each attribute key's bytes are kept after their first use.

The messages and field numbers are those of opentelemetry-proto
(``opentelemetry/proto/collector/trace/v1/trace_service.proto`` and the files it
imports); what comes out is what the SDK's encoder makes of the same spans, which
tests/tracing/test_otlp.py checks by decoding both with the opentelemetry-proto
classes. Runs on the exporter's thread only.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Mapping, Sequence

from opentelemetry.trace import TraceState

from pool.tracing._record import AttributeValue, SpanRecord

# Wire types: 0 varint, 1 64-bit, 2 length-delimited, 5 32-bit. A tag is
# (field number << 3) | wire type, one byte below field 16.
_VARINT, _I64, _LEN, _I32 = 0, 1, 2, 5


def _tag(field: int, wire_type: int) -> bytes:
    return _varint((field << 3) | wire_type)


_SMALL_VARINTS = [bytes((n,)) for n in range(0x80)]


def _varint(value: int) -> bytes:
    """An unsigned varint (a negative int64 as its 64-bit two's complement)."""
    if 0 <= value < 0x80:
        return _SMALL_VARINTS[value]
    value &= (1 << 64) - 1
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _field(tag: bytes, payload: bytes) -> bytes:
    """A length-delimited field: its tag, the payload's length, the payload."""
    size = len(payload)
    return tag + (_SMALL_VARINTS[size] if size < 0x80 else _varint(size)) + payload


# ExportTraceServiceRequest.resource_spans = 1
_REQUEST_RESOURCE_SPANS = _tag(1, _LEN)
# ResourceSpans: resource = 1, scope_spans = 2, schema_url = 3
_RESOURCE_SPANS_RESOURCE = _tag(1, _LEN)
_RESOURCE_SPANS_SCOPE_SPANS = _tag(2, _LEN)
_RESOURCE_SPANS_SCHEMA_URL = _tag(3, _LEN)
# Resource.attributes = 1
_RESOURCE_ATTRIBUTES = _tag(1, _LEN)
# ScopeSpans: scope = 1, spans = 2
_SCOPE_SPANS_SCOPE = _tag(1, _LEN)
_SCOPE_SPANS_SPANS = _tag(2, _LEN)
# InstrumentationScope: name = 1, version = 2
_SCOPE_NAME = _tag(1, _LEN)
_SCOPE_VERSION = _tag(2, _LEN)
# Span: trace_id = 1, span_id = 2, trace_state = 3, parent_span_id = 4, name = 5,
# kind = 6, start_time_unix_nano = 7, end_time_unix_nano = 8, attributes = 9,
# events = 11, status = 15, flags = 16 (fixed32); the ids are fixed-size bytes.
_SPAN_TRACE_ID = _tag(1, _LEN) + _varint(16)
_SPAN_SPAN_ID = _tag(2, _LEN) + _varint(8)
_SPAN_TRACE_STATE = _tag(3, _LEN)
_SPAN_PARENT_SPAN_ID = _tag(4, _LEN) + _varint(8)
_SPAN_NAME = _tag(5, _LEN)
_SPAN_KIND = _tag(6, _VARINT)
_SPAN_START = _tag(7, _I64)
_SPAN_END = _tag(8, _I64)
_SPAN_ATTRIBUTES = _tag(9, _LEN)
_SPAN_EVENTS = _tag(11, _LEN)
_SPAN_STATUS = _tag(15, _LEN)
_SPAN_FLAGS = _tag(16, _I32)
# Span.Event: time_unix_nano = 1 (fixed64), name = 2
_EVENT_TIME = _tag(1, _I64)
_EVENT_NAME = _tag(2, _LEN)
# Status: message = 2, code = 3 (STATUS_CODE_ERROR = 2). A span that did not fail
# carries an empty status, as the SDK's encoder writes an unset one.
_STATUS_ERROR_CODE = _tag(3, _VARINT) + _varint(2)
_STATUS_MESSAGE = _tag(2, _LEN)
_STATUS_UNSET = _SPAN_STATUS + _varint(0)
# SpanFlags: whether the parent is remote is known (0x100), and if it is (0x200).
_FLAGS_LOCAL_PARENT = _SPAN_FLAGS + struct.pack("<I", 0x100)
_FLAGS_REMOTE_PARENT = _SPAN_FLAGS + struct.pack("<I", 0x300)
# KeyValue: key = 1, value = 2 (AnyValue)
_KEY = _tag(1, _LEN)
_VALUE = _tag(2, _LEN)
# AnyValue: string_value = 1, bool_value = 2, int_value = 3, double_value = 4,
# array_value = 5 (ArrayValue: values = 1), bytes_value = 7
_STRING_VALUE = _tag(1, _LEN)
_BOOL_TRUE = _tag(2, _VARINT) + _varint(1)
_BOOL_FALSE = _tag(2, _VARINT) + _varint(0)
_INT_VALUE = _tag(3, _VARINT)
_DOUBLE_VALUE = _tag(4, _I64)
_ARRAY_VALUE = _tag(5, _LEN)
_ARRAY_VALUES = _tag(1, _LEN)
_BYTES_VALUE = _tag(7, _LEN)

_pack_u64 = struct.Struct("<Q").pack
_pack_double = struct.Struct("<d").pack

# How many encoded attributes are kept for reuse (a few hundred bytes each at most).
_ATTRIBUTES_KEPT = 4096

# The W3C limit on a tracestate header; a longer one is dropped, as the SDK does.
_TRACESTATE_MAX_LENGTH = 8192


def _any_value(value: object) -> bytes:
    # In the SDK encoder's order: bool is an int to Python, so it goes first.
    if isinstance(value, bool):
        return _BOOL_TRUE if value else _BOOL_FALSE
    if isinstance(value, str):
        return _field(_STRING_VALUE, value.encode())
    if isinstance(value, int):
        return _INT_VALUE + _varint(value)
    if isinstance(value, float):
        return _DOUBLE_VALUE + _pack_double(value)
    if isinstance(value, bytes):
        return _field(_BYTES_VALUE, value)
    if isinstance(value, Sequence):
        values = b"".join(_field(_ARRAY_VALUES, _any_value(v)) for v in value)
        return _field(_ARRAY_VALUE, values)
    raise TypeError(f"an attribute of type {type(value).__name__} cannot be encoded")


def _trace_state(header: str) -> str:
    """A ``tracestate`` header as the SDK keeps it: its valid members again, or
    nothing where one member is malformed (W3C: then the whole header is void)."""
    if len(header) > _TRACESTATE_MAX_LENGTH:
        return ""
    return ",".join(f"{key}={value}" for key, value in TraceState.from_header([header]).items())


class OtlpEncoder:
    """Encodes batches of spans of one resource and one instrumentation scope."""

    def __init__(
        self,
        resource_attributes: Mapping[str, object],
        resource_schema_url: str,
        scope_name: str,
        scope_version: str,
    ) -> None:
        # What precedes the spans of a batch, and what follows them, never changes.
        self._keys: dict[str, bytes] = {}
        self._attributes: dict[tuple[str, type, AttributeValue], bytes] = {}
        self._trace_states: dict[str, bytes] = {}
        resource = b"".join(
            _field(_RESOURCE_ATTRIBUTES, self._key_value(key, value))
            for key, value in resource_attributes.items()
        )
        self._resource = _field(_RESOURCE_SPANS_RESOURCE, resource)
        scope = _field(_SCOPE_NAME, scope_name.encode())
        if scope_version:
            scope += _field(_SCOPE_VERSION, scope_version.encode())
        self._scope = _field(_SCOPE_SPANS_SCOPE, scope)
        self._schema_url = (
            _field(_RESOURCE_SPANS_SCHEMA_URL, resource_schema_url.encode())
            if resource_schema_url
            else b""
        )

    def encode(self, spans: Iterable[SpanRecord]) -> bytes:
        """An ``ExportTraceServiceRequest`` with ``spans``."""
        scope_spans = b"".join([self._scope, *map(self._span, spans)])
        resource_spans = b"".join(
            (self._resource, _field(_RESOURCE_SPANS_SCOPE_SPANS, scope_spans), self._schema_url)
        )
        return _field(_REQUEST_RESOURCE_SPANS, resource_spans)

    def _key(self, key: str) -> bytes:
        encoded = self._keys.get(key)
        if encoded is None:
            # Attribute names are a small fixed set (the GenAI conventions' and the pool's).
            encoded = self._keys[key] = _field(_KEY, key.encode())
        return encoded

    def _key_value(self, key: str, value: object) -> bytes:
        return self._key(key) + _field(_VALUE, _any_value(value))

    def _span(self, span: SpanRecord) -> bytes:
        parts = [
            _SPAN_TRACE_ID,
            span.trace_id,
            _SPAN_SPAN_ID,
            span.span_id,
        ]
        if span.trace_state:
            state = self._trace_states.get(span.trace_state)
            if state is None:
                kept = _trace_state(span.trace_state)
                state = _field(_SPAN_TRACE_STATE, kept.encode()) if kept else b""
                if len(self._trace_states) > 1000:
                    self._trace_states.clear()  # callers' states vary: keep the recent ones
                self._trace_states[span.trace_state] = state
            parts.append(state)
        if span.parent_span_id:
            parts += (_SPAN_PARENT_SPAN_ID, span.parent_span_id)
        name = span.name.encode()
        parts += (
            _SPAN_NAME,
            _varint(len(name)),
            name,
            _SPAN_KIND,
            _SMALL_VARINTS[span.kind],
            _SPAN_START,
            _pack_u64(span.start_ns),
            _SPAN_END,
            _pack_u64(span.end_ns),
        )
        attributes = self._attributes
        for key, value in span.attributes:
            # Most values repeat from span to span (the operation, the model, the
            # tenant, small counts): their encoding is kept, keyed by type too (True,
            # 1 and 1.0 are one key to a dict, three encodings to OTLP).
            known = (key, type(value), value)
            encoded = attributes.get(known)
            if encoded is None:
                if len(attributes) >= _ATTRIBUTES_KEPT:
                    attributes.clear()  # ids and counts that never come back
                encoded = attributes[known] = _field(_SPAN_ATTRIBUTES, self._key_value(key, value))
            parts.append(encoded)
        for event_name, at in span.events:
            event = b"".join((_EVENT_TIME, _pack_u64(at), _field(_EVENT_NAME, event_name.encode())))
            parts.append(_field(_SPAN_EVENTS, event))
        if span.error is None:
            parts.append(_STATUS_UNSET)
        else:
            # An empty description is left out, as protobuf leaves out empty strings.
            message = _field(_STATUS_MESSAGE, span.error.encode()) if span.error else b""
            status = message + _STATUS_ERROR_CODE
            parts.append(_field(_SPAN_STATUS, status))
        parts.append(_FLAGS_REMOTE_PARENT if span.parent_is_remote else _FLAGS_LOCAL_PARENT)
        return _field(_SCOPE_SPANS_SPANS, b"".join(parts))
