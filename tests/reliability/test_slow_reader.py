"""A client that reads one byte a second holds back only its own generation: the
producer stops at the bounded channel (engine.stream_buffer_tokens) plus what the
sockets hold, the pool does not buffer the rest, and another client is served meanwhile."""

from __future__ import annotations

import json
import socket

import httpx
import trio

from .conftest import start_server, wait_for

TOTAL = 5000
BUFFER = 8


async def test_a_one_byte_a_second_reader(nursery: trio.Nursery, scripted: None) -> None:
    model = {
        "backend": "scripted",
        "enabled": True,
        "target_inflight": 4,
        # ~100-byte words, so a few kernel buffers' worth is a few hundred words at most.
        "scripted_reply": " ".join(f"{i:05d}" + "x" * 95 for i in range(TOTAL)),
    }
    info = await start_server(nursery, {"m": model}, engine={"stream_buffer_tokens": BUFFER})
    runtime = info.pool.model("m").replicas[0].runtime
    host, port = info.host, info.port
    sock = trio.socket.socket()
    # A small receive window, as a slow mobile client has: what TCP holds stays small.
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    await sock.connect((host, port))
    stream = trio.SocketStream(sock)
    body = json.dumps({"model": "m", "input": "x", "stream": True}).encode()
    await stream.send_all(
        b"POST /v1/responses HTTP/1.1\r\nHost: %s:%d\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (host.encode(), port, len(body), body)
    )
    try:
        received = b""
        samples = []
        async with httpx.AsyncClient(base_url=info.url, timeout=10) as other:
            for served in range(1, 5):
                with trio.fail_after(30):
                    received += await stream.receive_some(1)
                # Meanwhile another client's request on the same model completes (bounded
                # by ten times what it takes on a loaded machine, not by the slow reader).
                with trio.fail_after(20):
                    reply = await other.post("/v1/responses", json={"model": "m", "input": "y"})
                assert reply.status_code == 200
                # Words the slow stream's generation has sent (each other reply is TOTAL).
                samples.append(runtime.sent - served * TOTAL)  # type: ignore[union-attr]
                await trio.sleep(1.0)
        # The producer is held back: it stopped far short of the reply and stays there;
        # what it got ahead is the channel plus what the two sockets' buffers hold.
        assert samples[-1] == samples[-2] == samples[-3], samples
        assert BUFFER <= samples[-1] < TOTAL // 10, samples
        assert info.pool.snapshot("m").running == 1
        assert received == b"HTTP"  # one byte a second: nothing more was read
    finally:
        await stream.aclose()
    await wait_for(lambda: info.pool.snapshot("m").running == 0, 5.0)
