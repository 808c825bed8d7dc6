"""The upstream transports against raw HTTP servers on loopback: framing, reuse, errors."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from functools import partial

import pytest
import trio

from pool.backends._upstream import (
    HttpxTransport,
    LeanTransport,
    Transport,
    UpstreamBroken,
    UpstreamTimeout,
    UpstreamUnreachable,
    open_transport,
    sse_batches,
    sse_data,
)

Handler = Callable[[trio.SocketStream, bytes], Awaitable[bool]]


async def _read_request(stream: trio.SocketStream, buffer: bytearray) -> bytes | None:
    """One request (head and Content-Length body) from ``stream``; None at EOF."""
    while b"\r\n\r\n" not in buffer:
        data = await stream.receive_some(65536)
        if not data:
            return None
        buffer += data
    head, _, _ = bytes(buffer).partition(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    end = len(head) + 4 + length
    while len(buffer) < end:
        buffer += await stream.receive_some(65536)
    request = bytes(buffer[:end])
    del buffer[:end]
    return request


class RawServer:
    """Answers each request with ``handler``; counts connections and requests."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.connections = 0
        self.requests: list[bytes] = []
        self.port = 0

    async def serve(self, stream: trio.SocketStream) -> None:
        self.connections += 1
        buffer = bytearray()
        async with stream:
            while (request := await _read_request(stream, buffer)) is not None:
                self.requests.append(request)
                if not await self.handler(stream, request):
                    return  # the handler closes the connection


@pytest.fixture
async def start(nursery: trio.Nursery) -> Callable[[Handler], Awaitable[RawServer]]:
    async def start_server(handler: Handler) -> RawServer:
        server = RawServer(handler)
        listeners = await nursery.start(partial(trio.serve_tcp, server.serve, 0, host="127.0.0.1"))
        server.port = listeners[0].socket.getsockname()[1]
        return server

    return start_server


def _chunked(*pieces: bytes) -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces) + b"0\r\n\r\n"


async def _sse_reply(stream: trio.SocketStream, request: bytes) -> bool:
    head = (
        b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
    )
    await stream.send_all(head)
    for piece in (b'data: {"n": 1}\n\n', b'data: {"n": 2}\r\n\r\ndata: [DO', b"NE]\n\n"):
        await stream.send_all(b"%x\r\n%s\r\n" % (len(piece), piece))
    await stream.send_all(b"0\r\n\r\n")
    return True


async def _collect(chunks: AsyncIterator[bytes]) -> list[bytes]:
    return [data async for data in sse_data(chunks)]


@pytest.mark.parametrize("kind", ["lean", "httpx"])
async def test_chunked_event_stream_and_connection_reuse(
    start: Callable[[Handler], Awaitable[RawServer]], kind: str
) -> None:
    server = await start(_sse_reply)
    url = f"http://127.0.0.1:{server.port}/v1"
    transport: Transport = (
        LeanTransport(url, timeout_s=5) if kind == "lean" else HttpxTransport(url, timeout_s=5)
    )
    try:
        for _ in range(3):
            async with transport.request("POST", "/chat", body=b"{}") as response:
                assert response.status == 200
                assert await _collect(response.chunks()) == [b'{"n": 1}', b'{"n": 2}', b"[DONE]"]
    finally:
        await transport.aclose()
    assert server.connections == 1
    assert server.requests[0].startswith(b"POST /v1/chat HTTP/1.1\r\n")
    assert server.requests[0].endswith(b"\r\n\r\n{}")


async def test_content_length_and_close_delimited_bodies(
    start: Callable[[Handler], Awaitable[RawServer]],
) -> None:
    async def reply(stream: trio.SocketStream, request: bytes) -> bool:
        if b"GET /empty" in request:
            await stream.send_all(b"HTTP/1.1 204 No Content\r\n\r\n")
            return True
        if b"GET /length" in request:
            await stream.send_all(b"HTTP/1.1 404 Not Found\r\nContent-Length: 5\r\n\r\nnope!")
            return True
        await stream.send_all(b"HTTP/1.0 200 OK\r\n\r\nuntil the end")
        return False

    server = await start(reply)
    transport = LeanTransport(f"http://127.0.0.1:{server.port}", timeout_s=5)
    async with transport.request("GET", "/length") as response:
        assert (response.status, await response.read()) == (404, b"nope!")
    async with transport.request("GET", "/empty") as response:
        assert (response.status, await response.read()) == (204, b"")
    async with transport.request("GET", "/close") as response:
        assert (response.status, await response.read()) == (200, b"until the end")
    async with transport.request("GET", "/length") as response:
        assert await response.read() == b"nope!"
    await transport.aclose()
    # The first connection was reused once; the close-delimited answer ended the second.
    assert server.connections == 2


