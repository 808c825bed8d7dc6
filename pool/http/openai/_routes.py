"""The routes of the dialect (its parsing and rendering stay beside them until they move
into ``_parse.py`` and ``_render.py``)."""

from __future__ import annotations

import base64
import json
import struct
import time
import uuid
from collections.abc import Callable
from typing import Any

from quart import Blueprint, Quart, Response

from pool.actors import (
    Admission,
    DecodingOverrides,
    Delta,
    Embedded,
    EmbeddingRequest,
    Finished,
    InferenceRequest,
    ToolCallDelta,
)
from pool.backends import ImagePart, TextPart, ToolCall, Turn
from pool.errors import PoolError
from pool.http._common import (
    AppContext,
    ErrorShape,
    HotRoute,
    SchemaError,
    cache_headers_in,
    chat_request,
    dumps,
    inference_headers,
    json_response,
    logit_bias,
    read_body,
    require,
    retry_after,
    tenant_and_priority,
    with_cache,
)
from pool.http._streaming import HEARTBEAT_S, admitted_stream, sse_keep_alive
from pool.http._tools import chat_call, chat_output_format, chat_tools, tool_choice
from pool.schemas import (
    ChatCompletionRequest,
    ChatImagePart,
    ChatTextPart,
    CompletionRequest,
    EmbeddingsRequest,
    OpenAISampling,
)

_FINISH = {"stop": "stop", "length": "length", "cancelled": "stop", "tool_calls": "tool_calls"}


def openai_error(status: int, code: str, message: str, param: str | None = None) -> dict[str, Any]:
    kind = "invalid_request_error" if status < 500 else "server_error"
    if status == 401:
        kind = "authentication_error"
    elif status == 429:
        kind = "rate_limit_error"
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def _parts(
    content: str | list[ChatTextPart | ChatImagePart] | None,
) -> tuple[TextPart | ImagePart, ...]:
    if not isinstance(content, list):
        return (TextPart(content or ""),)
    return tuple(
        TextPart(p.text)
        if isinstance(p, ChatTextPart)
        else ImagePart(p.image_url.url, p.image_url.detail)
        for p in content
    )


def inference_request(body: ChatCompletionRequest) -> InferenceRequest:
    """System and developer messages become instructions; the rest the conversation."""
    system: list[str] = []
    turns: list[Turn] = []
    for message in body.messages:
        content = message.content
        if message.role in ("system", "developer"):
            if isinstance(content, list):
                system.append("\n".join(p.text for p in content if isinstance(p, ChatTextPart)))
            else:
                system.append(content or "")
            continue
        calls = tuple(
            ToolCall(c.id, c.function.name, c.function.arguments) for c in message.tool_calls or ()
        )
        turns.append(
            Turn(message.role, _parts(content), calls, message.tool_call_id)  # type: ignore[arg-type]
        )
    tools = chat_tools(body.tools)
    return chat_request(
        body.model,
        turns,
        tools=tools,
        tool_choice=tool_choice(body.tool_choice, tools),
        parallel_tool_calls=body.parallel_tool_calls,
        output_format=chat_output_format(body.response_format),
        instructions="\n\n".join(system) if system else None,
        allow_remote=body.allow_remote,
        keep_alive=body.keep_alive,
        decoding=openai_decoding(
            body,
            temperature=body.temperature,
            top_p=body.top_p,
            top_k=body.top_k,
            max_tokens=body.max_completion_tokens or body.max_tokens,
            stop=body.stop,
        ),
    )


def request_from_chat_completions(body: ChatCompletionRequest | dict[str, Any]) -> InferenceRequest:
    """The neutral request of a Chat Completions body (embedded use builds them so).

    Raises:
        pydantic.ValidationError: ``body`` is a dict that fails the schema.
        PoolError: ``invalid_request`` for a conversation that does not end with the user.
    """
    if not isinstance(body, ChatCompletionRequest):
        body = ChatCompletionRequest.model_validate(body)
    return inference_request(body)


def openai_decoding(
    body: OpenAISampling,
    *,
    temperature: float | None,
    top_p: float | None,
    top_k: int | None,
    max_tokens: int | None,
    stop: str | list[str] | None,
) -> DecodingOverrides:
    """The decoding a Chat Completions or Completions body asks for."""
    return DecodingOverrides(
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        max_tokens=max_tokens,
        stop=(stop,) if isinstance(stop, str) else tuple(stop or ()),
        repetition_penalty=body.repetition_penalty,
        min_p=body.min_p,
        seed=body.seed,
        presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty,
        logit_bias=logit_bias(body.logit_bias),
    )


