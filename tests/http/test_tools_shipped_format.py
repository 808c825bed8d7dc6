"""Tools on the pool's own prompt format: the shipped default model (SmolLM2 with
``prompt_format: qwen3_template``, from config/settings.json) calls tools in Qwen3's
markup through Chat Completions, Responses and Ollama.

The format shows the model the tools in Qwen3's ``<tools>`` block; a forced call runs
under the grammar of a ``<tool_call>`` block, so even a 135M model writes a valid one;
a tool result goes back as a ``<tool_response>`` and the model answers in plain text.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import ollama
import openai
import pytest
import trio

from .conftest import sse_events, start_server

pytestmark = pytest.mark.real_model
ROOT = Path(__file__).resolve().parents[2]
SHIPPED = "smollm2-135m-instruct"

WEATHER: Any = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
QUESTION: Any = [{"role": "user", "content": "What is the weather in Paris?"}]
RESULT = '{"temperature": "22 C", "sky": "sunny"}'


def _shipped_model() -> dict[str, Any]:
    """The default settings' SmolLM2 definition, as shipped (one replica here)."""
    settings = json.loads((ROOT / "config" / "settings.json").read_text("utf-8"))
    definition: dict[str, Any] = settings["engine"]["models"][SHIPPED]
    assert definition["backend"] == "llama_cpp"
    assert definition["prompt_format"] == "qwen3_template"
    return {**definition, "replica_max": 1}


@pytest.fixture
async def url(nursery: trio.Nursery) -> str:
    info = await start_server(nursery, {SHIPPED: _shipped_model()})
    return info.url


async def test_chat_completions_forced_call_auto_and_round_trip(url: str) -> None:
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    forced = await client.chat.completions.create(
        model=SHIPPED,
        messages=QUESTION,
        tools=[WEATHER],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        temperature=0,
        max_tokens=60,
    )
    choice = forced.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    (call,) = choice.message.tool_calls or []
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}

    # The same call streamed, forced by "required" (one call: parallel_tool_calls false).
    stream = await client.chat.completions.create(
        model=SHIPPED,
        messages=QUESTION,
        tools=[WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=0,
        max_tokens=60,
        stream=True,
    )
    names: dict[int, str] = {}
    arguments: dict[int, str] = {}
    content = ""
    finish = None
    async for chunk in stream:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        finish = chunk.choices[0].finish_reason or finish
        content += delta.content or ""
        for piece in delta.tool_calls or ():
            if piece.function and piece.function.name:
                names[piece.index] = piece.function.name
            if piece.function and piece.function.arguments:
                arguments[piece.index] = arguments.get(piece.index, "") + piece.function.arguments
    assert finish == "tool_calls" and content == ""
    assert names == {0: "get_weather"}
    assert json.loads(arguments[0]) == {"city": "Paris"}

    # Automatic: the model may answer or call; this question it answers in text, and
    # the markup scanner hands the text through.
    auto = await client.chat.completions.create(
        model=SHIPPED,
        messages=[{"role": "user", "content": "Hi! What is 2+2?"}],
        tools=[WEATHER],
        temperature=0,
        max_tokens=30,
    )
    answer = auto.choices[0]
    if answer.message.tool_calls:
        assert answer.finish_reason == "tool_calls"
        assert all(c.function.name == "get_weather" for c in answer.message.tool_calls)
        assert all(
            isinstance(json.loads(c.function.arguments), dict) for c in answer.message.tool_calls
        )
    else:
        assert answer.finish_reason in ("stop", "length")
        assert "4" in (answer.message.content or "")
        assert "<tool_call>" not in (answer.message.content or "")

    # The call and its result go back; the model answers from the result.
    final = await client.chat.completions.create(
        model=SHIPPED,
        messages=[
            *QUESTION,
            {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
            {"role": "tool", "tool_call_id": call.id, "content": RESULT},
        ],
        tools=[WEATHER],
        tool_choice="none",
        temperature=0,
        max_tokens=40,
    )
    reply = final.choices[0]
    assert reply.finish_reason in ("stop", "length") and not reply.message.tool_calls
    assert "22" in (reply.message.content or "")


async def test_responses_forced_call_and_round_trip(url: str) -> None:
    tool = {"type": "function", **WEATHER["function"]}
    body: dict[str, Any] = {
        "model": SHIPPED,
        "input": "What is the weather in Paris?",
        "tools": [tool],
        "tool_choice": {"type": "function", "name": "get_weather"},
        "decoding": {"temperature": 0, "max_tokens": 60},
    }
    async with httpx.AsyncClient(base_url=url, timeout=300) as http:
        reply = (await http.post("/v1/responses", json=body)).json()
        assert reply["finish_reason"] == "tool_calls"
        (item,) = reply["output"]
        assert item["type"] == "function_call" and item["name"] == "get_weather"
        assert json.loads(item["arguments"]) == {"city": "Paris"}

        streamed = await http.post("/v1/responses", json={**body, "stream": True})
        events = [(kind, json.loads(data)) for kind, data in sse_events(streamed.text)]
        deltas = "".join(
            e["delta"] for kind, e in events if kind == "response.function_call_arguments.delta"
        )
        assert json.loads(deltas) == {"city": "Paris"}
        assert events[-1][1]["response"]["output"][0]["name"] == "get_weather"

        final = await http.post(
            "/v1/responses",
            json={
                "model": SHIPPED,
                "messages": [
                    {"role": "user", "content": "What is the weather in Paris?"},
                    {
                        "type": "function_call",
                        "call_id": item["call_id"],
                        "name": "get_weather",
                        "arguments": item["arguments"],
                    },
                    {"type": "function_call_output", "call_id": item["call_id"], "output": RESULT},
                ],
                "tools": [tool],
                "tool_choice": "none",
                "decoding": {"temperature": 0, "max_tokens": 40},
            },
        )
        assert final.status_code == 200, final.text
        answered = final.json()
        assert answered["finish_reason"] in ("stop", "length")
        assert "function_call" not in [o["type"] for o in answered["output"]]
        assert "22" in answered["output_text"]


async def test_ollama_tools_and_round_trip(url: str) -> None:
    local = ollama.AsyncClient(host=url)
    shown = await local.show(SHIPPED)
    assert "tools" in (shown.capabilities or [])
    # Ollama has no tool_choice: the model may call; this question it answers.
    offered = await local.chat(
        model=SHIPPED,
        messages=[{"role": "user", "content": "Hi! What is 2+2?"}],
        tools=[WEATHER],
        options={"temperature": 0, "num_predict": 30},
    )
    if offered.message.tool_calls:
        assert all(c.function.name == "get_weather" for c in offered.message.tool_calls)
    else:
        assert "4" in (offered.message.content or "")
    answered = await local.chat(
        model=SHIPPED,
        messages=[
            *QUESTION,
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
                ],
            },
            {"role": "tool", "content": RESULT, "tool_name": "get_weather"},
        ],
        options={"temperature": 0, "num_predict": 40},
    )
    assert not answered.message.tool_calls
    assert "22" in (answered.message.content or "")


