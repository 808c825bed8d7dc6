"""Anthropic's Messages API with the official ``anthropic`` client, against stub models:
text, the stream's event sequence, stop sequences, max_tokens, thinking blocks, tools
(through the test backend that calls tools), images, errors as the SDK's exception
classes, ``x-api-key`` and bearer auth, pings while a stream waits, and count_tokens."""

from __future__ import annotations

import base64
import json
from collections.abc import AsyncIterator
from typing import Any

import anthropic
import httpx
import pytest
import trio

from pool import ServerInfo
from pool.backends import register_backend, unregister_backend
from pool.http.anthropic import _routes as _messages
from tests.media.helpers import PNG

from . import tool_backend
from .conftest import running, sse_events, start_server

MODELS: dict[str, dict[str, Any]] = {
    "echo": {"backend": "stub", "enabled": True, "target_inflight": 4},
    "fixed": {"backend": "stub", "enabled": True, "stub_reply": "one two three four five"},
    "thinker": {
        "backend": "stub",
        "enabled": True,
        "stub_reply": "<think>\nThe user greets me.\n</think>\n\nHello there!",
    },
    "vision": {"backend": "stub", "enabled": True, "modalities": ["text", "image"]},
    # One slot, 3 s per reply: a second request waits for it.
    "busy": {
        "backend": "stub",
        "enabled": True,
        "stub_reply": " ".join(f"w{i}" for i in range(60)),
        "stub_tokens_per_second": 20,
        "max_queue": 1,
    },
    "lazy": {"backend": "stub", "on_demand": True, "stub_reply": "a b c", "stub_load_seconds": 0.4},
}
USER: Any = [{"role": "user", "content": "hello there world"}]


@pytest.fixture
async def server(nursery: trio.Nursery) -> ServerInfo:
    return await start_server(nursery, MODELS)


@pytest.fixture
async def client(server: ServerInfo) -> AsyncIterator[anthropic.AsyncAnthropic]:
    async with anthropic.AsyncAnthropic(base_url=server.url, api_key="unused", max_retries=0) as c:
        yield c


async def test_a_message(client: anthropic.AsyncAnthropic) -> None:
    raw = await client.messages.with_raw_response.create(
        model="echo", max_tokens=50, messages=USER, system="Be brief.", metadata={"user_id": "u1"}
    )
    assert raw.headers["request-id"] and raw.headers["x-queue-wait-ms"]
    message = await raw.parse()
    assert message.type == "message" and message.role == "assistant"
    assert message.id.startswith("msg_") and message.model == "echo"
    assert [block.type for block in message.content] == ["text"]
    assert message.content[0].text == "hello there world"  # type: ignore[union-attr]
    assert message.stop_reason == "end_turn" and message.stop_sequence is None
    assert message.usage.input_tokens == 3 and message.usage.output_tokens == 3


async def test_the_stream_is_the_documented_event_sequence(
    client: anthropic.AsyncAnthropic,
) -> None:
    async with client.messages.stream(model="fixed", max_tokens=50, messages=USER) as stream:
        kinds = [event.type async for event in stream]
        final = await stream.get_final_message()
    assert kinds[0] == "message_start"
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    # The SDK adds a "text" event after each text delta.
    deltas = [k for k in kinds if k == "content_block_delta"]
    assert len(deltas) == 5 and kinds.count("text") == 5
    assert kinds.count("content_block_start") == 1
    assert final.content[0].text == "one two three four five"  # type: ignore[union-attr]
    assert final.stop_reason == "end_turn"
    assert final.usage.output_tokens == 5 and final.usage.input_tokens == 3


