"""Embeddings over HTTP: what llama-server, ``vllm serve`` and remote APIs speak.

The backends that forward requests to an OpenAI-compatible server share the config
fields of an embedding model (:class:`EmbeddingFields`) and one client
(:func:`embed_upstream`): the texts of a job go to the server's ``/v1/embeddings`` in
as few requests as its batch limit allows, the vectors come back in input order, and
the token counts are summed.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import Field

from pool.backends._kinds import KindFields
from pool.backends._protocol import EmbeddingJob, EmbeddingResult
from pool.backends._upstream import Transport, post_json
from pool.errors import BackendError

# The pooling types llama.cpp and vLLM both know (as llama-server's --pooling spells them).
ServerPooling = Literal["mean", "cls", "last"]


class EmbeddingFields(KindFields):
    """The config fields of a model that serves embeddings through an HTTP server."""

    embedding_batch_size: Annotated[int, Field(ge=1, le=2048)] = Field(
        64,
        description="Most texts sent to the server in one embeddings request; a larger"
        " call is split into several requests of this size.",
    )


# The field of a backend whose server takes OpenAI's `dimensions` (vLLM, remote APIs).
DIMENSIONS_DESCRIPTION = (
    "The model can shorten its vectors (a Matryoshka model, or a remote API that takes"
    " `dimensions`): requests may set `dimensions`, passed to the server. Otherwise"
    " `dimensions` is a 400."
)


class PooledEmbeddingFields(EmbeddingFields):
    """:class:`EmbeddingFields` of a server the pool starts, which also takes the pooling."""

    pooling: ServerPooling | None = Field(
        None,
        description="How the server pools token vectors into one; default: the model's own"
        " (a causal chat model such as SmolLM2 needs `mean`).",
    )


def _vectors(reply: Any, count: int, what: str) -> list[tuple[float, ...]]:
    """The vectors of one reply in input order (servers may answer out of order)."""
    try:
        items = sorted(reply["data"], key=lambda item: int(item["index"]))
        vectors = [tuple(float(x) for x in item["embedding"]) for item in items]
    except (KeyError, TypeError, ValueError) as exc:
        raise BackendError(f"{what} sent a malformed embeddings reply: {exc!r}") from exc
    if len(vectors) != count:
        raise BackendError(f"{what} returned {len(vectors)} vectors for {count} texts")
    return vectors


async def embed_upstream(
    transport: Transport,
    path: str,
    job: EmbeddingJob,
    *,
    model: str,
    batch_size: int,
    headers: dict[str, str] | None = None,
    what: str = "upstream",
    truncate_fields: Mapping[str, Any] | None = None,
) -> EmbeddingResult:
    """Embed ``job``'s texts with POSTs of at most ``batch_size`` texts to ``path``.

    ``truncate_fields`` go into the body when the job may cut long texts, for a server
    that can (vLLM's ``truncate_prompt_tokens``); elsewhere a text longer than the
    context is the server's 400.

    Raises:
        PoolError: ``invalid_request`` when the server refuses the input (4xx: a text too
            long, a ``dimensions`` the model cannot give), ``backend_timeout`` when slow.
        BackendError: the server failed, or its reply is malformed.
    """
    vectors: list[tuple[float, ...]] = []
    tokens: int | None = 0
    for start in range(0, len(job.texts), batch_size):
        batch = list(job.texts[start : start + batch_size])
        body: dict[str, Any] = {"model": model, "input": batch, "encoding_format": "float"}
        if job.dimensions is not None:
            body["dimensions"] = job.dimensions
        if job.truncate and truncate_fields:
            body.update(truncate_fields)
        raw = await post_json(transport, path, body, headers, what, job.model)
        try:
            reply = json.loads(raw)
        except ValueError as exc:
            raise BackendError(f"{what} sent a malformed embeddings reply: {exc}") from exc
        vectors.extend(_vectors(reply, len(batch), what))
        usage = reply.get("usage") if isinstance(reply, dict) else None
        prompt_tokens = usage.get("prompt_tokens") if isinstance(usage, dict) else None
        tokens = (
            tokens + prompt_tokens if tokens is not None and prompt_tokens is not None else None
        )
    return EmbeddingResult(tuple(vectors), tokens)