async def test_llama_server_renders_the_same_format(
    nursery: trio.Nursery, llama_server_binary: str
) -> None:
    """llama-server gets the pool's qwen3_template as its chat template: the server sees
    the tools, past calls and results in the same markup, and parses calls in it."""
    shipped = _shipped_model()
    info = await start_server(
        nursery,
        {
            "ls": {
                "backend": "llama_server",
                "llama_server_binary": llama_server_binary,
                "model_path": shipped["model_path"],
                "prompt_format": shipped["prompt_format"],
                "llama_server_n_ctx": 2048,
                "llama_server_n_gpu_layers": 0,
                "enabled": True,
            }
        },
    )
    client = openai.AsyncOpenAI(base_url=info.url + "/v1", api_key="unused", max_retries=0)
    forced = await client.chat.completions.create(
        model="ls",
        messages=QUESTION,
        tools=[WEATHER],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        temperature=0,
        max_tokens=60,
    )
    assert forced.choices[0].finish_reason == "tool_calls"
    (call,) = forced.choices[0].message.tool_calls or []
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    auto = await client.chat.completions.create(
        model="ls",
        messages=[{"role": "user", "content": "Hi! What is 2+2?"}],
        tools=[WEATHER],
        temperature=0,
        max_tokens=30,
    )
    assert auto.choices[0].message.tool_calls or "4" in (auto.choices[0].message.content or "")
    final = await client.chat.completions.create(
        model="ls",
        messages=[
            *QUESTION,
            {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
            {"role": "tool", "tool_call_id": call.id, "content": RESULT},
        ],
        tools=[WEATHER],
        tool_choice="none",
        temperature=0,
        max_tokens=40,
    )
    reply = final.choices[0]
    assert not reply.message.tool_calls
    assert "22" in (reply.message.content or "")
