"""The trace context an HTTP request arrives with, and the header its answer carries.

The request pipeline (pool/http/_pipeline.py, in front of every route) sets :data:`INCOMING_TRACE`
for each request and WebSocket handshake while the pool traces; the pool's admission
reads it in the same task (the handler's, or a task it spawned, which inherits it) to
make the request span a child of the caller's ``traceparent``, and leaves the span's
own ``traceparent`` in it for the response header. Nothing else crosses a task
boundary through the context: the actors get the span's ``traceparent`` on the request.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

# W3C Trace Context: the caller's span (and vendor state) in, the request span out.
TRACEPARENT = "traceparent"
TRACESTATE = "tracestate"

Send = Callable[[Any], Awaitable[None]]


@dataclass(slots=True)
class IncomingTrace:
    """A request's W3C headers as sent (None where absent), and the ``traceparent`` of
    the span the pool made for it (``answer``: None until a request was admitted)."""

    traceparent: str | None
    tracestate: str | None
    answer: str | None = None


INCOMING_TRACE: ContextVar[IncomingTrace | None] = ContextVar(
    "llm_pool_incoming_trace", default=None
)


def incoming_trace(headers: Iterable[tuple[bytes, bytes]]) -> IncomingTrace:
    """The trace headers of an ASGI scope's ``headers`` (names in lower case)."""
    parent: str | None = None
    states: list[str] = []
    for name, value in headers:
        if name == b"traceparent" and parent is None:
            parent = value.decode("latin-1")
        elif name == b"tracestate":
            # Several tracestate headers are one list (W3C Trace Context, section 3.3.1).
            states.append(value.decode("latin-1"))
    return IncomingTrace(parent, ",".join(states) or None)


def answering_with_trace(send: Send, incoming: IncomingTrace) -> Send:
    """``send`` that adds ``traceparent`` (the request span's) to the response head,
    where the request was admitted before its head went out."""

    async def send_traced(message: Any) -> None:
        if message["type"] == "http.response.start" and incoming.answer is not None:
            head = [*message.get("headers", ()), (b"traceparent", incoming.answer.encode())]
            message = {**message, "headers": head}
        await send(message)

    return send_traced