@pytest.mark.parametrize("pause_s", [0.0, 0.05])
async def test_an_idle_connection_the_server_closed_is_replaced(
    start: Callable[[Handler], Awaitable[RawServer]], pause_s: float
) -> None:
    async def reply_then_close(stream: trio.SocketStream, request: bytes) -> bool:
        await stream.send_all(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        return False  # closed without saying so: the client finds out when it reuses it

    server = await start(reply_then_close)
    transport = LeanTransport(f"http://127.0.0.1:{server.port}", timeout_s=5)
    for _ in range(3):
        async with transport.request("GET", "/") as response:
            assert await response.read() == b"ok"
        # With a pause the close is seen before reuse; without one, by the failed read.
        await trio.sleep(pause_s)
    await transport.aclose()
    assert (server.connections, len(server.requests)) == (3, 3)


async def test_leaving_a_response_early_closes_its_connection(
    start: Callable[[Handler], Awaitable[RawServer]],
) -> None:
    closed = trio.Event()

    async def endless(stream: trio.SocketStream, request: bytes) -> bool:
        await stream.send_all(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        try:
            while True:
                await stream.send_all(b"5\r\ntoken\r\n")
                await trio.sleep(0.01)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            closed.set()  # how a server learns that nobody reads any more
        return False

    server = await start(endless)
    transport = LeanTransport(f"http://127.0.0.1:{server.port}", timeout_s=5)
    with trio.move_on_after(0.1):
        async with transport.request("POST", "/", body=b"{}") as response:
            async for _ in response.chunks():
                pass
    with trio.fail_after(5):
        await closed.wait()
    await transport.aclose()


async def test_errors(start: Callable[[Handler], Awaitable[RawServer]]) -> None:
    async def silent(stream: trio.SocketStream, request: bytes) -> bool:
        await trio.sleep_forever()
        return False

    async def garbage(stream: trio.SocketStream, request: bytes) -> bool:
        await stream.send_all(b"SSH-2.0-OpenSSH\r\n\r\n")
        return False

    async def bad_length(stream: trio.SocketStream, request: bytes) -> bool:
        await stream.send_all(b"HTTP/1.1 200 OK\r\nContent-Length: lots\r\n\r\nshort")
        return False

    async def cut(stream: trio.SocketStream, request: bytes) -> bool:
        await stream.send_all(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nshort")
        return False

    with trio.socket.socket() as unused:
        await unused.bind(("127.0.0.1", 0))
        port = unused.getsockname()[1]
    with pytest.raises(UpstreamUnreachable):
        async with LeanTransport(f"http://127.0.0.1:{port}", timeout_s=1).request("GET", "/"):
            pass
    for handler, error in ((silent, UpstreamTimeout), (garbage, UpstreamBroken)):
        server = await start(handler)
        transport = LeanTransport(f"http://127.0.0.1:{server.port}", timeout_s=0.2)
        with pytest.raises(error):
            async with transport.request("GET", "/"):
                pass
    for handler in (cut, bad_length):
        server = await start(handler)
        transport = LeanTransport(f"http://127.0.0.1:{server.port}", timeout_s=1)
        with pytest.raises(UpstreamBroken):
            async with transport.request("GET", "/") as response:
                await response.read()


async def test_event_stream_splitting() -> None:
    async def pieces(*items: bytes) -> AsyncIterator[bytes]:
        for item in items:
            yield item

    stream = pieces(
        b"event: x\ndata: a", b"\ndata: b\n\n: comment\n\nda", b"ta:c\r\n\r\ndata: tail"
    )
    assert await _collect(stream) == [b"a\nb", b"c", b"tail"]


def test_transport_by_scheme() -> None:
    assert isinstance(open_transport("http://127.0.0.1:1/v1", timeout_s=1), LeanTransport)
    assert isinstance(open_transport("https://api.example/v1", timeout_s=1), HttpxTransport)


async def _chunks(*pieces: bytes) -> AsyncIterator[bytes]:
    for piece in pieces:
        yield piece


async def test_sse_batches_hand_over_every_event_of_a_chunk_at_once() -> None:
    pieces = (
        b"data: a\n\ndata:b\n\nda",
        b"ta: c\r",
        b"\n\r\nevent: x\ndata: d1\ndata: d2\n\n: a comment\n\nevent: no data\n\n",
        b"data: e",
    )
    batches = [batch async for batch in sse_batches(_chunks(*pieces))]
    assert batches == [[b"a", b"b"], [b"c", b"d1\nd2"], [b"e"]]
    # sse_data is the same events one by one.
    assert [d async for d in sse_data(_chunks(*pieces))] == [b"a", b"b", b"c", b"d1\nd2", b"e"]


async def test_chunked_bodies_in_any_split(
    start: Callable[[Handler], Awaitable[RawServer]],
) -> None:
    big = b"b" * 100_000  # above the size decoded whole: streamed in pieces
    body = (
        b"3\r\nabc\r\n4;ext=1\r\ndefg\r\n"  # several chunks in one read, an extension
        + b"%x\r\n%s\r\n" % (len(big), big)
        + b"5\r\nhijkl\r\n0\r\nTrailer: x\r\n\r\n"
    )

    async def reply(stream: trio.SocketStream, request: bytes) -> bool:
        await stream.send_all(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        for at in range(0, len(body), 7919):  # splits inside size lines, data and CRLFs
            await stream.send_all(body[at : at + 7919])
            await trio.sleep(0.001)
        return True

    server = await start(reply)
    transport = LeanTransport(f"http://127.0.0.1:{server.port}", timeout_s=5)
    try:
        for _ in range(2):  # the connection is reused after the trailers
            async with transport.request("GET", "/") as response:
                assert await response.read() == b"abcdefg" + big + b"hijkl"
    finally:
        await transport.aclose()
    assert server.connections == 1
