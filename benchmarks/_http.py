"""A small HTTP/1.1 client on raw Trio sockets, for measuring rather than for features.

httpx costs hundreds of microseconds per request in Python, which would drown the
differences these benchmarks look for; this client writes one request, reads the
status line and headers, then either a Content-Length body or a chunked stream,
timestamping each ``response.output_text.delta`` event as it arrives.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import trio

DELTA_MARK = b"event: response.output_text.delta"
# A Chat Completions chunk that carries text (OpenAI-compatible servers, llama-server).
CHAT_DELTA_MARK = b'"content":"'


@dataclass
class Result:
    status: int = 0
    started: float = 0.0
    ended: float = 0.0
    first_token: float | None = None
    token_times: list[float] = field(default_factory=list)
    tokens: int = 0
    error: str | None = None

    @property
    def latency_ms(self) -> float:
        return (self.ended - self.started) * 1000

    @property
    def ttft_ms(self) -> float | None:
        return None if self.first_token is None else (self.first_token - self.started) * 1000


class Connection:
    """One keep-alive connection to ``host:port``."""

    def __init__(self, host: str, port: int, delta_mark: bytes = DELTA_MARK) -> None:
        self.host, self.port = host, port
        self.delta_mark = delta_mark
        self._stream: trio.SocketStream | None = None
        self._buffer = b""

    async def _connect(self) -> trio.SocketStream:
        if self._stream is None:
            self._stream = await trio.open_tcp_stream(self.host, self.port)
            self._buffer = b""
        return self._stream

    async def aclose(self) -> None:
        if self._stream is not None:
            await self._stream.aclose()
            self._stream = None

    async def _read_until(self, marker: bytes) -> bytes:
        assert self._stream is not None
        while marker not in self._buffer:
            chunk = await self._stream.receive_some(65536)
            if not chunk:
                raise ConnectionError("connection closed")
            self._buffer += chunk
        head, _, self._buffer = self._buffer.partition(marker)
        return head

    async def _read_exactly(self, size: int) -> bytes:
        assert self._stream is not None
        while len(self._buffer) < size:
            chunk = await self._stream.receive_some(65536)
            if not chunk:
                raise ConnectionError("connection closed")
            self._buffer += chunk
        data, self._buffer = self._buffer[:size], self._buffer[size:]
        return data

    async def post(
        self, path: str, body: dict[str, object], headers: dict[str, str] | None = None
    ) -> Result:
        result = Result(started=time.perf_counter())
        payload = json.dumps(body).encode()
        extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
        request = (
            f"POST {path} HTTP/1.1\r\nHost: {self.host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(payload)}\r\n{extra}\r\n"
        ).encode() + payload
        try:
            reused = self._stream is not None
            stream = await self._connect()
            await stream.send_all(request)
            try:
                head = await self._read_until(b"\r\n\r\n")
            except (OSError, trio.BrokenResourceError):
                if not reused:
                    raise
                # The server closed the kept-alive connection (llama-server does after a
                # stream): the request never ran, so send it again on a new connection.
                await self.aclose()
                stream = await self._connect()
                await stream.send_all(request)
                head = await self._read_until(b"\r\n\r\n")
            lines = head.split(b"\r\n")
            result.status = int(lines[0].split()[1])
            fields = {
                k.strip().lower(): v.strip()
                for k, _, v in (line.decode("latin-1").partition(":") for line in lines[1:])
            }
            if "content-length" in fields:
                body_bytes = await self._read_exactly(int(fields["content-length"]))
                if result.status == 200 and body_bytes.startswith(b"{"):
                    result.first_token = time.perf_counter()
                    result.tokens = _tokens(json.loads(body_bytes))
            else:
                await self._read_chunked(result)
            if fields.get("connection", "").lower() == "close":
                await self.aclose()
        except (OSError, trio.BrokenResourceError, ValueError, IndexError) as exc:
            # A reset from an overloaded server is that request's error, not the run's.
            result.error = f"{type(exc).__name__}: {exc}"
            await self.aclose()
        result.ended = time.perf_counter()
        return result

    async def _receive(self) -> bytes:
        assert self._stream is not None
        chunk = await self._stream.receive_some(65536)
        if not chunk:
            raise ConnectionError("connection closed")
        return chunk

    async def _read_chunked(self, result: Result) -> None:
        # Offsets into one buffer, never slicing the whole buffer per chunk: a stream of
        # tens of thousands of small chunks must cost this client little (it shares the
        # cores with the servers it measures).
        buffer, at = self._buffer, 0
        pending = b""  # the start of an event whose end has not arrived yet
        mark, empty = self.delta_mark, self.delta_mark + b'"'
        while True:
            while (end := buffer.find(b"\r\n", at)) < 0:
                buffer, at = buffer[at:] + await self._receive(), 0
            size = int(buffer[at:end].split(b";")[0], 16)
            at = end + 2
            if size == 0:
                while (end := buffer.find(b"\r\n", at)) < 0:
                    buffer, at = buffer[at:] + await self._receive(), 0
                self._buffer = buffer[end + 2 :]
                return
            while len(buffer) - at < size + 2:
                buffer, at = buffer[at:] + await self._receive(), 0
            data = buffer[at : at + size]
            at += size + 2
            now = time.perf_counter()
            if pending or not data.endswith(b"\n\n"):
                data = pending + data
                cut = data.rfind(b"\n\n") + 2
                data, pending = data[:cut], data[cut:]
            # Whole events only; a text delta is an event with the mark (a Chat
            # Completions role chunk carries an empty content, which is not a token).
            tokens = data.count(mark) - data.count(empty)
            if tokens > 0:
                result.tokens += tokens
                result.token_times.extend([now] * tokens)
                if result.first_token is None:
                    result.first_token = now


def _tokens(answer: dict[str, Any]) -> int:
    """Output tokens of a JSON answer: the pool's envelope or a Chat Completion."""
    if isinstance(answer.get("metrics"), dict):
        return int(answer["metrics"].get("engine_output_tokens") or 0)
    if isinstance(answer.get("usage"), dict):
        return int(answer["usage"].get("completion_tokens") or 0)
    return 0
