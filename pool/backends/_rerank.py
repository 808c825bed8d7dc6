"""Rerank and score: how well each document answers a query, as one task job.

A :class:`RerankJob` is one ``/v1/rerank`` or ``/v1/score`` request. It runs on a model
of kind ``rerank``, whose runtime scores (query, document) pairs with its rank head
(:class:`RankingRuntime`), or on a model of kind ``embedding``, whose runtime embeds
the query and the documents: the score is then their cosine similarity, the
documented fallback for a model without a rank head. The answer names which method
scored (:data:`RerankMethod`).

Either way the documents go to the runtime in batches of at most
``engine.rerank.batch_documents`` documents and ``batch_chars`` characters, one after
the other, so that each call fits the runtime's context; the bounds of the whole
request (:func:`rerank_job`) are checked before it is queued.

A server that ranks over HTTP (llama-server's ``--reranking``, ``vllm serve``, a remote
API) is called through :func:`rank_upstream`.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal, Protocol, runtime_checkable

from pool.backends._gguf import read_gguf_header
from pool.backends._protocol import (
    EmbeddingJob,
    EmbeddingResult,
    ModelKind,
    Runtime,
)
from pool.backends._tasks import TaskJob, TaskResult, TaskSink, TaskUsage
from pool.backends._upstream import Transport, post_json
from pool.config import RerankLimits
from pool.errors import BackendError, PoolError

# How the scores were made: a rank head (a cross-encoder reading each pair), or the
# cosine similarity of two embeddings (an embedding model's fallback).
RerankMethod = Literal["rank_head", "embedding_cosine"]


@dataclass(frozen=True, slots=True)
class RankResult:
    """One score per document of a :meth:`RankingRuntime.rank` call, in order, and the
    tokens read (``None`` where the runtime does not say)."""

    scores: tuple[float, ...]
    prompt_tokens: int | None = None


@runtime_checkable
class RankingRuntime(Runtime, Protocol):
    """A runtime that can score (query, document) pairs with a rank head.

    ``ranks`` is False on a replica of the same runtime class that was loaded as
    another kind (a server started without its reranking mode).
    """

    @property
    def ranks(self) -> bool: ...

    async def rank(self, query: str, documents: Sequence[str]) -> RankResult:
        """One relevance score per document (higher: more relevant), in order.

        Raises:
            BackendError: the runtime failed.
            PoolError: ``invalid_request`` when the runtime refuses the input (a pair
                longer than its context), ``backend_timeout``.
        """
        ...


@dataclass(frozen=True, slots=True)
class Ranked:
    """A rerank job's answer: one score per document in request order, and the method."""

    scores: tuple[float, ...]
    method: RerankMethod


def batches(
    query: str, documents: Sequence[str], most_documents: int, most_chars: int
) -> list[tuple[int, int]]:
    """``documents`` cut into ``[start, end)`` runs of at most ``most_documents`` and
    ``most_chars`` characters (each pair counts the query once); a pair longer than
    ``most_chars`` alone is a batch of its own."""
    runs: list[tuple[int, int]] = []
    start, chars = 0, 0
    for index, document in enumerate(documents):
        size = len(query) + len(document)
        if index > start and (index - start >= most_documents or chars + size > most_chars):
            runs.append((start, index))
            start, chars = index, 0
        chars += size
    if start < len(documents):
        runs.append((start, len(documents)))
    return runs


def cosine(a: Sequence[float], b: Sequence[float]) -> float:
    """The cosine similarity of two vectors (0 for a zero vector)."""
    dot = sum(x * y for x, y in zip(a, b, strict=True))
    norm = math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b))
    return dot / norm if norm else 0.0


