"""OpenAI's legacy ``/v1/completions`` with the official client, and the runner headers."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx
import openai
import pytest
import trio

from pool import ServerInfo
from pool.backends import register_backend, unregister_backend

from . import recording_backend
from .conftest import start_server


def _client(server: ServerInfo) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


async def test_plain_and_several_prompts(server: ServerInfo) -> None:
    client = _client(server)
    reply = await client.completions.create(model="echo", prompt="a b c", max_tokens=2)
    assert reply.object == "text_completion"
    assert reply.choices[0].text == "a b" and reply.choices[0].finish_reason == "length"
    assert reply.usage is not None and reply.usage.completion_tokens == 2
    several = await client.completions.create(model="echo", prompt=["one", "two three"])
    assert [c.text for c in several.choices] == ["one", "two three"]
    assert [c.index for c in several.choices] == [0, 1]


async def test_streams_text_completion_chunks(server: ServerInfo) -> None:
    client = _client(server)
    stream = await client.completions.create(
        model="slow",
        prompt="go",
        max_tokens=100,
        stream=True,
        stream_options={"include_usage": True},
    )
    pieces, finish, usage = [], None, None
    async for chunk in stream:
        assert chunk.object == "text_completion"
        if chunk.choices:
            pieces.append(chunk.choices[0].text)
            finish = chunk.choices[0].finish_reason or finish
        if chunk.usage:
            usage = chunk.usage
    assert "".join(pieces) == " ".join(f"w{i}" for i in range(40))
    assert finish == "stop" and usage is not None and usage.completion_tokens == 40


async def test_headers_and_refusals(client: httpx.AsyncClient) -> None:
    r = await client.post("/v1/completions", json={"model": "echo", "prompt": "hi"})
    assert r.status_code == 200
    for header in ("X-Queue-Wait-Ms", "X-GPU-Time-Ms", "X-Cache-Hit", "X-Request-Id"):
        assert header in r.headers
    r = await client.post("/v1/completions", json={"model": "echo", "prompt": "hi", "logprobs": 2})
    assert r.status_code == 400 and r.json()["error"]["code"] == "logprobs_unsupported"
    r = await client.post("/v1/completions", json={"model": "echo", "prompt": "hi", "echo": True})
    assert r.status_code == 422
    r = await client.post(
        "/v1/completions", json={"model": "echo", "prompt": ["a", "b"], "stream": True}
    )
    assert r.status_code == 400 and r.json()["error"]["code"] == "stream_multiple_prompts"
    r = await client.post("/v1/completions", json={"model": "missing", "prompt": "hi"})
    assert r.status_code == 404


@pytest.fixture
async def recorder(nursery: trio.Nursery) -> AsyncIterator[ServerInfo]:
    """A server whose one model, ``rec``, keeps every request its runtime is given."""
    register_backend("recorder", recording_backend.__name__)
    try:
        yield await start_server(nursery, {"rec": {"backend": "recorder", "enabled": True}})
    finally:
        unregister_backend("recorder")


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/completions"])
async def test_keep_alive_and_sampling_fields_reach_the_backend(
    recorder: ServerInfo, route: str
) -> None:
    body = {"model": "rec", "keep_alive": "5m", "seed": 3, "min_p": 0.1,
            "presence_penalty": 0.5, "logit_bias": {"42": -100}}  # fmt: skip
    body |= (
        {"messages": [{"role": "user", "content": "hi"}]} if "chat" in route else {"prompt": "hi"}
    )
    runtime: Any = recorder.pool.model("rec").replicas[0].runtime
    async with httpx.AsyncClient(base_url=recorder.url, timeout=30) as client:
        r = await client.post(route, json=body)
        assert r.status_code == 200, r.text
        [seen] = runtime.requests
        decoding = seen.decoding
        assert (decoding.seed, decoding.min_p, decoding.presence_penalty) == (3, 0.1, 0.5)
        assert decoding.logit_bias == ((42, -100.0),)
        assert decoding.frequency_penalty is None  # not asked: left to the backend
        r = await client.post(route, json=body | {"logit_bias": {"x": 1}})
        assert r.status_code == 400
        assert len(runtime.requests) == 1  # refused before it reached the backend


async def test_sampling_a_backend_cannot_honour_is_a_400(client: httpx.AsyncClient) -> None:
    # exllamav3 has no seed: refused before any queue, whatever the model's state.
    r = await client.post(
        "/v1/chat/completions",
        json={"model": "single", "messages": [{"role": "user", "content": "hi"}], "seed": 1},
    )
    assert r.status_code == 400 and r.json()["error"]["code"] == "sampling_unsupported"
    r = await client.post(
        "/api/generate", json={"model": "single", "prompt": "hi", "options": {"min_p": 0.1}}
    )
    assert r.status_code == 400 and "min_p" in r.json()["error"]
