"""Embeddings through the pool: OpenAI's /v1/embeddings, Ollama's /api/embed(dings).

The stub's deterministic vectors (``embedding: true``, ``stub_embedding_dim``) test the
pool's part: admission, batching, encodings, the refusals between model kinds.
"""

from __future__ import annotations

import base64
import math
import struct

import httpx
import openai
import pytest
import trio

from pool import ServerInfo
from pool.backends.stub import StubRuntime, stub_embedding
from tests.http.conftest import start_server

MODELS = {
    "embed": {"backend": "stub", "enabled": True, "embedding": True, "stub_embedding_dim": 12},
    "chat": {"backend": "stub", "enabled": True},
    "embed-lazy": {
        "backend": "stub",
        "embedding": True,
        "on_demand": True,
        "stub_load_seconds": 0.05,
    },
}


@pytest.fixture
async def server(nursery: trio.Nursery) -> ServerInfo:
    return await start_server(nursery, MODELS)


@pytest.fixture
async def client(server: ServerInfo) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=server.url, timeout=10)


async def test_openai_client_batch_and_base64(server: ServerInfo) -> None:
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    texts = [f"text number {i}" for i in range(16)]
    # The client asks for base64 by default and decodes it itself.
    reply = await client.embeddings.create(model="embed", input=texts)
    assert len(reply.data) == 16
    assert [d.index for d in reply.data] == list(range(16))
    for item, text in zip(reply.data, texts, strict=True):
        assert item.embedding == pytest.approx(list(stub_embedding(text, 12)), abs=1e-6)
    assert reply.usage.prompt_tokens == 16 * 3
    floats = await client.embeddings.create(model="embed", input="one", encoding_format="float")
    assert floats.data[0].embedding == pytest.approx(list(stub_embedding("one", 12)))
    short = await client.embeddings.create(model="embed", input="one", dimensions=4)
    assert len(short.data[0].embedding) == 4
    assert math.isclose(math.hypot(*short.data[0].embedding), 1.0, rel_tol=1e-6)


async def test_base64_is_little_endian_float32(client: httpx.AsyncClient) -> None:
    r = await client.post(
        "/v1/embeddings", json={"model": "embed", "input": ["a"], "encoding_format": "base64"}
    )
    assert r.status_code == 200, r.text
    body = r.json()
    raw = base64.b64decode(body["data"][0]["embedding"])
    assert struct.unpack("<12f", raw) == pytest.approx(stub_embedding("a", 12), abs=1e-6)
    assert body["object"] == "list" and body["model"] == "embed"
    assert "X-Queue-Wait-Ms" in r.headers


async def test_wrong_kind_of_model_is_a_400_with_a_code(client: httpx.AsyncClient) -> None:
    r = await client.post("/v1/embeddings", json={"model": "chat", "input": "x"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "wrong_model_kind"
    r = await client.post(
        "/v1/chat/completions",
        json={"model": "embed", "messages": [{"role": "user", "content": "hi"}]},
    )
    assert r.status_code == 400 and r.json()["error"]["code"] == "wrong_model_kind"
    r = await client.post("/v1/responses", json={"model": "embed", "input": "hi"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "wrong_model_kind"
    r = await client.post("/api/embed", json={"model": "chat", "input": "x"})
    assert r.status_code == 400 and "is of kind chat" in r.json()["error"]
    r = await client.post("/v1/embeddings", json={"model": "embed", "input": "x", "dimensions": 99})
    assert r.status_code == 400 and r.json()["error"]["param"] == "dimensions"
    r = await client.post("/v1/embeddings", json={"model": "nope", "input": "x"})
    assert r.status_code == 404


async def test_ollama_client_embed(server: ServerInfo) -> None:
    import ollama

    client = ollama.AsyncClient(host=server.url)
    texts = [f"t{i}" for i in range(16)]
    reply = await client.embed(model="embed", input=texts)
    assert len(reply.embeddings) == 16
    assert reply.embeddings[3] == pytest.approx(list(stub_embedding("t3", 12)))
    old = await client.embeddings(model="embed", prompt="t3")
    assert list(old.embedding) == pytest.approx(list(stub_embedding("t3", 12)))


async def test_on_demand_embedding_model_loads_for_the_request(
    client: httpx.AsyncClient,
) -> None:
    r = await client.post("/api/embed", json={"model": "embed-lazy", "input": "x"})
    assert r.status_code == 200, r.text
    assert len(r.json()["embeddings"][0]) == 8
    ps = (await client.get("/api/ps")).json()
    assert [m["name"] for m in ps["models"] if m["name"] == "embed-lazy"] == ["embed-lazy"]


async def test_capabilities_and_openapi_name_the_new_routes(client: httpx.AsyncClient) -> None:
    caps = (await client.get("/v1/capabilities")).json()["capabilities"]
    assert caps["embeddings"] is True
    paths = (await client.get("/openapi.json")).json()["paths"]
    for path in ("/v1/embeddings", "/v1/completions", "/api/embed", "/api/embeddings"):
        operation = paths[path]["post"]
        assert "requestBody" in operation and "content" in operation["responses"]["200"]
    for path in ("/api/tags", "/api/ps", "/"):
        assert "content" in paths[path]["get"]["responses"]["200"]
    assert "/api/copy" in paths and "/v1/chat/completions" in paths


async def test_an_unexpected_backend_exception_is_a_clean_error(
    client: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # A bug in a backend (issue #25: a TypeError out of llama_cpp's embed) fails that
    # request with a clean error; the exception is the server log's, never the client's.
    async def broken_embed(self: StubRuntime, job: object) -> None:
        float([1.0])  # type: ignore[arg-type]

    async def broken_generate(self: StubRuntime, request: object, sink: object) -> None:
        float([1.0])  # type: ignore[arg-type]

    monkeypatch.setattr(StubRuntime, "embed", broken_embed)
    monkeypatch.setattr(StubRuntime, "generate", broken_generate)
    answers = [
        await client.post("/v1/embeddings", json={"model": "embed", "input": "x"}),
        await client.post("/v1/responses", json={"model": "chat", "input": "x"}),
    ]
    for answer in answers:
        assert answer.status_code == 500, answer.text
        error = answer.json()["error"]
        assert error["code"] == "internal_error"
        assert "the backend failed unexpectedly" in error["message"]
        assert "TypeError" not in answer.text and "float()" not in answer.text
    streamed = await client.post(
        "/v1/responses", json={"model": "chat", "input": "x", "stream": True}
    )
    assert '"internal_error"' in streamed.text and "TypeError" not in streamed.text
    logged = [r for r in caplog.records if r.exc_info and r.exc_info[0] is TypeError]
    assert len(logged) == 3
    # The failure was that request's alone: the models still serve.
    monkeypatch.undo()
    again = await client.post("/v1/embeddings", json={"model": "embed", "input": "x"})
    assert again.status_code == 200, again.text
