"""The W3C trace context and the sampling decision, held to OpenTelemetry SDK's answers.

pool/tracing/_context.py does what the SDK's propagator, id generator and
``ParentBased(TraceIdRatioBased)`` sampler did for each request, on plain ints; these
tests ask the SDK the same questions and compare.
"""

from __future__ import annotations

import random
import re

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace.sampling import Decision, TraceIdRatioBased
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from pool.tracing import _context
from pool.tracing._context import (
    RemoteParent,
    Sampler,
    format_traceparent,
    new_span_id,
    new_trace_id,
    parse_traceparent,
)

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
SPAN = "00f067aa0ba902b7"

HEADERS = [
    f"00-{TRACE}-{SPAN}-01",
    f"00-{TRACE}-{SPAN}-00",
    f"00-{TRACE}-{SPAN}-03",  # sampled, and a flag this version does not know
    f" \t00-{TRACE}-{SPAN}-01 \t",  # whitespace around is allowed
    f"01-{TRACE}-{SPAN}-01-whatever-follows",  # a later version may add fields
    f"00-{TRACE}-{SPAN}-01-extra",  # version 00 may not
    f"ff-{TRACE}-{SPAN}-01",  # version ff is invalid
    f"00-{'0' * 32}-{SPAN}-01",  # an all-zero trace id
    f"00-{TRACE}-{'0' * 16}-01",  # an all-zero span id
    f"00-{TRACE.upper()}-{SPAN}-01",  # upper-case hex
    f"00-{TRACE[:-1]}-{SPAN}-01",
    "00-xyz-01",
    "",
    f"00-{TRACE}-{SPAN}-01-" + "x" * 600,  # longer than the SDK reads
]


def _sdk_parent(header: str) -> RemoteParent | None:
    context = TraceContextTextMapPropagator().extract({"traceparent": header})
    span = trace.get_current_span(context).get_span_context()
    if not span.is_valid:
        return None
    return RemoteParent(
        span.trace_id.to_bytes(16, "big"), span.span_id.to_bytes(8, "big"), span.trace_flags.sampled
    )


@pytest.mark.parametrize("header", HEADERS)
def test_traceparent_is_read_as_the_sdk_reads_it(header: str) -> None:
    assert parse_traceparent(header) == _sdk_parent(header)


def test_a_valid_traceparent_names_the_callers_span() -> None:
    assert parse_traceparent(f"00-{TRACE}-{SPAN}-01") == RemoteParent(
        bytes.fromhex(TRACE), bytes.fromhex(SPAN), True
    )
    unsampled = parse_traceparent(f"00-{TRACE}-{SPAN}-00")
    assert unsampled is not None and not unsampled.sampled


def test_new_ids_are_valid_and_format_as_w3c() -> None:
    trace_ids = {new_trace_id() for _ in range(200)}
    span_ids = {new_span_id() for _ in range(200)}
    assert len(trace_ids) == len(span_ids) == 200
    assert all(len(t) == 16 and any(t) for t in trace_ids)
    assert all(len(s) == 8 and any(s) for s in span_ids)
    header = format_traceparent(next(iter(trace_ids)), next(iter(span_ids)), True)
    assert re.fullmatch(r"00-[0-9a-f]{32}-[0-9a-f]{16}-01", header)
    one, two = (1).to_bytes(16, "big"), (2).to_bytes(8, "big")
    assert format_traceparent(one, two, False) == f"00-{1:032x}-{2:016x}-00"
    # What the pool sends is what it (and the SDK) reads back.
    parent = parse_traceparent(header)
    assert parent is not None and parent == _sdk_parent(header)


def test_a_zero_draw_is_drawn_again(monkeypatch: pytest.MonkeyPatch) -> None:
    draws = iter([bytes(16), bytes(16), b"\x05" * 16, bytes(8), b"\x07" * 8])
    monkeypatch.setattr(_context, "_random_bytes", lambda size: next(draws))
    assert new_trace_id() == b"\x05" * 16
    assert new_span_id() == b"\x07" * 8


@pytest.mark.parametrize("ratio", [0.0, 0.001, 0.1, 0.5, 0.999, 1.0])
def test_new_traces_are_sampled_as_the_sdk_samples_them(ratio: float) -> None:
    sdk = TraceIdRatioBased(ratio)
    ours = Sampler(ratio)
    assert ours.bound == sdk.bound
    draw = random.Random(29)
    low = [draw.getrandbits(128) for _ in range(2000)]
    # Trace ids right at the bound, where a rounding difference would show.
    edge = [ours.bound - 1, ours.bound, ours.bound + 1, (7 << 64) | ours.bound]
    for trace_id in [*low, *(t for t in edge if t > 0)]:
        expected = sdk.should_sample(None, trace_id, "x").decision is Decision.RECORD_AND_SAMPLE
        assert ours.samples_new_trace(trace_id.to_bytes(16, "big")) == expected, trace_id
