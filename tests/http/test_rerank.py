"""Rerank and score through the pool: /v1/rerank (and its aliases), vLLM's /v1/score.

The stub's rank head (``kind: rerank``) scores the share of the query's words a document
holds, and its embedding model answers by cosine similarity of its deterministic
vectors, so the pool's part is what is tested: shapes, ordering, ``top_n``, the
bounds of ``engine.rerank``, batching, the kinds, keys, budgets and usage rows.
The real runtimes have their own tests (tests/backends/test_rerank_real.py).
"""

from __future__ import annotations

import math
from typing import Any

import httpx
import pytest
import trio

from pool import ServerInfo
from pool.backends.stub import stub_embedding
from tests.http.conftest import start_server

MODELS = {
    "ranker": {"backend": "stub", "enabled": True, "kind": "rerank"},
    "embed": {"backend": "stub", "enabled": True, "embedding": True, "stub_embedding_dim": 16},
    "chat": {"backend": "stub", "enabled": True},
}
LIMITS = {
    "max_documents": 6,
    "max_document_chars": 40,
    "max_request_chars": 200,
    "batch_documents": 2,
    "batch_chars": 1000,
}
QUERY = "capital of france"
DOCUMENTS = [
    "berlin is in germany",
    "paris is the capital of france",
    "the capital of spain",
]
RERANK_PATHS = ("/v1/rerank", "/rerank", "/v2/rerank", "/openai/v1/rerank")
SCORE_PATHS = ("/v1/score", "/score", "/openai/v1/score")


def _cosine(a: tuple[float, ...], b: tuple[float, ...]) -> float:
    return sum(x * y for x, y in zip(a, b, strict=True)) / (math.hypot(*a) * math.hypot(*b))


@pytest.fixture
async def server(nursery: trio.Nursery) -> ServerInfo:
    return await start_server(nursery, MODELS, engine={"rerank": LIMITS}, usage={"flush_ms": 10})


@pytest.fixture
async def client(server: ServerInfo) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=server.url, timeout=10)


@pytest.mark.parametrize("path", RERANK_PATHS)
async def test_rerank_orders_by_the_rank_head(client: httpx.AsyncClient, path: str) -> None:
    r = await client.post(path, json={"model": "ranker", "query": QUERY, "documents": DOCUMENTS})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["id"].startswith("rerank-") and body["model"] == "ranker"
    assert body["method"] == "rank_head"
    assert [x["index"] for x in body["results"]] == [1, 2, 0]
    assert [x["relevance_score"] for x in body["results"]] == pytest.approx([1.0, 2 / 3, 0.0])
    assert all("document" not in x for x in body["results"])
    # The stub reads each pair: the query's three words and the document's.
    words = sum(3 + len(d.split()) for d in DOCUMENTS)
    assert body["usage"] == {"prompt_tokens": words, "total_tokens": words}
    assert r.headers["X-Queue-Wait-Ms"].isdigit()


async def test_top_n_and_documents_as_objects(client: httpx.AsyncClient) -> None:
    documents: list[Any] = [{"text": DOCUMENTS[0]}, DOCUMENTS[1], {"text": DOCUMENTS[2]}]
    r = await client.post(
        "/v1/rerank",
        json={
            "model": "ranker",
            "query": QUERY,
            "documents": documents,
            "top_n": 2,
            "return_documents": True,
        },
    )
    assert r.status_code == 200, r.text
    assert [(x["index"], x["document"]) for x in r.json()["results"]] == [
        (1, {"text": DOCUMENTS[1]}),
        (2, {"text": DOCUMENTS[2]}),
    ]


