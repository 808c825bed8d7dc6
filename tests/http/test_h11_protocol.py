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

from pool.http._h11_protocol import DISCONNECT_HOOK, DisconnectHook, PoolH11Protocol, install

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


async def test_the_disconnect_hook_cancels_the_app_when_its_client_leaves() -> None:
    """The app registers a cancel scope with the request's hook and waits forever; the
    client's close cancels it, with no task of the app's waiting for ``http.disconnect``."""
    install()
    cancelled = trio.Event()

    async def app(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        hook = scope["extensions"][DISCONNECT_HOOK]
        assert isinstance(hook, DisconnectHook) and not hook.closed
        with trio.CancelScope() as waiting:
            hook.cancels(waiting)
            await trio.sleep_forever()
        assert waiting.cancelled_caught
        cancelled.set()

    config = Config()
    config.bind = ["127.0.0.1:0"]
    async with trio.open_nursery() as nursery:
        binds = await nursery.start(serve, app, config)
        port = int(binds[0].rsplit(":", 1)[1])
        client = await trio.open_tcp_stream("127.0.0.1", port)
        await client.send_all(_REQUEST)
        await trio.sleep(0.2)
        assert not cancelled.is_set()
        await client.aclose()
        with trio.fail_after(2):
            await cancelled.wait()
        nursery.cancel_scope.cancel()


def test_a_hook_registered_after_its_stream_closed_cancels_at_once() -> None:
    hook = DisconnectHook()
    hook.close()
    scope = trio.CancelScope()
    hook.cancels(scope)
    assert scope.cancel_called
