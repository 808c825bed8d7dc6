"""A lean ASGI path for the inference hot routes; Quart serves everything else.

``POST /v1/responses`` and ``POST /v1/chat/completions`` (and their peers under
``/openai/v1``) carry nearly all of the load.
Quart spends on each of them a request context, werkzeug headers, routing, signals,
hooks and a per-chunk send loop (py-spy: about a fifth of the pool's CPU per JSON
request, docs/performance.md). This layer calls the very same view functions (so the
routes keep one implementation), with what Quart's hooks did done here in the same
order: the ``Host``/``Origin`` check, the whole body read (413 past
``service.max_body_bytes``, 408 past ``service.body_timeout_s``), the view, its
blueprint's error shapes, ``X-Request-Id`` and the ``X-RateLimit-*`` headers.
The views read the request through the accessors of ``pool/http/_common.py``, which
look at :data:`lean_request` first. Only ``POST`` is served here: any other method on
a hot path goes on to Quart, so its 405 (with ``Allow``) and the WebSocket route's 426
come from one place, pool/http/_app.py and pool/http/_responses.py.

A client that disconnects cancels the view (as Quart-Trio does), which leaves the
``admit`` block and stops the generation.

The message that ends a response (Quart's included) is sent shielded from the app's
cancellation: within that very ``send`` Hypercorn's trio server hands the app
``http.disconnect`` and then does the connection's bookkeeping (recycles a kept-alive
connection and arms its idle timer, or closes it when shutting down). The app's
disconnect watcher (ours, Quart-Trio's) cancels the task at that moment, so the
bookkeeping was cut short: the idle connection never timed out, was not closed at a
shutdown, and a request sent on it after SIGTERM hung until the grace ran out.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any, cast

import trio
from hypercorn.typing import ASGIReceiveCallable, ASGISendCallable, Scope
from quart import Response
from quart.wrappers.response import DataBody
from quart_trio import QuartTrio

from pool.actors import RELAY_HEADER, RELAYED, RateLimiter
from pool.config import ServiceSettings
from pool.errors import PoolError
from pool.http._common import (
    HotRoute,
    LeanRequest,
    SchemaError,
    dumps,
    lean_request,
    new_request_id,
    rate_limit_headers,
)
from pool.http._hosts import HostAllowList
from pool.tracing import INCOMING_TRACE, answering_with_trace, incoming_trace

log = logging.getLogger("pool.http")

Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]

_JSON = (b"content-type", b"application/json")


class LeanRoutes:
    """The ASGI app ``serve`` runs: hot routes here, the rest (and lifespan) to Quart."""

    def __init__(
        self,
        app: QuartTrio,
        routes: dict[str, HotRoute],
        hosts: HostAllowList,
        max_body_bytes: int,
        body_timeout_s: float,
        rate_limiter: RateLimiter,
        traced: bool = False,
    ) -> None:
        self.app = app
        self.routes = routes
        self.rate_limiter = rate_limiter
        self.hosts = hosts
        self.max_body_bytes = max_body_bytes
        # As Quart's BODY_TIMEOUT for the other routes (pool/http/_app.py).
        self.body_timeout_s = body_timeout_s
        self.active = 0  # HTTP requests being answered, Quart's included
        # The pool traces: every request's W3C trace headers are read here, for all routes
        # (the pool's admission makes its span their child: pool/tracing/_incoming.py).
        self.traced = traced
        self._settled = trio.Event()

    async def drained(self) -> None:
        """Return once no HTTP request is being answered (``serve``'s drain)."""
        while self.active:
            self._settled = trio.Event()
            await self._settled.wait()

    async def __call__(
        self, asgi_scope: Scope, asgi_receive: ASGIReceiveCallable, asgi_send: ASGISendCallable
    ) -> None:
        scope = cast(dict[str, Any], asgi_scope)
        if self.traced and scope["type"] != "lifespan":
            incoming = incoming_trace(scope["headers"])
            token = INCOMING_TRACE.set(incoming)
            try:
                traced_send = cast(ASGISendCallable, answering_with_trace(asgi_send, incoming))
                await self._answer(asgi_scope, asgi_receive, traced_send)
            finally:
                INCOMING_TRACE.reset(token)
            return
        await self._answer(asgi_scope, asgi_receive, asgi_send)

    async def _answer(
        self, asgi_scope: Scope, asgi_receive: ASGIReceiveCallable, asgi_send: ASGISendCallable
    ) -> None:
        scope = cast(dict[str, Any], asgi_scope)
        if scope["type"] != "http":
            await self._route(asgi_scope, asgi_receive, asgi_send)
            return
        self.active += 1
        try:
            await self._route(asgi_scope, asgi_receive, _whole_ending(asgi_send))
        finally:
            self.active -= 1
            self._settled.set()

    async def _route(
        self, asgi_scope: Scope, asgi_receive: ASGIReceiveCallable, asgi_send: ASGISendCallable
    ) -> None:
        scope = cast(dict[str, Any], asgi_scope)
        route = (
            self.routes.get(scope["path"])
            if scope["type"] == "http" and scope["method"] == "POST"
            else None
        )
        if route is None:
            await self.app(asgi_scope, asgi_receive, asgi_send)
            return
        receive, send = cast(Receive, asgi_receive), cast(Send, asgi_send)
        headers: dict[str, str] = {}
        for name, value in scope["headers"]:
            # The first of repeated headers, as werkzeug's Headers.get gives it.
            headers.setdefault(name.decode("latin-1").lower(), value.decode("latin-1"))
        rid = new_request_id(headers.get("x-request-id", ""))
        async with trio.open_nursery() as nursery:
            nursery.start_soon(
                self._serve, nursery, route, scope["path"], headers, rid, receive, send
            )

    async def _serve(
        self,
        nursery: trio.Nursery,
        route: HotRoute,
        path: str,
        headers: dict[str, str],
        rid: str,
        receive: Receive,
        send: Send,
    ) -> None:
        request = LeanRequest(headers, b"", rid)
        token = lean_request.set(request)
        # As Quart's before_request hook does (docs/cluster.md): a relayed request is
        # served here, never onwards.
        RELAYED.set(bool(headers.get(RELAY_HEADER.lower())))
        try:
            try:
                self.hosts.check(headers.get("host", ""), headers.get("origin"))
            except PoolError as exc:
                log.warning("request_id=%s refused: %s %s", rid, exc.code, exc.message)
                await self._send(await route.on_pool_error(exc), rid, send)
                return
            try:
                body = await self._read_body(headers, receive)
            except trio.TooSlowError:
                error = {"error": {"code": "invalid_request", "message": "the body was too slow"}}
                await self._send_bytes(408, dumps(error), rid, send)
                return
            if body is None:
                return  # the client left
            if isinstance(body, int):
                message = f"the body is larger than {self.max_body_bytes} bytes"
                error = {"error": {"code": "request_too_large", "message": message}}
                await self._send_bytes(413, dumps(error), rid, send)
                return
            request.body = body
            # From here on a disconnect cancels the view (and so the generation).
            nursery.start_soon(_cancel_on_disconnect, receive, nursery.cancel_scope)
            try:
                response = await route.view()
            except PoolError as exc:
                response = await route.on_pool_error(exc)
            except SchemaError as exc:
                response = await route.on_schema_error(exc)
            except Exception:
                log.exception("request_id=%s unhandled error on POST %s", rid, path)
                error = {
                    "error": {
                        "code": "internal_error",
                        "message": "internal error; see the server log",
                    }
                }
                await self._send_bytes(500, dumps(error), rid, send)
                return
            response.headers.update(rate_limit_headers(self.rate_limiter, request.tenant))
            await self._send(response, rid, send)
        finally:
            lean_request.reset(token)
            nursery.cancel_scope.cancel()

    async def _read_body(self, headers: dict[str, str], receive: Receive) -> bytes | int | None:
        """The whole body; its size when it is too large; None when the client left."""
        declared = headers.get("content-length", "")
        if declared.isdigit() and int(declared) > self.max_body_bytes:
            return int(declared)
        parts: list[bytes] = []
        size = 0
        with trio.fail_after(self.body_timeout_s):
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    return None
                part = message.get("body", b"")
                size += len(part)
                if size > self.max_body_bytes:
                    return size
                parts.append(part)
                if not message.get("more_body", False):
                    return b"".join(parts)

    async def _send(self, response: Response, rid: str, send: Send) -> None:
        head = [
            (name.lower().encode("latin-1"), value.encode("latin-1"))
            for name, value in response.headers.items()
        ]
        head.append((b"x-request-id", rid.encode("latin-1")))
        await send({"type": "http.response.start", "status": response.status_code, "headers": head})
        if isinstance(response.response, DataBody):  # a JSON answer: one message
            data = response.response.data
            await send({"type": "http.response.body", "body": data, "more_body": False})
            return
        async with response.response as body:
            async for data in body:
                await send({"type": "http.response.body", "body": data, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _send_bytes(self, status: int, payload: bytes, rid: str, send: Send) -> None:
        head = [
            (b"content-length", str(len(payload)).encode()),
            _JSON,
            (b"x-request-id", rid.encode("latin-1")),
        ]
        await send({"type": "http.response.start", "status": status, "headers": head})
        await send({"type": "http.response.body", "body": payload, "more_body": False})


def _whole_ending(send: ASGISendCallable) -> ASGISendCallable:
    """``send``, with the message that ends the response shielded (the module's doc)."""

    async def ending_shielded(message: Any) -> None:
        if message["type"] == "http.response.body" and not message.get("more_body", False):
            # Bounded: Hypercorn shields its own socket write; the rest is local.
            with trio.CancelScope(shield=True):
                await send(message)
        else:
            await send(message)

    return ending_shielded


async def _cancel_on_disconnect(receive: Receive, scope: trio.CancelScope) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
    scope.cancel()


def lean_app(
    app: QuartTrio, hosts: HostAllowList, service: ServiceSettings, *, traced: bool = False
) -> LeanRoutes:
    """``app`` behind the lean layer for the hot routes its route modules registered
    (``traced``: the pool traces, so every request's trace headers are read)."""
    routes: dict[str, HotRoute] = app.extensions["pool.hot_routes"]
    limiter: RateLimiter = app.extensions["pool.rate_limiter"]
    return LeanRoutes(
        app,
        routes,
        hosts,
        service.max_body_bytes,
        service.body_timeout_s,
        limiter,
        traced=traced,
    )
