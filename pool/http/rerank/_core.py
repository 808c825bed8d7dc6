"""The core of the rerank and score routes: a parsed body in, the reply body out.

Kept apart from the HTTP views so that another path to the same reply (a forwarding
backend's, an embedded caller's) reuses it as it is.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any

from pool.actors import Completed, Pool, TaskRequest
from pool.backends import Ranked, rerank_job
from pool.errors import BackendError
from pool.schemas import RerankReply, RerankRequest, ScoreReply, ScoreRequest, renders


@dataclass(frozen=True, slots=True)
class Answered:
    """A reply body and what its answer headers report."""

    body: dict[str, Any]
    queue_wait_ms: float
    backend_ms: float | None


def _documents(body: RerankRequest) -> list[str]:
    return [d if isinstance(d, str) else d.text for d in body.documents]


def _ranked(done: Completed) -> Ranked:
    if not isinstance(done.value, Ranked):
        raise BackendError(f"a rerank job answered {type(done.value).__name__}")
    return done.value


async def rerank_reply(
    pool: Pool, body: RerankRequest, *, tenant: str = "default", priority: str = "normal"
) -> Answered:
    """Rerank ``body``'s documents against its query with ``body.model``.

    Raises:
        PoolError: a bound of ``engine.rerank`` (``too_many_documents``,
            ``document_too_long``, ``rerank_too_long``), ``wrong_model_kind`` for a model
            that neither ranks nor embeds, and every admission error.
    """
    documents = _documents(body)
    job = rerank_job(body.model, (body.query,), documents, pool.settings.engine.rerank)
    request = TaskRequest(
        body.model, job, allow_remote=body.allow_remote, keep_alive=body.keep_alive
    )
    done = await pool.run_task(request, tenant=tenant, priority=priority)
    return Answered(
        rerank_body(body, documents, _ranked(done), done.usage.prompt_tokens or 0),
        done.timings.queue_wait_ms or 0.0,
        done.timings.backend_ms,
    )


@renders(RerankReply)
def rerank_body(
    body: RerankRequest, documents: list[str], ranked: Ranked, tokens: int
) -> dict[str, Any]:
    # Best first; equal scores keep the documents' order (a stable sort).
    order = sorted(range(len(documents)), key=lambda i: -ranked.scores[i])
    if body.top_n is not None:
        order = order[: body.top_n]
    results: list[dict[str, Any]] = []
    for index in order:
        result: dict[str, Any] = {"index": index, "relevance_score": ranked.scores[index]}
        if body.return_documents:
            result["document"] = {"text": documents[index]}
        results.append(result)
    return {
        "id": "rerank-" + uuid.uuid4().hex,
        "model": body.model,
        "results": results,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        "method": ranked.method,
    }


def _pairs(body: ScoreRequest) -> tuple[list[str], list[str]]:
    """The queries and documents of a score request: one ``text_1`` for every ``text_2``,
    or the two lists pair by pair (a one-item ``text_1`` list counts as one text)."""
    firsts = [body.text_1] if isinstance(body.text_1, str) else list(body.text_1)
    seconds = [body.text_2] if isinstance(body.text_2, str) else list(body.text_2)
    if len(firsts) > 1 and len(seconds) == 1:
        # vLLM scores a list against one text too: the one text is then the document.
        seconds = seconds * len(firsts)
    return firsts, seconds


async def score_reply(
    pool: Pool, body: ScoreRequest, *, tenant: str = "default", priority: str = "normal"
) -> Answered:
    """Score ``body``'s pairs with ``body.model`` (vLLM's ``/v1/score``).

    Raises:
        PoolError: as :func:`rerank_reply`, and ``invalid_request`` for two lists of
            different lengths.
    """
    queries, documents = _pairs(body)
    job = rerank_job(body.model, queries, documents, pool.settings.engine.rerank)
    request = TaskRequest(
        body.model, job, allow_remote=body.allow_remote, keep_alive=body.keep_alive
    )
    done = await pool.run_task(request, tenant=tenant, priority=priority)
    return Answered(
        score_body(body.model, _ranked(done), done.usage.prompt_tokens or 0),
        done.timings.queue_wait_ms or 0.0,
        done.timings.backend_ms,
    )


@renders(ScoreReply)
def score_body(model: str, ranked: Ranked, tokens: int) -> dict[str, Any]:
    return {
        "id": "score-" + uuid.uuid4().hex,
        "object": "list",
        "created": int(time.time()),
        "model": model,
        "data": [
            {"index": index, "object": "score", "score": score}
            for index, score in enumerate(ranked.scores)
        ],
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        "method": ranked.method,
    }
