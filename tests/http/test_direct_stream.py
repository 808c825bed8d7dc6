"""The client connection read and written through its descriptor (pool/http/_direct_stream.py):
the bytes and the errors of Trio's own stream, without its scheduler pass."""

from __future__ import annotations

import socket
import struct

import pytest
import trio

from pool.http._direct_stream import DirectSocketStream


def _pair() -> tuple[DirectSocketStream, trio.SocketStream]:
    ours, theirs = trio.socket.socketpair()
    return DirectSocketStream(trio.SocketStream(ours)), trio.SocketStream(theirs)


async def test_a_read_waits_for_data_and_ends_at_the_peers_eof() -> None:
    stream, peer = _pair()
    async with trio.open_nursery() as nursery:
        got: list[bytes] = []

        async def read() -> None:
            got.append(await stream.receive_some(100))

        nursery.start_soon(read)
        await trio.testing.wait_all_tasks_blocked()
        assert got == []  # waiting, not spinning
        await peer.send_all(b"hello")
    assert got == [b"hello"]
    await peer.aclose()
    assert await stream.receive_some() == b""


async def test_a_write_larger_than_the_socket_buffer_waits_for_the_reader() -> None:
    stream, peer = _pair()
    payload = bytes(range(256)) * 40_000  # 10 MB: many times the socket's buffer
    received = bytearray()
    async with trio.open_nursery() as nursery:

        async def read_all() -> None:
            while len(received) < len(payload):
                received.extend(await peer.receive_some(1 << 16))

        nursery.start_soon(read_all)
        await stream.send_all(payload)
    assert received == payload


async def test_a_closed_stream_says_closed_and_a_reset_one_broken() -> None:
    stream, peer = _pair()
    await stream.aclose()
    with pytest.raises(trio.ClosedResourceError):
        await stream.receive_some()
    with pytest.raises(trio.ClosedResourceError):
        await stream.send_all(b"x")

    listener = trio.socket.socket()
    await listener.bind(("127.0.0.1", 0))
    listener.listen()
    client = trio.socket.socket()
    await client.connect(listener.getsockname())
    accepted, _ = await listener.accept()
    stream = DirectSocketStream(trio.SocketStream(accepted))
    # An abortive close: the peer's kernel answers with a reset.
    client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    client.close()
    with pytest.raises(trio.BrokenResourceError):
        for _ in range(100):  # the first write may still be taken before the reset lands
            await stream.send_all(b"x" * 1000)
            await trio.sleep(0.01)
    listener.close()
    await stream.aclose()
    await peer.aclose()


async def test_a_write_after_send_eof_says_closed() -> None:
    stream, peer = _pair()
    await stream.send_eof()
    assert await peer.receive_some() == b""
    with pytest.raises(trio.ClosedResourceError):
        await stream.send_all(b"late")
    await stream.aclose()
    await peer.aclose()
