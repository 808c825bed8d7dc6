"""OpenTelemetry traces of the pool's requests (docs/operations.md, "Tracing").

Optional: the OpenTelemetry packages (the ``tracing`` extra) are imported only when
tracing is on; otherwise the pool pays one ``None`` check per request.
"""

from pool.actors import (
    FIRST_TOKEN_EVENT,
    GENERATION_SPAN,
    LOAD_SPAN,
    QUEUE_SPAN,
    RequestTrace,
    Tracing,
)
from pool.tracing._incoming import (
    INCOMING_TRACE,
    TRACEPARENT,
    TRACESTATE,
    IncomingTrace,
    answering_with_trace,
    incoming_trace,
)
from pool.tracing._setup import INSTALL_HINT, open_tracing, tracing_target
from pool.tracing._target import TracingTarget

__all__ = [
    "FIRST_TOKEN_EVENT",
    "GENERATION_SPAN",
    "INCOMING_TRACE",
    "INSTALL_HINT",
    "LOAD_SPAN",
    "QUEUE_SPAN",
    "TRACEPARENT",
    "TRACESTATE",
    "IncomingTrace",
    "RequestTrace",
    "Tracing",
    "TracingTarget",
    "answering_with_trace",
    "incoming_trace",
    "open_tracing",
    "tracing_target",
]
