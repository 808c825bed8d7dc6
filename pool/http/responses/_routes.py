"""The routes of ``/v1/responses``: the POST (JSON and SSE), and the WebSocket on the
same path with the 426 of its plain GET."""

from __future__ import annotations

import logging
import time

import trio
from quart import Blueprint, Quart, Response, websocket

from pool.actors import CacheMode, Caller, InferenceRequest
from pool.errors import PoolError
from pool.http._collected import collected
from pool.http._common import (
    AppContext,
    HotRoute,
    SchemaError,
    cache_headers_in,
    json_response,
    open_model_route,
    parse_json,
    request_id,
    require,
    revoked_error,
    tenant_and_priority,
    validate,
    with_cache,
)
from pool.http._responses_core import EventObjects
from pool.http._route import GENERATION_REFUSALS, SSE, Route, serves
from pool.http._streaming import admitted_stream, streamed_answer
from pool.http.responses._parse import inference_request
from pool.http.responses._render import (
    ERRORS,
    ResponseEvents,
    ResponseStream,
    closing_frame,
    error_event,
    response_body,
    socket_frame,
    upgrade_required,
)
from pool.schemas import ResponseEnvelope, ResponseRequest, ResponseStreamEvent

log = logging.getLogger("pool.http")


# -- the documented routes (pool/http/_route.py) ----------------------------------------
CREATE_RESPONSE = Route(
    "post",
    "/v1/responses",
    "inference",
    "Run a request",
    "`stream: false` answers one response envelope. `stream: true` answers Server-Sent Events:"
    " `response.created`, one `response.output_text.delta` per generated piece,"
    " `response.metrics`, `response.completed`; an error after the stream started is an"
    " `error` event. A request that waits for VRAM or a load (an on-demand model not"
    " loaded yet) streams at once and shows the wait before the first delta:"
    " `response.queued` (`position`, `waiting_for`: vram/load/replica) and"
    " `response.loading` (`progress` 0..1, null where unknown); its timeout is then an"
    " `error` event. `queue_timeout` errors carry `waiting_for`. The same path accepts a"
    " WebSocket (see `GET /v1/responses`)."
    " Headers: `X-Tenant-ID`, `X-Priority` (high/normal/low), `X-Cache-Mode` (prefix/auto"
    " reuse the scope's cached prefix, none reuses nothing), `X-Cache-Tag` (cached state is"
    " shared only within one tenant and tag); responses carry `X-Request-Id`,"
    " `X-Queue-Wait-Ms`, `X-GPU-Time-Ms`, `X-Cache-Hit`, `X-Cache-Tokens-Reused` (prompt"
    " tokens the runtime reused; on a stream, only `metrics.engine_cached_prompt_tokens`"
    " knows). Images are inlined before queueing: `data:` URLs always,"
    " `file://` only under `service.media_dirs`, `http(s)` only with `service.media_fetch`"
    " and from public addresses; a refusal is 400 `image_refused` with a `reason`."
    " Function tools (`tools`, `tool_choice`; `function_call`/`function_call_output` items in"
    " `messages`) answer `function_call` output items (streamed as"
    " `response.output_item.added` and `response.function_call_arguments.delta`/`.done`);"
    " `text.format` constrains the reply to JSON.",
    ResponseRequest,
    reply=ResponseEnvelope,
    stream=SSE,
    events=ResponseStreamEvent,
    valid_input_codes=GENERATION_REFUSALS,
)
RESPONSES_SOCKET = Route(
    "get",
    "/v1/responses",
    "inference",
    "Run requests over a WebSocket",
    "The WebSocket handshake (`Upgrade: websocket`, answered 101). Send request bodies"
    " (`ResponseRequest`) as JSON text frames, one at a time; receive the events of"
    ' `stream: true` as frames; send `{"type": "response.cancel"}` to cancel the running'
    " one (`response.cancelled`).",
    status=101,
    refusals=(426,),
)
ROUTES = (CREATE_RESPONSE, RESPONSES_SOCKET)


