"""The official openai client against the served pool."""

from __future__ import annotations

import functools
import time

import httpx
import openai
import pytest
import trio

from pool import ServerInfo

from .conftest import running, start_server, wait_stopped


def _client(server: ServerInfo) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


async def test_plain_and_streamed_chat(server: ServerInfo) -> None:
    client = _client(server)
    reply = await client.chat.completions.create(
        model="echo",
        messages=[
            {"role": "system", "content": "Be nice."},
            {"role": "user", "content": "hello there"},
        ],
    )
    assert reply.choices[0].message.content == "hello there"
    assert reply.choices[0].finish_reason == "stop"
    assert reply.usage is not None and reply.usage.completion_tokens == 2
    stream = await client.chat.completions.create(
        model="slow",
        messages=[{"role": "user", "content": "go"}],
        stream=True,
        stream_options={"include_usage": True},
    )
    pieces = []
    usage = None
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            pieces.append(chunk.choices[0].delta.content)
        if chunk.usage:
            usage = chunk.usage
    assert "".join(pieces) == " ".join(f"w{i}" for i in range(40))
    assert len(pieces) == 40 and usage is not None and usage.completion_tokens == 40


async def test_multi_turn_max_tokens_and_stop(server: ServerInfo) -> None:
    client = _client(server)
    reply = await client.chat.completions.create(
        model="echo",
        messages=[
            {"role": "user", "content": "first"},
            {"role": "assistant", "content": "ok"},
            {"role": "user", "content": [{"type": "text", "text": "a b c d e"}]},
        ],
        max_completion_tokens=3,
    )
    assert reply.choices[0].message.content == "a b c"
    assert reply.choices[0].finish_reason == "length"


async def test_models_list(server: ServerInfo) -> None:
    ids = {m.id async for m in _client(server).models.list()}
    assert ids == {"echo", "slow"}


async def test_errors_are_openai_shaped(server: ServerInfo) -> None:
    client = _client(server)
    with pytest.raises(openai.NotFoundError) as missing:
        await client.chat.completions.create(
            model="nope", messages=[{"role": "user", "content": "x"}]
        )
    assert missing.value.body["code"] == "unknown_model"  # type: ignore[index]
    with pytest.raises(openai.ConflictError):
        await client.chat.completions.create(
            model="cold", messages=[{"role": "user", "content": "x"}]
        )
    with pytest.raises(openai.BadRequestError):
        await client.chat.completions.create(
            model="echo", messages=[{"role": "assistant", "content": "x"}]
        )
    with pytest.raises(openai.UnprocessableEntityError):
        await client.chat.completions.create(
            model="echo", messages=[{"role": "user", "content": "x"}], temperature=7
        )


async def test_closing_a_chat_stream_stops_generation(endless: ServerInfo) -> None:
    client = _client(endless)
    stream = await client.chat.completions.create(
        model="endless", messages=[{"role": "user", "content": "go"}], stream=True
    )
    async with httpx.AsyncClient(base_url=endless.url, timeout=30) as http:
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                break
        assert await running(http, "endless") == 1  # generating when the client leaves
        await stream.close()
        await wait_stopped(http, "endless")  # long before its 100 s of words ran out


async def test_backpressure_bodies_carry_the_runner_fields(nursery: trio.Nursery) -> None:
    # The 503 and 429 of both completion routes say how busy the pool is, in the names
    # of the runner API's own routes (queueDepth/avgWaitMs; limit/remaining/resetAt).
    models = {
        "busy": {
            "backend": "stub",
            "enabled": True,
            "max_queue": 0,
            "stub_reply": " ".join(["word"] * 400),
            "stub_tokens_per_second": 20,
        },
        "echo": {"backend": "stub", "enabled": True},
    }
    info = await start_server(
        nursery, models, tenancy={"tenants": {"metered": {"requests_per_minute": 1}}}
    )
    bodies = {
        "/v1/chat/completions": {"messages": [{"role": "user", "content": "x"}]},
        "/v1/completions": {"prompt": "x"},
    }
    async with httpx.AsyncClient(base_url=info.url, timeout=30) as client:
        async with trio.open_nursery() as holder:  # the one slot, taken by a long stream
            hold = {"model": "busy", "input": "x"}
            holder.start_soon(functools.partial(client.post, "/v1/responses", json=hold))
            with trio.fail_after(10):
                while info.pool.snapshot("busy").running != 1:
                    await trio.sleep(0.01)
            for path, body in bodies.items():
                full = await client.post(path, json=body | {"model": "busy"})
                assert full.status_code == 503, full.text
                error = full.json()["error"]
                assert error["code"] == "queue_full"
                assert error["queueDepth"] == 0 and isinstance(error["avgWaitMs"], int | float)
            holder.cancel_scope.cancel()
        metered = {"X-Tenant-ID": "metered"}
        first = await client.post("/v1/completions", json=bodies["/v1/completions"]
                                  | {"model": "echo"}, headers=metered)  # fmt: skip
        assert first.status_code == 200, first.text
        for path, body in bodies.items():
            limited = await client.post(path, json=body | {"model": "echo"}, headers=metered)
            assert limited.status_code == 429, limited.text
            error = limited.json()["error"]
            assert (error["limit"], error["remaining"]) == (1, 0)
            assert isinstance(error["resetAt"], int) and error["resetAt"] >= time.time() - 1
