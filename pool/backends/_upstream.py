"""HTTP transports for upstream servers, and the Server-Sent Events splitter.

Every token a managed ``llama-server`` or ``vllm serve`` generates crosses this code, so
the transport for plain ``http://`` upstreams is a small HTTP/1.1 client on Trio
sockets: httpx (httpcore, h11, line decoding) cost about a millisecond of time to first
token and several percent of generation speed on two cores, where every cycle the
relay spends is taken from the server's compute threads. ``https://`` upstreams (cloud
APIs, where TLS, proxies and the network dominate) keep httpx behind the same interface.

Both transports raise :class:`UpstreamUnreachable` (no connection, the request was not
taken), :class:`UpstreamTimeout` and :class:`UpstreamBroken` (the exchange broke off).
"""

from __future__ import annotations

import contextlib
import json
import os
import select
from collections.abc import AsyncIterator, Iterator, Mapping
from typing import Any, Protocol
from urllib.parse import urlsplit

import httpx
import trio

from pool.errors import BackendError, PoolError


class UpstreamError(Exception):
    """The exchange with the upstream failed."""


class UpstreamUnreachable(UpstreamError):
    """No connection: the upstream never saw the request, so it can be retried."""


class UpstreamTimeout(UpstreamError):
    """The upstream did not connect or send within the timeout."""


class UpstreamBroken(UpstreamError):
    """The connection closed early or the response was not valid HTTP."""


class UpstreamResponse(Protocol):
    status: int

    @property
    def headers(self) -> Mapping[str, str]:
        """The response's headers, names in lower case."""
        ...

    def chunks(self) -> AsyncIterator[bytes]:
        """The body as it arrives (decoded from its transfer framing)."""
        ...

    async def read(self) -> bytes:
        """The whole body."""
        ...


class Transport(Protocol):
    def request(
        self,
        method: str,
        path: str,
        *,
        body: bytes | None = None,
        headers: Mapping[str, str] | None = None,
        timeout_s: float | None = None,
    ) -> contextlib.AbstractAsyncContextManager[UpstreamResponse]:
        """Send one request; the response is open until the block ends."""
        ...

    async def aclose(self) -> None: ...


def open_transport(
    base_url: str, *, timeout_s: float, connect_timeout_s: float = 10.0
) -> Transport:
    """The lean client for ``http://`` URLs, httpx for anything else."""
    if urlsplit(base_url).scheme == "http":
        return LeanTransport(base_url, timeout_s=timeout_s, connect_timeout_s=connect_timeout_s)
    return HttpxTransport(base_url, timeout_s=timeout_s, connect_timeout_s=connect_timeout_s)


