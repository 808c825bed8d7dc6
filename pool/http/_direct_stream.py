"""A client's connection read and written through its socket's descriptor directly.

Trio's ``SocketStream.receive_some`` and ``send_all`` pass through the scheduler after
every call that did not have to wait (a checkpoint, by Trio's convention that every
``await`` of its API is one). A JSON request makes two reads and two writes on its
client connection, and each such pass runs the scheduler's whole step for the task
(``benchmarks.pertoken_counts --per-request`` splits wake-ups by what woke the task).
:class:`DirectSocketStream` waits only when the socket is not ready. A read that does
not wait takes at most what the socket's buffer holds, so no connection keeps the loop
for longer than that.

Hypercorn's connection (pool/http/_keep_alive.py's ``PoolTCPServer``) uses it for plain
TCP, and takes its write lock without a scheduler pass as well; a TLS connection keeps
Trio's stream. A read or write that does not wait is no cancellation point either; the
connection's task passes through the scheduler at its next wait, at the latest when
Hypercorn's channel to the app is full (pool/http/_h11_protocol.py).
"""

from __future__ import annotations

import errno
import os

import trio

# A descriptor closed under the stream: Trio's own stream says ClosedResourceError too.
_CLOSED = {errno.EBADF, errno.ENOTSOCK}


class DirectSocketStream:
    """What Hypercorn's ``TCPServer`` uses of a :class:`trio.SocketStream` (``socket``,
    ``receive_some``, ``send_all``, ``send_eof``, ``aclose``), with the same errors:
    :class:`trio.ClosedResourceError` once closed, :class:`trio.BrokenResourceError`
    when the connection broke."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self._stream = stream
        self.socket = stream.socket

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        while True:
            fd = self._fd()
            try:
                return os.read(fd, max_bytes or 65536)
            except BlockingIOError:
                pass
            except OSError as exc:
                raise _stream_error(exc) from exc
            await trio.lowlevel.wait_readable(fd)

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        if self.socket.did_shutdown_SHUT_WR:
            raise trio.ClosedResourceError("can't send data after sending EOF")
        view = memoryview(data)
        while view:
            fd = self._fd()
            try:
                view = view[os.write(fd, view) :]
            except BlockingIOError:
                await trio.lowlevel.wait_writable(fd)
            except OSError as exc:
                raise _stream_error(exc) from exc

    async def send_eof(self) -> None:
        await self._stream.send_eof()

    async def aclose(self) -> None:
        await self._stream.aclose()

    def _fd(self) -> int:
        # Asked each time, never kept: a closed socket says -1, not a number the kernel
        # may since have given to another connection.
        fd = self.socket.fileno()
        if fd == -1:
            raise trio.ClosedResourceError("this socket was already closed")
        return fd


def _stream_error(exc: OSError) -> trio.ClosedResourceError | trio.BrokenResourceError:
    if exc.errno in _CLOSED:
        return trio.ClosedResourceError("this socket was already closed")
    return trio.BrokenResourceError(f"socket connection broken: {exc}")
