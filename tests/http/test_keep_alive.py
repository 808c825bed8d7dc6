"""One keep-alive timer task per connection (pool/http/_keep_alive.py): Hypercorn's
meaning (an idle connection closes after the timeout, a busy one never, an idle one at
once when the server terminates) without a task started for every request."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

import hypercorn.trio.run
import trio
from hypercorn.config import Config
from hypercorn.trio import serve
from hypercorn.trio.tcp_server import TCPServer

from pool.http._h11_protocol import install as install_h11_protocol
from pool.http._keep_alive import PoolTCPServer, install

_REQUEST = b"GET /x HTTP/1.1\r\nhost: pool\r\n\r\n"


async def _app(scope: Any, receive: Any, send: Any) -> None:
    """Answers ``ok``; ``GET /slow`` after 1.5 s."""
    if scope["type"] == "lifespan":
        while (await receive())["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})
        return
    if scope["path"] == "/slow":
        await trio.sleep(1.5)
    await send(
        {"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]}
    )
    await send({"type": "http.response.body", "body": b"ok"})


@asynccontextmanager
async def _serving(keep_alive_s: float) -> AsyncIterator[tuple[int, trio.Event]]:
    """Hypercorn serving :func:`_app` with whatever connection class is installed: its
    port, and the event that shuts it down."""
    config = Config()
    config.bind = ["127.0.0.1:0"]
    config.keep_alive_timeout = keep_alive_s
    config.graceful_timeout = 5
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        binds = await nursery.start(partial(serve, _app, config, shutdown_trigger=stop.wait))
        yield int(binds[0].rsplit(":", 1)[1]), stop
        nursery.cancel_scope.cancel()


async def _ask(client: trio.SocketStream, path: str = "/x") -> None:
    await client.send_all(_REQUEST.replace(b"/x", path.encode()))
    answer = b""
    while not answer.endswith(b"ok"):
        answer += await client.receive_some()
    assert answer.startswith(b"HTTP/1.1 200")


async def _closed_within(client: trio.SocketStream, seconds: float) -> float:
    """Seconds until the server closes ``client``'s connection (fails past ``seconds``)."""
    began = trio.current_time()
    with trio.fail_after(seconds):
        while await client.receive_some():
            pass
    return trio.current_time() - began


async def test_an_idle_connection_closes_after_the_timeout_and_a_busy_one_does_not() -> None:
    install_h11_protocol()
    install()
    async with _serving(keep_alive_s=1.0) as (port, _):
        client = await trio.open_tcp_stream("127.0.0.1", port)
        await _ask(client, "/slow")  # busy for longer than the timeout: kept
        await trio.sleep(0.5)
        await _ask(client)  # idle for half the timeout, then busy: kept, timer re-armed
        waited = await _closed_within(client, 4.0)
        assert 0.8 <= waited <= 2.5
        await client.aclose()


async def test_a_terminating_server_closes_an_idle_connection_at_once() -> None:
    install_h11_protocol()
    install()
    async with _serving(keep_alive_s=30.0) as (port, stop):
        idle = await trio.open_tcp_stream("127.0.0.1", port)
        await _ask(idle)
        stop.set()
        assert await _closed_within(idle, 3.0) < 1.0
        await idle.aclose()


async def test_a_server_terminating_while_busy_answers_then_closes() -> None:
    install_h11_protocol()
    install()
    async with _serving(keep_alive_s=30.0) as (port, stop):
        busy = await trio.open_tcp_stream("127.0.0.1", port)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_ask, busy, "/slow")
            await trio.sleep(0.5)
            stop.set()
        assert await _closed_within(busy, 3.0) < 1.0
        await busy.aclose()


class _Spawned(trio.abc.Instrument):
    def __init__(self) -> None:
        self.count = 0

    def task_spawned(self, task: trio.lowlevel.Task) -> None:
        self.count += 1


async def _one_answer_then_close(keep_alive_s: float) -> float:
    """Seconds from a client's close, after one answer on a kept-alive connection, to the
    server's own close (its end of file on the client's socket)."""
    async with _serving(keep_alive_s) as (port, _):
        client = await trio.open_tcp_stream("127.0.0.1", port)
        await _ask(client)
        await trio.sleep(0.2)  # the answer is done: the keep-alive timer runs
        await client.send_eof()
        waited = await _closed_within(client, keep_alive_s * 2)
        await client.aclose()
    return waited


async def test_a_connection_closed_between_requests_is_closed_at_once() -> None:
    """Hypercorn's connection holds the socket (CLOSE_WAIT: an fd and two tasks) until its
    keep-alive timer ends; the pool's closes it when the client does."""
    keep_alive_s = 4.0
    install_h11_protocol()
    try:
        setattr(hypercorn.trio.run, "TCPServer", TCPServer)  # noqa: B010
        assert await _one_answer_then_close(keep_alive_s) >= keep_alive_s - 0.5  # the defect
        install()
        assert await _one_answer_then_close(keep_alive_s) < keep_alive_s / 2
    finally:
        install()


async def _tasks_per_request() -> float:
    """Tasks started per request on one kept-alive connection, whatever is installed."""
    async with _serving(keep_alive_s=30.0) as (port, _):
        client = await trio.open_tcp_stream("127.0.0.1", port)
        await _ask(client)  # the connection and its timer are started
        spawned = _Spawned()
        trio.lowlevel.add_instrument(spawned)
        try:
            for _ in range(20):
                await _ask(client)
        finally:
            trio.lowlevel.remove_instrument(spawned)
        await client.aclose()
    return spawned.count / 20


async def test_a_request_on_a_kept_alive_connection_starts_no_timer_task() -> None:
    """Hypercorn starts the app's task and a new timer task per request; the pool's
    connection, the app's alone."""
    install_h11_protocol()
    try:
        setattr(hypercorn.trio.run, "TCPServer", TCPServer)  # noqa: B010
        assert await _tasks_per_request() == 2
        install()
        assert await _tasks_per_request() == 1
    finally:
        install()


def test_install_is_idempotent_and_swaps_hypercorns_class() -> None:
    install()
    install()
    assert getattr(hypercorn.trio.run, "TCPServer") is PoolTCPServer  # noqa: B009
