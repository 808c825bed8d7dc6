"""Invalid tool and schema definitions are 400s naming the field; a backend without
tools or structured output refuses them instead of ignoring them (stub models)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import openai
import pytest
import trio
from trio_websocket import open_websocket_url

from pool import ServerInfo
from pool.backends import register_backend, unregister_backend

from . import tool_backend
from .conftest import sse_events, start_server

USER: Any = [{"role": "user", "content": "hi"}]


def _tool(**function: Any) -> Any:
    return {"type": "function", "function": function}


GOOD = _tool(name="get_weather", parameters={"type": "object", "properties": {}})


@pytest.fixture
async def info(nursery: trio.Nursery) -> ServerInfo:
    return await start_server(nursery, {"echo": {"backend": "stub", "enabled": True}})


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"tools": [_tool(description="no name")]}, "tools[0].function.name"),
        ({"tools": [GOOD, _tool(name="has space")]}, "tools[1].function.name"),
        (
            {"tools": [_tool(name="f", parameters={"type": "strange"})]},
            "tools[0].function.parameters.type",
        ),
        (
            {"tools": [_tool(name="f", parameters={"type": "object", "properties": {"a": 3}})]},
            "tools[0].function.parameters.properties.a",
        ),
        (
            {"tools": [_tool(name="f", parameters={"type": "object", "required": "a"})]},
            "tools[0].function.parameters.required",
        ),
        ({"tools": [GOOD, GOOD]}, "tools[1].name"),
        ({"tools": [{"type": "web_search", "function": {"name": "f"}}]}, "tools[0].type"),
        (
            {"tools": [GOOD], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
        ),
        ({"tool_choice": "required"}, "tool_choice"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "response_format.json_schema.schema",
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "object", "anyOf": []}},
                }
            },
            "response_format.json_schema.schema.anyOf",
        ),
    ],
)
async def test_chat_definitions_are_400_naming_the_field(
    info: ServerInfo, fields: dict[str, Any], param: str
) -> None:
    client = openai.AsyncOpenAI(base_url=info.url + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as refused:
        await client.chat.completions.create(model="echo", messages=USER, **fields)
    # Rules between fields (a tool_choice that tools do not match, two tools of one
    # name) and JSON schemas deeper than the document describes have codes of their own.
    expected = {"tool_choice": "tool_choice_unmatched", "tools[1].name": "duplicate_tool"}.get(
        param, "invalid_request"
    )
    if ".parameters." in param or ".schema." in param:
        expected = "invalid_json_schema"  # inside a JSON schema
    assert refused.value.code == expected
    assert refused.value.param == param
    assert param in refused.value.message


async def test_backends_without_tools_refuse_them(info: ServerInfo) -> None:
    client = openai.AsyncOpenAI(base_url=info.url + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as refused:
        await client.chat.completions.create(model="echo", messages=USER, tools=[GOOD])
    assert refused.value.code == "tools_unsupported" and refused.value.param == "tools"
    history: Any = [
        *USER,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "42"},
    ]
    with pytest.raises(openai.BadRequestError) as refused:
        await client.chat.completions.create(model="echo", messages=history)
    assert refused.value.code == "tools_unsupported"
    with pytest.raises(openai.BadRequestError) as refused:
        await client.chat.completions.create(
            model="echo", messages=USER, response_format={"type": "json_object"}
        )
    assert refused.value.code == "structured_output_unsupported"
    # tool_choice "none" with no tools, and response_format text, change nothing.
    plain = await client.chat.completions.create(
        model="echo", messages=USER, tool_choice="none", response_format={"type": "text"}
    )
    assert plain.choices[0].message.content == "hi"


async def test_responses_and_ollama_definitions(info: ServerInfo) -> None:
    async with httpx.AsyncClient(base_url=info.url, timeout=10) as http:
        bad_name = await http.post(
            "/v1/responses",
            json={"model": "echo", "input": "hi", "tools": [{"type": "function", "name": "a b"}]},
        )
        assert bad_name.status_code == 400
        assert bad_name.json()["error"]["param"] == "tools[0].name"
        bad_format = await http.post(
            "/v1/responses",
            json={"model": "echo", "input": "hi", "text": {"format": {"type": "json_schema"}}},
        )
        assert bad_format.status_code == 400
        assert bad_format.json()["error"]["param"] == "text.format.schema"
        refused = await http.post(
            "/v1/responses",
            json={
                "model": "echo",
                "input": "hi",
                "tools": [{"type": "function", "name": "f"}],
            },
        )
        assert refused.status_code == 400
        assert refused.json()["error"]["code"] == "tools_unsupported"
        ollama_format = await http.post(
            "/api/chat", json={"model": "echo", "messages": USER, "format": 3, "stream": False}
        )
        assert ollama_format.status_code == 400 and "format" in ollama_format.json()["error"]
        ollama_tool = await http.post(
            "/api/chat",
            json={"model": "echo", "messages": USER, "tools": [_tool(name="")], "stream": False},
        )
        assert ollama_tool.status_code == 400
        assert "tools[0].function.name" in ollama_tool.json()["error"]
        caps = (await http.get("/v1/capabilities")).json()["capabilities"]
        assert caps["functionCalling"] is False and caps["structuredOutput"] is False


@pytest.fixture
async def caller(nursery: trio.Nursery) -> AsyncIterator[ServerInfo]:
    register_backend("toolcaller", tool_backend.__name__)
    try:
        yield await start_server(nursery, {"caller": {"backend": "toolcaller", "enabled": True}})
    finally:
        unregister_backend("toolcaller")


async def test_calls_render_on_every_surface(caller: ServerInfo) -> None:
    client = openai.AsyncOpenAI(base_url=caller.url + "/v1", api_key="unused", max_retries=0)
    reply = await client.chat.completions.create(model="caller", messages=USER, tools=[GOOD])
    message = reply.choices[0].message
    assert reply.choices[0].finish_reason == "tool_calls" and message.content == "Checking."
    assert message.tool_calls and message.tool_calls[0].id == "call_toy1"
    assert message.tool_calls[0].function.arguments == '{"n": 1}'

    stream = await client.chat.completions.create(
        model="caller", messages=USER, tools=[GOOD], stream=True
    )
    chunks = [c async for c in stream if c.choices]
    pieces = [p for c in chunks for p in c.choices[0].delta.tool_calls or ()]
    assert [p.id for p in pieces] == ["call_toy1", None, None]
    assert "".join(p.function.arguments or "" for p in pieces if p.function) == '{"n": 1}'
    assert chunks[-1].choices[0].finish_reason == "tool_calls"

    async with httpx.AsyncClient(base_url=caller.url, timeout=10) as http:
        tool = {"type": "function", "name": "get_weather"}
        body = {"model": "caller", "input": "hi", "tools": [tool]}
        envelope = (await http.post("/v1/responses", json=body)).json()
        assert [o["type"] for o in envelope["output"]] == ["output_text", "function_call"]
        assert envelope["output"][1]["call_id"] == "call_toy1"
        streamed = await http.post("/v1/responses", json={**body, "stream": True})
        kinds = [kind for kind, _ in sse_events(streamed.text)]
        assert kinds == [
            "response.created",
            "response.output_text.delta",
            "response.output_item.added",
            "response.function_call_arguments.delta",
            "response.function_call_arguments.delta",
            "response.function_call_arguments.done",
            "response.output_item.done",
            "response.metrics",
            "response.completed",
        ]

        async with open_websocket_url(
            caller.url.replace("http://", "ws://") + "/v1/responses"
        ) as ws:
            await ws.send_message(json.dumps(body))
            frames: list[str] = []
            with trio.fail_after(5):
                while not frames or json.loads(frames[-1])["type"] != "response.completed":
                    frames.append(str(await ws.get_message()))
            assert [json.loads(f)["type"] for f in frames] == kinds

        chat = {"model": "caller", "messages": USER, "tools": [GOOD]}
        whole = (await http.post("/api/chat", json={**chat, "stream": False})).json()
        assert whole["message"]["tool_calls"] == [
            {"function": {"name": "get_weather", "arguments": {"n": 1}}}
        ]
        lines = [
            json.loads(line) for line in (await http.post("/api/chat", json=chat)).text.splitlines()
        ]
        called = [line for line in lines if line.get("message", {}).get("tool_calls")]
        assert len(called) == 1 and not called[0]["done"] and lines[-1]["done"]
