"""Hypercorn's HTTP/1.1 protocol with three changes: one socket write per whole answer,
the end of a request's stream told to the app without a task of its own, and a
request's messages put in its app's channel without a scheduler pass.

**The held head.** Hypercorn writes an answer's head, its body and its (empty, for a
sized body) end as three writes: three sends through its connection lock and shielded
scope, two ``send`` system calls and a checkpoint for the empty one, each waking the
client on its own. A JSON answer of the pool is one head and one body
(pool/http/_pipeline.py), so the head of an answer whose size is declared
(``content-length``) is held here and goes out in the same write as the body, and the
empty end is not written at all.

Only sized answers are held: their body follows at once. A stream (chunked, SSE) has no
declared size, and its head still goes out as soon as it is sent, before the first
event. Anything else sent while a head is held (the stream closed, a raw write) writes
the head first, so no bytes are reordered or lost.

**The end of a stream, told without a task.** An ASGI app learns that its client left
only from an ``http.disconnect`` message, so an app that must stop when that happens
(the pool's hot routes stop the generation, pool/http/_pipeline.py) runs a second task
that waits for it: a task start, a nursery and two steps more on every request. The
protocol here puts a :class:`DisconnectHook` in each HTTP request's scope (the
``pool.disconnect`` extension); an app registers a cancel scope with it, and the
protocol cancels that scope where it closes the request's stream (the client left, or
the answer is done), just before Hypercorn sends ``http.disconnect``.

:func:`install` puts :class:`PoolH11Protocol` where Hypercorn's connection wrapper
builds its HTTP/1.1 protocol (``hypercorn.protocol.H11Protocol``), after checking that
the names it relies on are still there.

**Messages without a scheduler pass.** Hypercorn hands the app a request's body, its
end and the disconnect through a memory channel, with Trio's ``send``, which passes
through the scheduler even when the channel has room: a step of the connection's task
for each. :class:`_EagerPut` puts them with ``send_nowait`` while there is room, and the
pipeline (pool/http/_pipeline.py) takes what waits in that channel the same way.
"""

from __future__ import annotations

from itertools import chain
from typing import Any

import h11
import hypercorn.protocol
import trio
from hypercorn.events import RawData
from hypercorn.protocol.events import Body, EndBody, Response
from hypercorn.protocol.events import Event as StreamEvent
from hypercorn.protocol.h11 import H11Protocol
from hypercorn.protocol.http_stream import HTTPStream
from hypercorn.typing import H11SendableEvent

_LENGTH = b"content-length"

DISCONNECT_HOOK = "pool.disconnect"  # the ASGI scope's extension that holds the hook


class DisconnectHook:
    """Cancels the scope an app registers once the request's stream is closed: the
    client left, or the answer is done (the module's doc)."""

    __slots__ = ("_scope", "closed")

    def __init__(self) -> None:
        self._scope: trio.CancelScope | None = None
        self.closed = False

    def cancels(self, scope: trio.CancelScope) -> None:
        """Cancel ``scope`` when the stream closes (at once if it has)."""
        self._scope = scope
        if self.closed:
            scope.cancel()

    def close(self) -> None:
        self.closed = True
        if self._scope is not None:
            self._scope.cancel()


class PoolH11Protocol(H11Protocol):
    """Hypercorn's HTTP/1.1 protocol, writing a sized answer's head with its body and
    telling a request's app the end of its stream through a :class:`DisconnectHook`."""

    _held = b""  # a head not written yet
    _disconnect: DisconnectHook | None = None  # the open HTTP request's

    async def _create_stream(self, request: h11.Request) -> None:
        await super()._create_stream(request)
        if isinstance(self.stream, HTTPStream):
            # Before the request's body reaches the app, which looks for it after.
            self._disconnect = DisconnectHook()
            self.stream.scope["extensions"][DISCONNECT_HOOK] = self._disconnect  # type: ignore[assignment]
            channel = getattr(self.stream.app_put, "__self__", None)
            if isinstance(channel, trio.MemorySendChannel):
                self.stream.app_put = _EagerPut(channel)

    async def _close_stream(self) -> None:
        hook, self._disconnect = self._disconnect, None
        if hook is not None:
            hook.close()
        await super()._close_stream()

    async def stream_send(self, event: StreamEvent) -> None:
        if isinstance(event, Response) and event.status_code >= 200 and _sized(event):
            # As Hypercorn builds the head (its own headers, a last request's close).
            headers = list(chain(event.headers, self.config.response_headers("h11")))
            if self.keep_alive_requests >= self.config.keep_alive_max_requests:
                headers.append((b"connection", b"close"))
            try:
                self._held = self.connection.send(
                    h11.Response(headers=headers, status_code=event.status_code)
                )
            except h11.LocalProtocolError:
                if self.connection.their_state != h11.ERROR:
                    raise
            return
        if self._held and not isinstance(event, Body | EndBody):
            held, self._held = self._held, b""
            await self.send(RawData(data=held))
        await super().stream_send(event)

    async def _send_h11_event(self, event: H11SendableEvent) -> None:
        try:
            data = self.connection.send(event)
        except h11.LocalProtocolError:
            if self.connection.their_state != h11.ERROR:
                raise
            return
        if self._held:
            data, self._held = self._held + (data or b""), b""
        if data:  # a sized body's end is no bytes: nothing to write
            await self.send(RawData(data=data))


class _EagerPut:
    """A request's messages to its app (its body, its end, the disconnect) put in the
    app's channel (Hypercorn's ``app_put``) without the scheduler pass of Trio's ``send``
    while the channel has room, a task step each; a full channel (Hypercorn's
    ``max_app_queue_size``: an app that does not read) still waits."""

    __slots__ = ("_channel",)

    def __init__(self, channel: trio.MemorySendChannel[Any]) -> None:
        self._channel = channel

    async def __call__(self, message: Any) -> None:
        try:
            self._channel.send_nowait(message)
        except trio.WouldBlock:
            await self._channel.send(message)


def _sized(event: Response) -> bool:
    return any(name.lower() == _LENGTH for name, _ in event.headers)


def install() -> None:
    """Have Hypercorn's connections speak HTTP/1.1 through :class:`PoolH11Protocol`
    (idempotent; a Hypercorn whose wrapper no longer builds ``H11Protocol`` by that name
    fails here, at start, rather than silently going without both changes)."""
    current = getattr(hypercorn.protocol, "H11Protocol", None)
    if current is PoolH11Protocol:
        return
    if current is not H11Protocol:
        raise RuntimeError(f"hypercorn.protocol.H11Protocol is {current!r}, not Hypercorn's")
    if not all(hasattr(H11Protocol, name) for name in ("_create_stream", "_close_stream")):
        raise RuntimeError("Hypercorn's H11Protocol no longer creates and closes streams here")
    setattr(hypercorn.protocol, "H11Protocol", PoolH11Protocol)  # noqa: B010 - not exported
