"""The OTLP encoding of span records, against the OpenTelemetry SDK's encoder.

pool/tracing/_otlp.py writes the protobuf wire format itself; for the same spans (built
here as the SDK's ``ReadableSpan``) it must give what the SDK's encoder gives: the same
message once decoded with the opentelemetry-proto classes, and the same bytes.
"""

from __future__ import annotations

from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import Event, ReadableSpan
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import (
    SpanContext,
    SpanKind,
    Status,
    StatusCode,
    TraceFlags,
    TraceState,
)

from pool.tracing._otlp import _ATTRIBUTES_KEPT, OtlpEncoder
from pool.tracing._record import KIND_INTERNAL, KIND_SERVER, Attributes, SpanRecord

RESOURCE = Resource.create({"service.name": "pool-a", "service.version": "9.9.9"})
SCOPE = InstrumentationScope("llm-pool", "9.9.9")
TRACE_ID = bytes.fromhex("4bf92f3577b34da6a3ce929d0e0e4736")
CALLER = bytes.fromhex("00f067aa0ba902b7")
T0 = 1_795_712_607_410_790_000

REQUEST_ATTRIBUTES: Attributes = (
    ("gen_ai.operation.name", "chat"),
    ("gen_ai.request.model", "qwen-7b"),
    ("llm_pool.tenant", "équipe-a"),  # not ASCII
    ("gen_ai.request.max_tokens", 16),
    ("gen_ai.request.temperature", 0.5),
    ("gen_ai.request.top_k", 0),
    ("gen_ai.response.id", "resp_" + "x" * 200),  # a length over one varint byte
    ("gen_ai.response.finish_reasons", ("stop", "length")),
    ("gen_ai.usage.input_tokens", 70_000),
    ("llm_pool.negative", -3),
    ("llm_pool.flag", True),
    ("llm_pool.other_flag", False),
    ("llm_pool.one", 1),  # True, 1 and 1.0 are one dict key: three encodings
    ("llm_pool.one_float", 1.0),
    ("llm_pool.empty", ""),
    ("llm_pool.no_reasons", ()),
)


def _span_id(n: int) -> bytes:
    return n.to_bytes(8, "big")


def _record(**fields: object) -> SpanRecord:
    base: dict[str, object] = {
        "name": "chat qwen-7b",
        "trace_id": TRACE_ID,
        "span_id": _span_id(0x1234),
        "parent_span_id": b"",
        "parent_is_remote": False,
        "kind": KIND_SERVER,
        "start_ns": T0,
        "end_ns": T0 + 1_500_000,
        "attributes": REQUEST_ATTRIBUTES,
        "events": (),
        "error": None,
        "trace_state": None,
    }
    return SpanRecord(**{**base, **fields})  # type: ignore[arg-type]


SPANS = [
    # A request span whose caller sent traceparent and tracestate.
    _record(parent_span_id=CALLER, parent_is_remote=True, trace_state="vendor=1, other=x"),
    # Its generation: a local parent, an event, the caller's state inherited.
    _record(
        name="llm_pool.generation",
        span_id=_span_id(0x5678),
        parent_span_id=_span_id(0x1234),
        kind=KIND_INTERNAL,
        attributes=(("llm_pool.replica", 0), ("llm_pool.relayed_to", "node-b")),
        events=(("llm_pool.first_token", T0 + 200_000),),
        trace_state="vendor=1, other=x",
    ),
    # A root span that failed, with a malformed tracestate (the SDK keeps nothing).
    _record(
        span_id=_span_id(0x9ABC),
        trace_id=(7).to_bytes(16, "big"),
        error="queue_timeout",
        trace_state="no equals sign",
    ),
    _record(span_id=b"\xff" * 8, trace_id=b"\xff" * 16, attributes=(), error=""),
]


