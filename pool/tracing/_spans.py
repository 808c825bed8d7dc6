"""The spans of one request, recorded after the fact from the pool's own timers.

A request's path crosses tasks (its caller's, the replica's job), so nothing here
relies on an ambient "current span". The request span's ids are drawn when the pool
admits the request (its parent is the caller's ``traceparent``, passed in by the HTTP
layer); when the request ends, it and its children are recorded from the timestamps
the pool keeps anyway: the ticket's queue and dispatch times, the model's load end,
the replica job's start, first token and end (``perf_counter`` values, placed on the
wall clock through one reading taken at the start).

The request path makes plain :class:`SpanRecord` values only, and queues them
(``_export.py``): the OTLP encoding and the HTTP post happen on the exporter's thread,
so a slow or absent collector never holds a request up. OpenTelemetry's SDK is not on
the request path: its span objects cost several times the CPU budget of a traced
request (#29, benchmarks/tracing.py); the SDK still gives the resource (with
``OTEL_RESOURCE_ATTRIBUTES``) and the exporter's HTTP client (with its
``OTEL_EXPORTER_OTLP_*`` variables, retries and compression).

This module imports OpenTelemetry; only :func:`pool.tracing.open_tracing` imports it,
once tracing is on.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import trio
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource

from pool._version import __version__
from pool.actors import FIRST_TOKEN_EVENT, GENERATION_SPAN, LOAD_SPAN, QUEUE_SPAN, TaskRequest
from pool.errors import PoolError
from pool.tracing._context import (
    Sampler,
    format_traceparent,
    new_span_id,
    new_trace_id,
    parse_traceparent,
)
from pool.tracing._export import BatchExport, BatchSettings
from pool.tracing._incoming import INCOMING_TRACE
from pool.tracing._otlp import OtlpEncoder
from pool.tracing._record import (
    KIND_INTERNAL,
    KIND_SERVER,
    AttributeValue,
    SpanRecord,
)
from pool.tracing._target import TracingTarget

if TYPE_CHECKING:
    from pool.actors import Admission, ModelActor, PoolRequest

# The instrumentation scope of every span.
SCOPE_NAME = "llm-pool"


def _otlp_http_sender(exporter: OTLPSpanExporter) -> Callable[[bytes], bool]:
    """``send`` for :class:`BatchExport`: the body goes out through the SDK exporter's
    own HTTP client, so its endpoint, ``OTEL_EXPORTER_OTLP_*`` headers, timeout,
    compression, TLS files and retries apply as they did when it encoded the spans.

    The client is the exporter's private part (``opentelemetry-exporter-otlp-proto-http``
    has no public call for an encoded body); the version is pinned, and the tests
    export to a real OTLP/HTTP receiver through it."""
    client = exporter._client

    def send(body: bytes) -> bool:
        return bool(client.export(body).success)

    return send


class OtelTracing:
    """A :class:`pool.tracing.Tracing` that exports OpenTelemetry spans over OTLP/HTTP:
    its own sampler, queue and exporter thread (several pools in one process never
    share one); :meth:`shutdown` exports what is queued."""

    def __init__(
        self,
        target: TracingTarget,
        send: Callable[[bytes], bool] | None = None,
        batches: BatchSettings | None = None,
    ) -> None:
        """``send`` posts an encoded export (default: the SDK's OTLP/HTTP exporter to
        ``target.traces_url``); ``batches`` default to the ``OTEL_BSP_*`` variables."""
        self.target = target
        self.sampler = Sampler(target.sample_ratio)
        # Resource.create adds the SDK's telemetry.sdk.* attributes and those of
        # OTEL_RESOURCE_ATTRIBUTES, as the SDK's tracer provider did.
        resource = Resource.create(
            {"service.name": target.service_name, "service.version": __version__}
        )
        encoder = OtlpEncoder(resource.attributes, resource.schema_url, SCOPE_NAME, __version__)
        self._exporter: OTLPSpanExporter | None = None
        if send is None:
            self._exporter = OTLPSpanExporter(endpoint=target.traces_url)
            send = _otlp_http_sender(self._exporter)
        self.export = BatchExport(encoder.encode, send, batches or BatchSettings.from_environ())

    def request(
        self,
        request: PoolRequest,
        tenant: str,
        admitted_at: float,
    ) -> OtelRequestTrace:
        """Open the span of ``request``, admitted at ``admitted_at`` (``perf_counter``)."""
        incoming = INCOMING_TRACE.get()
        kind = KIND_INTERNAL  # an embedded caller's request
        parent = None
        if incoming is not None:
            kind = KIND_SERVER
            if incoming.traceparent is not None:
                # An invalid traceparent is ignored (a new trace), as the W3C spec asks.
                parent = parse_traceparent(incoming.traceparent)
        if parent is None:
            trace_id = new_trace_id()
            sampled = self.sampler.samples_new_trace(trace_id)
            trace = OtelRequestTrace(
                self, request, tenant, admitted_at, kind, trace_id, b"", sampled, None
            )
        else:
            # The caller decided whether its trace is recorded; its tracestate goes on.
            trace = OtelRequestTrace(
                self,
                request,
                tenant,
                admitted_at,
                kind,
                parent.trace_id,
                parent.span_id,
                parent.sampled,
                incoming.tracestate if incoming is not None else None,
            )
        if incoming is not None:
            incoming.answer = trace.traceparent
        return trace

    def shutdown(self) -> None:
        """Export what is queued and stop the exporter thread (blocking: run it in a
        worker thread; the exporter's own timeout bounds each post)."""
        self.export.shutdown()
        if self._exporter is not None:
            self._exporter.shutdown()  # type: ignore[no-untyped-call]  # the SDK's, unannotated


# GenAI's request attributes, from the decoding field the client asked.
_ASKED_ATTRIBUTES = (
    ("gen_ai.request.max_tokens", "max_tokens"),
    ("gen_ai.request.temperature", "temperature"),
    ("gen_ai.request.top_p", "top_p"),
    ("gen_ai.request.top_k", "top_k"),
)


def _request_attributes(request: PoolRequest, tenant: str) -> list[tuple[str, AttributeValue]]:
    """The request span's attributes known at admission (GenAI's names)."""
    if isinstance(request, TaskRequest):
        return [
            ("gen_ai.operation.name", request.job.operation),
            ("gen_ai.request.model", request.model),
            ("llm_pool.tenant", tenant),
        ]
    decoding = getattr(request, "decoding", None)
    if decoding is None:  # an embedding request has no decoding settings
        return [
            ("gen_ai.operation.name", "embeddings"),
            ("gen_ai.request.model", request.model),
            ("llm_pool.tenant", tenant),
        ]
    attributes: list[tuple[str, AttributeValue]] = [
        ("gen_ai.operation.name", "chat"),
        ("gen_ai.request.model", request.model),
        ("llm_pool.tenant", tenant),
    ]
    # What the client asked only (None: the pool's default applies, not an attribute).
    asked = decoding.asked
    for name, field in _ASKED_ATTRIBUTES:
        value = asked.get(field)
        if value is not None:
            attributes.append((name, value))
    return attributes


def _error_code(exc: BaseException) -> str:
    if isinstance(exc, PoolError):
        return exc.code
    if isinstance(exc, trio.Cancelled | GeneratorExit):
        return "cancelled"  # the caller left (a client that disconnected)
    return type(exc).__name__


class OtelRequestTrace:
    """A :class:`pool.tracing.RequestTrace`: the request span's ids from admission, and
    its spans recorded by :meth:`end` (see the module's docstring)."""

    __slots__ = (
        "_error",
        "_export",
        "_kind",
        "_parent_span_id",
        "_request",
        "_sampled",
        "_start",
        "_tenant",
        "_trace_state",
        "_wall_offset_ns",
        "actor",
        "admission",
        "relayed_to",
        "span_id",
        "trace_id",
        "traceparent",
    )

    def __init__(
        self,
        tracing: OtelTracing,
        request: PoolRequest,
        tenant: str,
        admitted_at: float,
        kind: int,
        trace_id: bytes,
        parent_span_id: bytes,
        sampled: bool,
        trace_state: str | None,
    ) -> None:
        self._export = tracing.export
        self._request = request
        self._tenant = tenant
        self._start = admitted_at
        self._kind = kind
        self.trace_id = trace_id
        self.span_id = new_span_id()
        self._parent_span_id = parent_span_id
        self._sampled = sampled
        self._trace_state = trace_state
        self.traceparent = format_traceparent(trace_id, self.span_id, sampled)
        # One reading of both clocks: every perf_counter stamp is placed from it.
        self._wall_offset_ns = time.time_ns() - int(time.perf_counter() * 1e9)
        self.admission: Admission | None = None
        self.actor: ModelActor | None = None
        self.relayed_to: str | None = None
        self._error: str | None = None

    def fail(self, exc: BaseException) -> None:
        """What ended the request before it finished (an error, a departed caller)."""
        if self._error is None:
            self._error = _error_code(exc)

    def _outcome(self) -> str | None:
        """None for a request that finished, else its error code."""
        admission = self.admission
        if admission is not None:
            if admission.succeeded:
                return None
            if admission.failed is not None:
                return admission.failed.code
        return self._error or "cancelled"

    def end(self) -> None:
        """Record the request's spans and queue them for export (the request is over)."""
        if not self._sampled:
            return  # not recorded: its traceparent went out with the flag unset
        now = time.perf_counter()
        error = self._outcome()
        request = self._request
        attributes = _request_attributes(request, self._tenant)
        spans: list[SpanRecord] = []
        admission = self.admission
        if admission is not None:
            attributes.append(("gen_ai.response.id", admission.id))
            attributes.append(("gen_ai.response.model", admission.model))
            _usage(admission, attributes)
            self._phases(admission, now, error, spans)
        if error is not None:
            attributes.append(("error.type", error))
        offset = self._wall_offset_ns
        spans.append(
            SpanRecord(
                f"{attributes[0][1]} {request.model}",  # GenAI's "{operation} {model}"
                self.trace_id,
                self.span_id,
                self._parent_span_id,
                bool(self._parent_span_id),  # a parent here is the caller's
                self._kind,
                offset + int(self._start * 1e9),
                offset + int(now * 1e9),
                tuple(attributes),
                (),
                error,
                self._trace_state,
            )
        )
        self._export.add(spans)

    def _phases(
        self, admission: Admission, now: float, error: str | None, spans: list[SpanRecord]
    ) -> None:
        ticket = admission.queued_ticket
        if ticket is None:
            return  # refused at the door (a timeout while another model made way)
        dispatched = ticket.dispatched_at
        waited_until = now if dispatched is None else dispatched
        # A request that never left the queue ended there: its error is the queue's.
        queue_error = error if dispatched is None else None
        if ticket.waited:
            # One that found a free replica on arrival has no queue span: a span of a
            # few microseconds says nothing, and each costs CPU (benchmarks/tracing.py).
            spans.append(self._child(QUEUE_SPAN, ticket.enqueued_at, waited_until, queue_error))
        if ticket.waits_for_load:
            ready_at = self.actor.ready_at if self.actor is not None else None
            loaded = ready_at is not None and ticket.enqueued_at <= ready_at <= waited_until
            spans.append(
                self._child(
                    LOAD_SPAN,
                    ticket.enqueued_at,
                    ready_at if loaded and ready_at is not None else waited_until,
                    None if loaded else queue_error,
                )
            )
        started = ticket.started_at
        if started is None:
            return
        job = admission.job
        ended = job.finished_at if job is not None else now
        attributes: tuple[tuple[str, AttributeValue], ...] = ()
        if ticket.replica is not None:
            attributes = (("llm_pool.replica", ticket.replica),)
        if self.relayed_to is not None:
            attributes += (("llm_pool.relayed_to", self.relayed_to),)
        # A generation's path through the relay: the upstream's bytes or rendered again.
        stats = getattr(job, "stats", None)
        if isinstance(relay_path := getattr(stats, "relay_path", None), str):
            attributes += (("llm_pool.relay_path", relay_path),)
        events: tuple[tuple[str, int], ...] = ()
        first_ms = getattr(job, "time_to_first_token_ms", None)
        if first_ms is not None:
            at = self._wall_offset_ns + int((started + first_ms / 1000) * 1e9)
            events = ((FIRST_TOKEN_EVENT, at),)
        spans.append(self._child(GENERATION_SPAN, started, ended, error, attributes, events))

    def _child(
        self,
        name: str,
        start: float,
        end: float,
        error: str | None,
        attributes: tuple[tuple[str, AttributeValue], ...] = (),
        events: tuple[tuple[str, int], ...] = (),
    ) -> SpanRecord:
        offset = self._wall_offset_ns
        return SpanRecord(
            name,
            self.trace_id,
            new_span_id(),
            self.span_id,
            False,
            KIND_INTERNAL,
            offset + int(start * 1e9),
            offset + int(end * 1e9),
            attributes,
            events,
            error,
            self._trace_state,
        )


def _usage(admission: Admission, attributes: list[tuple[str, AttributeValue]]) -> None:
    """The request span's attributes of what the request produced."""
    done = admission.finished
    if done is not None:
        attributes.append(("gen_ai.response.finish_reasons", (done.finish_reason,)))
        usage = done.usage
    elif admission.embedding is not None:
        usage = admission.embedding.usage
    elif admission.completed is not None:
        usage = admission.completed.usage
    else:
        return
    if usage.prompt_tokens is not None:
        attributes.append(("gen_ai.usage.input_tokens", usage.prompt_tokens))
    if usage.output_tokens is not None:
        attributes.append(("gen_ai.usage.output_tokens", usage.output_tokens))
    if usage.cached_tokens is not None:
        attributes.append(("llm_pool.usage.cached_tokens", usage.cached_tokens))