async def sse_data(chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """The ``data`` of each Server-Sent Event in ``chunks`` (multi-line data joined)."""
    async for batch in sse_batches(chunks):
        for data in batch:
            yield data


async def sse_batches(chunks: AsyncIterator[bytes]) -> AsyncIterator[list[bytes]]:
    """The ``data`` of the Server-Sent Events in ``chunks``, a list per chunk received.

    A relay at full speed reads many events per chunk: splitting them in one pass and
    handing them over together costs one step of the caller's loop per read, not one per
    token. Each event is usually one ``data:`` line; anything else (several lines,
    comments, other fields, CRLF line ends) takes the line-by-line path.
    """
    buffer = b""  # the start of an event whose blank line has not arrived yet
    async for chunk in chunks:
        if b"\r" in chunk or b"\r" in buffer[-1:]:
            buffer = (buffer + chunk).replace(b"\r\n", b"\n")
        else:
            buffer += chunk
        blocks = buffer.split(b"\n\n")
        buffer = blocks.pop()
        out: list[bytes] = []
        for block in blocks:
            if block.startswith(b"data:") and b"\n" not in block:
                out.append(_field_value(block))
            elif (data := _block_data(block)) is not None:
                out.append(data)
        if out:
            yield out
    # A stream that ends without the last blank line still delivers its last event.
    if (data := _block_data(buffer.removesuffix(b"\r"))) is not None:
        yield [data]


def _block_data(block: bytes) -> bytes | None:
    """The data of one event (None: it has no ``data`` field)."""
    lines = [_field_value(line) for line in block.split(b"\n") if line.startswith(b"data:")]
    return b"\n".join(lines) if lines else None


def _field_value(line: bytes) -> bytes:
    value = line[5:]  # after "data:"
    return value[1:] if value.startswith(b" ") else value


def with_trace(headers: dict[str, str] | None, trace_parent: str | None) -> dict[str, str] | None:
    """``headers`` with the request's ``traceparent`` where it is traced: the upstream's
    spans (a traced vLLM server, a relaying peer) then join the pool's trace."""
    if trace_parent is None:
        return headers
    return {**(headers or {}), "traceparent": trace_parent}


# --- the lean HTTP/1.1 client ---------------------------------------------------------

_MAX_HEAD = 64 * 1024


class _Connection:
    """One TCP connection and the bytes read from it but not consumed yet.

    Reads and writes go to the socket's descriptor directly and wait only when the
    socket is not ready. Trio's ``receive_some`` and ``send_all`` add a pass through the
    scheduler after every call that did not wait (``benchmarks.pertoken_counts
    --per-request``: 1.7 of the 18.8 task wake-ups of a pass-through JSON request). The
    relay needs none of them: each chunk read is handed to the request's sink, whose send
    is itself a checkpoint.
    """

    __slots__ = ("buffer", "read_timeout_s", "socket", "stream")

    def __init__(self, stream: trio.SocketStream, read_timeout_s: float) -> None:
        self.stream = stream
        self.socket = stream.socket
        self.buffer = bytearray()
        self.read_timeout_s = read_timeout_s

    @property
    def fd(self) -> int:
        # Asked each time, never kept: once the stream is closed this is -1 (EBADF), not
        # a number the kernel may have given to another connection since.
        return self.socket.fileno()

    async def fill(self) -> None:
        """Add what arrives next to :attr:`buffer`, waiting at most ``read_timeout_s``."""
        deadline = trio.current_time() + self.read_timeout_s
        while True:
            fd = self.fd
            try:
                data = os.read(fd, 65536)
                break
            except BlockingIOError:
                pass
            except OSError as exc:
                raise UpstreamBroken(f"connection lost: {exc}") from exc
            with trio.move_on_at(deadline) as waiting:
                await trio.lowlevel.wait_readable(fd)
            if waiting.cancelled_caught:
                raise UpstreamTimeout(f"no data within {self.read_timeout_s:g}s")
        if not data:
            raise UpstreamBroken("the upstream closed the connection")
        self.buffer += data

    async def send(self, message: bytes) -> None:
        """Write all of ``message``, waiting only while the socket's buffer is full."""
        view = memoryview(message)
        while view:
            fd = self.fd
            try:
                view = view[os.write(fd, view) :]
            except BlockingIOError:
                await trio.lowlevel.wait_writable(fd)
            except OSError as exc:
                raise UpstreamBroken(f"sending failed: {exc}") from exc

    async def read_line(self) -> bytes:
        while (end := self.buffer.find(b"\r\n")) < 0:
            if len(self.buffer) > _MAX_HEAD:
                raise UpstreamBroken("response line too long")
            await self.fill()
        line = bytes(self.buffer[:end])
        del self.buffer[: end + 2]
        return line

    def take(self, size: int) -> bytes:
        data = bytes(self.buffer[:size])
        del self.buffer[:size]
        return data


_SMALL_CHUNK = 64 * 1024


def _complete_chunks(buffer: bytearray) -> tuple[bytes, str]:
    """Decode and remove the chunks of a chunked body that ``buffer`` holds whole.

    Returns the data and what comes next: ``"more"`` (a chunk of up to 64 KiB, or its
    size line, is still arriving: read and call again), ``"end"`` (the last chunk came;
    its trailers are left in ``buffer``) or ``"stream"`` (a larger chunk, or a bad size
    line: the caller's chunk-by-chunk path takes it, and reports a bad one).
    """
    # An event stream sends a chunk per event, so this loop runs once per token: it
    # keeps to the fewest calls a chunk (a find, an int, a slice, an append).
    pieces: list[bytearray] = []
    append = pieces.append
    find = buffer.find
    at = 0
    held = len(buffer)
    state = "more"
    while True:
        end = find(b"\r\n", at)
        if end < 0:
            if held - at > 64:  # no size line is this long
                state = "stream"
            break
        try:
            size = int(buffer[at:end], 16)
        except ValueError:
            try:  # a chunk extension (";name=value") after the size
                size = int(buffer[at:end].split(b";", 1)[0], 16)
            except ValueError:
                state = "stream"
                break
        if size == 0:
            at, state = end + 2, "end"
            break
        if size > _SMALL_CHUNK:
            state = "stream"
            break
        if held < end + 4 + size:  # the rest of this chunk is still arriving
            break
        append(buffer[end + 2 : end + 2 + size])
        at = end + 4 + size
    del buffer[:at]
    return b"".join(pieces), state


class LeanResponse:
    def __init__(self, connection: _Connection, status: int, headers: dict[str, str]) -> None:
        self.status = status
        self.headers = headers
        self._connection = connection
        self.complete = False

    @property
    def reusable(self) -> bool:
        return self.complete and self.headers.get("connection", "").lower() != "close"

    async def chunks(self) -> AsyncIterator[bytes]:
        connection = self._connection
        if self.complete:
            return
        if self.status in (204, 304):  # never a body
            pass
        elif "chunked" in self.headers.get("transfer-encoding", "").lower():
            while True:
                # Every chunk already read goes out as one piece: an event stream sends a
                # chunk per token, and a relay that fell behind should not pay a step
                # per token to catch up.
                ready, state = _complete_chunks(connection.buffer)
                if ready:
                    yield ready
                if state == "end":
                    while await connection.read_line():  # trailers, then a blank line
                        pass
                    break
                if state == "more":
                    await connection.fill()
                    continue
                size_line = await connection.read_line()
                try:
                    remaining = int(size_line.split(b";", 1)[0], 16)
                except ValueError:
                    raise UpstreamBroken(f"bad chunk size {size_line[:40]!r}") from None
                if remaining == 0:
                    while await connection.read_line():  # trailers, then a blank line
                        pass
                    break
                while remaining:
                    if not connection.buffer:
                        await connection.fill()
                    piece = connection.take(remaining)
                    remaining -= len(piece)
                    yield piece
                while len(connection.buffer) < 2:
                    await connection.fill()
                del connection.buffer[:2]
        elif (length := self.headers.get("content-length")) is not None:
            if not length.isdigit():
                raise UpstreamBroken(f"bad Content-Length {length[:40]!r}")
            remaining = int(length)
            while remaining:
                if not connection.buffer:
                    await connection.fill()
                piece = connection.take(remaining)
                remaining -= len(piece)
                yield piece
        else:  # the body ends when the connection does
            self.headers["connection"] = "close"
            while True:
                if connection.buffer:
                    yield connection.take(len(connection.buffer))
                try:
                    await connection.fill()
                except UpstreamBroken:
                    break
        self.complete = True

    async def read(self) -> bytes:
        return b"".join([piece async for piece in self.chunks()])


class LeanTransport:
    """HTTP/1.1 to one ``http://host:port`` with kept-alive connections.

    Args:
        base_url: ``http://host:port``; request paths are appended to it.
        timeout_s: the longest wait for any read (not for the whole response).
        connect_timeout_s: the longest wait for a connection.
        max_idle: connections kept for reuse.
    """

    def __init__(
        self,
        base_url: str,
        *,
        timeout_s: float,
        connect_timeout_s: float = 10.0,
        max_idle: int = 64,
    ) -> None:
        parts = urlsplit(base_url)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"not an http:// URL: {base_url!r}")
        self.host = parts.hostname
        self.port = parts.port or 80
        self._prefix = parts.path.rstrip("/")
        self._host_header = parts.netloc
        self._timeout_s = timeout_s
        self._connect_timeout_s = connect_timeout_s
        self._max_idle = max_idle
        self._idle: list[_Connection] = []
        self._closed = False

    async def _connect(self, read_timeout_s: float) -> _Connection:
        with trio.move_on_after(self._connect_timeout_s) as waiting:
            try:
                stream = await trio.open_tcp_stream(self.host, self.port)
            except OSError as exc:
                raise UpstreamUnreachable(f"cannot connect to {self._host_header}: {exc}") from exc
        if waiting.cancelled_caught:
            raise UpstreamTimeout(
                f"no connection to {self._host_header} within {self._connect_timeout_s:g}s"
            )
        return _Connection(stream, read_timeout_s)

    @contextlib.asynccontextmanager
    async def request(
        self,
        method: str,
        path: str,
        *,
        body: bytes | None = None,
        headers: Mapping[str, str] | None = None,
        timeout_s: float | None = None,
    ) -> AsyncIterator[LeanResponse]:
        if self._closed:
            raise UpstreamUnreachable("the client is closed")
        head = [f"{method} {self._prefix}{path} HTTP/1.1\r\nHost: {self._host_header}\r\n"]
        if body is not None:
            # JSON unless the caller names the body's type (a forwarded multipart form).
            if not _names_content_type(headers):
                head.append("Content-Type: application/json\r\n")
            head.append(f"Content-Length: {len(body)}\r\n")
        head.extend(f"{name}: {value}\r\n" for name, value in (headers or {}).items())
        message = "".join(head).encode("latin-1") + b"\r\n" + (body or b"")
        read_timeout = self._timeout_s if timeout_s is None else timeout_s
        connection, response = await self._exchange(message, read_timeout)
        try:
            yield response
        except BaseException:
            # Left mid-response (an error or a cancelled request): the connection's
            # state is unknown, and closing it is how the upstream learns to stop.
            await _close(connection)
            raise
        if response.reusable and not self._closed and len(self._idle) < self._max_idle:
            self._idle.append(connection)
        else:
            await _close(connection)

    async def _exchange(
        self, message: bytes, read_timeout: float
    ) -> tuple[_Connection, LeanResponse]:
        while self._idle:
            connection = self._idle.pop()
            if _closed_by_peer(connection):
                await _close(connection)
                continue
            connection.read_timeout_s = read_timeout
            try:
                return connection, await self._send(connection, message)
            except UpstreamBroken:
                # The server closed the idle connection before it read the request
                # (nothing came back): the request never ran, so a new one may send it.
                await _close(connection)
            except BaseException:
                await _close(connection)
                raise
        connection = await self._connect(read_timeout)
        try:
            return connection, await self._send(connection, message)
        except BaseException:
            await _close(connection)
            raise

    async def _send(self, connection: _Connection, message: bytes) -> LeanResponse:
        await connection.send(message)
        while True:
            status_line = await connection.read_line()
            parts = status_line.split(None, 2)
            if len(parts) < 2 or not parts[0].startswith(b"HTTP/") or not parts[1].isdigit():
                raise UpstreamBroken(f"not an HTTP response: {status_line[:80]!r}")
            status = int(parts[1])
            headers: dict[str, str] = {}
            while line := await connection.read_line():
                name, _, value = line.decode("latin-1").partition(":")
                headers[name.strip().lower()] = value.strip()
            if parts[0] == b"HTTP/1.0" and "keep-alive" not in headers.get("connection", ""):
                headers["connection"] = "close"
            if status != 100:  # an interim "100 Continue" is followed by the real one
                return LeanResponse(connection, status, headers)

    async def aclose(self) -> None:
        self._closed = True
        idle, self._idle = self._idle, []
        for connection in idle:
            await _close(connection)