@dataclass(frozen=True, slots=True)
class RerankJob(TaskJob):
    """Score ``documents`` against ``queries``: one query for every document (rerank,
    score with one ``text_1``), or one query per document (score of two lists)."""

    served_by: ClassVar[frozenset[ModelKind]] = frozenset({"rerank", "embedding"})
    operation: ClassVar[str] = "rerank"
    model: str
    queries: tuple[str, ...]
    documents: tuple[str, ...]
    batch_documents: int = 32
    batch_chars: int = 65_536
    request_id: str = ""

    def groups(self) -> list[tuple[str, list[int]]]:
        """Each distinct query with the indexes of its documents, in first-seen order."""
        if len(self.queries) == 1:
            return [(self.queries[0], list(range(len(self.documents))))]
        grouped: dict[str, list[int]] = {}
        for index, query in enumerate(self.queries):
            grouped.setdefault(query, []).append(index)
        return list(grouped.items())

    async def run(self, runtime: Runtime, sink: TaskSink) -> TaskResult:
        if isinstance(runtime, RankingRuntime) and runtime.ranks:
            return await self._rank(runtime)
        embed = getattr(runtime, "embed", None)
        if embed is None:
            # Admission lets only rerank and embedding models through; a runtime of
            # those kinds without either call is the backend's bug.
            raise BackendError(f"model {self.model!r}: its runtime neither ranks nor embeds")
        return await self._cosine(embed)

    async def _rank(self, runtime: RankingRuntime) -> TaskResult:
        scores: list[float] = [0.0] * len(self.documents)
        tokens: int | None = 0
        for query, indexes in self.groups():
            texts = [self.documents[i] for i in indexes]
            for start, end in batches(query, texts, self.batch_documents, self.batch_chars):
                result = await runtime.rank(query, texts[start:end])
                if len(result.scores) != end - start:
                    raise BackendError(
                        f"model {self.model!r} returned {len(result.scores)} scores for"
                        f" {end - start} documents"
                    )
                for index, score in zip(indexes[start:end], result.scores, strict=True):
                    scores[index] = score
                tokens = _add(tokens, result.prompt_tokens)
        return TaskResult(Ranked(tuple(scores), "rank_head"), TaskUsage(prompt_tokens=tokens or 0))

    async def _cosine(self, embed: Any) -> TaskResult:
        # Each distinct text is embedded once, the queries first, in the same batches.
        texts = list(dict.fromkeys((*self.queries, *self.documents)))
        vectors: dict[str, tuple[float, ...]] = {}
        tokens: int | None = 0
        for start, end in batches("", texts, self.batch_documents, self.batch_chars):
            chunk = tuple(texts[start:end])
            result: EmbeddingResult = await embed(
                EmbeddingJob(self.request_id, self.model, chunk, truncate=False)
            )
            if len(result.vectors) != len(chunk):
                raise BackendError(
                    f"model {self.model!r} returned {len(result.vectors)} vectors for"
                    f" {len(chunk)} texts"
                )
            vectors.update(zip(chunk, result.vectors, strict=True))
            tokens = _add(tokens, result.prompt_tokens)
        scores = tuple(
            cosine(vectors[self.queries[0 if len(self.queries) == 1 else i]], vectors[doc])
            for i, doc in enumerate(self.documents)
        )
        return TaskResult(Ranked(scores, "embedding_cosine"), TaskUsage(prompt_tokens=tokens or 0))


def require_rank_head(path: Path) -> None:
    """Refuse to serve a GGUF without a rank head as ``kind: rerank``: llama.cpp's rank
    pooling would hand back a hidden state's first value as every score.

    Raises:
        BackendError: the file has no ``cls`` or ``cls.output`` tensor.
    """
    try:
        header = read_gguf_header(path)
    except (OSError, ValueError, struct.error):
        return  # unreadable here: llama.cpp says why, if it cannot load it
    if not header.rank_head:
        raise BackendError(
            f"{path.name} has no rank head (no cls or cls.output tensor): kind rerank needs"
            " a reranker GGUF; serve this one as kind embedding to rerank by cosine similarity"
        )


