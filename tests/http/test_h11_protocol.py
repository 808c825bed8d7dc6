"""The held head (pool/http/_h11_protocol.py): a sized answer in one write, a stream's head
at once, and the same bytes on the wire as Hypercorn's own protocol writes."""

from __future__ import annotations

from typing import Any

import h11
import hypercorn.protocol
import trio
from hypercorn.config import Config
from hypercorn.events import Event, RawData
from hypercorn.protocol.events import Body, EndBody, Response, StreamClosed
from hypercorn.protocol.h11 import H11Protocol
from hypercorn.trio import serve
from hypercorn.trio.worker_context import WorkerContext

from pool.http._h11_protocol import PoolH11Protocol, install

_REQUEST = b"GET /x HTTP/1.1\r\nhost: pool\r\n\r\n"


def _protocol(kind: type[H11Protocol]) -> tuple[H11Protocol, list[Any]]:
    """A protocol of ``kind`` that has read one request, and the writes it makes (any
    other event it sends to the connection: its name)."""
    writes: list[Any] = []

    async def send(event: Event) -> None:
        writes.append(event.data if isinstance(event, RawData) else type(event).__name__)

    config = Config()
    config.include_date_header = False  # the same head from both protocols
    config.include_server_header = False
    context: Any = WorkerContext(None)
    protocol = kind(None, config, context, None, {}, False, None, None, send)  # type: ignore[arg-type]
    connection = protocol.connection
    assert isinstance(connection, h11.Connection)
    connection.receive_data(_REQUEST)
    assert isinstance(connection.next_event(), h11.Request)
    assert isinstance(connection.next_event(), h11.EndOfMessage)
    return protocol, writes


async def _answer(protocol: H11Protocol, events: list[Any]) -> None:
    for event in events:
        await protocol.stream_send(event)


def _sized(body: bytes) -> list[Any]:
    head = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    return [
        Response(stream_id=1, headers=head, status_code=200),
        Body(stream_id=1, data=body),
        EndBody(stream_id=1),
    ]


async def test_a_sized_answer_is_one_write_of_the_same_bytes() -> None:
    body = b'{"id":"x","object":"chat.completion"}'
    held, held_writes = _protocol(PoolH11Protocol)
    plain, plain_writes = _protocol(H11Protocol)
    await _answer(held, _sized(body))
    await _answer(plain, _sized(body))
    assert len(held_writes) == 1
    assert len(plain_writes) == 3  # head, body, the empty end: what the class saves
    assert held_writes[0] == b"".join(plain_writes)
    assert held_writes[0].endswith(b"\r\n\r\n" + body)


async def test_a_stream_head_goes_out_before_its_first_event() -> None:
    held, writes = _protocol(PoolH11Protocol)
    head = [(b"content-type", b"text/event-stream"), (b"transfer-encoding", b"chunked")]
    await held.stream_send(Response(stream_id=1, headers=head, status_code=200))
    assert len(writes) == 1 and writes[0].startswith(b"HTTP/1.1 200 ")
    await held.stream_send(Body(stream_id=1, data=b"data: 1\n\n"))
    await held.stream_send(EndBody(stream_id=1))
    assert writes[1:] == [b"9\r\ndata: 1\n\n\r\n", b"0\r\n\r\n"]


async def test_a_head_held_when_the_stream_closes_is_written_first() -> None:
    # The app sent its head and failed before the body: the head goes out, as before.
    held, writes = _protocol(PoolH11Protocol)
    plain, plain_writes = _protocol(H11Protocol)
    head = [(b"content-length", b"10")]
    await held.stream_send(Response(stream_id=1, headers=head, status_code=200))
    await plain.stream_send(Response(stream_id=1, headers=head, status_code=200))
    assert writes == []
    await held.stream_send(StreamClosed(stream_id=1))
    await plain.stream_send(StreamClosed(stream_id=1))
    assert writes == plain_writes
    assert writes[0].startswith(b"HTTP/1.1 200 ") and writes[1:] == ["Closed"]


def test_install_is_idempotent_and_swaps_hypercorns_class() -> None:
    install()
    install()
    assert getattr(hypercorn.protocol, "H11Protocol") is PoolH11Protocol  # noqa: B009


async def _one_answer_then_close(keep_alive_s: float) -> float:
    """Seconds from a client's close, after one answer on a kept-alive connection, to
    the server's own close (its end of file on the client's socket), with Hypercorn
    serving through whatever protocol is installed."""

    async def app(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        head = [(b"content-length", b"2")]
        await send({"type": "http.response.start", "status": 200, "headers": head})
        await send({"type": "http.response.body", "body": b"ok"})

    config = Config()
    config.bind = ["127.0.0.1:0"]
    config.keep_alive_timeout = keep_alive_s
    async with trio.open_nursery() as nursery:
        binds = await nursery.start(serve, app, config)
        port = int(binds[0].rsplit(":", 1)[1])
        client = await trio.open_tcp_stream("127.0.0.1", port)
        await client.send_all(_REQUEST)
        answer = b""
        while not answer.endswith(b"ok"):
            answer += await client.receive_some()
        assert answer.startswith(b"HTTP/1.1 200")
        await trio.sleep(0.2)  # the answer is done: the keep-alive timer runs
        await client.send_eof()
        closed_from = trio.current_time()
        with trio.fail_after(keep_alive_s * 2):
            while await client.receive_some():
                pass
        waited = trio.current_time() - closed_from
        await client.aclose()
        nursery.cancel_scope.cancel()
    return waited


async def test_a_connection_closed_between_requests_is_closed_at_once() -> None:
    """Hypercorn alone holds the socket (CLOSE_WAIT: an fd and two tasks) until the
    keep-alive timer ends; the pool's protocol closes it when the client does."""
    keep_alive_s = 4.0
    try:
        setattr(hypercorn.protocol, "H11Protocol", H11Protocol)  # noqa: B010
        assert await _one_answer_then_close(keep_alive_s) >= keep_alive_s - 0.5  # the defect
        install()
        assert await _one_answer_then_close(keep_alive_s) < keep_alive_s / 2
    finally:
        install()