def _names_content_type(headers: Mapping[str, str] | None) -> bool:
    return any(name.lower() == "content-type" for name in headers or ())


def _closed_by_peer(connection: _Connection) -> bool:
    # An idle connection has nothing to read unless the server closed it (EOF). poll,
    # not select: select fails for descriptors above 1023.
    poller = select.poll()
    poller.register(connection.fd, select.POLLIN)
    return bool(poller.poll(0) or connection.buffer)


async def _close(connection: _Connection) -> None:
    with trio.CancelScope(shield=True):
        await connection.stream.aclose()


# --- httpx, for https:// ----------------------------------------------------------------


class _HttpxResponse:
    def __init__(self, response: httpx.Response) -> None:
        self.status = response.status_code
        self.headers: Mapping[str, str] = {k.lower(): v for k, v in response.headers.items()}
        self._response = response

    async def chunks(self) -> AsyncIterator[bytes]:
        with _httpx_errors():
            async for piece in self._response.aiter_bytes():
                yield piece

    async def read(self) -> bytes:
        with _httpx_errors():
            return await self._response.aread()


@contextlib.contextmanager
def _httpx_errors() -> Iterator[None]:
    try:
        yield
    except httpx.TimeoutException as exc:
        raise UpstreamTimeout(f"{type(exc).__name__}") from exc
    except (httpx.ConnectError, httpx.UnsupportedProtocol) as exc:
        raise UpstreamUnreachable(f"{type(exc).__name__}: {exc}") from exc
    except httpx.HTTPError as exc:
        raise UpstreamBroken(f"{type(exc).__name__}: {exc}") from exc


