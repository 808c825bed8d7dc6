"""The routes of OpenAI's dialect: each reads its body (:mod:`._parse`), runs the pool,
and answers in OpenAI's shapes (:mod:`._render`)."""

from __future__ import annotations

import time
import uuid

from quart import Blueprint, Quart, Response

from pool.http._collected import collected
from pool.http._common import (
    AppContext,
    HotRoute,
    inference_headers,
    json_response,
    open_model_route,
)
from pool.http._streaming import HEARTBEAT_S, admitted_stream, streamed_answer
from pool.http.openai._parse import completion_requests, embedding_request, inference_request
from pool.http.openai._render import (
    ERRORS,
    ChatCompletionStream,
    CompletionStream,
    cached_tokens,
    chat_completion_body,
    completion_body,
    embeddings_body,
)
from pool.schemas import ChatCompletionRequest, CompletionRequest, EmbeddingsRequest


def register(app: Quart, ctx: AppContext) -> None:
    pool = ctx.pool
    blueprint = Blueprint("openai", __name__)
    ctx.error_shapes[blueprint.name] = ERRORS

    # Each route is served under /v1 and under /openai/v1, the base URL that is OpenAI's
    # API throughout (its Responses API included: pool/http/openai_responses/_routes.py).
    @blueprint.post("/v1/chat/completions")
    @blueprint.post("/openai/v1/chat/completions")
    async def chat_completions() -> Response:
        """OpenAI Chat Completions, plain or streamed (``stream_options.include_usage``)."""
        opened = await open_model_route(ctx, ChatCompletionRequest)
        body = opened.body
        request = opened.neutral(inference_request(body))
        completion_id = "chatcmpl-" + uuid.uuid4().hex
        created = int(time.time())
        if not body.stream:
            done = await collected(pool, opened, request)
            return json_response(
                chat_completion_body(completion_id, created, body.model, done.finished),
                headers=done.headers(),
            )
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        stream = ChatCompletionStream(completion_id, created, body.model, include_usage)
        admission, chunks = await admitted_stream(
            pool, opened, request, stream, heartbeat_s=HEARTBEAT_S
        )
        return streamed_answer(chunks, admission)

    for path in ("/v1/chat/completions", "/openai/v1/chat/completions"):
        ctx.hot_routes[path] = HotRoute(chat_completions, blueprint.name)

    @blueprint.post("/v1/embeddings")
    @blueprint.post("/openai/v1/embeddings")
    async def embeddings() -> Response:
        """OpenAI Embeddings: one vector per input, floats or base64."""
        # The cache headers are read (and checked) as on every model route; embeddings
        # reuse no prefix, so nothing applies them.
        opened = await open_model_route(ctx, EmbeddingsRequest)
        body = opened.body
        done = await pool.embed(
            embedding_request(body), tenant=opened.tenant, priority=opened.priority
        )
        headers = inference_headers(done.timings.queue_wait_ms or 0.0, done.timings.backend_ms)
        return json_response(embeddings_body(body, done), headers=headers)

    @blueprint.post("/v1/completions")
    @blueprint.post("/openai/v1/completions")
    async def completions() -> Response:
        """OpenAI's legacy Completions: plain, or streamed as ``text_completion`` chunks."""
        opened = await open_model_route(ctx, CompletionRequest)
        body = opened.body
        requests = [opened.neutral(r) for r in completion_requests(body)]
        completion_id = "cmpl-" + uuid.uuid4().hex
        created = int(time.time())
        if not body.stream:
            # Each prompt to its end, one after the other.
            each = [await collected(pool, opened, one) for one in requests]
            finished = [done.finished for done in each]
            headers = inference_headers(
                sum(done.admission.queue_wait_ms for done in each),
                sum(f.timings.backend_ms or 0.0 for f in finished),
                cached_tokens(finished),
            )
            return json_response(
                completion_body(completion_id, created, body.model, finished), headers=headers
            )
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        stream = CompletionStream(completion_id, created, body.model, include_usage)
        # A streamed completion has one prompt (completion_requests refuses more).
        admission, chunks = await admitted_stream(
            pool, opened, requests[0], stream, heartbeat_s=HEARTBEAT_S
        )
        return streamed_answer(chunks, admission)

    app.register_blueprint(blueprint)