def _add(total: int | None, more: int | None) -> int | None:
    return total + more if total is not None and more is not None else None


def rerank_job(
    model: str, queries: Sequence[str], documents: Sequence[str], limits: RerankLimits
) -> RerankJob:
    """The job of a rerank or score request, within ``limits`` (``engine.rerank``).

    Raises:
        PoolError: ``invalid_request`` for no documents or a count of queries that is
            neither one nor one per document; ``too_many_documents``,
            ``document_too_long`` or ``rerank_too_long`` past a bound.
    """
    if not documents:
        raise PoolError("invalid_request", "documents must hold at least one document")
    if len(queries) not in (1, len(documents)):
        raise PoolError(
            "invalid_request",
            f"{len(queries)} queries for {len(documents)} documents: give one query, or"
            " one per document",
        )
    if len(documents) > limits.max_documents:
        raise PoolError(
            "too_many_documents",
            f"{len(documents)} documents; this pool takes at most {limits.max_documents}"
            " per request (engine.rerank.max_documents)",
            details={"param": "documents", "limit": limits.max_documents},
        )
    for what, texts in (("query", queries), ("documents", documents)):
        for index, text in enumerate(texts):
            if len(text) > limits.max_document_chars:
                raise PoolError(
                    "document_too_long",
                    f"{what}[{index}] has {len(text)} characters; at most"
                    f" {limits.max_document_chars} (engine.rerank.max_document_chars)",
                    details={
                        "param": what,
                        "index": index,
                        "limit": limits.max_document_chars,
                    },
                )
    total = sum(len(d) for d in documents) + (
        len(queries[0]) * len(documents) if len(queries) == 1 else sum(len(q) for q in queries)
    )
    if total > limits.max_request_chars:
        raise PoolError(
            "rerank_too_long",
            f"the request reads {total} characters (the query once per document); at most"
            f" {limits.max_request_chars} (engine.rerank.max_request_chars)",
            details={"limit": limits.max_request_chars},
        )
    return RerankJob(
        model=model,
        queries=tuple(queries),
        documents=tuple(documents),
        batch_documents=limits.batch_documents,
        batch_chars=limits.batch_chars,
    )


async def rank_upstream(
    transport: Transport,
    path: str,
    query: str,
    documents: Sequence[str],
    *,
    model: str,
    headers: dict[str, str] | None = None,
    what: str = "upstream",
) -> RankResult:
    """Score ``documents`` with one POST of the rerank shape that llama-server, vLLM,
    Jina and Cohere share (``query``, ``documents``, ``top_n``; an answer of ``results``
    with ``index`` and ``relevance_score``), back in document order.

    Raises:
        PoolError: ``invalid_request`` when the server refuses the input (a 4xx: a pair
            longer than its context), ``backend_timeout`` when slow.
        BackendError: the server failed, or its reply is malformed.
    """
    body = {
        "model": model,
        "query": query,
        "documents": list(documents),
        "top_n": len(documents),
        "return_documents": False,
    }
    raw = await post_json(transport, path, body, headers, what, model)
    try:
        reply = json.loads(raw)
        scores: list[float | None] = [None] * len(documents)
        for item in reply["results"]:
            scores[int(item["index"])] = float(item["relevance_score"])
    except (KeyError, TypeError, ValueError, IndexError) as exc:
        raise BackendError(f"{what} sent a malformed rerank reply: {exc!r}") from exc
    if any(score is None for score in scores):
        raise BackendError(
            f"{what} scored {sum(s is not None for s in scores)} of {len(documents)} documents"
        )
    usage = reply.get("usage") if isinstance(reply, dict) else None
    tokens = None
    if isinstance(usage, dict):
        counted = usage.get("prompt_tokens", usage.get("total_tokens"))
        tokens = counted if isinstance(counted, int) else None
    return RankResult(tuple(s for s in scores if s is not None), tokens)
