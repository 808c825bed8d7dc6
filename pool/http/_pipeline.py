"""The one request pipeline: the ordered steps every HTTP request and WebSocket handshake
passes, whatever route serves it.

Installed as the Quart app's ASGI entry (``app.asgi_app``, pool/http/_app.py), so a served
pool, an embedded app and Quart's test client all run it. In order:

1. trace headers (while the pool traces): W3C ``traceparent``/``tracestate`` in, the
   request span's ``traceparent`` on the answer (pool/tracing/_incoming.py);
2. the request id: the client's sane ``X-Request-Id`` or a fresh one, on every answer
   (a WebSocket handshake's too);
3. relayed marking: a request a cluster peer relayed is served here, never onwards;
4. the ``Host``/``Origin`` check (pool/http/_hosts.py), before anything else is read;
5. the whole body, before any route: 413 past ``service.max_body_bytes`` (by
   ``Content-Length`` or as the chunks arrive), 408 past ``service.body_timeout_s``.
   A route that answers without reading its body (unload, an early 401 or 404) would
   leave late bytes unread and the kept-alive connection's next request unanswered.
   A refusal of step 4 or 5 leaves the body unread itself, so it closes the connection
   (``Connection: close``);
6. the route: a hot route's view is called directly (below), any other goes to Quart
   with the body already read;
7. the answer's head: ``X-Request-Id`` and the ``X-RateLimit-*`` headers of the tenant
   the route acted for (pool/http/_common.py ``rate_limit_headers``);
8. errors in the route's dialect: a step's refusal (4, 5) and a view's ``PoolError`` or
   ``SchemaError`` are rendered by the :class:`~pool.http._common.ErrorShape` of the
   blueprint that serves the path (OpenAI's, Ollama's, Anthropic's or the pool's), the
   same functions for hot routes and Quart's (pool/http/_app.py's error handlers); a
   405's by the path's routes, a 404's by the dialect that owns the path's prefix
   (:meth:`RequestPipeline.dialect`).
The access log line of each request is Hypercorn's (pool/http/_access_log.py), for all.

The hot routes (``POST /v1/responses``, ``POST /v1/chat/completions`` and their peers
under ``/openai/v1``) carry nearly all of the load. Quart spends on each a request
context, werkzeug headers, routing, signals, hooks and a per-chunk send loop (py-spy:
about a fifth of the pool's CPU per JSON request, docs/performance.md), so their views
are called here with the request in :data:`~pool.http._common.pipeline_request`, which
the accessors of pool/http/_common.py read for every route. Only ``POST`` is served so:
any other method on a hot path goes on to Quart, whose 405 (with ``Allow``) and the
WebSocket route's 426 come from one place. A client that disconnects cancels a hot
view (as Quart-Trio does for its own), which leaves the ``admit`` block and stops the
generation; served by Hypercorn, the pool's HTTP/1.1 protocol cancels it where it
closes the request's stream (pool/http/_h11_protocol.py), without a task of its own.

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
from werkzeug.exceptions import HTTPException, MethodNotAllowed
from werkzeug.routing import MapAdapter

from pool.actors import RELAY_HEADER, RELAYED
from pool.config import ServiceSettings
from pool.errors import PoolError
from pool.http._access_log import REQUEST_ID_KEY
from pool.http._common import (
    AppContext,
    HotRoute,
    PipelineRequest,
    SchemaError,
    internal_error_response,
    new_request_id,
    pipeline_request,
    rate_limit_headers,
)
from pool.http._h11_protocol import DISCONNECT_HOOK, DisconnectHook
from pool.http._hosts import HostAllowList
from pool.tracing import INCOMING_TRACE, answering_with_trace, incoming_trace

log = logging.getLogger("pool.http")

Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]
AsgiApp = Callable[[Scope, ASGIReceiveCallable, ASGISendCallable], Awaitable[None]]


class RequestPipeline:
    """The ASGI app in front of Quart's (the module's doc): every HTTP request and
    WebSocket handshake; lifespan goes straight to Quart."""

    def __init__(
        self,
        quart: AsgiApp,
        ctx: AppContext,
        routes: Callable[[], MapAdapter],
        hosts: HostAllowList,
        service: ServiceSettings,
        rate_limit_headers: Callable[[str], dict[str, str]],
        *,
        traced: bool,
    ) -> None:
        self.quart = quart
        self.ctx = ctx
        self._routes = routes
        self._adapter: MapAdapter | None = None
        self.hosts = hosts
        self.max_body_bytes = service.max_body_bytes
        self.body_timeout_s = service.body_timeout_s
        self.rate_limit_headers = rate_limit_headers
        # The pool traces: every request's W3C trace headers are read (step 1).
        self.traced = traced
        self.active = 0  # HTTP requests being answered
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
        kind = scope["type"]
        if kind == "lifespan":
            await self.quart(asgi_scope, asgi_receive, asgi_send)
            return
        receive, send = cast(Receive, asgi_receive), cast(Send, asgi_send)
        trace_token = None
        if self.traced:
            incoming = incoming_trace(scope["headers"])
            trace_token = INCOMING_TRACE.set(incoming)
            send = cast(Send, answering_with_trace(send, incoming))
        headers: dict[str, str] = {}
        for name, value in scope["headers"]:
            # The first of repeated headers, as werkzeug's Headers.get gives it.
            headers.setdefault(name.decode("latin-1").lower(), value.decode("latin-1"))
        request = PipelineRequest(headers, b"", new_request_id(headers.get("x-request-id", "")))
        request_token = pipeline_request.set(request)
        RELAYED.set(bool(headers.get(RELAY_HEADER.lower())))
        try:
            if kind == "http":
                self.active += 1
                try:
                    await self._http(scope, request, receive, _whole_ending(send))
                finally:
                    self.active -= 1
                    self._settled.set()
            else:
                await self._websocket(scope, request, receive, send)
        finally:
            pipeline_request.reset(request_token)
            if trace_token is not None:
                INCOMING_TRACE.reset(trace_token)

    async def _http(
        self, scope: dict[str, Any], request: PipelineRequest, receive: Receive, send: Send
    ) -> None:
        path, method = scope["path"], scope["method"]
        send = self._answering_with_headers(send, request)
        refusal = self._refused_host(request)
        if refusal is not None:
            await self._refuse_unread(refusal, path, method, send)
            return
        try:
            body = await self._read_body(request.headers, receive)
        except trio.TooSlowError:
            timeout = f"the body did not all arrive within {self.body_timeout_s:g} s"
            await self._refuse_unread(PoolError("request_timeout", timeout), path, method, send)
            return
        if body is None:
            return  # the client left
        if isinstance(body, int):
            too_large = f"the body is larger than {self.max_body_bytes} bytes"
            await self._refuse_unread(PoolError("request_too_large", too_large), path, method, send)
            return
        request.body = body
        hot = self.ctx.hot_routes.get(path) if method == "POST" else None
        if hot is None:
            replay = cast(ASGIReceiveCallable, _replaying(body, receive))
            await self.quart(cast(Scope, scope), replay, cast(ASGISendCallable, send))
            return
        # From here on a disconnect cancels the view (and so the generation): through the
        # pool's HTTP/1.1 protocol's hook, or a task that waits for ``http.disconnect``.
        hook = scope["extensions"].get(DISCONNECT_HOOK) if "extensions" in scope else None
        if isinstance(hook, DisconnectHook):
            with trio.CancelScope() as cancel:
                hook.cancels(cancel)
                await self._answer_hot(hot, request, path, send)
            return
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_cancel_on_disconnect, receive, nursery.cancel_scope)
            try:
                await self._answer_hot(hot, request, path, send)
            finally:
                nursery.cancel_scope.cancel()

    async def _answer_hot(
        self, hot: HotRoute, request: PipelineRequest, path: str, send: Send
    ) -> None:
        try:
            response = await hot.view()
        except (PoolError, SchemaError) as exc:
            response = self.ctx.error_answer(exc, hot.dialect)
        except Exception:
            log.exception("request_id=%s unhandled error on POST %s", request.request_id, path)
            response = internal_error_response()
        await _send_response(response, send)

    async def _websocket(
        self, scope: dict[str, Any], request: PipelineRequest, receive: Receive, send: Send
    ) -> None:
        send = _handshake_with_request_id(send, request.request_id)
        scope[REQUEST_ID_KEY] = request.request_id  # for its access line (_access_log.py)
        refusal = self._refused_host(request)
        if refusal is None:
            asgi = cast(ASGIReceiveCallable, receive), cast(ASGISendCallable, send)
            await self.quart(cast(Scope, scope), *asgi)
            return
        # A refused handshake is answered with the HTTP error, never accepted.
        if (await receive())["type"] != "websocket.connect":
            return
        response = self._error(refusal, scope["path"], "GET")
        if "websocket.http.response" not in scope.get("extensions", {}):
            await send({"type": "websocket.close", "code": 1008})
            return
        start = {"type": "websocket.http.response.start", "status": response.status_code}
        await send({**start, "headers": _head(response)})
        await send({"type": "websocket.http.response.body", "body": await response.get_data()})

    async def _refuse_unread(self, exc: PoolError, path: str, method: str, send: Send) -> None:
        """Answer a step's refusal (4, 5) sent before the body was all read, and close the
        connection after it. Hypercorn closes a connection whose request was not read to
        its end; without ``Connection: close`` the client believes it kept alive, and its
        next request on it (or the late rest of this body) met a closed socket."""
        response = self._error(exc, path, method)
        response.headers["Connection"] = "close"
        await _send_response(response, send)

    def _refused_host(self, request: PipelineRequest) -> PoolError | None:
        try:
            self.hosts.check(request.headers.get("host", ""), request.headers.get("origin"))
        except PoolError as exc:
            log.warning("request_id=%s refused: %s %s", request.request_id, exc.code, exc.message)
            return exc
        return None

    def _error(self, exc: PoolError, path: str, method: str) -> Response:
        """``exc`` in the error shape of the blueprint that serves ``path``."""
        return self.ctx.error_answer(exc, self.dialect(path, method))

    def dialect(self, path: str, method: str) -> str | None:
        """The blueprint whose error shape answers ``method`` on ``path``: the route's;
        for a method the path's routes do not take (a 405), theirs; for a path no route
        serves (a 404), the one that owns its prefix (``AppContext.path_dialects``).
        None: the pool's own shape."""
        hot = self.ctx.hot_routes.get(path) if method == "POST" else None
        if hot is not None:
            return hot.dialect
        if self._adapter is None:
            self._adapter = self._routes()
        try:
            endpoint, _ = self._adapter.match(path, method)
        except MethodNotAllowed as exc:
            try:
                endpoint, _ = self._adapter.match(path, next(iter(exc.valid_methods or ["GET"])))
            except HTTPException:
                return self.ctx.unrouted_dialect(path)
        except HTTPException:
            return self.ctx.unrouted_dialect(path)
        blueprint, _, _ = str(endpoint).rpartition(".")
        return blueprint or None

    def _answering_with_headers(self, send: Send, request: PipelineRequest) -> Send:
        """``send`` that adds ``X-Request-Id`` and ``X-RateLimit-*`` to the answer's head
        (step 7), computed as it goes out so the figures include the request itself."""
        headers_of = self.rate_limit_headers

        async def send_with_headers(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                head = [
                    (name, value)
                    for name, value in message.get("headers", ())
                    if name.lower() != b"x-request-id"
                ]
                head.append((b"x-request-id", request.request_id.encode("latin-1")))
                for name, value in rate_limit_headers(headers_of, request.tenant).items():
                    head.append((_name_bytes(name), value.encode("latin-1")))
                message = {**message, "headers": head}
            await send(message)

        return send_with_headers

    async def _read_body(self, headers: dict[str, str], receive: Receive) -> bytes | int | None:
        """The whole body; its size when it is too large; None when the client left."""
        declared = headers.get("content-length", "")
        if declared.isdigit() and int(declared) > self.max_body_bytes:
            return int(declared)
        parts: list[bytes] = []
        size = 0
        channel = _channel_of(receive)
        with trio.fail_after(self.body_timeout_s):
            while True:
                message = _waiting_message(channel) or await receive()
                if message["type"] == "http.disconnect":
                    return None
                part = message.get("body", b"")
                size += len(part)
                if size > self.max_body_bytes:
                    return size
                parts.append(part)
                if not message.get("more_body", False):
                    return b"".join(parts)


def _channel_of(receive: Receive) -> trio.MemoryReceiveChannel[dict[str, Any]] | None:
    """The memory channel whose ``receive`` the server handed the app (Hypercorn's), if so."""
    channel = getattr(receive, "__self__", None)
    return channel if isinstance(channel, trio.MemoryReceiveChannel) else None


def _waiting_message(channel: trio.MemoryReceiveChannel[dict[str, Any]] | None) -> Any:
    """A message already in ``channel``, taken without the scheduler pass that Trio's
    ``receive`` makes even when it need not wait (a task step each: the body and its
    end are two messages); None when none waits (then ``receive`` waits for it)."""
    if channel is None:
        return None
    try:
        return channel.receive_nowait()
    except trio.WouldBlock:
        return None


# Header names as they go on the wire, encoded once: every answer's head has the same
# dozen names (py-spy: lower() and encode() of each, per answer, on the JSON path).
_NAMES: dict[str, bytes] = {}


def _name_bytes(name: str) -> bytes:
    encoded = _NAMES.get(name)
    if encoded is None:
        encoded = name.lower().encode("latin-1")
        if len(_NAMES) < 512:  # the pool's own names; a bound all the same
            _NAMES[name] = encoded
    return encoded


def _head(response: Response) -> list[tuple[bytes, bytes]]:
    return [
        (_name_bytes(name), value.encode("latin-1")) for name, value in response.headers.items()
    ]


async def _send_response(response: Response, send: Send) -> None:
    """A response a hot view or a step made, as ASGI messages (the head's request id and
    rate-limit headers are added by the send of step 7)."""
    head = _head(response)
    await send({"type": "http.response.start", "status": response.status_code, "headers": head})
    if isinstance(response.response, DataBody):  # a JSON answer: one message
        data = response.response.data
        await send({"type": "http.response.body", "body": data, "more_body": False})
        return
    async with response.response as body:
        async for data in body:
            await send({"type": "http.response.body", "body": data, "more_body": True})
    await send({"type": "http.response.body", "body": b"", "more_body": False})


def _replaying(body: bytes, receive: Receive) -> Receive:
    """``receive`` for Quart: the body the pipeline read, in one message, then the
    connection's own messages (its disconnect)."""
    given = False

    async def replay() -> dict[str, Any]:
        nonlocal given
        if not given:
            given = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


def _handshake_with_request_id(send: Send, request_id: str) -> Send:
    """``send`` that puts ``X-Request-Id`` on the handshake's answer (step 2): the accept,
    or the HTTP answer of a refused one. The access log reads it from there."""
    header = (b"x-request-id", request_id.encode("latin-1"))

    async def send_with_request_id(message: dict[str, Any]) -> None:
        if message["type"] in ("websocket.accept", "websocket.http.response.start"):
            head = [
                (name, value)
                for name, value in message.get("headers", ())
                if name.lower() != b"x-request-id"
            ]
            message = {**message, "headers": [*head, header]}
        await send(message)

    return send_with_request_id


def _whole_ending(send: Send) -> Send:
    """``send``, with the message that ends the response shielded (the module's doc)."""

    async def ending_shielded(message: dict[str, Any]) -> None:
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
