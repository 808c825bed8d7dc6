"""Rerank with real runtimes: an embedding model's cosine fallback on all-MiniLM-L6-v2
(CTranslate2's encoder, converted once per machine as tests/backends/test_ct2_encoder.py
does), through the pool's HTTP route."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from pool import ServerInfo, serve
from pool.config import build_settings
from pool.convert import cached_encoder

pytestmark = pytest.mark.real_model

# A query with the document that answers it, among lookalikes that share its words.
QUERY = "How do I fix a flat tyre on my bicycle?"
DOCUMENTS = [
    "How do I fix a flat roof on my house?",
    "How do I bake bread at home?",
    "Repairing a punctured bike tire step by step.",
    "Bicycles were invented in the nineteenth century.",
]


@pytest.fixture(scope="module")
def encoder_dir() -> Path:
    return cached_encoder()  # downloaded and built once per machine, then reused


async def test_minilm_reranks_the_answer_first_by_cosine(
    encoder_dir: Path, nursery: trio.Nursery
) -> None:
    model: dict[str, Any] = {
        "backend": "ct2",
        "model_path": str(encoder_dir),
        "kind": "embedding",
        "enabled": True,
    }
    settings = build_settings(
        {"engine": {"models": {"minilm": model}, "rerank": {"batch_documents": 2}}}
    )
    info: ServerInfo = await nursery.start(
        lambda task_status: serve(settings, host="127.0.0.1", port=0, task_status=task_status)
    )
    async with httpx.AsyncClient(base_url=info.url, timeout=60) as client:
        r = await client.post(
            "/v1/rerank",
            json={"model": "minilm", "query": QUERY, "documents": DOCUMENTS, "top_n": 2},
        )
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["method"] == "embedding_cosine"
        assert body["results"][0]["index"] == 2, body
        assert len(body["results"]) == 2
        # all-MiniLM's vectors are unit length: the scores are cosines in [-1, 1].
        assert all(-1.0 <= x["relevance_score"] <= 1.0 for x in body["results"])
        assert body["usage"]["prompt_tokens"] > 0
        score = await client.post(
            "/v1/score", json={"model": "minilm", "text_1": QUERY, "text_2": DOCUMENTS}
        )
        assert score.status_code == 200, score.text
        scores = [x["score"] for x in score.json()["data"]]
        assert max(range(4), key=scores.__getitem__) == 2
        # The same pairs score the same on both routes (within float rounding).
        ranked = {x["index"]: x["relevance_score"] for x in body["results"]}
        assert scores[2] == pytest.approx(ranked[2], abs=1e-6)
    info.shutdown()
