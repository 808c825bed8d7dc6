"""A zero-work OpenAI-compatible upstream that streams as fast as it can.

``POST /v1/chat/completions`` (any path ending in ``/chat/completions``) answers
``max_tokens`` (default 256) chunks of one word each, then the finish chunk, the usage
chunk when ``stream_options.include_usage`` asks for it, and ``[DONE]``; without
``stream: true`` one Chat Completion. It shares the two cores with the pool and the
client it is measured against, so it must cost next to nothing per token: each answer
is encoded once per length and kept, the server is a bare asyncio protocol (no HTTP
framework, no per-request task), and one pump writes the next event of every open
stream in turn, like a batching engine whose every step yields one token per sequence,
then lets the event loop run. A stream whose client does not keep up (the transport's
buffer above its high-water mark) is skipped until it drains, so a slow reader sees
backpressure, not an unbounded buffer.

    python -m benchmarks.zero_upstream --port 0   # prints "listening on http://HOST:PORT"
"""

from __future__ import annotations

import argparse
import asyncio
import json
from functools import cache

WORD = " tok"
MODEL = "zero"


def _chunked(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def _chunk(delta: dict[str, str], finish: str | None) -> bytes:
    payload = {
        "id": "chatcmpl-zero",
        "object": "chat.completion.chunk",
        "created": 0,
        "model": MODEL,
        "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
    }
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


_STREAM_HEAD = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\n"
    b"Transfer-Encoding: chunked\r\n\r\n"
)


@cache
def stream_events(tokens: int, usage: bool) -> tuple[bytes, ...]:
    """Every write of one streamed answer, HTTP chunk framing included: the headers and
    role chunk, one per token, then the tail (finish, usage, ``[DONE]``, last chunk)."""
    head = _STREAM_HEAD + _chunked(_chunk({"role": "assistant", "content": ""}, None))
    token = _chunked(_chunk({"content": WORD}, None))
    tail = _chunk({}, "length")
    if usage:
        counts = {"prompt_tokens": 1, "completion_tokens": tokens, "total_tokens": tokens + 1}
        body = {
            "id": "chatcmpl-zero",
            "object": "chat.completion.chunk",
            "created": 0,
            "model": MODEL,
            "choices": [],
            "usage": counts,
        }
        tail += b"data: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n"
    tail += b"data: [DONE]\n\n"
    return (head, *([token] * tokens), _chunked(tail) + b"0\r\n\r\n")


@cache
def json_answer(tokens: int) -> bytes:
    body = json.dumps(
        {
            "id": "chatcmpl-zero",
            "object": "chat.completion",
            "created": 0,
            "model": MODEL,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": (WORD * tokens).strip()},
                    "logprobs": None,
                    "finish_reason": "length",
                }
            ],
            "usage": {"prompt_tokens": 1, "completion_tokens": tokens, "total_tokens": tokens + 1},
        },
        separators=(",", ":"),
    ).encode()
    return b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (
        len(body),
        body,
    )


_NOT_FOUND = b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n"


class _Stream:
    __slots__ = ("events", "next", "protocol")

    def __init__(self, protocol: _Upstream, events: tuple[bytes, ...]) -> None:
        self.protocol = protocol
        self.events = events
        self.next = 0


class _Pump:
    """Writes one event of every open stream per round, then yields to the loop."""

    def __init__(self) -> None:
        self.streams: list[_Stream] = []
        self.wake = asyncio.Event()

    def add(self, stream: _Stream) -> None:
        self.streams.append(stream)
        self.wake.set()

    async def run(self) -> None:
        while True:
            if not self.streams:
                self.wake.clear()
                await self.wake.wait()
            still: list[_Stream] = []
            wrote = False
            for stream in self.streams:
                protocol = stream.protocol
                if protocol.closed:
                    continue
                if not protocol.paused:
                    protocol.transport.write(stream.events[stream.next])
                    stream.next += 1
                    wrote = True
                if stream.next < len(stream.events):
                    still.append(stream)
                else:
                    protocol.stream_done()
            self.streams = still
            if still and not wrote:
                # Every reader is behind: sleep until one drains (no busy loop).
                self.wake.clear()
                await self.wake.wait()
            else:
                await asyncio.sleep(0)


class _Upstream(asyncio.Protocol):
    pump: _Pump

    def __init__(self) -> None:
        self.buffer = b""
        self.paused = False
        self.closed = False
        self.streaming = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.pump.wake.set()

    def pause_writing(self) -> None:
        self.paused = True

    def resume_writing(self) -> None:
        self.paused = False
        self.pump.wake.set()

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        self._serve()

    def stream_done(self) -> None:
        self.streaming = False
        self._serve()  # a request pipelined behind the stream

    def _serve(self) -> None:
        while not self.streaming:
            end = self.buffer.find(b"\r\n\r\n")
            if end < 0:
                return
            head = self.buffer[:end].decode("latin-1")
            length = 0
            for line in head.split("\r\n")[1:]:
                name, _, value = line.partition(":")
                if name.strip().lower() == "content-length":
                    length = int(value)
            if len(self.buffer) < end + 4 + length:
                return
            body = self.buffer[end + 4 : end + 4 + length]
            self.buffer = self.buffer[end + 4 + length :]
            path = head.split(" ", 2)[1]
            if not path.endswith("/chat/completions"):
                self.transport.write(_NOT_FOUND)
                continue
            request = json.loads(body or b"{}")
            tokens = int(request.get("max_completion_tokens") or request.get("max_tokens") or 256)
            if not request.get("stream"):
                self.transport.write(json_answer(tokens))
                continue
            usage = bool((request.get("stream_options") or {}).get("include_usage"))
            self.streaming = True
            self.pump.add(_Stream(self, stream_events(tokens, usage)))


async def main(port: int) -> None:
    loop = asyncio.get_running_loop()
    pump = _Pump()
    _Upstream.pump = pump
    server = await loop.create_server(_Upstream, "127.0.0.1", port, backlog=1024)
    bound = server.sockets[0].getsockname()[1]
    print(f"listening on http://127.0.0.1:{bound}", flush=True)
    await pump.run()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, default=0)
    asyncio.run(main(parser.parse_args().port))
