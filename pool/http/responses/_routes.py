"""The routes of the dialect (its parsing and rendering stay beside them until they move
into ``_parse.py`` and ``_render.py``)."""

from __future__ import annotations

import json
import logging
import time
from typing import Any

import trio
from quart import Quart, Response, websocket

from pool.actors import (
    Admission,
    Caller,
    DecodingOverrides,
    Delta,
    Failed,
    Finished,
    InferenceRequest,
    Queued,
    ToolCallDelta,
    Waiting,
)
from pool.backends import ImagePart, TextPart, ToolCall, Turn
from pool.config import SAMPLING_NAMES
from pool.errors import PoolError
from pool.http._common import (
    AppContext,
    HotRoute,
    SchemaError,
    cache_headers_in,
    dumps,
    error_body,
    inference_headers,
    json_response,
    logit_bias,
    parse_json,
    read_body,
    request_id,
    require,
    revoked_error,
    schema_error_body,
    tenant_and_priority,
    validate,
    with_cache,
)
from pool.http._streaming import admitted_stream
from pool.http._tools import responses_output_format, responses_tools, tool_choice
from pool.schemas import (
    Content,
    DecodingRequest,
    FunctionCallItem,
    FunctionCallOutput,
    FunctionCallOutputItem,
    ImageContent,
    Message,
    OutputText,
    ResponseEnvelope,
    ResponseMetrics,
    ResponseRequest,
)

log = logging.getLogger("pool.http")


def _turn(role: str, content: Content) -> Turn:
    if isinstance(content, str):
        return Turn(role, (TextPart(content),))  # type: ignore[arg-type]
    parts: list[TextPart | ImagePart] = []
    for item in content:
        if isinstance(item, ImageContent):
            parts.append(ImagePart(item.image_url.url, item.image_url.detail))
        else:
            parts.append(TextPart(item.text))
    return Turn(role, tuple(parts))  # type: ignore[arg-type]


def decoding_overrides(asked: DecodingRequest) -> DecodingOverrides:
    """The native ``decoding`` object names every sampling field as the pool does; only
    ``logit_bias`` changes shape (string token ids to pairs)."""
    fields = {name: getattr(asked, name) for name in SAMPLING_NAMES}
    fields["logit_bias"] = logit_bias(asked.logit_bias, "decoding.logit_bias")
    return DecodingOverrides(**fields)


def _conversation(
    items: list[Message | FunctionCallItem | FunctionCallOutputItem],
) -> tuple[Turn, ...]:
    """Messages and function-call items as turns: consecutive calls join the assistant
    turn before them (or a turn of their own), each output becomes a ``tool`` turn."""
    turns: list[Turn] = []
    for item in items:
        if isinstance(item, Message):
            turns.append(_turn(item.role, item.content))
        elif isinstance(item, FunctionCallItem):
            call = ToolCall(item.call_id, item.name, item.arguments)
            last = turns[-1] if turns else None
            if last is not None and last.role == "assistant":
                turns[-1] = Turn("assistant", last.parts, (*last.tool_calls, call))
            else:
                turns.append(Turn("assistant", (TextPart(""),), (call,)))
        else:
            turns.append(Turn("tool", (TextPart(item.output),), tool_call_id=item.call_id))
    return tuple(turns)


def inference_request(body: ResponseRequest) -> InferenceRequest:
    """The neutral request of a ``/v1/responses`` body."""
    if body.messages is not None:
        last = body.messages[-1]
        if not (
            isinstance(last, FunctionCallOutputItem)
            or (isinstance(last, Message) and last.role == "user")
        ):
            raise PoolError(
                "invalid_request",
                "the last message must have role `user` (or be a function_call_output)",
            )
        turns = _conversation(body.messages)
    else:
        assert body.input is not None
        turns = (_turn("user", body.input),)
    tools = responses_tools(body.tools)
    return InferenceRequest(
        model=body.model,
        turns=turns,
        multi_turn=body.messages is not None,
        instructions=body.instructions,
        decoding=decoding_overrides(body.decoding),
        thinking=body.thinking,
        allow_remote=body.allow_remote,
        keep_alive=body.keep_alive,
        source_lang_code=body.source_lang_code,
        target_lang_code=body.target_lang_code,
        tools=tools,
        tool_choice=tool_choice(body.tool_choice, tools),
        parallel_tool_calls=body.parallel_tool_calls,
        output_format=responses_output_format(body.text.format if body.text else None),
    )


