"""What the pool answers while it starts: 503 ``starting`` with ``Retry-After``.

The port is bound before the pool opens (pool/http/_server.py), and opening it loads the
models marked ``enabled``, which can take minutes. The runner spec wants a runner that is
starting up to answer 503 (spec: model-runner-api, "Capability Descriptor"), not to
refuse connections, so an orchestrator polling ``/v1/capabilities`` (or a container
health check) learns it is on its way. Until Hypercorn takes the listening socket over,
this answers every request on it with one small fixed response and closes the
connection; connections still in the backlog at the hand-over are Hypercorn's.
"""

from __future__ import annotations

import contextlib
import json
import logging
import socket

import trio

from pool.errors import STATUS_BY_CODE

log = logging.getLogger("pool.server")

RETRY_AFTER_S = 5
# A request head larger than this is not read to its end: the answer is the same.
_HEAD_LIMIT = 64 * 1024
# How long a connection may take to send its request head.
_READ_TIMEOUT_S = 5.0


def _response() -> bytes:
    body = json.dumps(
        {"error": {"code": "starting", "message": "the pool is starting; retry shortly"}}
    ).encode()
    head = (
        f"HTTP/1.1 {STATUS_BY_CODE['starting']} Service Unavailable\r\n"
        "content-type: application/json\r\n"
        f"content-length: {len(body)}\r\n"
        f"retry-after: {RETRY_AFTER_S}\r\n"
        "connection: close\r\n\r\n"
    )
    return head.encode() + body


_RESPONSE = _response()


class StartingResponder:
    """Answers 503 ``starting`` on a listening socket until :meth:`stop`."""

    def __init__(self) -> None:
        self._scope = trio.CancelScope()
        self._stopped = trio.Event()

    async def run(self, socks: list[socket.socket]) -> None:
        """Answer on the listening ``socks`` (duplicates of them, so closing ours leaves
        them open for Hypercorn)."""
        listeners = [trio.SocketListener(trio.socket.from_stdlib_socket(s.dup())) for s in socks]
        try:
            with self._scope:
                await trio.serve_listeners(self._answer, listeners)
        finally:
            for listener in listeners:
                listener.socket.close()
            self._stopped.set()

    async def stop(self) -> None:
        """Stop answering, and return once nothing here accepts any more."""
        self._scope.cancel()
        await self._stopped.wait()

    @staticmethod
    async def _answer(stream: trio.SocketStream) -> None:
        async with stream:
            head = b""
            with trio.move_on_after(_READ_TIMEOUT_S):
                while b"\r\n\r\n" not in head and len(head) < _HEAD_LIMIT:
                    chunk = await stream.receive_some(_HEAD_LIMIT)
                    if not chunk:
                        return
                    head += chunk
            with contextlib.suppress(trio.BrokenResourceError):  # the client left first
                await stream.send_all(_RESPONSE)
