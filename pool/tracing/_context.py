"""W3C trace context: reading a caller's ``traceparent``, new ids, the sampling decision.

The rules are those of OpenTelemetry's SDK, which the pool used to call for each
request (``TraceContextTextMapPropagator``, ``RandomIdGenerator``,
``ParentBased(TraceIdRatioBased(ratio))``): kept here as plain functions because
the SDK's objects cost more CPU a request than the issue's bar allows (#29,
benchmarks/tracing.py). tests/tracing/test_context.py holds them to the SDK's answers.
Nothing here imports OpenTelemetry. Ids are bytes, as OTLP carries them (16 for a
trace, 8 for a span); a header carries their hex.
"""

from __future__ import annotations

import random
import re
from typing import NamedTuple

# Version, trace id, parent id, flags; a later version may append fields ("-..."), which
# version 00 may not (W3C Trace Context, section 3.2; the SDK's expression).
_TRACEPARENT = re.compile(
    r"^[ \t]*([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(?:(-.*)|[ \t]*)$"
)
# Longer headers are ignored unread, as the SDK does.
_TRACEPARENT_MAX_LENGTH = 512

SAMPLED_FLAG = 0x01

# TraceIdRatioBased decides on the low 64 bits of the trace id.
_TRACE_ID_LOW_BITS = (1 << 64) - 1

# Random bits, as the SDK's RandomIdGenerator draws them (Mersenne Twister:
# unpredictable enough to keep traces apart, no system call per request).
_random_bytes = random.randbytes
_ZERO_TRACE_ID = bytes(16)
_ZERO_SPAN_ID = bytes(8)
_ZERO_TRACE_HEX = "0" * 32
_ZERO_SPAN_HEX = "0" * 16


class RemoteParent(NamedTuple):
    """The caller's span, read from its ``traceparent``."""

    trace_id: bytes
    span_id: bytes
    sampled: bool


def parse_traceparent(header: str) -> RemoteParent | None:
    """The span a ``traceparent`` names; None for a malformed or invalid one (a request
    with one starts a new trace: W3C Trace Context says to ignore it, never refuse)."""
    if len(header) > _TRACEPARENT_MAX_LENGTH:
        return None
    match = _TRACEPARENT.match(header)
    if match is None:
        return None
    version, trace_hex, span_hex, flags_hex, extra = match.groups()
    if version == "ff" or (version == "00" and extra):
        return None
    if trace_hex == _ZERO_TRACE_HEX or span_hex == _ZERO_SPAN_HEX:
        return None
    sampled = bool(int(flags_hex, 16) & SAMPLED_FLAG)
    return RemoteParent(bytes.fromhex(trace_hex), bytes.fromhex(span_hex), sampled)


def format_traceparent(trace_id: bytes, span_id: bytes, sampled: bool) -> str:
    """The ``traceparent`` of a span of this pool (version 00)."""
    return "00-" + trace_id.hex() + "-" + span_id.hex() + ("-01" if sampled else "-00")


def new_trace_id() -> bytes:
    """A random, valid (not all zero) trace id."""
    trace_id = _random_bytes(16)
    while trace_id == _ZERO_TRACE_ID:
        trace_id = _random_bytes(16)
    return trace_id


def new_span_id() -> bytes:
    """A random, valid (not all zero) span id."""
    span_id = _random_bytes(8)
    while span_id == _ZERO_SPAN_ID:
        span_id = _random_bytes(8)
    return span_id


class Sampler:
    """``ParentBased(TraceIdRatioBased(ratio))``: a request with a valid ``traceparent``
    follows its caller's decision; a new trace is recorded when the low 64 bits of its
    id fall under ``ratio`` of their range (the same trace id gets the same answer on
    every node that samples at the same ratio)."""

    __slots__ = ("bound", "ratio")

    def __init__(self, ratio: float) -> None:
        self.ratio = ratio
        self.bound = round(ratio * (_TRACE_ID_LOW_BITS + 1))

    def samples_new_trace(self, trace_id: bytes) -> bool:
        # The low 64 bits of the id as a number are its last 8 bytes.
        return int.from_bytes(trace_id[8:], "big") < self.bound
