"""The spans of one request, recorded after the fact from the pool's own timers.

A request's path crosses tasks (its caller's, the replica's job), and OpenTelemetry's
current-span context lives in contextvars that a Trio task copies only when it is
spawned: a span opened in one task would not be "current" in the other. So nothing
here relies on that context. The request span is opened by the caller's task when the
pool admits the request (its parent is the caller's ``traceparent``, passed in by the
HTTP layer, never ambient state), and when the request ends the children are built
from the timestamps the pool keeps anyway: the ticket's queue and dispatch times, the
model's load end, the replica job's start, first token and end (``perf_counter``
values, placed on the wall clock through one reading taken at the start).

Spans leave through the SDK's ``BatchSpanProcessor``: ending a span appends it to a
bounded in-memory queue, and the export (OTLP over HTTP/protobuf) happens on the
processor's own thread, so a slow or absent collector never holds a request up (a
full queue drops spans, as the SDK documents).

This module imports OpenTelemetry; only :func:`pool.tracing.open_tracing` imports it,
once tracing is on.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import trio
from opentelemetry.context import Context
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from opentelemetry.trace import Span, SpanKind, Status, StatusCode, set_span_in_context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from opentelemetry.util.types import AttributeValue

from pool._version import __version__
from pool.actors import FIRST_TOKEN_EVENT, GENERATION_SPAN, LOAD_SPAN, QUEUE_SPAN
from pool.errors import PoolError
from pool.tracing._incoming import INCOMING_TRACE, TRACEPARENT, TRACESTATE
from pool.tracing._target import TracingTarget

if TYPE_CHECKING:
    from pool.actors import Admission, EmbeddingRequest, InferenceRequest, ModelActor


class _PoolResource(Resource):
    """The pool's resource, hashed once.

    The OTLP encoder groups every exported span by its resource, a dict lookup per
    span, and the SDK's ``Resource.__hash__`` JSON-encodes all the attributes each
    time (about a tenth of the exporter thread's CPU, benchmarks/tracing.py). A
    resource never changes once made, so its hash is kept."""

    def __init__(self, resource: Resource) -> None:
        super().__init__(resource.attributes, resource.schema_url)
        self._hash = super().__hash__()

    def __hash__(self) -> int:
        return self._hash


class OtelTracing:
    """A :class:`pool.tracing.Tracing` on the OpenTelemetry SDK: its own provider
    (several pools in one process never share one), sampling, and the batch exporter;
    :meth:`shutdown` flushes what is queued."""

    def __init__(self, target: TracingTarget) -> None:
        self.target = target
        resource = _PoolResource(
            Resource.create({"service.name": target.service_name, "service.version": __version__})
        )
        self._provider = TracerProvider(
            resource=resource, sampler=ParentBased(TraceIdRatioBased(target.sample_ratio))
        )
        self._provider.add_span_processor(
            BatchSpanProcessor(OTLPSpanExporter(endpoint=target.traces_url))
        )
        self.tracer = self._provider.get_tracer("llm-pool", __version__)
        self._propagator = TraceContextTextMapPropagator()

    def request(
        self, request: InferenceRequest | EmbeddingRequest, tenant: str, admitted_at: float
    ) -> OtelRequestTrace:
        """Open the span of ``request``, admitted at ``admitted_at`` (``perf_counter``)."""
        incoming = INCOMING_TRACE.get()
        parent: Context | None = None
        kind = SpanKind.INTERNAL  # an embedded caller's request
        if incoming is not None:
            kind = SpanKind.SERVER
            if incoming.traceparent is not None:
                carrier = {TRACEPARENT: incoming.traceparent}
                if incoming.tracestate is not None:
                    carrier[TRACESTATE] = incoming.tracestate
                # An invalid traceparent is ignored (a new trace), as the W3C spec asks.
                parent = self._propagator.extract(carrier)
        trace = OtelRequestTrace(self, request, tenant, admitted_at, parent, kind)
        if incoming is not None:
            incoming.answer = trace.traceparent
        return trace

    def shutdown(self) -> None:
        """Export what is queued and stop the exporter thread (blocking: run it in a
        worker thread; the exporter's own timeout bounds it)."""
        self._provider.shutdown()


def _operation(request: InferenceRequest | EmbeddingRequest) -> str:
    # GenAI's operation names: an embedding request has no decoding settings.
    return "chat" if hasattr(request, "decoding") else "embeddings"


def _request_attributes(
    request: InferenceRequest | EmbeddingRequest, operation: str, tenant: str
) -> dict[str, AttributeValue]:
    attributes: dict[str, AttributeValue] = {
        "gen_ai.operation.name": operation,
        "gen_ai.request.model": request.model,
        "llm_pool.tenant": tenant,
    }
    decoding = getattr(request, "decoding", None)
    if decoding is None:
        return attributes
    # What the client asked for (None: the pool's default applies, not an attribute).
    asked = decoding.asked
    for name, field in (
        ("gen_ai.request.max_tokens", "max_tokens"),
        ("gen_ai.request.temperature", "temperature"),
        ("gen_ai.request.top_p", "top_p"),
        ("gen_ai.request.top_k", "top_k"),
    ):
        value = asked.get(field)
        if value is not None:
            attributes[name] = value
    return attributes


def _error_code(exc: BaseException) -> str:
    if isinstance(exc, PoolError):
        return exc.code
    if isinstance(exc, trio.Cancelled | GeneratorExit):
        return "cancelled"  # the caller left (a client that disconnected)
    return type(exc).__name__


class OtelRequestTrace:
    """A :class:`pool.tracing.RequestTrace`: the request span, open from admission, and
    its phases, recorded by :meth:`end` (see the module's docstring)."""

    __slots__ = (
        "_error",
        "_perf0",
        "_tracer",
        "_wall0",
        "actor",
        "admission",
        "relayed_to",
        "span",
        "traceparent",
    )

    def __init__(
        self,
        tracing: OtelTracing,
        request: InferenceRequest | EmbeddingRequest,
        tenant: str,
        admitted_at: float,
        parent: Context | None,
        kind: SpanKind,
    ) -> None:
        self._tracer = tracing.tracer
        # One reading of both clocks: every perf_counter stamp is placed from it.
        self._wall0 = time.time_ns()
        self._perf0 = time.perf_counter()
        operation = _operation(request)
        self.span: Span = self._tracer.start_span(
            f"{operation} {request.model}",
            context=parent,
            kind=kind,
            attributes=_request_attributes(request, operation, tenant),
            start_time=self._ns(admitted_at),
        )
        context = self.span.get_span_context()
        self.traceparent = (
            f"00-{context.trace_id:032x}-{context.span_id:016x}-{context.trace_flags:02x}"
        )
        self.admission: Admission | None = None
        self.actor: ModelActor | None = None
        self.relayed_to: str | None = None
        self._error: str | None = None

    def _ns(self, stamp: float) -> int:
        return self._wall0 + int((stamp - self._perf0) * 1e9)

    def fail(self, exc: BaseException) -> None:
        """What ended the request before it finished (an error, a departed caller)."""
        if self._error is None:
            self._error = _error_code(exc)

    def _outcome(self) -> str | None:
        """None for a request that finished, else its error code."""
        admission = self.admission
        if admission is not None:
            if admission.finished is not None or admission.embedding is not None:
                return None
            if admission.failed is not None:
                return admission.failed.code
        return self._error or "cancelled"

    def end(self) -> None:
        """Record the phases and end the request span (the request is over)."""
        span = self.span
        now = time.perf_counter()
        error = self._outcome()
        attributes: dict[str, AttributeValue] = {}
        admission = self.admission
        if admission is not None and span.is_recording():
            attributes["gen_ai.response.id"] = admission.id
            attributes["gen_ai.response.model"] = admission.model
            self._phases(admission, now, error)
            self._usage(admission, attributes)
        if error is not None:
            attributes["error.type"] = error
            span.set_status(Status(StatusCode.ERROR, error))
        span.set_attributes(attributes)
        span.end(end_time=self._ns(now))

    def _usage(self, admission: Admission, attributes: dict[str, AttributeValue]) -> None:
        done = admission.finished
        usage = done.usage if done is not None else None
        if done is not None:
            attributes["gen_ai.response.finish_reasons"] = (done.finish_reason,)
        elif admission.embedding is not None:
            usage = admission.embedding.usage
        if usage is None:
            return
        for name, value in (
            ("gen_ai.usage.input_tokens", usage.prompt_tokens),
            ("gen_ai.usage.output_tokens", usage.output_tokens),
            ("llm_pool.usage.cached_tokens", usage.cached_tokens),
        ):
            if value is not None:
                attributes[name] = value

    def _phases(self, admission: Admission, now: float, error: str | None) -> None:
        ticket = admission.queued_ticket
        if ticket is None:
            return  # refused at the door (a timeout while another model made way)
        parent = set_span_in_context(self.span)
        dispatched = ticket.dispatched_at
        waited_until = now if dispatched is None else dispatched
        # A request that never left the queue ended there: its error is the queue's.
        queue_error = error if dispatched is None else None
        if ticket.waited:
            # One that found a free replica on arrival has no queue span: a span of a
            # few microseconds says nothing, and each costs CPU (benchmarks/tracing.py).
            self._phase(QUEUE_SPAN, parent, ticket.enqueued_at, waited_until, queue_error)
        if ticket.waits_for_load:
            ready_at = self.actor.ready_at if self.actor is not None else None
            loaded = ready_at is not None and ticket.enqueued_at <= ready_at <= waited_until
            self._phase(
                LOAD_SPAN,
                parent,
                ticket.enqueued_at,
                ready_at if loaded and ready_at is not None else waited_until,
                None if loaded else queue_error,
            )
        started = ticket.started_at
        if started is None:
            return
        job = admission.job
        ended = job.finished_at if job is not None else now
        # Attributes given at the start, not set one by one: each set takes the span's lock.
        attributes: dict[str, AttributeValue] = {}
        if ticket.replica is not None:
            attributes["llm_pool.replica"] = ticket.replica
        if self.relayed_to is not None:
            attributes["llm_pool.relayed_to"] = self.relayed_to
        generation = self._tracer.start_span(
            GENERATION_SPAN, context=parent, attributes=attributes, start_time=self._ns(started)
        )
        first_ms = getattr(job, "time_to_first_token_ms", None)
        if first_ms is not None:
            generation.add_event(FIRST_TOKEN_EVENT, timestamp=self._ns(started + first_ms / 1000))
        if error is not None:
            generation.set_status(Status(StatusCode.ERROR, error))
        generation.end(end_time=self._ns(ended))

    def _phase(
        self, name: str, parent: Context, start: float, end: float, error: str | None
    ) -> None:
        span = self._tracer.start_span(name, context=parent, start_time=self._ns(start))
        if error is not None:
            span.set_status(Status(StatusCode.ERROR, error))
        span.end(end_time=self._ns(end))