async def test_an_embedding_model_answers_by_cosine(client: httpx.AsyncClient) -> None:
    r = await client.post(
        "/v1/rerank", json={"model": "embed", "query": QUERY, "documents": DOCUMENTS}
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["method"] == "embedding_cosine"
    query = stub_embedding(QUERY, 16)
    expected = {i: _cosine(query, stub_embedding(d, 16)) for i, d in enumerate(DOCUMENTS)}
    assert {x["index"]: x["relevance_score"] for x in body["results"]} == pytest.approx(expected)
    scores = [x["relevance_score"] for x in body["results"]]
    assert scores == sorted(scores, reverse=True)
    # Each distinct text embedded once: the query and the three documents.
    words = len(QUERY.split()) + sum(len(d.split()) for d in DOCUMENTS)
    assert body["usage"]["prompt_tokens"] == words


@pytest.mark.parametrize("path", SCORE_PATHS)
async def test_score_one_text_against_a_list(client: httpx.AsyncClient, path: str) -> None:
    r = await client.post(path, json={"model": "ranker", "text_1": QUERY, "text_2": DOCUMENTS})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "list" and body["model"] == "ranker"
    assert body["method"] == "rank_head" and body["id"].startswith("score-")
    assert [(x["index"], x["object"]) for x in body["data"]] == [(i, "score") for i in range(3)]
    assert [x["score"] for x in body["data"]] == pytest.approx([0.0, 1.0, 2 / 3])


async def test_score_pairs_two_lists(client: httpx.AsyncClient) -> None:
    r = await client.post(
        "/v1/score",
        json={
            "model": "ranker",
            "text_1": ["capital of france", "big cat", "capital of france"],
            "text_2": ["paris capital of france", "a small dog", "rome"],
        },
    )
    assert r.status_code == 200, r.text
    assert [x["score"] for x in r.json()["data"]] == pytest.approx([1.0, 0.0, 0.0])
    uneven = await client.post(
        "/v1/score", json={"model": "ranker", "text_1": ["a", "b"], "text_2": ["a", "b", "c"]}
    )
    assert uneven.status_code == 400 and uneven.json()["error"]["code"] == "invalid_request"


async def test_documents_go_to_the_runtime_in_batches(
    server: ServerInfo, client: httpx.AsyncClient
) -> None:
    r = await client.post(
        "/v1/rerank",
        json={"model": "ranker", "query": "a", "documents": ["a", "b", "c", "a b", "d"]},
    )
    assert r.status_code == 200, r.text
    assert [x["index"] for x in r.json()["results"]][:2] == [0, 3]
    runtime: Any = server.pool.model("ranker").replicas[0].runtime
    # engine.rerank.batch_documents is 2: three calls for five documents.
    assert runtime.calls == [2, 2, 1]


@pytest.mark.parametrize(
    ("documents", "query", "code"),
    [
        (["d"] * 7, "q", "too_many_documents"),
        (["x" * 41], "q", "document_too_long"),
        (["d"], "q" * 41, "document_too_long"),
        # Five pairs of 40 + 1 characters: 205, past max_request_chars (200).
        (["d"] * 5, "q" * 40, "rerank_too_long"),
    ],
)
async def test_the_bounds_of_engine_rerank_are_400s(
    client: httpx.AsyncClient, documents: list[str], query: str, code: str
) -> None:
    r = await client.post(
        "/v1/rerank", json={"model": "ranker", "query": query, "documents": documents}
    )
    assert r.status_code == 400, r.text
    assert r.headers["X-Error-Code"] == code
    assert r.json()["error"]["code"] == code
    assert "engine.rerank" in r.json()["error"]["message"]


@pytest.mark.parametrize("path", ("/v1/rerank", "/v1/score"))
async def test_a_chat_model_is_the_wrong_kind(client: httpx.AsyncClient, path: str) -> None:
    body = (
        {"query": "q", "documents": ["d"]} if "rerank" in path else {"text_1": "q", "text_2": "d"}
    )
    r = await client.post(path, json={"model": "chat", **body})
    assert r.status_code == 400, r.text
    assert r.headers["X-Error-Code"] == "wrong_model_kind"
    assert r.json()["error"]["message"] == (
        "model 'chat' is of kind chat; this request needs a model of kind embedding or rerank"
    )


async def test_a_rerank_model_refuses_generation_and_embeddings(
    client: httpx.AsyncClient,
) -> None:
    chat = await client.post(
        "/v1/chat/completions",
        json={"model": "ranker", "messages": [{"role": "user", "content": "hi"}]},
    )
    assert chat.headers["X-Error-Code"] == "wrong_model_kind"
    embed = await client.post("/v1/embeddings", json={"model": "ranker", "input": "x"})
    assert embed.headers["X-Error-Code"] == "wrong_model_kind"


async def test_bad_bodies_are_422_and_unknown_models_404(client: httpx.AsyncClient) -> None:
    empty = await client.post("/v1/rerank", json={"model": "ranker", "query": "q", "documents": []})
    assert empty.status_code == 422
    no_query = await client.post("/v1/rerank", json={"model": "ranker", "documents": ["d"]})
    assert no_query.status_code == 422
    bad_top = await client.post(
        "/v1/rerank", json={"model": "ranker", "query": "q", "documents": ["d"], "top_n": 0}
    )
    assert bad_top.status_code == 422
    unknown = await client.post(
        "/v1/rerank", json={"model": "nope", "query": "q", "documents": ["d"]}
    )
    assert unknown.status_code == 404


async def test_usage_rows_and_tenants(client: httpx.AsyncClient) -> None:
    r = await client.post(
        "/v1/rerank",
        json={"model": "ranker", "query": "a b", "documents": ["a", "b c"]},
        headers={"X-Tenant-ID": "search"},
    )
    assert r.status_code == 200, r.text
    with trio.fail_after(10):
        while True:
            usage = (await client.get("/v1/admin/usage", params={"group_by": "tenant"})).json()
            rows = {row["tenant"]: row for row in usage["usage"]}
            if "search" in rows:
                break
            await trio.sleep(0.02)
    # Two pairs read: (2 + 1) + (2 + 2) words.
    assert rows["search"]["requests"] == 1 and rows["search"]["prompt_tokens"] == 7
    assert rows["search"]["output_tokens"] == 0


async def test_a_spent_budget_refuses_rerank(nursery: trio.Nursery) -> None:
    server = await start_server(
        nursery, MODELS, budgets=[{"tenant": "metered", "tokens_per_day": 4}]
    )
    metered = {"X-Tenant-ID": "metered"}
    body = {"model": "ranker", "query": "a b", "documents": ["a b c"]}
    async with httpx.AsyncClient(base_url=server.url, timeout=10) as client:
        first = await client.post("/v1/rerank", json=body, headers=metered)
        assert first.status_code == 200, first.text
        refused = await client.post("/v1/rerank", json=body, headers=metered)
        assert refused.status_code == 429
        assert refused.json()["error"]["code"] == "budget_exceeded"
        assert (await client.post("/v1/rerank", json=body)).status_code == 200


async def test_keys_and_tenant_scopes_apply(nursery: trio.Nursery) -> None:
    keys = [{"name": "alice", "key": "sk-alice", "tenant": "team-a"}]
    server = await start_server(nursery, MODELS, auth={"keys": keys})
    body = {"model": "ranker", "query": "q", "documents": ["d"]}
    async with httpx.AsyncClient(base_url=server.url, timeout=10) as client:
        anonymous = await client.post("/v1/rerank", json=body)
        assert anonymous.status_code == 401
        keyed = {"Authorization": "Bearer sk-alice"}
        assert (await client.post("/v1/rerank", json=body, headers=keyed)).status_code == 200
        other = await client.post(
            "/v1/score",
            json={"model": "ranker", "text_1": "q", "text_2": "d"},
            headers={**keyed, "X-Tenant-ID": "team-b"},
        )
        assert other.status_code == 403
        assert other.headers["X-Error-Code"] == "tenant_forbidden"