class HttpxTransport:
    """The same interface over httpx (TLS, proxies from the environment, HTTP/1.1)."""

    def __init__(self, base_url: str, *, timeout_s: float, connect_timeout_s: float = 10.0) -> None:
        self._base = base_url.rstrip("/")
        self._client = httpx.AsyncClient(
            timeout=httpx.Timeout(timeout_s, connect=min(connect_timeout_s, timeout_s)),
            limits=httpx.Limits(max_keepalive_connections=64),
        )

    @contextlib.asynccontextmanager
    async def request(
        self,
        method: str,
        path: str,
        *,
        body: bytes | None = None,
        headers: Mapping[str, str] | None = None,
        timeout_s: float | None = None,
    ) -> AsyncIterator[_HttpxResponse]:
        all_headers = dict(headers or {})
        if body is not None and not _names_content_type(headers):
            all_headers["Content-Type"] = "application/json"
        request = self._client.build_request(
            method,
            self._base + path,
            content=body,
            headers=all_headers,
            timeout=httpx.USE_CLIENT_DEFAULT if timeout_s is None else timeout_s,
        )
        with _httpx_errors():
            response = await self._client.send(request, stream=True)
        try:
            yield _HttpxResponse(response)
        finally:
            with trio.CancelScope(shield=True):
                await response.aclose()

    async def aclose(self) -> None:
        with trio.CancelScope(shield=True):
            await self._client.aclose()


