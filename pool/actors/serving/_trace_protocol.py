"""What the pool sees of tracing: two protocols and the names of the spans.

The pool holds a :class:`Tracing` only where tracing is on, handed to it by whoever opens
it (``pool.open_pool`` and ``serve`` open it from the settings with
``pool.tracing.open_tracing``); the implementation (pool/tracing/_spans.py) imports
OpenTelemetry and reads the admissions, so it sits above the actors, never below.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from pool.actors.models._model import ModelActor
    from pool.actors.serving._admission import Admission
    from pool.actors.serving._request import PoolRequest

# The children of a request span, and the event of its first token (the request span
# itself is "{operation} {model}", as the GenAI semantic conventions name it).
QUEUE_SPAN = "llm_pool.queue_wait"
LOAD_SPAN = "llm_pool.load_wait"
GENERATION_SPAN = "llm_pool.generation"
FIRST_TOKEN_EVENT = "llm_pool.first_token"


class RequestTrace(Protocol):
    """The spans of one admitted request, open from its admission to :meth:`end`.

    The pool sets :attr:`admission` (and :attr:`actor` or :attr:`relayed_to`) as it
    learns them, calls :meth:`fail` with what ended the request early, and sends
    :attr:`traceparent` (the request span's) upstream.
    """

    traceparent: str
    admission: Admission | None
    actor: ModelActor | None
    relayed_to: str | None

    def fail(self, exc: BaseException) -> None: ...

    def end(self) -> None: ...


class Tracing(Protocol):
    """The pool's tracer: a :class:`RequestTrace` per request, flushed at shutdown."""

    def request(
        self,
        request: PoolRequest,
        tenant: str,
        admitted_at: float,
    ) -> RequestTrace:
        """Open the span of ``request``, admitted at ``admitted_at`` (``perf_counter``)."""
        ...

    def shutdown(self) -> None:
        """Export what is queued and stop (blocking: run it in a worker thread)."""
        ...
