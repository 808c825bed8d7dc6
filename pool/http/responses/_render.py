"""Replies of ``/v1/responses`` in the pool's own shapes: the envelope, the events (as
SSE and as WebSocket frames) and errors (``ERRORS``, the pool's error shape).

The events are OpenAI's Responses names where one exists (``response.created``,
``response.output_text.delta``, ``response.function_call_arguments.*``,
``response.completed``) plus the pool's own (``response.queued``,
``response.loading``, ``response.metrics``). :class:`ResponseEvents` builds them as
objects; the SSE encoding and the ``function_call`` items are the ones OpenAI's Responses
API uses too (pool/http/_responses_core.py).
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

from quart import Response

from pool.actors import Admission, Delta, Finished, Queued, ToolCallDelta, Waiting
from pool.backends import ToolCall
from pool.errors import PoolError
from pool.http._common import (
    POOL_ERRORS,
    SchemaError,
    error_body,
    json_response,
    schema_error_body,
)
from pool.http._responses_core import EventObjects, SseEvents, function_call_item
from pool.http._responses_core import sse as core_sse
from pool.http._streaming import StreamRenderer
from pool.schemas import FunctionCallOutput, OutputText, ResponseEnvelope, ResponseMetrics

log = logging.getLogger("pool.http")

ERRORS = POOL_ERRORS


def response_metrics(finished: Finished) -> ResponseMetrics:
    t, usage = finished.timings, finished.usage
    return ResponseMetrics(
        backend_inference_wall_ms=t.backend_ms,
        engine_total_wall_ms=t.engine_ms,
        engine_outside_backend_wall_ms=t.engine_outside_backend_ms,
        pool_total_wall_ms=t.pool_ms,
        engine_queue_wait_ms=t.queue_wait_ms,
        engine_tokenize_ms=t.tokenize_ms,
        gpu_time_to_first_token_ms=t.time_to_first_token_ms,
        gpu_generate_total_ms=t.generate_ms,
        gpu_decode_after_first_token_ms=t.decode_after_first_token_ms,
        engine_prompt_tokens=usage.prompt_tokens,
        engine_output_tokens=usage.output_tokens,
        engine_cached_prompt_tokens=usage.cached_tokens,
        engine_tokens_per_second=t.tokens_per_second,
    )


def _call_output(call: ToolCall) -> FunctionCallOutput:
    return FunctionCallOutput.model_validate(
        function_call_item(call.id, call.name, call.arguments, "completed")
    )


def envelope(admission: Admission, finished: Finished) -> ResponseEnvelope:
    output: list[OutputText | FunctionCallOutput] = [OutputText(text=finished.text)]
    if finished.tool_calls:
        # A reply of calls only has no text item, as OpenAI's.
        output = output if finished.text else []
        output += [_call_output(call) for call in finished.tool_calls]
    return ResponseEnvelope(
        id=admission.id,
        model=admission.model,
        output=output,
        output_text=finished.text,
        finish_reason=finished.finish_reason,
        metrics=response_metrics(finished),
    )


def response_body(admission: Admission, finished: Finished, pool_ms: float) -> dict[str, Any]:
    """The envelope of a request without ``stream``, with the HTTP layer's own measure
    of the whole request (``pool_ms``) as its ``pool_total_wall_ms``."""
    reply = envelope(admission, finished)
    reply.metrics.pool_total_wall_ms = round(pool_ms, 3)
    return reply.model_dump()


def upgrade_required(error: PoolError) -> Response:
    """The 426 of a plain GET of the WebSocket route, naming the upgrade (RFC 9110)."""
    return json_response(
        error_body(error), error.status, {"Upgrade": "websocket", "Connection": "Upgrade"}
    )


# -- event objects ----------------------------------------------------------------------------


def created_event(admission: Admission) -> dict[str, Any]:
    return {"type": "response.created", "id": admission.id, "model": admission.model}


def finished_events(
    admission: Admission, finished: Finished, pool_ms: float | None = None
) -> tuple[dict[str, Any], dict[str, Any]]:
    """``response.metrics`` and ``response.completed``; ``pool_ms`` is the HTTP layer's
    own measure of the whole request, when it has one, for the completed envelope."""
    body = envelope(admission, finished)
    metrics = {"type": "response.metrics", "metrics": body.metrics.model_dump()}
    if pool_ms is not None:
        body.metrics.pool_total_wall_ms = round(pool_ms, 3)
    return metrics, {"type": "response.completed", "response": body.model_dump()}


def wait_event(waiting: Waiting) -> dict[str, Any]:
    """``response.queued`` (its place, what it waits for) or ``response.loading``."""
    if isinstance(waiting, Queued):
        return {
            "type": "response.queued",
            "position": waiting.position,
            "waiting_for": waiting.waiting_for,
        }
    return {"type": "response.loading", "progress": waiting.progress}


def error_event(exc: PoolError | SchemaError) -> dict[str, Any]:
    body = schema_error_body(exc) if isinstance(exc, SchemaError) else error_body(exc)
    return {"type": "error", "error": body["error"]}


_DELTA = "response.output_text.delta"
_DELTA_HEAD = b"event: " + _DELTA.encode() + b'\ndata: {"type":"' + _DELTA.encode() + b'","delta":'


def delta_event(text: str) -> dict[str, Any]:
    return {"type": _DELTA, "delta": text}


class ResponseEvents(StreamRenderer[EventObjects]):
    """The events of one request as objects, in order: ``response.created``, its waits,
    the text deltas and tool-call events, then ``response.metrics`` and
    ``response.completed`` (or an ``error`` event). The WebSocket sends each as a frame,
    :class:`ResponseStream` as SSE.

    Tool calls are sent as OpenAI's Responses API sends them: a call's first piece opens
    its item (``response.output_item.added``), each arguments piece is a
    ``response.function_call_arguments.delta``, and at the end every call gets
    ``response.function_call_arguments.done`` and ``response.output_item.done``.

    Args:
        started: when the HTTP layer began the request (``time.perf_counter()``), for the
            completed envelope's ``pool_total_wall_ms``; None keeps the engine's figure.
    """

    reports_waits = True

    def __init__(self, started: float | None = None) -> None:
        self.started = started
        self._calls: dict[int, str] = {}  # item ids, by the pool's call index

    def elapsed_ms(self) -> float | None:
        return None if self.started is None else (time.perf_counter() - self.started) * 1000

    def opening(self, admission: Admission) -> EventObjects:
        return [created_event(admission)]

    def render_wait(self, admission: Admission, waiting: Waiting) -> EventObjects:
        return [wait_event(waiting)]

    def render_delta(self, admission: Admission, delta: Delta) -> EventObjects:
        return [delta_event(delta.text)]

    def render_tool_call(self, admission: Admission, piece: ToolCallDelta) -> EventObjects:
        events: EventObjects = []
        if piece.id is not None and piece.index not in self._calls:
            item = function_call_item(piece.id, piece.name or "", "", "in_progress")
            self._calls[piece.index] = item["id"]
            events.append(
                {"type": "response.output_item.added", "output_index": piece.index, "item": item}
            )
        if piece.arguments:
            events.append(
                {
                    "type": "response.function_call_arguments.delta",
                    "item_id": self._calls.get(piece.index, ""),
                    "output_index": piece.index,
                    "delta": piece.arguments,
                }
            )
        return events

    def render_finished(self, admission: Admission, finished: Finished) -> EventObjects:
        events: EventObjects = []
        for index, call in enumerate(finished.tool_calls):
            item = function_call_item(call.id, call.name, call.arguments, "completed")
            events.append(
                {
                    "type": "response.function_call_arguments.done",
                    "item_id": item["id"],
                    "output_index": index,
                    "arguments": call.arguments,
                }
            )
            events.append(
                {"type": "response.output_item.done", "output_index": index, "item": item}
            )
        return [*events, *finished_events(admission, finished, self.elapsed_ms())]

    def render_error(self, admission: Admission, exc: PoolError) -> EventObjects:
        return [error_event(exc)]


# -- as SSE ----------------------------------------------------------------------------


def sse_delta(text: str) -> bytes:
    # Every token takes this path: the bytes of sse() without building a dict.
    return _DELTA_HEAD + json.dumps(text, ensure_ascii=False).encode() + b"}\n\n"


def sse(event: dict[str, Any]) -> bytes:
    if event["type"] == _DELTA and len(event) == 2:
        return sse_delta(event["delta"])
    return core_sse(event)


class ResponseStream(SseEvents):
    """The SSE stream of one request: the :class:`ResponseEvents`, each its own event.
    The log line says how it ended (its status line went out before the reply existed).

    Args:
        started: when the HTTP layer began the request (``time.perf_counter()``), for
            the completed envelope's ``pool_total_wall_ms`` and the log line.
    """

    reports_waits = True

    def __init__(self, request_id: str, model: str, tenant: str, started: float) -> None:
        super().__init__(ResponseEvents(started))
        self.request_id = request_id
        self.model = model
        self.tenant = tenant
        self.started = started

    def render_delta(self, admission: Admission, delta: Delta) -> bytes:
        return sse_delta(delta.text)

    def render_finished(self, admission: Admission, finished: Finished) -> bytes:
        out = super().render_finished(admission, finished)
        log.info(
            "request_id=%s model=%s tenant=%s stream=true status=200 ms=%.1f",
            self.request_id,
            self.model,
            self.tenant,
            (time.perf_counter() - self.started) * 1000,
        )
        return out

    def render_error(self, admission: Admission, exc: PoolError) -> bytes:
        log.info(
            "request_id=%s model=%s stream=true error=%s", self.request_id, self.model, exc.code
        )
        return super().render_error(admission, exc)


# -- as WebSocket frames ---------------------------------------------------------------


def socket_frame(event: dict[str, Any]) -> str:
    """One event as the text frame of a running socket (compact JSON)."""
    return json.dumps(event, separators=(",", ":"), ensure_ascii=False)


def closing_frame(exc: PoolError) -> str:
    """The last frame of a socket refused at its handshake or whose key was revoked."""
    return json.dumps(error_event(exc))
