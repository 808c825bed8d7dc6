"""Rerank documents/s for one GGUF: through the pool's ``/v1/rerank`` against the same
llama-server's own ``/v1/rerank``.

The pool starts the llama-server (``kind: rerank``, ``--reranking``) on a known port, so
both sides talk to one server process and the ratio is the pool's own cost: its HTTP
stack, admission, the job, and its batching (``engine.rerank.batch_documents`` per
runtime call, one call after the other). The GGUF is a BERT cross-encoder of
ms-marco-MiniLM-L-6-v2's size (384 wide, 6 layers) with random weights
(tests/backends/tiny_reranker.py): no reranker GGUF can be downloaded here, and the cost
of a pair depends on the shape, not on the weights. Each round sends one request of
``--documents`` documents to each side, interleaved (A B, B A, ...) so drift on a shared
machine hits both::

    LLM_POOL_LLAMA_SERVER=/path/to/llama-server python -m benchmarks.rerank --rounds 8
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import trio

from benchmarks._machine import describe
from pool import ServerInfo, serve
from pool.backends import free_port
from pool.config import build_settings
from tests.backends import tiny_reranker

WORDS = tiny_reranker.WORDS
QUERY = "what is the capital city of france"


def _documents(count: int, words: int) -> list[str]:
    """``count`` documents of ``words`` vocabulary words each, all different."""
    return [
        " ".join(WORDS[(i * 7 + j * 3) % len(WORDS)] for j in range(words)) for i in range(count)
    ]


async def _timed(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> float:
    started = time.perf_counter()
    r = await client.post(url, json=body)
    elapsed = time.perf_counter() - started
    r.raise_for_status()
    assert len(r.json()["results"]) == len(body["documents"])
    return elapsed


async def main(
    binary: str, rounds: int, documents: int, words: int, batch: int, out: Path | None
) -> dict[str, Any]:
    machine = describe()
    with tempfile.TemporaryDirectory() as folder:
        gguf = tiny_reranker.write(
            Path(folder) / "minilm-sized-reranker.gguf",
            width=384,
            layers=6,
            feed_forward=1536,
            heads=12,
        )
        port = free_port("127.0.0.1")
        settings = build_settings(
            {
                "service": {"shutdown_grace_s": 2, "usage": {"enabled": False}},
                "engine": {
                    "rerank": {"batch_documents": batch},
                    "models": {
                        "ranker": {
                            "backend": "llama_server",
                            "llama_server_binary": binary,
                            "llama_server_port": port,
                            "model_path": str(gguf),
                            "llama_server_n_ctx": 512,
                            "kind": "rerank",
                            "enabled": True,
                        }
                    },
                },
            }
        )
        docs = _documents(documents, words)
        times: dict[str, list[float]] = {"pool": [], "direct": []}
        async with trio.open_nursery() as nursery:
            info: ServerInfo = await nursery.start(
                lambda task_status: serve(
                    settings, host="127.0.0.1", port=0, task_status=task_status
                )
            )
            assert info.pool.snapshot("ranker").state == "loaded"
            urls = {
                "pool": f"{info.url}/v1/rerank",
                "direct": f"http://127.0.0.1:{port}/v1/rerank",
            }
            body = {"model": "ranker", "query": QUERY, "documents": docs}
            async with httpx.AsyncClient(timeout=600) as client:
                for side in ("pool", "direct"):  # warm-up, not counted
                    await _timed(client, urls[side], body)
                for index in range(rounds):
                    order = ("pool", "direct") if index % 2 == 0 else ("direct", "pool")
                    for side in order:
                        times[side].append(await _timed(client, urls[side], body))
                    print(
                        f"round {index + 1}: pool {documents / times['pool'][-1]:.1f} docs/s,"
                        f" direct {documents / times['direct'][-1]:.1f} docs/s"
                    )
            info.shutdown()
    rates = {side: [documents / t for t in runs] for side, runs in times.items()}
    summary = {
        "pool_docs_per_s": statistics.median(rates["pool"]),
        "direct_docs_per_s": statistics.median(rates["direct"]),
        "pool_ms_p50": statistics.median(times["pool"]) * 1000,
        "direct_ms_p50": statistics.median(times["direct"]) * 1000,
    }
    summary["pool_ratio"] = summary["pool_docs_per_s"] / summary["direct_docs_per_s"]
    result = {
        "command": "python -m benchmarks.rerank"
        f" --rounds {rounds} --documents {documents} --words {words} --batch {batch}",
        "machine": machine,
        "loadavg_at_end": os.getloadavg(),
        "model": "BERT 384 wide, 6 layers, 12 heads (ms-marco-MiniLM-L-6-v2's shape),"
        " random weights, F32 GGUF",
        "documents": documents,
        "words_per_document": words,
        "batch_documents": batch,
        "rounds": rounds,
        "summary": summary,
        "runs": rates,
    }
    if out is not None:
        _write(out, result)
    return result


def _write(out: Path, result: dict[str, Any]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / "results.md").write_text(_markdown(result))


def _markdown(result: dict[str, Any]) -> str:
    s = result["summary"]
    machine = result["machine"]
    return (
        "# rerank: pool vs llama-server directly\n\n"
        f"Command: `{result['command']}`  \n"
        f"Machine: {machine['cpu']}, {machine['cores']} cores, load average at start"
        f" {machine['loadavg_at_start']}, at end"
        f" {[round(x, 2) for x in result['loadavg_at_end']]}  \n"
        f"Model: {result['model']}; {result['documents']} documents of"
        f" {result['words_per_document']} words per request, `batch_documents`"
        f" {result['batch_documents']}, {result['rounds']} rounds (medians)\n\n"
        "| side | documents/s | request ms (p50) |\n|---|---|---|\n"
        f"| pool `/v1/rerank` | {s['pool_docs_per_s']:.1f} | {s['pool_ms_p50']:.1f} |\n"
        f"| llama-server `/v1/rerank` | {s['direct_docs_per_s']:.1f}"
        f" | {s['direct_ms_p50']:.1f} |\n\n"
        f"Pool / direct: {s['pool_ratio']:.3f}\n"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--documents", type=int, default=64)
    parser.add_argument("--words", type=int, default=40)
    parser.add_argument("--batch", type=int, default=32, help="engine.rerank.batch_documents")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/rerank"))
    parser.add_argument("--binary", default=os.environ.get("LLM_POOL_LLAMA_SERVER", "llama-server"))
    args = parser.parse_args()
    trio.run(main, args.binary, args.rounds, args.documents, args.words, args.batch, args.out)