def request_from_responses(body: ResponseRequest | dict[str, Any]) -> InferenceRequest:
    """The neutral request of a Responses-format body (embedded use builds them so).

    Raises:
        pydantic.ValidationError: ``body`` is a dict that fails the schema.
        PoolError: ``invalid_request`` for a conversation that does not end with the
            user's turn (or a function call's output).
    """
    if not isinstance(body, ResponseRequest):
        body = ResponseRequest.model_validate(body)
    return inference_request(body)


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


def function_call_item(call: ToolCall) -> FunctionCallOutput:
    return FunctionCallOutput(
        id="fc_" + call.id, call_id=call.id, name=call.name, arguments=call.arguments
    )


class CallEvents:
    """The stream events of tool calls, as OpenAI's Responses API sends them.

    A call's first piece opens its item (``response.output_item.added``), each
    arguments piece is a ``response.function_call_arguments.delta``, and at the end
    every call gets ``response.function_call_arguments.done`` and
    ``response.output_item.done``.
    """

    def __init__(self) -> None:
        self._items: dict[int, str] = {}

    def piece(self, piece: ToolCallDelta) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if piece.id is not None and piece.index not in self._items:
            item_id = "fc_" + piece.id
            self._items[piece.index] = item_id
            events.append(
                {
                    "type": "response.output_item.added",
                    "output_index": piece.index,
                    "item": {
                        "type": "function_call",
                        "id": item_id,
                        "call_id": piece.id,
                        "name": piece.name or "",
                        "arguments": "",
                        "status": "in_progress",
                    },
                }
            )
        if piece.arguments:
            events.append(
                {
                    "type": "response.function_call_arguments.delta",
                    "item_id": self._items.get(piece.index, ""),
                    "output_index": piece.index,
                    "delta": piece.arguments,
                }
            )
        return events

    def done(self, finished: Finished) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        for index, call in enumerate(finished.tool_calls):
            item = function_call_item(call)
            events.append(
                {
                    "type": "response.function_call_arguments.done",
                    "item_id": item.id,
                    "output_index": index,
                    "arguments": call.arguments,
                }
            )
            events.append(
                {
                    "type": "response.output_item.done",
                    "output_index": index,
                    "item": item.model_dump(),
                }
            )
        return events


def envelope(admission: Admission, finished: Finished) -> ResponseEnvelope:
    output: list[OutputText | FunctionCallOutput] = [OutputText(text=finished.text)]
    if finished.tool_calls:
        # A reply of calls only has no text item, as OpenAI's.
        output = output if finished.text else []
        output += [function_call_item(call) for call in finished.tool_calls]
    return ResponseEnvelope(
        id=admission.id,
        model=admission.model,
        output=output,
        output_text=finished.text,
        finish_reason=finished.finish_reason,
        metrics=response_metrics(finished),
    )


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


def sse_delta(text: str) -> bytes:
    # Every token takes this path: the bytes of sse() without building a dict.
    return _DELTA_HEAD + json.dumps(text, ensure_ascii=False).encode() + b"}\n\n"


def sse(event: dict[str, Any]) -> bytes:
    kind: str = event["type"]
    if kind == _DELTA and len(event) == 2:
        return sse_delta(event["delta"])
    return b"event: " + kind.encode() + b"\ndata: " + dumps(event) + b"\n\n"


