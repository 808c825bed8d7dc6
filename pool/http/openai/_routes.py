"""The routes of OpenAI's dialect: each reads its body (:mod:`._parse`), runs the pool,
and answers in OpenAI's shapes (:mod:`._render`)."""

from __future__ import annotations

import dataclasses
import time
import uuid

from quart import Blueprint, Quart, Response, request

from pool.backends import PassThrough
from pool.http._collected import collected
from pool.http._common import (
    JSON_TYPE,
    AppContext,
    HotRoute,
    inference_headers,
    json_response,
    open_model_route,
    require,
)
from pool.http._forwarding import forward_route, forwarded
from pool.http._route import (
    COMPLETION_REFUSALS,
    EMBEDDING_REFUSALS,
    FORWARD_REFUSALS,
    GENERATION_REFUSALS,
    SSE,
    Route,
    serves,
)
from pool.http._streaming import HEARTBEAT_S, admitted_stream, streamed_answer
from pool.http.openai._audio_routes import AUDIO_ROUTES, register_audio
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
from pool.http.openai._speech import (
    OPENAI_SPEECH,
    OPENAI_VOICES,
    SPEECH,
    VOICES,
    speech_answer,
    voices_answer,
)
from pool.schemas import (
    ChatCompletion,
    ChatCompletionRequest,
    ChatCompletionStreamEvent,
    CompletionRequest,
    EmbeddingList,
    EmbeddingsRequest,
    ImageGenerationRequest,
    ImagesResponse,
    SpeechRequest,
    TextCompletion,
    TextCompletionStreamEvent,
)

# -- the documented routes (pool/http/_route.py) ----------------------------------------
CHAT_COMPLETIONS = Route(
    "post",
    "/v1/chat/completions",
    "openai",
    "Chat Completions (OpenAI)",
    "OpenAI's Chat Completions, plain or streamed (`stream_options.include_usage`;"
    " `chat.completion.chunk` events, then `data: [DONE]`). Prefix cache headers as"
    " `/v1/responses`; `usage.prompt_tokens_details.cached_tokens` counts the prompt tokens"
    " the runtime reused. Sampling"
    " fields a model's backend cannot honour (`min_p`, `seed`, penalties, `logit_bias`) are"
    " a 400 `sampling_unsupported`; `keep_alive` as on Ollama's routes (the idle time of an"
    " on-demand model; 0 unloads it after the request). An embedding model"
    " answers 400 `wrong_model_kind`. Tools (`tools`, `tool_choice`,"
    " `parallel_tool_calls`, `tool` messages; calls come back in `message.tool_calls` and"
    " streamed `delta.tool_calls`) and `response_format` where the backend has them, else"
    " 400 `tools_unsupported` / `structured_output_unsupported`; a bad definition is a 400"
    " naming the field in `param`.",
    ChatCompletionRequest,
    reply=ChatCompletion,
    stream=SSE,
    events=ChatCompletionStreamEvent,
    errors="openai",
    valid_input_codes=GENERATION_REFUSALS,
)
OPENAI_CHAT_COMPLETIONS = Route(
    "post",
    "/openai/v1/chat/completions",
    "openai",
    "Chat Completions (OpenAI base URL)",
    "`POST /v1/chat/completions` under the base URL `/openai/v1`.",
    ChatCompletionRequest,
    reply=ChatCompletion,
    stream=SSE,
    events=ChatCompletionStreamEvent,
    errors="openai",
    valid_input_codes=GENERATION_REFUSALS,
)
EMBEDDINGS = Route(
    "post",
    "/v1/embeddings",
    "openai",
    "Embeddings (OpenAI)",
    "One vector per input, in order, for a model with `embedding: true` (llama_cpp,"
    " llama_server, vllm_serve, openai_remote, stub); `encoding_format` `float` or `base64`"
    " (little-endian float32); `dimensions` only where the model can shorten its vectors"
    " (else 400 naming `dimensions`). The inputs go through the same queue, replicas,"
    " tenant limits and on-demand loads as generation, as one backend call (a server"
    " backend splits them into requests of `embedding_batch_size`); `keep_alive` as on"
    " Ollama's routes; a model of another kind answers 400 `wrong_model_kind`.",
    EmbeddingsRequest,
    reply=EmbeddingList,
    errors="openai",
    valid_input_codes=EMBEDDING_REFUSALS,
)
OPENAI_EMBEDDINGS = Route(
    "post",
    "/openai/v1/embeddings",
    "openai",
    "Embeddings (OpenAI base URL)",
    "`POST /v1/embeddings` under the base URL `/openai/v1`.",
    EmbeddingsRequest,
    reply=EmbeddingList,
    errors="openai",
    valid_input_codes=EMBEDDING_REFUSALS,
)
COMPLETIONS = Route(
    "post",
    "/v1/completions",
    "openai",
    "Completions (OpenAI, legacy)",
    "One choice per prompt (`prompt` a string or a list); `stream: true` (one prompt) answers"
    " `text_completion` chunks as Server-Sent Events, then `data: [DONE]`. `max_tokens`"
    " defaults to 16 as in OpenAI's API; `echo` must be false; `logprobs` is a 400"
    " `logprobs_unsupported`. The prompt is one user turn rendered by the model's prompt"
    " format; `keep_alive` as on Ollama's routes. Headers as `/v1/responses`"
    " (`X-Queue-Wait-Ms`, `X-GPU-Time-Ms`, ...).",
    CompletionRequest,
    reply=TextCompletion,
    stream=SSE,
    events=TextCompletionStreamEvent,
    errors="openai",
    valid_input_codes=COMPLETION_REFUSALS,
)
OPENAI_COMPLETIONS = Route(
    "post",
    "/openai/v1/completions",
    "openai",
    "Completions (OpenAI base URL)",
    "`POST /v1/completions` under the base URL `/openai/v1`.",
    CompletionRequest,
    reply=TextCompletion,
    stream=SSE,
    events=TextCompletionStreamEvent,
    errors="openai",
    valid_input_codes=COMPLETION_REFUSALS,
)
IMAGES_GENERATIONS = Route(
    "post",
    "/v1/images/generations",
    "openai",
    "Image generation (OpenAI)",
    "OpenAI's image generation, for a model of kind `image`: a `server` model (any"
    " OpenAI-compatible server the pool starts) gets the body as the client sent it,"
    " its `model` replaced by the server's own name where `served_model` sets one, and"
    " its reply comes back as it answered: JSON, or Server-Sent Events where it streams."
    " The request goes through the same keys, tenant limits, budgets (one request each;"
    " tokens where the reply has `usage`), queue, VRAM gate and on-demand loads as"
    " generation; a model of another kind answers 400 `wrong_model_kind`; the server's"
    " own refusal of the request (400, 413, 415, 422) a 400 `invalid_request` quoting it.",
    ImageGenerationRequest,
    reply=ImagesResponse,
    stream=SSE,
    errors="openai",
    valid_input_codes=FORWARD_REFUSALS,
)
OPENAI_IMAGES_GENERATIONS = Route(
    "post",
    "/openai/v1/images/generations",
    "openai",
    "Image generation (OpenAI base URL)",
    "`POST /v1/images/generations` under the base URL `/openai/v1`.",
    ImageGenerationRequest,
    reply=ImagesResponse,
    stream=SSE,
    errors="openai",
    valid_input_codes=FORWARD_REFUSALS,
)
ROUTES = (
    CHAT_COMPLETIONS,
    OPENAI_CHAT_COMPLETIONS,
    EMBEDDINGS,
    OPENAI_EMBEDDINGS,
    COMPLETIONS,
    OPENAI_COMPLETIONS,
    IMAGES_GENERATIONS,
    OPENAI_IMAGES_GENERATIONS,
    *AUDIO_ROUTES,
    SPEECH,
    OPENAI_SPEECH,
    VOICES,
    OPENAI_VOICES,
)


