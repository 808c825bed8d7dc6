"""``POST /v1/chat/completions``: the OpenAI Chat Completions format over the same pool.

System and developer messages become ``instructions``; one user message becomes
single-turn ``input`` (so single-turn models work with chat clients); a longer
conversation becomes ``messages``. Errors use OpenAI's error object.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from quart import Blueprint, Quart, Response

from pool.actors import Admission, DecodingOverrides, Delta, Finished, InferenceRequest
from pool.backends import ImagePart, TextPart, Turn
from pool.errors import PoolError
from pool.http._common import (
    AppContext,
    SchemaError,
    chat_request,
    dumps,
    json_response,
    read_body,
    require,
    tenant_and_priority,
)
from pool.http._streaming import admitted_stream
from pool.schemas import ChatCompletionRequest, ChatImagePart, ChatTextPart

_FINISH = {"stop": "stop", "length": "length", "cancelled": "stop"}


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
        turns.append(Turn(message.role, _parts(content)))  # type: ignore[arg-type]
    return chat_request(
        body.model,
        turns,
        instructions="\n\n".join(system) if system else None,
        allow_remote=body.allow_remote,
        decoding=DecodingOverrides(
            temperature=body.temperature,
            top_p=body.top_p,
            top_k=body.top_k,
            max_tokens=body.max_completion_tokens or body.max_tokens,
            stop=(body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ()),
        ),
    )


def _usage(finished: Finished) -> dict[str, int]:
    prompt = finished.usage.prompt_tokens or 0
    completion = finished.usage.output_tokens or 0
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


def register(app: Quart, ctx: AppContext) -> None:
    pool = ctx.pool
    blueprint = Blueprint("openai", __name__)

    @blueprint.errorhandler(PoolError)
    async def pool_error(exc: PoolError) -> Response:
        headers = (
            {"Retry-After": str(max(1, round(exc.retry_after_s)))} if exc.retry_after_s else None
        )
        return json_response(openai_error(exc.status, exc.code, exc.message), exc.status, headers)

    @blueprint.errorhandler(SchemaError)
    async def schema_error(exc: SchemaError) -> Response:
        loc = exc.errors[0]["loc"] if exc.errors else ()
        message = exc.errors[0]["msg"] if exc.errors else "invalid body"
        param = ".".join(str(p) for p in loc) or None
        return json_response(
            openai_error(422, "validation_error", f"{param}: {message}", param), 422
        )

    @blueprint.post("/v1/chat/completions")
    async def chat_completions() -> Response:
        """OpenAI Chat Completions, plain or streamed (``stream_options.include_usage``)."""
        require(ctx, "inference")
        tenant, priority = tenant_and_priority()
        body = await read_body(ChatCompletionRequest)
        request = inference_request(body)
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
                            "message": {"role": "assistant", "content": finished.text},
                            "logprobs": None,
                            "finish_reason": _FINISH[finished.finish_reason],
                        }
                    ],
                    "usage": _usage(finished),
                },
                headers={"X-Queue-Wait-Ms": str(round(admission.queue_wait_ms))},
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

        def render(admission: Admission, event: Delta | Finished) -> bytes:
            if type(event) is Delta:
                return chunk({"content": event.text}, None)
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

        admission, chunks = await admitted_stream(
            pool,
            request,
            tenant=tenant,
            priority=priority,
            render=render,
            render_error=render_error,
            opening=lambda _: chunk({"role": "assistant", "content": ""}, None),
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

    app.register_blueprint(blueprint)
