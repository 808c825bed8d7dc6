"""A stand-in internet for the media tests: loopback servers behind public addresses.

The machine may only send traffic to loopback. :class:`LoopbackInternet` is the network
*beneath* the pool's address check: the pool resolves names (with a test resolver),
checks the addresses as it always does, and only then does this backend carry the
connection for a public address to the loopback server that plays it.
"""

from __future__ import annotations

import base64
import contextlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpcore
import trio

PNG = b"\x89PNG\r\n\x1a\n" + b"\x00\x00\x00\rIHDR" + bytes(range(64))
PNG_URL = "data:image/png;base64," + base64.b64encode(PNG).decode()


@dataclass
class Route:
    status: int = 200
    body: bytes = PNG
    headers: dict[str, str] = field(default_factory=dict)
    delay_s: float = 0.0


@dataclass
class Seen:
    path: str
    host: str


class TinyHttpServer:
    """One response per connection from a table of routes; records what was asked."""

    def __init__(self, routes: dict[str, Route]) -> None:
        self.routes = routes
        self.seen: list[Seen] = []
        self.port = 0

    async def run(self, *, task_status: trio.TaskStatus[TinyHttpServer]) -> None:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        self.port = listeners[0].socket.getsockname()[1]
        task_status.started(self)
        await trio.serve_listeners(self._handle, listeners)

    async def _handle(self, stream: trio.SocketStream) -> None:
        async with stream:
            data = b""
            while b"\r\n\r\n" not in data:
                chunk = await stream.receive_some(4096)
                if not chunk:
                    return
                data += chunk
            head = data.split(b"\r\n\r\n", 1)[0].decode("latin-1").split("\r\n")
            path = head[0].split(" ")[1]
            headers = dict(line.split(": ", 1) for line in head[1:])
            self.seen.append(Seen(path, headers.get("Host", "")))
            route = self.routes.get(path, Route(404, b"no"))
            if route.delay_s:
                await trio.sleep(route.delay_s)
            lines = [f"HTTP/1.1 {route.status} Whatever", f"Content-Length: {len(route.body)}"]
            lines += ["Connection: close", *(f"{k}: {v}" for k, v in route.headers.items())]
            # A client that refuses the answer early (too large) may hang up mid-send.
            with contextlib.suppress(trio.BrokenResourceError):
                await stream.send_all(("\r\n".join(lines) + "\r\n\r\n").encode() + route.body)


def resolver_of(names: dict[str, Sequence[str]]) -> Any:
    """A resolver that knows ``names`` only (an unknown one fails like DNS does)."""

    async def resolve(host: str, port: int) -> Sequence[str]:
        if host not in names:
            raise OSError(f"unknown host {host}")
        return names[host]

    return resolve


class LoopbackInternet(httpcore.AsyncNetworkBackend):
    """Carries connections for ``(address, port)`` to loopback servers; records them."""

    def __init__(self, servers: dict[tuple[str, int], TinyHttpServer]) -> None:
        self.servers = servers
        self.dialled: list[tuple[str, int]] = []
        self._trio = httpcore.TrioBackend()

    async def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,  # noqa: ASYNC109 - httpcore's interface
        local_address: str | None = None,
        socket_options: Iterable[Any] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        self.dialled.append((host, port))
        server = self.servers.get((host, port))
        if server is None:
            raise httpcore.ConnectError(f"nothing plays {host}:{port}")
        return await self._trio.connect_tcp("127.0.0.1", server.port, timeout=timeout)

    async def connect_unix_socket(
        self,
        path: str,
        timeout: float | None = None,  # noqa: ASYNC109 - httpcore's interface
        socket_options: Iterable[Any] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        raise httpcore.ConnectError("no unix sockets here")

    async def sleep(self, seconds: float) -> None:
        await trio.sleep(seconds)
