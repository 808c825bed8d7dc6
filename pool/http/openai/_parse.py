"""OpenAI's request bodies as the pool's neutral requests.

Chat Completions: system and developer messages become instructions, the rest the
conversation (:func:`~pool.http._common.chat_request`); a legacy completion is one
single-turn request per prompt; an embeddings body one :class:`EmbeddingRequest`.
"""

from __future__ import annotations

from typing import Any

from pool.actors import DecodingOverrides, EmbeddingRequest, InferenceRequest
from pool.backends import ImagePart, TextPart, ToolCall, Turn
from pool.errors import PoolError
from pool.http._common import chat_request, logit_bias
from pool.http._tools import chat_output_format, chat_tools, tool_choice
from pool.schemas import (
    ChatCompletionRequest,
    ChatImagePart,
    ChatTextPart,
    CompletionRequest,
    EmbeddingsRequest,
    OpenAISampling,
)


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
    if body.stream and len(prompts) > 1:
        raise PoolError(
            "stream_multiple_prompts",
            "stream: true takes one prompt; send several prompts without streaming",
            details={"param": "prompt"},
        )
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