def register(app: Quart, ctx: AppContext) -> None:
    pool = ctx.pool
    blueprint = Blueprint("responses", __name__)
    ctx.error_shapes[blueprint.name] = ERRORS

    @serves(blueprint, CREATE_RESPONSE)
    async def create_response() -> Response:
        """Run a request: one JSON envelope, or Server-Sent Events with ``stream: true``."""
        opened = await open_model_route(ctx, ResponseRequest)
        body = opened.body
        request = opened.neutral(inference_request(body))
        started = time.perf_counter()
        rid = request_id()

        if not body.stream:
            done = await collected(pool, opened, request)
            elapsed_ms = (time.perf_counter() - started) * 1000
            reply = response_body(done.admission, done.finished, elapsed_ms)
            log.info(
                "request_id=%s model=%s tenant=%s status=200 ms=%.1f",
                rid,
                body.model,
                opened.tenant,
                (time.perf_counter() - started) * 1000,
            )
            return json_response(reply, headers=done.headers())

        stream = ResponseStream(rid, body.model, opened.tenant, started)
        admission, chunks = await admitted_stream(pool, opened, request, stream)
        return streamed_answer(chunks, admission)

    ctx.hot_routes["/v1/responses"] = HotRoute(create_response, blueprint.name)

    @serves(blueprint, RESPONSES_SOCKET)
    async def responses_socket_without_upgrade() -> Response:
        """A plain GET of the WebSocket route: 426 naming the upgrade it needs (RFC 9110)."""
        require(ctx, "inference")
        return upgrade_required(
            PoolError(
                "upgrade_required",
                "GET /v1/responses is the WebSocket route: send the handshake"
                " (Upgrade: websocket), or POST a request body",
            )
        )

    # The handshake is the GET that RESPONSES_SOCKET documents (101).
    @blueprint.websocket(RESPONSES_SOCKET.path)
    async def responses_socket() -> None:
        """Request bodies in, the same events as SSE out; ``response.cancel`` cancels."""
        # Its bodies come in frames: the handshake's headers are read as a model route
        # reads them (open_model_route), for every request the socket then runs.
        try:
            caller = require(ctx, "inference")
            tenant, priority = tenant_and_priority()
            cache = cache_headers_in()
        except PoolError as exc:
            await websocket.accept()
            await websocket.send(closing_frame(exc))
            await websocket.close(1008)
            return
        await websocket.accept()
        revoked = await _socket_session(ctx, tenant, priority, cache, caller)
        if revoked is not None:
            # Policy violation: the key this socket was opened with is no longer valid.
            with trio.move_on_after(_CLOSE_S, shield=True):
                await websocket.send(closing_frame(revoked))
                await websocket.close(1008, revoked.message[:_CLOSE_REASON_CHARS])

    app.register_blueprint(blueprint)


# Bounds on the closing words to a client whose key was revoked.
_CLOSE_S = 1.0
_CLOSE_REASON_CHARS = 120  # a close frame's reason holds at most 123 bytes


async def _socket_session(
    ctx: AppContext,
    tenant: str,
    priority: str,
    cache: tuple[CacheMode, str | None],
    caller: Caller | None,
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

    async def send(events: EventObjects | None) -> None:
        for event in events or ():
            await outgoing_send.send(socket_frame(event))

    async def run_one(request: InferenceRequest) -> None:
        # Each turn gets the request line an HTTP request would (the handshake has its own).
        started = time.perf_counter()
        rid, outcome = "-", "status=cancelled"
        # The engine's pool_total_wall_ms stands: a socket's turn has no HTTP request.
        events = ResponseEvents()
        with trio.CancelScope() as scope:
            running.append(scope)
            try:
                async with ctx.pool.admit(
                    request, tenant=tenant, priority=priority, report_waits=True
                ) as admission:
                    rid = admission.id
                    await send(events.opening(admission))
                    async for waiting in admission.waits():
                        await send(events.render_wait(admission, waiting))
                    async for event in admission.events():
                        await send(events.render(admission, event))
                    outcome = (
                        "status=200"
                        if admission.failed is None
                        else f"error={admission.failed.code}"
                    )
            except PoolError as exc:
                outcome = f"error={exc.code}"
                await send([error_event(exc)])
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
            await send([{"type": "response.cancelled"}])

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
                            [error_event(PoolError("invalid_request", "no request is running"))]
                        )
                    continue
                if running:
                    raise PoolError(
                        "invalid_request", "a request is already running on this connection"
                    )
                if isinstance(data, dict):
                    data.pop("type", None)
                request = with_cache(inference_request(validate(ResponseRequest, data)), cache)
            except (PoolError, SchemaError) as exc:
                await send([error_event(exc)])
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