def register(app: Quart, ctx: AppContext) -> None:
    pool = ctx.pool

    @app.post("/v1/responses")
    async def create_response() -> Response:
        """Run a request: one JSON envelope, or Server-Sent Events with ``stream: true``."""
        require(ctx, "inference")
        tenant, priority = tenant_and_priority()
        cache = cache_headers_in()
        body = await read_body(ResponseRequest)
        request = with_cache(inference_request(body), cache)
        started = time.perf_counter()
        rid = request_id()

        def elapsed_ms() -> float:
            return (time.perf_counter() - started) * 1000

        if not body.stream:
            async with pool.admit(request, tenant=tenant, priority=priority) as admission:
                finished = await admission.collect()
            reply = envelope(admission, finished)
            reply.metrics.pool_total_wall_ms = round(elapsed_ms(), 3)
            headers = inference_headers(
                admission.queue_wait_ms, finished.timings.backend_ms, finished.usage.cached_tokens
            )
            log.info(
                "request_id=%s model=%s tenant=%s status=200 ms=%.1f",
                rid,
                body.model,
                tenant,
                elapsed_ms(),
            )
            return json_response(reply.model_dump(), headers=headers)

        calls = CallEvents()

        def render(admission: Admission, event: Delta | Finished) -> bytes:
            if type(event) is Delta:
                return sse_delta(event.text)
            assert isinstance(event, Finished)
            metrics, completed = finished_events(admission, event, elapsed_ms())
            done = b"".join(sse(e) for e in calls.done(event))
            log.info(
                "request_id=%s model=%s tenant=%s stream=true status=200 ms=%.1f",
                rid,
                body.model,
                tenant,
                elapsed_ms(),
            )
            return done + sse(metrics) + sse(completed)

        def render_error(admission: Admission, exc: PoolError) -> bytes:
            log.info("request_id=%s model=%s stream=true error=%s", rid, body.model, exc.code)
            return sse(error_event(exc))

        def render_tool_call(admission: Admission, piece: ToolCallDelta) -> bytes:
            return b"".join(sse(e) for e in calls.piece(piece))

        admission, chunks = await admitted_stream(
            pool,
            request,
            tenant=tenant,
            priority=priority,
            render=render,
            render_error=render_error,
            opening=lambda admission: sse(created_event(admission)),
            render_wait=lambda admission, waiting: sse(wait_event(waiting)),
            render_tool_call=render_tool_call,
        )
        headers = inference_headers(admission.queue_wait_ms, None)
        headers.update({"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        response = Response(chunks, content_type="text/event-stream", headers=headers)
        response.timeout = None
        return response

    ctx.hot_routes["/v1/responses"] = HotRoute(create_response)

    @app.get("/v1/responses")
    async def responses_socket_without_upgrade() -> Response:
        """A plain GET of the WebSocket route: 426 naming the upgrade it needs (RFC 9110)."""
        require(ctx, "inference")
        error = PoolError(
            "upgrade_required",
            "GET /v1/responses is the WebSocket route: send the handshake"
            " (Upgrade: websocket), or POST a request body",
        )
        return json_response(
            error_body(error), error.status, {"Upgrade": "websocket", "Connection": "Upgrade"}
        )

    @app.websocket("/v1/responses")
    async def responses_socket() -> None:
        """Request bodies in, the same events as SSE out; ``response.cancel`` cancels."""
        try:
            caller = require(ctx, "inference")
            tenant, priority = tenant_and_priority()
        except PoolError as exc:
            await websocket.accept()
            await websocket.send(json.dumps(error_event(exc)))
            await websocket.close(1008)
            return
        await websocket.accept()
        revoked = await _socket_session(ctx, tenant, priority, caller)
        if revoked is not None:
            # Policy violation: the key this socket was opened with is no longer valid.
            with trio.move_on_after(_CLOSE_S, shield=True):
                await websocket.send(json.dumps(error_event(revoked)))
                await websocket.close(1008, revoked.message[:_CLOSE_REASON_CHARS])


# Bounds on the closing words to a client whose key was revoked.
_CLOSE_S = 1.0
_CLOSE_REASON_CHARS = 120  # a close frame's reason holds at most 123 bytes


async def _socket_session(
    ctx: AppContext, tenant: str, priority: str, caller: Caller | None
) -> PoolError | None:
    """One connection: a reader, a writer and at most one running request.

    Returns:
        The error to close with when the caller's key was revoked meanwhile (the
        session, its running request included, has ended then); None otherwise.
    """
    outgoing_send, outgoing_recv = trio.open_memory_channel[str](
        ctx.settings.engine.stream_buffer_tokens
    )
    running: list[trio.CancelScope] = []
    revoked: list[PoolError] = []

    async def end_on_revocation(caller: Caller, scope: trio.CancelScope) -> None:
        # A revocation wakes this at once (an idle socket is closed then, not at its
        # next message).
        await ctx.auth.keys.revoked(caller)
        revoked.append(revoked_error(caller))
        scope.cancel()

    async def writer() -> None:
        async with outgoing_recv:
            async for frame in outgoing_recv:
                await websocket.send(frame)

    async def send(event: dict[str, Any]) -> None:
        await outgoing_send.send(json.dumps(event, separators=(",", ":"), ensure_ascii=False))

    async def run_one(request: InferenceRequest) -> None:
        # Each turn gets the request line an HTTP request would (the handshake has its own).
        started = time.perf_counter()
        rid, outcome = "-", "status=cancelled"
        with trio.CancelScope() as scope:
            running.append(scope)
            try:
                async with ctx.pool.admit(
                    request, tenant=tenant, priority=priority, report_waits=True
                ) as admission:
                    rid = admission.id
                    await send(created_event(admission))
                    async for waiting in admission.waits():
                        await send(wait_event(waiting))
                    calls = CallEvents()
                    async for event in admission.events():
                        if type(event) is Delta:
                            await send({"type": _DELTA, "delta": event.text})
                        elif isinstance(event, ToolCallDelta):
                            for piece in calls.piece(event):
                                await send(piece)
                        elif isinstance(event, Finished):
                            outcome = "status=200"
                            for done in (*calls.done(event), *finished_events(admission, event)):
                                await send(done)
                        elif isinstance(event, Failed):
                            outcome = f"error={event.error.code}"
                            await send(error_event(event.error))
            except PoolError as exc:
                outcome = f"error={exc.code}"
                await send(error_event(exc))
            finally:
                running.remove(scope)
                log.info(
                    "request_id=%s model=%s tenant=%s websocket=true %s ms=%.1f",
                    rid,
                    request.model,
                    tenant,
                    outcome,
                    (time.perf_counter() - started) * 1000,
                )
        if scope.cancelled_caught:
            await send({"type": "response.cancelled"})

    async def reader(nursery: trio.Nursery) -> None:
        while True:
            frame = await websocket.receive()
            if caller is not None and not ctx.auth.keys.in_force(caller):
                # Its next message after a revocation is refused, whatever it is.
                revoked.append(revoked_error(caller))
                nursery.cancel_scope.cancel()
                return
            try:
                data = parse_json(frame)
                if isinstance(data, dict) and data.get("type") == "response.cancel":
                    if running:
                        running[0].cancel()
                    else:
                        await send(
                            error_event(PoolError("invalid_request", "no request is running"))
                        )
                    continue
                if running:
                    raise PoolError(
                        "invalid_request", "a request is already running on this connection"
                    )
                if isinstance(data, dict):
                    data.pop("type", None)
                request = inference_request(validate(ResponseRequest, data))
            except (PoolError, SchemaError) as exc:
                await send(error_event(exc))
                continue
            nursery.start_soon(run_one, request)

    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(writer)
            if caller is not None:
                nursery.start_soon(end_on_revocation, caller, nursery.cancel_scope)
            await reader(nursery)
    except* (trio.BrokenResourceError, trio.ClosedResourceError):
        pass
    finally:
        # Whichever way the socket ended, nothing may keep running for it.
        for scope in running:
            scope.cancel()
        outgoing_send.close()
    return revoked[0] if revoked else None