def register(app: Quart, ctx: AppContext) -> None:
    pool = ctx.pool
    blueprint = Blueprint("openai", __name__)
    pass_through = ctx.settings.service.pass_through
    ctx.error_shapes[blueprint.name] = ERRORS

    # Each route is served under /v1 and under /openai/v1, the base URL that is OpenAI's
    # API throughout (its Responses API included: pool/http/openai_responses/_routes.py).
    @serves(blueprint, CHAT_COMPLETIONS, OPENAI_CHAT_COMPLETIONS)
    async def chat_completions() -> Response:
        """OpenAI Chat Completions, plain or streamed (``stream_options.include_usage``)."""
        opened = await open_model_route(ctx, ChatCompletionRequest)
        body = opened.body
        request = opened.neutral(inference_request(body))
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        passes = pass_through and pool.relays_chat(body.model)
        if passes:
            # The upstream may answer in this very dialect (pool/backends/_pass_through.py).
            ask = PassThrough(body.model, body.stream, include_usage)
            request = dataclasses.replace(request, pass_through=ask)
        completion_id = "chatcmpl-" + uuid.uuid4().hex
        created = int(time.time())
        if not body.stream:
            done = await collected(pool, opened, request)
            if done.finished.body is not None:  # the upstream's reply, model rewritten
                return Response(done.finished.body, headers=done.headers(), content_type=JSON_TYPE)
            return json_response(
                chat_completion_body(completion_id, created, body.model, done.finished),
                headers=done.headers(),
            )
        stream = ChatCompletionStream(
            completion_id, created, body.model, include_usage, pass_through=passes
        )
        admission, chunks = await admitted_stream(
            pool, opened, request, stream, heartbeat_s=HEARTBEAT_S
        )
        return streamed_answer(chunks, admission)

    for path in ("/v1/chat/completions", "/openai/v1/chat/completions"):
        ctx.hot_routes[path] = HotRoute(chat_completions, blueprint.name)

    @serves(blueprint, EMBEDDINGS, OPENAI_EMBEDDINGS)
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

    @serves(blueprint, COMPLETIONS, OPENAI_COMPLETIONS)
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

    @serves(blueprint, IMAGES_GENERATIONS, OPENAI_IMAGES_GENERATIONS)
    async def images_generations() -> Response:
        """Image generation, forwarded to the image model's server as it came."""
        opened = await open_model_route(ctx, ImageGenerationRequest)
        return await forward_route(
            ctx,
            IMAGES_GENERATIONS.path,
            opened.body.model,
            opened.tenant,
            opened.priority,
            "image",
        )

    register_audio(blueprint, ctx)

    @serves(blueprint, SPEECH, OPENAI_SPEECH)
    async def speech() -> Response:
        """OpenAI's text to speech: the audio, streamed as it is made or whole."""
        opened = await open_model_route(ctx, SpeechRequest)
        # A `server` model answers by its own server, as it came.
        served = await forwarded(
            ctx, SPEECH.path, opened.body.model, opened.tenant, opened.priority
        )
        return served if served is not None else await speech_answer(pool, opened)

    @serves(blueprint, VOICES, OPENAI_VOICES)
    async def voices() -> Response:
        """The voices of the speech models."""
        require(ctx, "inference")
        return await voices_answer(pool, request.args.get("model") or None)

    app.register_blueprint(blueprint)