def _sdk_span(record: SpanRecord) -> ReadableSpan:
    state = TraceState.from_header([record.trace_state]) if record.trace_state else None
    trace_id = int.from_bytes(record.trace_id, "big")
    span_id = int.from_bytes(record.span_id, "big")
    context = SpanContext(trace_id, span_id, False, TraceFlags(1), state)
    parent = (
        SpanContext(trace_id, int.from_bytes(record.parent_span_id, "big"), record.parent_is_remote)
        if record.parent_span_id
        else None
    )
    return ReadableSpan(
        record.name,
        context=context,
        parent=parent,
        resource=RESOURCE,
        attributes=dict(record.attributes),
        events=[Event(name, timestamp=at) for name, at in record.events],
        kind=SpanKind.SERVER if record.kind == KIND_SERVER else SpanKind.INTERNAL,
        status=Status(StatusCode.UNSET)
        if record.error is None
        else Status(StatusCode.ERROR, record.error),
        start_time=record.start_ns,
        end_time=record.end_ns,
        instrumentation_scope=SCOPE,
    )


def _encoder() -> OtlpEncoder:
    return OtlpEncoder(RESOURCE.attributes, RESOURCE.schema_url, SCOPE.name, SCOPE.version or "")


def test_a_batch_encodes_as_the_sdk_encodes_it() -> None:
    ours = _encoder().encode(SPANS)
    theirs = encode_spans([_sdk_span(s) for s in SPANS])
    assert ExportTraceServiceRequest.FromString(ours) == theirs
    assert ours == theirs.SerializeToString()


def test_what_a_collector_decodes() -> None:
    (resource_spans,) = ExportTraceServiceRequest.FromString(
        _encoder().encode(SPANS)
    ).resource_spans
    resource = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
    assert resource["service.name"] == "pool-a"
    assert resource["telemetry.sdk.name"] == "opentelemetry"
    (scope_spans,) = resource_spans.scope_spans
    assert (scope_spans.scope.name, scope_spans.scope.version) == ("llm-pool", "9.9.9")
    request, generation, failed, extreme = scope_spans.spans
    assert (request.trace_id, request.parent_span_id) == (TRACE_ID, CALLER)
    assert request.trace_state == "vendor=1,other=x"
    assert generation.parent_span_id == request.span_id
    assert [(e.name, e.time_unix_nano) for e in generation.events] == [
        ("llm_pool.first_token", T0 + 200_000)
    ]
    values = {a.key: a.value for a in request.attributes}
    assert values["llm_pool.flag"].bool_value is True
    assert values["llm_pool.one"].int_value == 1
    assert values["llm_pool.one_float"].double_value == 1.0
    assert values["gen_ai.usage.input_tokens"].int_value == 70_000
    assert values["llm_pool.negative"].int_value == -3
    assert values["llm_pool.tenant"].string_value == "équipe-a"
    assert [
        v.string_value for v in values["gen_ai.response.finish_reasons"].array_value.values
    ] == [
        "stop",
        "length",
    ]
    assert (failed.status.code, failed.status.message, failed.trace_state) == (
        2,
        "queue_timeout",
        "",
    )
    assert failed.parent_span_id == b""
    assert extreme.span_id == b"\xff" * 8 and extreme.trace_id == b"\xff" * 16


def test_kept_encodings_never_mix_values_up() -> None:
    # The encoder keeps each attribute's bytes; a later span with other values (and
    # values equal to a dict but of another type) must still get its own.
    encoder = _encoder()
    encoder.encode(SPANS)
    swapped = (("llm_pool.one", True), ("llm_pool.flag", 1), ("gen_ai.request.max_tokens", 17))
    again = [_record(attributes=swapped)]
    assert encoder.encode(again) == encode_spans([_sdk_span(s) for s in again]).SerializeToString()


def test_many_distinct_values_are_not_all_kept() -> None:
    encoder = _encoder()
    for n in range(10_000):
        encoder.encode([_record(attributes=(("gen_ai.response.id", f"resp_{n}"),))])
    assert len(encoder._attributes) <= _ATTRIBUTES_KEPT