def completion_requests(body: CompletionRequest) -> list[InferenceRequest]:
    """One single-turn request per prompt of a legacy completion."""
    if body.logprobs is not None:
        raise PoolError(
            "logprobs_unsupported",
            f"model {body.model!r}: no backend of this pool reports logprobs; leave them out",
            details={"param": "logprobs"},
        )
    prompts = [body.prompt] if isinstance(body.prompt, str) else body.prompt
    decoding = openai_decoding(
        body,
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=body.top_k,
        max_tokens=body.max_tokens,
        stop=body.stop,
    )
    return [
        InferenceRequest.prompt(
            body.model,
            prompt,
            decoding=decoding,
            allow_remote=body.allow_remote,
            keep_alive=body.keep_alive,
        )
        for prompt in prompts
    ]


def embedding_request(body: EmbeddingsRequest) -> EmbeddingRequest:
    texts = (body.input,) if isinstance(body.input, str) else tuple(body.input)
    return EmbeddingRequest(
        body.model,
        texts,
        dimensions=body.dimensions,
        allow_remote=body.allow_remote,
        keep_alive=body.keep_alive,
    )


def encode_vector(vector: tuple[float, ...], encoding: str) -> list[float] | str:
    """A vector as OpenAI sends it: floats, or base64 of little-endian float32."""
    if encoding == "base64":
        return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")
    return list(vector)


def embeddings_body(body: EmbeddingsRequest, done: Embedded) -> dict[str, Any]:
    tokens = done.usage.prompt_tokens or 0
    return {
        "object": "list",
        "data": [
            {
                "object": "embedding",
                "index": index,
                "embedding": encode_vector(vector, body.encoding_format),
            }
            for index, vector in enumerate(done.vectors)
        ],
        "model": body.model,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }


def _message(finished: Finished) -> dict[str, Any]:
    """The assistant message of a reply; with tool calls, content is null when empty."""
    if not finished.tool_calls:
        return {"role": "assistant", "content": finished.text}
    return {
        "role": "assistant",
        "content": finished.text or None,
        "tool_calls": [chat_call(call) for call in finished.tool_calls],
    }


def _call_delta(piece: ToolCallDelta) -> dict[str, Any]:
    """A tool-call piece as OpenAI streams it: id, type and name only in the first."""
    out: dict[str, Any] = {"index": piece.index}
    function: dict[str, Any] = {"arguments": piece.arguments}
    if piece.id is not None:
        out["id"] = piece.id
        out["type"] = "function"
    if piece.name is not None:
        function["name"] = piece.name
    out["function"] = function
    return out


def _usage(finished: Finished) -> dict[str, Any]:
    prompt = finished.usage.prompt_tokens or 0
    completion = finished.usage.output_tokens or 0
    usage: dict[str, Any] = {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }
    if finished.usage.cached_tokens is not None:
        # OpenAI's own field for prompt tokens served from its prompt cache.
        usage["prompt_tokens_details"] = {"cached_tokens": finished.usage.cached_tokens}
    return usage


# Every streamed token takes the path below: the chunk is encoded once per stream around
# a marker, and each token only fills in its JSON string (the same bytes as dumps()).
_MARK = "\x00content\x00"


def content_chunk_encoder(template: bytes) -> Callable[[str], bytes]:
    """``template`` (an encoded chunk whose content is ``_MARK``) as a function of the
    content: the bytes ``dumps`` gives for the chunk with that content."""
    head, tail = template.split(json.dumps(_MARK).encode(), 1)

    def encode(text: str) -> bytes:
        return head + json.dumps(text, ensure_ascii=False).encode() + tail

    return encode


def pool_error(exc: PoolError) -> Response:
    """A PoolError as OpenAI's error object."""
    # The field at fault, where the pool knows it (dimensions, logprobs, a sampling field).
    param = exc.details.get("param")
    body = openai_error(
        exc.status, exc.code, exc.message, param if isinstance(param, str) else None
    )
    return json_response(body, exc.status, retry_after(exc))


