"""The rerank and score routes: each reads its body, runs :mod:`._core`, and answers."""

from __future__ import annotations

from quart import Blueprint, Quart, Response

from pool.http._common import (
    AppContext,
    Opened,
    inference_headers,
    json_response,
    open_model_route,
)
from pool.http._forwarding import forwarded
from pool.http._route import RERANK_REFUSALS, Route, serves
from pool.http.openai._render import ERRORS
from pool.http.rerank._core import Answered, rerank_reply, score_reply
from pool.schemas import RerankReply, RerankRequest, ScoreReply, ScoreRequest

_RERANK_DESCRIPTION = (
    "Scores each document against the query and answers the results best first"
    " (`top_n` of them if given), each with its `index` in `documents`, its"
    " `relevance_score` and, with `return_documents: true`, the document. Documents are"
    " strings or objects with `text` (llama.cpp, vLLM, Jina and Cohere clients). A model of"
    " kind `rerank` scores with its rank head (llama_cpp with rank pooling, llama_server"
    " `--reranking`, vllm_serve's score task, openai_remote passed through); a model of"
    " kind `embedding` answers by the cosine similarity of the query's and each document's"
    " embedding; `method` says which. Any other kind is a 400 `wrong_model_kind`. The"
    " request is one job through the same keys, tenant limits, budgets, queue and"
    " on-demand loads as generation; its documents go to the runtime in batches"
    " (`engine.rerank.batch_documents`, `batch_chars`), and past the bounds of"
    " `engine.rerank` it is a 400 `too_many_documents`, `document_too_long` or"
    " `rerank_too_long`. `usage.prompt_tokens` counts the tokens read."
)
RERANK = Route(
    "post",
    "/v1/rerank",
    "rerank",
    "Rerank documents",
    _RERANK_DESCRIPTION,
    RerankRequest,
    reply=RerankReply,
    errors="openai",
    valid_input_codes=RERANK_REFUSALS,
)
# The same operation where other clients look for it.
RERANK_ALIASES = tuple(
    Route(
        "post",
        path,
        "rerank",
        f"Rerank documents ({where})",
        f"`POST /v1/rerank` at {where}.",
        RerankRequest,
        reply=RerankReply,
        errors="openai",
        valid_input_codes=RERANK_REFUSALS,
    )
    for path, where in (
        ("/rerank", "`/rerank`, as llama-server and vLLM serve it"),
        ("/v2/rerank", "`/v2/rerank`, Cohere's v2 path"),
        ("/openai/v1/rerank", "the OpenAI base URL `/openai/v1`"),
    )
)
_SCORE_DESCRIPTION = (
    "vLLM's score API: `text_1` scored against each text of `text_2` (a string or a list),"
    " or two lists of one length pair by pair; the answer has one `score` per pair in"
    " request order. Scored as `/v1/rerank` scores (`method` says how), within the same"
    " bounds and errors; lists of different lengths are a 400 `invalid_request`."
)
SCORE = Route(
    "post",
    "/v1/score",
    "rerank",
    "Score pairs of texts (vLLM)",
    _SCORE_DESCRIPTION,
    ScoreRequest,
    reply=ScoreReply,
    errors="openai",
    valid_input_codes=(*RERANK_REFUSALS, "invalid_request"),
)
SCORE_ALIASES = tuple(
    Route(
        "post",
        path,
        "rerank",
        f"Score pairs of texts ({where})",
        f"`POST /v1/score` at {where}.",
        ScoreRequest,
        reply=ScoreReply,
        errors="openai",
        valid_input_codes=(*RERANK_REFUSALS, "invalid_request"),
    )
    for path, where in (
        ("/score", "`/score`, as vLLM serves it"),
        ("/openai/v1/score", "the OpenAI base URL `/openai/v1`"),
    )
)
ROUTES = (RERANK, *RERANK_ALIASES, SCORE, *SCORE_ALIASES)


def _answer(answered: Answered) -> Response:
    headers = inference_headers(answered.queue_wait_ms, answered.backend_ms)
    return json_response(answered.body, headers=headers)


def _whose(opened: Opened[RerankRequest] | Opened[ScoreRequest]) -> tuple[str, str, str]:
    """The model, tenant and priority of an opened request, as ``forwarded`` takes them."""
    return opened.body.model, opened.tenant, opened.priority


def register(app: Quart, ctx: AppContext) -> None:
    pool = ctx.pool
    blueprint = Blueprint("rerank", __name__)
    ctx.error_shapes[blueprint.name] = ERRORS

    @serves(blueprint, RERANK, *RERANK_ALIASES)
    async def rerank() -> Response:
        """Rerank documents against a query."""
        opened = await open_model_route(ctx, RerankRequest)
        # A `server` model answers by its own server, as it came.
        served = await forwarded(ctx, RERANK.path, *_whose(opened))
        if served is not None:
            return served
        return _answer(
            await rerank_reply(pool, opened.body, tenant=opened.tenant, priority=opened.priority)
        )

    @serves(blueprint, SCORE, *SCORE_ALIASES)
    async def score() -> Response:
        """Score pairs of texts (vLLM's form)."""
        opened = await open_model_route(ctx, ScoreRequest)
        served = await forwarded(ctx, SCORE.path, *_whose(opened))
        if served is not None:
            return served
        return _answer(
            await score_reply(pool, opened.body, tenant=opened.tenant, priority=opened.priority)
        )

    app.register_blueprint(blueprint)
