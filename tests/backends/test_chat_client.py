"""stream_chat keeps a request's token counts current from what the upstream sends
while it streams, so a stream cut short is charged what it used."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import trio

from pool.backends import TokensUsed, ToolCallDelta
from pool.backends._chat_client import stream_chat
from pool.backends._upstream import LeanTransport

from . import test_upstream
from .test_upstream import Handler, RawServer

start = test_upstream.start  # its raw-server fixture

# What each server sends with every chunk when asked (the pool's managed backends ask).
VLLM_CHUNKS = [
    {"choices": [{"delta": {"content": f"w{n} "}}],
     "usage": {"prompt_tokens": 11, "completion_tokens": n, "total_tokens": 11 + n}}
    for n in (1, 2, 3)
]  # fmt: skip
LLAMA_SERVER_CHUNKS = [
    {"choices": [{"delta": {"content": f"w{n} "}}],
     "timings": {"prompt_n": 4, "cache_n": 7, "predicted_n": n}}
    for n in (1, 2, 3)
]  # fmt: skip
PLAIN_CHUNKS = [{"choices": [{"delta": {"content": f"w{n} "}}]} for n in (1, 2, 3)]


def _stalling(chunks: list[dict[str, Any]]) -> Handler:
    """A server that streams ``chunks``, then sends nothing more."""

    async def reply(stream: trio.SocketStream, request: bytes) -> bool:
        head = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
        await stream.send_all(head + b"Transfer-Encoding: chunked\r\n\r\n")
        for chunk in chunks:
            piece = b"data: " + json.dumps(chunk).encode() + b"\n\n"
            await stream.send_all(b"%x\r\n%s\r\n" % (len(piece), piece))
        await trio.sleep_forever()
        return False

    return reply


class _Sink:
    def __init__(self) -> None:
        self.used = TokensUsed()
        self.text: list[str] = []
        self.all_arrived = trio.Event()

    async def send(self, text: str | ToolCallDelta) -> None:
        assert isinstance(text, str)
        self.text.append(text)
        if len(self.text) == 3:
            self.all_arrived.set()


async def _cut_after_three(server: RawServer, body: dict[str, Any]) -> _Sink:
    sink = _Sink()
    transport = LeanTransport(f"http://127.0.0.1:{server.port}/v1", timeout_s=10)
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(stream_chat, transport, "/chat/completions", body, sink)
            with trio.fail_after(10):
                await sink.all_arrived.wait()
            nursery.cancel_scope.cancel()  # the client left
    finally:
        await transport.aclose()
    return sink


@pytest.mark.parametrize(
    ("chunks", "expected"),
    [
        (VLLM_CHUNKS, TokensUsed(prompt_tokens=11, output_tokens=3)),
        (LLAMA_SERVER_CHUNKS, TokensUsed(prompt_tokens=11, cached_tokens=7, output_tokens=3)),
        # An upstream that counts nothing while it streams: the pool counts the pieces.
        (PLAIN_CHUNKS, TokensUsed()),
    ],
    ids=["vllm-usage", "llama-server-timings", "plain"],
)
async def test_a_cut_stream_keeps_the_counts_the_upstream_sent(
    start: Callable[[Handler], Awaitable[RawServer]],
    chunks: list[dict[str, Any]],
    expected: TokensUsed,
) -> None:
    server = await start(_stalling(chunks))
    sink = await _cut_after_three(server, {"model": "m", "messages": []})
    assert sink.text == ["w1 ", "w2 ", "w3 "]
    assert sink.used == expected


async def test_a_body_asking_for_more_usage_keeps_include_usage(
    start: Callable[[Handler], Awaitable[RawServer]],
) -> None:
    server = await start(_stalling(VLLM_CHUNKS))
    body = {"model": "m", "messages": [], "stream_options": {"continuous_usage_stats": True}}
    await _cut_after_three(server, body)
    sent = json.loads(server.requests[0].partition(b"\r\n\r\n")[2])
    assert sent["stream"] is True
    assert sent["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
