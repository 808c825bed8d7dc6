"""A Chat Completions upstream on loopback that records every request it receives.

A real HTTP/1.1 server on a trio socket (one request per connection, then ``Connection:
close``): ``GET /v1/models`` lists one model, ``POST /v1/chat/completions`` streams the
chunks it was given. Each request is kept as it arrived (method, path, headers with
lower-case names, the JSON body), so a test can check what the pool put on the wire.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import trio


def reply_chunks(text: str = "alpha beta") -> list[dict[str, Any]]:
    """A reply streamed one word a chunk, then a finish chunk with usage."""
    words = text.split(" ")
    pieces = [w if i == 0 else " " + w for i, w in enumerate(words)]
    chunks: list[dict[str, Any]] = [
        {"choices": [{"index": 0, "delta": {"content": p}, "finish_reason": None}]} for p in pieces
    ]
    chunks.append(
        {
            "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 5, "completion_tokens": len(pieces)},
        }
    )
    return chunks


@dataclass
class Received:
    method: str
    path: str
    headers: dict[str, str]
    body: Any


@dataclass
class RecordingUpstream:
    chunks: list[dict[str, Any]] = field(default_factory=reply_chunks)
    received: list[Received] = field(default_factory=list)
    # The exact bytes of a streamed answer (in place of ``chunks``) and of an answer
    # to ``"stream": false`` (default: the streamed one): a test of the pass-through
    # relay checks that they reach the client as they were sent.
    raw_stream: bytes | None = None
    raw_reply: bytes | None = None
    port: int = 0

    @property
    def url(self) -> str:
        """The base URL a model's ``remote_base_url`` names."""
        return f"http://127.0.0.1:{self.port}/v1"

    def posted(self) -> list[Any]:
        """The bodies of the chat completions received, in order."""
        return [r.body for r in self.received if r.path == "/v1/chat/completions"]

    async def run(self, *, task_status: trio.TaskStatus[RecordingUpstream]) -> None:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        self.port = listeners[0].socket.getsockname()[1]
        task_status.started(self)
        await trio.serve_listeners(self._answer, listeners)

    async def _answer(self, stream: trio.SocketStream) -> None:
        async with stream:
            data = b""
            while b"\r\n\r\n" not in data:
                chunk = await stream.receive_some()
                if not chunk:
                    return
                data += chunk
            head, _, body = data.partition(b"\r\n\r\n")
            lines = head.decode("latin-1").split("\r\n")
            method, path, _ = lines[0].split(" ", 2)
            headers = {k.lower(): v for k, v in (line.split(": ", 1) for line in lines[1:])}
            length = int(headers.get("content-length", "0"))
            while len(body) < length:
                body += await stream.receive_some()
            self.received.append(
                Received(method, path, headers, json.loads(body) if body else None)
            )
            if method == "GET" and path == "/v1/models":
                await stream.send_all(_response("application/json", b'{"data": [{"id": "up"}]}'))
            elif method == "POST" and path == "/v1/chat/completions":
                posted = self.received[-1].body
                if self.raw_reply is not None and posted.get("stream") is False:
                    await stream.send_all(_response("application/json", self.raw_reply))
                    return
                if self.raw_stream is not None:
                    await stream.send_all(_response("text/event-stream", self.raw_stream))
                    return
                events = "".join(f"data: {json.dumps(c)}\n\n" for c in self.chunks)
                events += "data: [DONE]\n\n"
                await stream.send_all(_response("text/event-stream", events.encode()))
            else:
                await stream.send_all(_response("application/json", b'{"error": "no route"}', 404))


def _response(content_type: str, body: bytes, status: int = 200) -> bytes:
    head = (
        f"HTTP/1.1 {status} {'OK' if status == 200 else 'Not Found'}\r\n"
        f"content-type: {content_type}\r\ncontent-length: {len(body)}\r\n"
        "connection: close\r\n\r\n"
    )
    return head.encode() + body
