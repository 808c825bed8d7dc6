"""``POST /v1/responses`` (JSON and SSE) and the WebSocket on the same path."""

from __future__ import annotations

import json
import logging
import time
from typing import Any

import trio
from quart import Quart, Response, request, websocket

from pool.actors import Admission
from pool.errors import PoolError
from pool.http._common import (
    AppContext,
    SchemaError,
    dumps,
    json_response,
    parse_json,
    read_body,
    request_id,
    require,
    schema_error_body,
    tenant_and_priority,
    validate,
)
from pool.http._streaming import admitted_stream
from pool.schemas import ResponseRequest

log = logging.getLogger("pool.http")

_CACHE_MODES = ("prefix", "none", "auto")


def cache_headers_in() -> None:
    """Validate ``X-Cache-Mode`` / ``X-Cache-Tag`` (no backend here keeps a prefix cache)."""
    mode = request.headers.get("x-cache-mode")
    if mode is not None and mode.strip().lower() not in _CACHE_MODES:
        raise PoolError("invalid_request", "X-Cache-Mode must be prefix, none or auto")
    tag = request.headers.get("x-cache-tag")
    if tag is not None and (len(tag) > 64 or not tag.isprintable()):
        raise PoolError(
            "invalid_request", "X-Cache-Tag must be printable and at most 64 characters"
        )


def inference_headers(queue_wait_ms: float, gpu_ms: float | None) -> dict[str, str]:
    return {
        "X-Queue-Wait-Ms": str(round(queue_wait_ms)),
        "X-GPU-Time-Ms": str(round(gpu_ms or 0)),
        "X-Cache-Hit": "false",
        "X-Cache-Tokens-Reused": "0",
    }


_DELTA = "response.output_text.delta"
_DELTA_HEAD = b"event: " + _DELTA.encode() + b'\ndata: {"type":"' + _DELTA.encode() + b'","delta":'


def sse(event: dict[str, Any]) -> bytes:
    kind: str = event["type"]
    if kind == _DELTA and len(event) == 2:
        # Every token takes this path: the same bytes as below without encoding a dict.
        text = json.dumps(event["delta"], ensure_ascii=False).encode()
        return _DELTA_HEAD + text + b"}\n\n"
    return b"event: " + kind.encode() + b"\ndata: " + dumps(event) + b"\n\n"


def register(app: Quart, ctx: AppContext) -> None:
    pool = ctx.pool

    @app.post("/v1/responses")
    async def create_response() -> Response:
        """Run a request: one JSON envelope, or Server-Sent Events with ``stream: true``."""
        require(ctx, "inference")
        tenant, priority = tenant_and_priority()
        cache_headers_in()
        body = await read_body(ResponseRequest)
        started = time.perf_counter()
        rid = request_id()
        if not body.stream:
            async with pool.admit(body, tenant=tenant, priority=priority) as admission:
                envelope = await admission.collect()
            envelope.metrics.pool_total_wall_ms = round((time.perf_counter() - started) * 1000, 3)
            headers = inference_headers(
                admission.queue_wait_ms, envelope.metrics.backend_inference_wall_ms
            )
            headers.update(pool.rate_limiter.headers(tenant))
            log.info(
                "request_id=%s model=%s tenant=%s status=200 ms=%.1f",
                rid,
                body.model,
                tenant,
                (time.perf_counter() - started) * 1000,
            )
            return json_response(envelope.model_dump(), headers=headers)

        def render(admission: Admission, event: dict[str, Any]) -> bytes:
            if event["type"] == "response.completed":
                event["response"]["metrics"]["pool_total_wall_ms"] = round(
                    (time.perf_counter() - started) * 1000, 3
                )
                log.info(
                    "request_id=%s model=%s tenant=%s stream=true status=200 ms=%.1f",
                    rid,
                    body.model,
                    tenant,
                    (time.perf_counter() - started) * 1000,
                )
            return sse(event)

        def render_error(admission: Admission, exc: PoolError) -> bytes:
            log.info("request_id=%s model=%s stream=true error=%s", rid, body.model, exc.code)
            return sse({"type": "error", "error": exc.body()["error"]})

        admission, chunks = await admitted_stream(
            pool, body, tenant=tenant, priority=priority, render=render, render_error=render_error
        )
        headers = inference_headers(admission.queue_wait_ms, None)
        headers.update({"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        response = Response(chunks, content_type="text/event-stream", headers=headers)
        response.timeout = None
        return response

    @app.websocket("/v1/responses")
    async def responses_socket() -> None:
        """Request bodies in, the same events as SSE out; ``response.cancel`` cancels."""
        try:
            require(ctx, "inference")
            tenant, priority = tenant_and_priority()
        except PoolError as exc:
            await websocket.accept()
            await websocket.send(json.dumps({"type": "error", "error": exc.body()["error"]}))
            await websocket.close(1008)
            return
        await websocket.accept()
        await _socket_session(ctx, tenant, priority)


async def _socket_session(ctx: AppContext, tenant: str, priority: str) -> None:
    """One connection: a reader, a writer and at most one running request."""
    outgoing_send, outgoing_recv = trio.open_memory_channel[str](
        ctx.settings.engine.stream_buffer_tokens
    )
    running: list[trio.CancelScope] = []

    async def writer() -> None:
        async with outgoing_recv:
            async for frame in outgoing_recv:
                await websocket.send(frame)

    async def send(event: dict[str, Any]) -> None:
        await outgoing_send.send(json.dumps(event, separators=(",", ":"), ensure_ascii=False))

    async def send_error(exc: PoolError | SchemaError) -> None:
        body = schema_error_body(exc) if isinstance(exc, SchemaError) else exc.body()
        await send({"type": "error", "error": body["error"]})

    async def run_one(body: ResponseRequest) -> None:
        with trio.CancelScope() as scope:
            running.append(scope)
            try:
                async with ctx.pool.admit(body, tenant=tenant, priority=priority) as admission:
                    async for event in admission.events():
                        await send(event)
            except PoolError as exc:
                await send_error(exc)
            finally:
                running.remove(scope)
        if scope.cancelled_caught:
            await send({"type": "response.cancelled"})

    async def reader(nursery: trio.Nursery) -> None:
        while True:
            frame = await websocket.receive()
            try:
                data = parse_json(frame)
                if isinstance(data, dict) and data.get("type") == "response.cancel":
                    if running:
                        running[0].cancel()
                    else:
                        await send_error(PoolError("invalid_request", "no request is running"))
                    continue
                if running:
                    raise PoolError(
                        "invalid_request", "a request is already running on this connection"
                    )
                if isinstance(data, dict):
                    data.pop("type", None)
                body = validate(ResponseRequest, data)
            except (PoolError, SchemaError) as exc:
                await send_error(exc)
                continue
            nursery.start_soon(run_one, body)

    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(writer)
            await reader(nursery)
    except* (trio.BrokenResourceError, trio.ClosedResourceError):
        pass
    finally:
        # Whichever way the socket ended, nothing may keep running for it.
        for scope in running:
            scope.cancel()
        outgoing_send.close()
