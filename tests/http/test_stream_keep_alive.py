"""Keep-alive while a stream waits: Chat Completions and legacy Completions streams send
SSE comments while their request waits for a load or a busy replica (so a proxy's idle
timeout does not cut them), and OpenAI's client reads such a stream as any other; Ollama's
NDJSON streams send chunks with nothing in them, which Ollama's client reads as such."""

from __future__ import annotations

import json
from typing import Any

import httpx
import ollama
import openai
import pytest
import trio

from pool import ServerInfo
from pool.http._streaming import SSE_KEEP_ALIVE

from .conftest import WAITING_MODELS, running, start_server

MODELS: dict[str, dict[str, Any]] = {
    **WAITING_MODELS,
    # One slot, 2 s per reply: a second request waits for it.
    "busy": {
        "backend": "stub",
        "enabled": True,
        "stub_reply": " ".join(f"w{i}" for i in range(40)),
        "stub_tokens_per_second": 20,
        "max_queue": 1,
    },
}
CHAT = [{"role": "user", "content": "hello"}]
ROUTES = [
    ("/v1/chat/completions", {"messages": CHAT}),
    ("/openai/v1/chat/completions", {"messages": CHAT}),
    ("/v1/completions", {"prompt": "hello"}),
    ("/openai/v1/completions", {"prompt": "hello"}),
]
COMMENT = SSE_KEEP_ALIVE.decode().strip()


@pytest.fixture
async def server(nursery: trio.Nursery) -> ServerInfo:
    return await start_server(nursery, MODELS)


def _first_text(line: str) -> bool:
    """Whether an SSE line is a chunk with generated text (a delta or a completion)."""
    return line.startswith("data: {") and ('"content":"a' in line or '"text":"a' in line)


@pytest.mark.parametrize(("path", "fields"), ROUTES)
async def test_a_stream_waiting_for_a_load_sends_comments_first(
    server: ServerInfo, path: str, fields: dict[str, Any]
) -> None:
    body = {"model": "lazy", "stream": True, **fields}
    async with httpx.AsyncClient(base_url=server.url, timeout=30) as http:
        reply = await http.post(path, json=body)
    assert reply.status_code == 200
    lines = [line for line in reply.text.splitlines() if line]
    first = next(i for i, line in enumerate(lines) if _first_text(line))
    # The load reports each quarter: a comment for the wait and each step of it.
    assert lines[:first].count(COMMENT) >= 3, lines
    assert COMMENT not in lines[first:]
    assert lines[-1] == "data: [DONE]"


async def test_a_stream_behind_a_busy_replica_sends_comments_until_it_runs(
    server: ServerInfo,
) -> None:
    body = {"model": "busy", "stream": True, "messages": CHAT}
    async with (
        httpx.AsyncClient(base_url=server.url, timeout=60) as http,
        trio.open_nursery() as nursery,
    ):
        nursery.start_soon(lambda: http.post("/v1/chat/completions", json=body))
        with trio.fail_after(20):
            while not await running(http, "busy"):
                await trio.sleep(0.02)
        seen: list[str] = []
        async with http.stream("POST", "/v1/chat/completions", json=body) as reply:
            # The headers come at once, not when the replica frees.
            assert reply.status_code == 200
            async for line in reply.aiter_lines():
                if line:
                    seen.append(line)
                if '"content":"w0' in line:
                    break
    assert COMMENT in seen[: seen.index(next(x for x in seen if '"content":"w0' in x))]


async def test_the_openai_client_reads_a_stream_with_comments(server: ServerInfo) -> None:
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    async with client:
        stream = await client.chat.completions.create(model="lazy", messages=CHAT, stream=True)
        text = "".join([chunk.choices[0].delta.content or "" async for chunk in stream])
        legacy = await client.completions.create(model="lazy", prompt="x", stream=True)
        legacy_text = "".join([chunk.choices[0].text async for chunk in legacy])
    assert text == "a b c" and legacy_text == "a b c"


async def test_a_wait_past_the_queue_timeout_ends_the_stream_with_an_error(
    server: ServerInfo,
) -> None:
    """The 200 went out with the first comment: the timeout is the stream's last event,
    which the OpenAI client raises as an error."""
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    async with client:
        stream = await client.chat.completions.create(model="never", messages=CHAT, stream=True)
        with pytest.raises(openai.APIError, match="waited"):
            async for _ in stream:
                pass


@pytest.mark.parametrize(
    ("path", "fields", "text_of"),
    [
        ("/api/chat", {"messages": CHAT}, lambda line: line["message"]["content"]),
        ("/api/generate", {"prompt": "hello"}, lambda line: line["response"]),
    ],
)
async def test_an_ollama_stream_waiting_for_a_load_sends_empty_chunks(
    server: ServerInfo, path: str, fields: dict[str, Any], text_of: Any
) -> None:
    async with httpx.AsyncClient(base_url=server.url, timeout=30) as http:
        reply = await http.post(path, json={"model": "lazy", **fields})
    assert reply.status_code == 200
    lines = [json.loads(line) for line in reply.text.splitlines()]
    texts = [text_of(line) for line in lines]
    first = next(i for i, text in enumerate(texts) if text)
    assert first >= 3 and texts[:first] == [""] * first, lines
    assert all(line["model"] == "lazy" and line["done"] is False for line in lines[:first])
    assert "".join(texts) == "a b c" and lines[-1]["done"] is True


async def test_the_ollama_client_reads_a_stream_with_empty_chunks(server: ServerInfo) -> None:
    client = ollama.AsyncClient(host=server.url)
    parts = [part async for part in await client.chat(model="lazy", messages=CHAT, stream=True)]
    assert "".join(p.message.content or "" for p in parts) == "a b c"
    assert parts[-1].done
    # A wait past the queue timeout ends the started stream with Ollama's error line.
    with pytest.raises(ollama.ResponseError, match="waited"):
        async for _ in await client.generate(model="never", prompt="x", stream=True):
            pass
