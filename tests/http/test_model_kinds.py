"""A model's kind (docs/backends.md, "Model kinds"): shown wherever models are listed,
and a request for another kind refused with 400 ``wrong_model_kind`` on every surface."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
import trio

from pool import ServerInfo
from tests.http.conftest import start_server

MODELS = {
    "chat": {"backend": "stub", "enabled": True},
    "embed": {"backend": "stub", "enabled": True, "embedding": True},
    "ranker": {"backend": "stub", "enabled": True, "kind": "rerank"},
}

_CHAT = {"messages": [{"role": "user", "content": "hi"}]}
# (path, body without its model): every generation route of every surface.
GENERATION_ROUTES: list[tuple[str, dict[str, Any]]] = [
    ("/v1/chat/completions", _CHAT),
    ("/openai/v1/chat/completions", _CHAT),
    ("/v1/completions", {"prompt": "hi"}),
    ("/v1/responses", {"input": "hi"}),
    ("/openai/v1/responses", {"input": "hi"}),
    ("/v1/messages", {"max_tokens": 8, **_CHAT}),
    ("/api/chat", {"stream": False, **_CHAT}),
    ("/api/generate", {"prompt": "hi", "stream": False}),
]
EMBEDDING_ROUTES: list[tuple[str, dict[str, Any]]] = [
    ("/v1/embeddings", {"input": "x"}),
    ("/openai/v1/embeddings", {"input": "x"}),
    ("/api/embed", {"input": "x"}),
    ("/api/embeddings", {"prompt": "x"}),
]


@pytest.fixture
async def client(nursery: trio.Nursery) -> httpx.AsyncClient:
    server: ServerInfo = await start_server(nursery, MODELS)
    return httpx.AsyncClient(base_url=server.url, timeout=10)


@pytest.mark.parametrize(("path", "body"), GENERATION_ROUTES)
@pytest.mark.parametrize("model", ["embed", "ranker"])
async def test_generation_on_another_kind_is_refused(
    client: httpx.AsyncClient, path: str, body: dict[str, Any], model: str
) -> None:
    r = await client.post(path, json={"model": model, **body})
    assert r.status_code == 400, r.text
    assert r.headers["X-Error-Code"] == "wrong_model_kind"
    kind = "embedding" if model == "embed" else "rerank"
    # The message names both kinds, whatever the dialect's error shape.
    assert f"is of kind {kind};" in r.text and "needs a model of kind chat" in r.text
    served = await client.post(path, json={"model": "chat", **body})
    assert served.status_code == 200, served.text


@pytest.mark.parametrize(("path", "body"), EMBEDDING_ROUTES)
@pytest.mark.parametrize("model", ["chat", "ranker"])
async def test_embeddings_on_another_kind_are_refused(
    client: httpx.AsyncClient, path: str, body: dict[str, Any], model: str
) -> None:
    r = await client.post(path, json={"model": model, **body})
    assert r.status_code == 400, r.text
    assert r.headers["X-Error-Code"] == "wrong_model_kind"
    kind = "chat" if model == "chat" else "rerank"
    assert f"is of kind {kind};" in r.text and "needs a model of kind embedding" in r.text
    served = await client.post(path, json={"model": "embed", **body})
    assert served.status_code == 200, served.text


async def test_the_error_body_names_both_kinds(client: httpx.AsyncClient) -> None:
    r = await client.post("/v1/embeddings", json={"model": "chat", "input": "x"})
    error = r.json()["error"]
    assert error["code"] == "wrong_model_kind"
    assert error["message"] == (
        "model 'chat' is of kind chat; this request needs a model of kind embedding"
    )


async def test_every_listing_shows_the_kind(client: httpx.AsyncClient) -> None:
    kinds = {"chat": "chat", "embed": "embedding", "ranker": "rerank"}
    rows = (await client.get("/v1/admin/models")).json()["models"]
    assert {row["name"]: row["kind"] for row in rows} == kinds
    for path in ("/v1/models", "/openai/v1/models"):
        cards = (await client.get(path)).json()["data"]
        assert {card["id"]: card["kind"] for card in cards} == kinds
    tags = (await client.get("/api/tags")).json()["models"]
    assert {tag["name"]: tag["kind"] for tag in tags} == kinds
    running = (await client.get("/api/ps")).json()["models"]
    assert {m["name"]: m["kind"] for m in running} == kinds