async def test_the_raw_stream(server: ServerInfo) -> None:
    """The wire itself: event names equal each data's type; a ping goes out at once."""
    body = {"model": "fixed", "max_tokens": 2, "stream": True, "messages": USER}
    async with httpx.AsyncClient(base_url=server.url, timeout=30) as http:
        reply = await http.post("/v1/messages", json=body, headers={"anthropic-version": "x"})
    assert reply.status_code == 200
    assert reply.headers["content-type"].startswith("text/event-stream")
    events = [(name, json.loads(data)) for name, data in sse_events(reply.text)]
    assert all(name == data["type"] for name, data in events)
    assert [name for name, _ in events] == [
        "message_start",
        "ping",
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    start = events[2][1]
    assert start == {
        "type": "content_block_start",
        "index": 0,
        "content_block": {"type": "text", "text": ""},
    }
    delta = events[-2][1]
    assert delta["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert delta["usage"]["output_tokens"] == 2


async def test_stop_sequences_and_max_tokens(client: anthropic.AsyncAnthropic) -> None:
    stopped = await client.messages.create(
        model="fixed", max_tokens=50, messages=USER, stop_sequences=["nope", "three"]
    )
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == "three"
    assert stopped.content[0].text == "one two "  # type: ignore[union-attr]
    async with client.messages.stream(
        model="fixed", max_tokens=50, messages=USER, stop_sequences=["four"]
    ) as stream:
        final = await stream.get_final_message()
    assert final.stop_reason == "stop_sequence" and final.stop_sequence == "four"
    assert final.content[0].text == "one two three "  # type: ignore[union-attr]
    cut = await client.messages.create(model="fixed", max_tokens=2, messages=USER)
    assert cut.stop_reason == "max_tokens" and cut.stop_sequence is None
    assert cut.content[0].text == "one two" and cut.usage.output_tokens == 2  # type: ignore[union-attr]
    # A stop sequence that never comes ends the turn as usual.
    whole = await client.messages.create(
        model="fixed", max_tokens=50, messages=USER, stop_sequences=["six"]
    )
    assert whole.stop_reason == "end_turn" and whole.stop_sequence is None


async def test_a_reply_that_opens_with_reasoning_has_a_thinking_block(
    client: anthropic.AsyncAnthropic,
) -> None:
    thinking: Any = {"type": "enabled", "budget_tokens": 1024}
    message = await client.messages.create(
        model="thinker", max_tokens=100, messages=USER, thinking=thinking
    )
    assert [block.type for block in message.content] == ["thinking", "text"]
    assert message.content[0].thinking == "The user greets me."  # type: ignore[union-attr]
    assert message.content[1].text == "Hello there!"  # type: ignore[union-attr]
    async with client.messages.stream(
        model="thinker", max_tokens=100, messages=USER, thinking=thinking
    ) as stream:
        deltas = [event.delta.type async for event in stream if event.type == "content_block_delta"]
        final = await stream.get_final_message()
    assert set(deltas) == {"thinking_delta", "text_delta"}
    assert deltas.index("text_delta") > deltas.index("thinking_delta")
    assert final.content[0].thinking == "The user greets me."  # type: ignore[union-attr]
    assert final.content[1].text == "Hello there!"  # type: ignore[union-attr]
    # Earlier reasoning sent back is accepted and not shown to the model again.
    again = await client.messages.create(
        model="echo",
        max_tokens=50,
        messages=[
            *USER,
            {"role": "assistant", "content": [b.model_dump() for b in message.content]},
            {"role": "user", "content": "and again"},
        ],
    )
    assert again.content[0].text == "and again"  # type: ignore[union-attr]


async def test_images(client: anthropic.AsyncAnthropic) -> None:
    data = base64.b64encode(PNG).decode()
    content: Any = [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": data}},
        {"type": "text", "text": "what is it?"},
    ]
    message = await client.messages.create(
        model="vision", max_tokens=50, messages=[{"role": "user", "content": content}]
    )
    assert message.content[0].text == "what is it?"  # type: ignore[union-attr]
    url: Any = [
        {"type": "image", "source": {"type": "url", "url": "http://169.254.169.254/x.png"}},
        {"type": "text", "text": "what is it?"},
    ]
    with pytest.raises(anthropic.BadRequestError) as refused:
        await client.messages.create(
            model="vision", max_tokens=50, messages=[{"role": "user", "content": url}]
        )
    assert refused.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]
    with pytest.raises(anthropic.BadRequestError):  # a text-only model
        await client.messages.create(
            model="echo", max_tokens=50, messages=[{"role": "user", "content": content}]
        )


async def test_errors_are_the_sdks_exceptions(
    server: ServerInfo, client: anthropic.AsyncAnthropic
) -> None:
    with pytest.raises(anthropic.NotFoundError) as missing:
        await client.messages.create(model="nope", max_tokens=5, messages=USER)
    assert missing.value.status_code == 404
    assert missing.value.body == {
        "type": "error",
        "error": {"type": "not_found_error", "message": "model 'nope' is not configured"},
    }
    assert missing.value.request_id
    with pytest.raises(anthropic.NotFoundError):
        async with client.messages.stream(model="nope", max_tokens=5, messages=USER) as stream:
            await stream.get_final_message()
    with pytest.raises(anthropic.BadRequestError) as assistant_last:
        await client.messages.create(
            model="echo", max_tokens=5, messages=[*USER, {"role": "assistant", "content": "x"}]
        )
    assert "last message" in str(assistant_last.value)
    with pytest.raises(anthropic.BadRequestError) as document:
        content: Any = [{"type": "document", "source": {"type": "text", "data": "x"}}]
        await client.messages.create(
            model="echo", max_tokens=5, messages=[{"role": "user", "content": content}]
        )
    assert "messages[0].content[0].type" in str(document.value)
    # The pool's own headers are checked as on every route.
    for header in ({"X-Priority": "urgent"}, {"X-Cache-Mode": "sometimes"}):
        with pytest.raises(anthropic.BadRequestError) as bad_header:
            await client.messages.create(
                model="echo", max_tokens=5, messages=USER, extra_headers=header
            )
        assert next(iter(header)) in str(bad_header.value)
    served = await client.messages.create(
        model="echo",
        max_tokens=5,
        messages=USER,
        extra_headers={"X-Priority": "high", "X-Cache-Mode": "none", "X-Cache-Tag": "t"},
    )
    assert served.stop_reason == "end_turn"
    server_tool: Any = [{"type": "web_search_20250305", "name": "web_search"}]
    with pytest.raises(anthropic.BadRequestError) as tool:
        await client.messages.create(model="echo", max_tokens=5, messages=USER, tools=server_tool)
    assert "tools[0].type" in str(tool.value)
    async with httpx.AsyncClient(base_url=server.url) as http:
        for body in (
            {"model": "echo", "messages": USER},  # max_tokens is required
            {"model": "echo", "max_tokens": 5, "messages": []},
            {"model": "echo", "max_tokens": 5, "messages": USER, "tool_choice": {"type": "x"}},
            # A block whose type is no string (found by schemathesis: once a 500).
            {
                "model": "echo",
                "max_tokens": 5,
                "messages": [{"role": "user", "content": [{"type": {}}]}],
            },
        ):
            reply = await http.post("/v1/messages", json=body)
            assert reply.status_code == 400, body
            assert reply.json()["type"] == "error"
            assert reply.json()["error"]["type"] == "invalid_request_error"
        broken = await http.post("/v1/messages", content=b"{", headers={"x-api-key": "k"})
        assert broken.status_code == 400 and broken.json()["type"] == "error"
        # The other surfaces keep their own shapes.
        other = await http.post("/v1/chat/completions", json={"model": "nope", "messages": USER})
        assert other.json()["error"]["code"] == "unknown_model"


async def test_busy_and_rate_limited_models(nursery: trio.Nursery) -> None:
    info = await start_server(
        nursery,
        MODELS,
        tenancy={"tenants": {"metered": {"requests_per_minute": 1, "burst": 1}}},
    )
    async with anthropic.AsyncAnthropic(
        base_url=info.url, api_key="unused", max_retries=0
    ) as client:
        metered = {"X-Tenant-ID": "metered"}
        await client.messages.create(
            model="echo", max_tokens=5, messages=USER, extra_headers=metered
        )
        with pytest.raises(anthropic.RateLimitError) as limited:
            await client.messages.create(
                model="echo", max_tokens=5, messages=USER, extra_headers=metered
            )
        assert limited.value.body["error"]["type"] == "rate_limit_error"  # type: ignore[index]
        assert int(limited.value.response.headers["retry-after"]) >= 1

        # One running, one queued (max_queue 1): the third is turned away at once.
        async with trio.open_nursery() as holders, httpx.AsyncClient(base_url=info.url) as http:
            for _ in range(2):
                holders.start_soon(
                    lambda: client.messages.create(model="busy", max_tokens=100, messages=USER)
                )
            with trio.fail_after(20):
                while (await http.get("/v1/admin/models/busy")).json()["queue_depth"] < 1:
                    await trio.sleep(0.02)
            with pytest.raises(anthropic.InternalServerError) as full:
                await client.messages.create(model="busy", max_tokens=5, messages=USER)
            assert full.value.status_code == 503
            assert full.value.body["error"]["type"] == "overloaded_error"  # type: ignore[index]
            holders.cancel_scope.cancel()


async def test_x_api_key_and_bearer_tokens(nursery: trio.Nursery) -> None:
    info = await start_server(nursery, MODELS, auth={"inference_tokens": ["sk-pool"]})
    for kwargs in ({"api_key": "sk-pool"}, {"auth_token": "sk-pool"}):
        async with anthropic.AsyncAnthropic(base_url=info.url, max_retries=0, **kwargs) as client:
            message = await client.messages.create(model="echo", max_tokens=5, messages=USER)
            assert message.content[0].text == "hello there world"  # type: ignore[union-attr]
            counted = await client.messages.count_tokens(model="echo", messages=USER)
            assert counted.input_tokens == 3
    async with anthropic.AsyncAnthropic(
        base_url=info.url, api_key="wrong", max_retries=0
    ) as client:
        with pytest.raises(anthropic.AuthenticationError) as refused:
            await client.messages.create(model="echo", max_tokens=5, messages=USER)
        assert refused.value.body["error"]["type"] == "authentication_error"  # type: ignore[index]
    # x-api-key is the Messages API's header; the other routes still want a bearer token.
    async with httpx.AsyncClient(base_url=info.url) as http:
        keyed = {"x-api-key": "sk-pool"}
        chat = await http.post(
            "/v1/chat/completions", json={"model": "echo", "messages": USER}, headers=keyed
        )
        assert chat.status_code == 401


async def test_tools(nursery: trio.Nursery) -> None:
    """A backend that calls the first tool it is offered: the tool_use block, its
    streamed input, and a tool_result round trip."""
    register_backend("toolcaller", tool_backend.__name__)
    try:
        info = await start_server(nursery, {"caller": {"backend": "toolcaller", "enabled": True}})
        tools: Any = [
            {
                "name": "count",
                "description": "Count",
                "input_schema": {"type": "object", "properties": {"n": {"type": "integer"}}},
            }
        ]
        async with anthropic.AsyncAnthropic(
            base_url=info.url, api_key="unused", max_retries=0
        ) as client:
            message = await client.messages.create(
                model="caller", max_tokens=50, messages=USER, tools=tools
            )
            assert message.stop_reason == "tool_use"
            assert [block.type for block in message.content] == ["text", "tool_use"]
            call = message.content[1]
            assert call.type == "tool_use"
            assert (call.id, call.name, call.input) == ("call_toy1", "count", {"n": 1})

            async with client.messages.stream(
                model="caller", max_tokens=50, messages=USER, tools=tools
            ) as stream:
                deltas = [
                    event.delta.type
                    async for event in stream
                    if event.type == "content_block_delta"
                ]
                final = await stream.get_final_message()
            assert deltas == ["text_delta", "input_json_delta", "input_json_delta"]
            assert final.stop_reason == "tool_use"
            assert final.content[1].input == {"n": 1}  # type: ignore[union-attr]

            answer = await client.messages.create(
                model="caller",
                max_tokens=50,
                messages=[
                    *USER,
                    {"role": "assistant", "content": [b.model_dump() for b in message.content]},
                    {
                        "role": "user",
                        "content": [
                            {"type": "tool_result", "tool_use_id": call.id, "content": "7"}
                        ],
                    },
                ],
            )
            # Without tools the test backend echoes the last turn: the tool's result.
            assert answer.content[0].text == "7"  # type: ignore[union-attr]
            with pytest.raises(anthropic.BadRequestError) as unknown:
                await client.messages.create(
                    model="caller",
                    max_tokens=50,
                    messages=USER,
                    tools=tools,
                    tool_choice={"type": "tool", "name": "other"},
                )
            assert "tool_choice.name" in str(unknown.value)
    finally:
        unregister_backend("toolcaller")


async def test_count_tokens(client: anthropic.AsyncAnthropic) -> None:
    counted = await client.messages.count_tokens(model="echo", messages=USER)
    message = await client.messages.create(model="echo", max_tokens=50, messages=USER)
    assert counted.input_tokens == message.usage.input_tokens == 3
    longer = [*USER, {"role": "assistant", "content": "hi"}, {"role": "user", "content": "a b"}]
    assert (await client.messages.count_tokens(model="echo", messages=longer)).input_tokens == 6
    with pytest.raises(anthropic.NotFoundError):
        await client.messages.count_tokens(model="nope", messages=USER)


async def test_a_stream_that_waits_for_a_load_pings(server: ServerInfo) -> None:
    """The headers go out at once and pings show the load, before the first block."""
    body = {"model": "lazy", "max_tokens": 10, "stream": True, "messages": USER}
    async with httpx.AsyncClient(base_url=server.url, timeout=30) as http:
        reply = await http.post("/v1/messages", json=body)
    names = [name for name, _ in sse_events(reply.text)]
    first_block = names.index("content_block_start")
    assert names[0] == "message_start"
    assert names[:first_block].count("ping") >= 3, names  # the start, then the load's steps
    assert names[-1] == "message_stop"


async def test_a_stream_that_waits_for_a_busy_replica_pings(
    server: ServerInfo, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A request behind a running one gets its headers at once and a ping every
    PING_INTERVAL_S (to within the pool's one-second wait tick) until it runs."""
    monkeypatch.setattr(_messages, "PING_INTERVAL_S", 0.5)
    body = {"model": "busy", "max_tokens": 100, "stream": True, "messages": USER}
    async with (
        trio.open_nursery() as nursery,
        httpx.AsyncClient(base_url=server.url, timeout=60) as http,
    ):
        nursery.start_soon(lambda: http.post("/v1/messages", json=body))
        with trio.fail_after(20):
            while not await running(http, "busy"):
                await trio.sleep(0.02)
        names: list[str] = []
        async with http.stream("POST", "/v1/messages", json=body) as reply:
            assert reply.status_code == 200
            block = ""
            async for line in reply.aiter_lines():
                if line.startswith("event: "):
                    block = line.removeprefix("event: ")
                    names.append(block)
                if block == "content_block_start":
                    break
    # message_start, its ping, the queued place, then a heartbeat every tick of the
    # remaining ~3 s of the running reply.
    assert names[0] == "message_start"
    assert names.count("ping") >= 4, names
