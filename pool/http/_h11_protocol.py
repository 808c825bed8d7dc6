"""Hypercorn's HTTP/1.1 protocol with two changes: one socket write per whole answer,
and a connection the client closes between requests is closed at once.

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

**A connection closed between requests.** Once an answer is done, Hypercorn (0.18)
starts the connection's keep-alive timer; if the client then closes (an HTTP client
over its keep-alive limit closes right after reading the answer, and every client
closes its idle connections when it ends), the end of file is read but nothing stops
that timer, and the connection's task group, which the socket's close waits for, waits
for it: the socket stays in CLOSE_WAIT, holding a file descriptor and two tasks, for the
whole ``service.keep_alive_s`` (75 s by default). Under steady traffic from such
clients the fds pile up by the thousand. The protocol here stops the timer when the
peer's close arrives with no request open, so the socket closes then.

:func:`install` puts :class:`PoolH11Protocol` where Hypercorn's connection wrapper
builds its HTTP/1.1 protocol (``hypercorn.protocol.H11Protocol``); the class checks at
install time that the names it relies on are still there.
"""

from __future__ import annotations

from itertools import chain

import h11
import hypercorn.protocol
from hypercorn.events import Closed, Event, RawData, Updated
from hypercorn.protocol.events import Body, EndBody, Response
from hypercorn.protocol.events import Event as StreamEvent
from hypercorn.protocol.h11 import H11Protocol
from hypercorn.typing import H11SendableEvent

_LENGTH = b"content-length"


class PoolH11Protocol(H11Protocol):
    """Hypercorn's HTTP/1.1 protocol, writing a sized answer's head with its body and
    closing at once a connection its client closed between requests."""

    _held = b""  # a head not written yet

    async def handle(self, event: Event) -> None:
        await super().handle(event)
        if isinstance(event, Closed) and self.stream is None:
            # No request open (one still open ends through its stream as before):
            # stop the keep-alive timer, the one task that would hold the socket open.
            await self.send(Updated(idle=False))

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
    setattr(hypercorn.protocol, "H11Protocol", PoolH11Protocol)  # noqa: B010 - not exported