def schema_error(exc: SchemaError) -> Response:
    """A schema failure as OpenAI's error object (422, ``param`` the field)."""
    loc = exc.errors[0]["loc"] if exc.errors else ()
    message = exc.errors[0]["msg"] if exc.errors else "invalid body"
    param = ".".join(str(p) for p in loc) or None
    return json_response(openai_error(422, "validation_error", f"{param}: {message}", param), 422)


OPENAI_ERRORS = ErrorShape(pool_error, schema_error)


def register(app: Quart, ctx: AppContext) -> None:
    pool = ctx.pool
    blueprint = Blueprint("openai", __name__)
    ctx.error_shapes[blueprint.name] = OPENAI_ERRORS

    # Each route is served under /v1 and under /openai/v1, the base URL that is OpenAI's
    # API throughout (its Responses API included: pool/http/openai_responses/_routes.py).
    @blueprint.post("/v1/chat/completions")
    @blueprint.post("/openai/v1/chat/completions")
    async def chat_completions() -> Response:
        """OpenAI Chat Completions, plain or streamed (``stream_options.include_usage``)."""
        require(ctx, "inference")
        tenant, priority = tenant_and_priority()
        cache = cache_headers_in()
        body = await read_body(ChatCompletionRequest)
        request = with_cache(inference_request(body), cache)
        completion_id = "chatcmpl-" + uuid.uuid4().hex
        created = int(time.time())
        if not body.stream:
            async with pool.admit(request, tenant=tenant, priority=priority) as admission:
                finished = await admission.collect()
            return json_response(
                {
                    "id": completion_id,
                    "object": "chat.completion",
                    "created": created,
                    "model": body.model,
                    "choices": [
                        {
                            "index": 0,
                            "message": _message(finished),
                            "logprobs": None,
                            "finish_reason": _FINISH[finished.finish_reason],
                        }
                    ],
                    "usage": _usage(finished),
                },
                headers=inference_headers(
                    admission.queue_wait_ms,
                    finished.timings.backend_ms,
                    finished.usage.cached_tokens,
                ),
            )
        include_usage = bool(body.stream_options and body.stream_options.include_usage)

        def chunk(delta: dict[str, Any], finish: str | None) -> bytes:
            payload = {
                "id": completion_id,
                "object": "chat.completion.chunk",
                "created": created,
                "model": body.model,
                "choices": [
                    {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
                ],
            }
            if include_usage:
                payload["usage"] = None
            return b"data: " + dumps(payload) + b"\n\n"

        content_chunk = content_chunk_encoder(chunk({"content": _MARK}, None))

        def render(admission: Admission, event: Delta | Finished) -> bytes:
            if type(event) is Delta:
                return content_chunk(event.text)
            assert isinstance(event, Finished)
            out = chunk({}, _FINISH[event.finish_reason])
            if include_usage:
                usage = {
                    "id": completion_id,
                    "object": "chat.completion.chunk",
                    "created": created,
                    "model": body.model,
                    "choices": [],
                    "usage": _usage(event),
                }
                out += b"data: " + dumps(usage) + b"\n\n"
            return out + b"data: [DONE]\n\n"

        def render_error(admission: Admission, exc: PoolError) -> bytes:
            return b"data: " + dumps(openai_error(exc.status, exc.code, exc.message)) + b"\n\n"

        def render_tool_call(admission: Admission, piece: ToolCallDelta) -> bytes:
            return chunk({"tool_calls": [_call_delta(piece)]}, None)

        admission, chunks = await admitted_stream(
            pool,
            request,
            tenant=tenant,
            priority=priority,
            render=render,
            render_error=render_error,
            opening=lambda _: chunk({"role": "assistant", "content": ""}, None),
            render_tool_call=render_tool_call,
            # While it waits for a load or a slot: SSE comments, which clients skip.
            render_wait=sse_keep_alive,
            heartbeat_s=HEARTBEAT_S,
        )
        response = Response(
            chunks,
            content_type="text/event-stream",
            headers={
                "Cache-Control": "no-cache",
                "X-Queue-Wait-Ms": str(round(admission.queue_wait_ms)),
            },
        )
        response.timeout = None
        return response

    for path in ("/v1/chat/completions", "/openai/v1/chat/completions"):
        ctx.hot_routes[path] = HotRoute(chat_completions, blueprint.name)

    @blueprint.post("/v1/embeddings")
    @blueprint.post("/openai/v1/embeddings")
    async def embeddings() -> Response:
        """OpenAI Embeddings: one vector per input, floats or base64."""
        require(ctx, "inference")
        tenant, priority = tenant_and_priority()
        body = await read_body(EmbeddingsRequest)
        done = await pool.embed(embedding_request(body), tenant=tenant, priority=priority)
        headers = inference_headers(done.timings.queue_wait_ms or 0.0, done.timings.backend_ms)
        return json_response(embeddings_body(body, done), headers=headers)

    @blueprint.post("/v1/completions")
    @blueprint.post("/openai/v1/completions")
    async def completions() -> Response:
        """OpenAI's legacy Completions: plain, or streamed as ``text_completion`` chunks."""
        require(ctx, "inference")
        tenant, priority = tenant_and_priority()
        cache = cache_headers_in()
        body = await read_body(CompletionRequest)
        requests = [with_cache(r, cache) for r in completion_requests(body)]
        completion_id = "cmpl-" + uuid.uuid4().hex
        created = int(time.time())

        def choice(index: int, text: str, finish: str | None) -> dict[str, Any]:
            return {"text": text, "index": index, "logprobs": None, "finish_reason": finish}

        if not body.stream:
            choices = []
            prompt_tokens = completion_tokens = 0
            cached_tokens: int | None = None
            queue_wait_ms = gpu_ms = 0.0
            for index, request in enumerate(requests):
                async with pool.admit(request, tenant=tenant, priority=priority) as admission:
                    finished = await admission.collect()
                choices.append(choice(index, finished.text, _FINISH[finished.finish_reason]))
                usage = _usage(finished)
                prompt_tokens += usage["prompt_tokens"]
                completion_tokens += usage["completion_tokens"]
                if finished.usage.cached_tokens is not None:
                    cached_tokens = (cached_tokens or 0) + finished.usage.cached_tokens
                queue_wait_ms += admission.queue_wait_ms
                gpu_ms += finished.timings.backend_ms or 0.0
            headers = inference_headers(queue_wait_ms, gpu_ms, cached_tokens)
            return json_response(
                {
                    "id": completion_id,
                    "object": "text_completion",
                    "created": created,
                    "model": body.model,
                    "choices": choices,
                    "usage": {
                        "prompt_tokens": prompt_tokens,
                        "completion_tokens": completion_tokens,
                        "total_tokens": prompt_tokens + completion_tokens,
                        **(
                            {}
                            if cached_tokens is None
                            else {"prompt_tokens_details": {"cached_tokens": cached_tokens}}
                        ),
                    },
                },
                headers=headers,
            )
        if len(requests) > 1:
            raise PoolError(
                "invalid_request",
                "stream: true takes one prompt; send several prompts without streaming",
                details={"param": "prompt"},
            )
        include_usage = bool(body.stream_options and body.stream_options.include_usage)

        def chunk(choices: list[dict[str, Any]], usage: dict[str, int] | None = None) -> bytes:
            payload: dict[str, Any] = {
                "id": completion_id,
                "object": "text_completion",
                "created": created,
                "model": body.model,
                "choices": choices,
            }
            if include_usage:
                payload["usage"] = usage
            return b"data: " + dumps(payload) + b"\n\n"

        def render(admission: Admission, event: Delta | Finished) -> bytes:
            if type(event) is Delta:
                return chunk([choice(0, event.text, None)])
            assert isinstance(event, Finished)
            out = chunk([choice(0, "", _FINISH[event.finish_reason])])
            if include_usage:
                out += chunk([], _usage(event))
            return out + b"data: [DONE]\n\n"

        def render_error(admission: Admission, exc: PoolError) -> bytes:
            return b"data: " + dumps(openai_error(exc.status, exc.code, exc.message)) + b"\n\n"

        admission, chunks = await admitted_stream(
            pool,
            requests[0],
            tenant=tenant,
            priority=priority,
            render=render,
            render_error=render_error,
            render_wait=sse_keep_alive,
            heartbeat_s=HEARTBEAT_S,
        )
        headers = inference_headers(admission.queue_wait_ms, None)
        headers.update({"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        response = Response(chunks, content_type="text/event-stream", headers=headers)
        response.timeout = None
        return response

    app.register_blueprint(blueprint)