__all__ = [
    "HttpxTransport",
    "LeanTransport",
    "Transport",
    "UpstreamBroken",
    "UpstreamError",
    "UpstreamResponse",
    "UpstreamTimeout",
    "UpstreamUnreachable",
    "open_transport",
    "sse_batches",
    "sse_data",
]


def upstream_message(body: bytes) -> str:
    """The message of an upstream's error body (OpenAI's ``{"error": {"message"}}`` or
    anything else), cut to 500 characters for logs and client errors."""
    try:
        data = json.loads(body)
    except ValueError:
        return body.decode("utf-8", "replace")[:500]
    error = data.get("error") if isinstance(data, dict) else None
    if isinstance(error, dict):
        return str(error.get("message") or error)[:500]
    return str(error or data)[:500]


async def post_json(
    transport: Transport,
    path: str,
    body: dict[str, Any],
    headers: dict[str, str] | None,
    what: str,
    model: str,
) -> bytes:
    """POST ``body`` as JSON to ``path`` and return the 200 reply's bytes.

    Raises:
        PoolError: ``invalid_request`` when the server refuses the input (a 4xx other
            than auth, not found and rate limits: the client's to fix, not a broken
            backend), ``backend_timeout`` when it does not answer in time.
        BackendError: the connection failed, or another status came back.
    """
    payload = json.dumps(body, ensure_ascii=False).encode()
    try:
        async with transport.request("POST", path, body=payload, headers=headers) as response:
            raw = await response.read()
    except UpstreamTimeout as exc:
        raise PoolError("backend_timeout", f"{what} did not answer in time ({exc})") from exc
    except UpstreamError as exc:
        raise BackendError(f"{what} connection failed: {exc}") from exc
    if 400 <= response.status < 500 and response.status not in (401, 403, 404, 429):
        raise PoolError(
            "invalid_request", f"model {model!r}: {what} refused the input: {upstream_message(raw)}"
        )
    if response.status != 200:
        raise BackendError(f"{what} answered HTTP {response.status}: {upstream_message(raw)}")
    return raw
