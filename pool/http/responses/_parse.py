"""A ``/v1/responses`` body as the pool's neutral request.

``input`` is one user turn; ``messages`` a conversation whose function-call items join
the assistant's turns and whose outputs become ``tool`` turns. The native ``decoding``
object names the sampling fields as the pool does.
"""

from __future__ import annotations

from typing import Any

from pool.actors import DecodingOverrides, InferenceRequest
from pool.backends import ImagePart, TextPart, ToolCall, Turn
from pool.config import SAMPLING_NAMES
from pool.errors import PoolError
from pool.http._common import logit_bias
from pool.http._responses_core import Conversation, Parts, tool_fields
from pool.schemas import (
    Content,
    DecodingRequest,
    FunctionCallItem,
    FunctionCallOutputItem,
    ImageContent,
    Message,
    ResponseRequest,
)


def _parts(content: Content) -> Parts:
    if isinstance(content, str):
        return (TextPart(content),)
    return tuple(
        ImagePart(item.image_url.url, item.image_url.detail)
        if isinstance(item, ImageContent)
        else TextPart(item.text)
        for item in content
    )


def decoding_overrides(asked: DecodingRequest) -> DecodingOverrides:
    """The native ``decoding`` object names every sampling field as the pool does; only
    ``logit_bias`` changes shape (string token ids to pairs)."""
    fields = {name: getattr(asked, name) for name in SAMPLING_NAMES}
    fields["logit_bias"] = logit_bias(asked.logit_bias, "decoding.logit_bias")
    return DecodingOverrides(**fields)


def _conversation(
    items: list[Message | FunctionCallItem | FunctionCallOutputItem],
) -> tuple[Turn, ...]:
    conversation = Conversation()
    for item in items:
        if isinstance(item, Message):
            conversation.message(item.role, _parts(item.content))
        elif isinstance(item, FunctionCallItem):
            conversation.call(ToolCall(item.call_id, item.name, item.arguments))
        else:
            conversation.output(item.call_id, (TextPart(item.output),))
    return tuple(conversation.turns)


def inference_request(body: ResponseRequest) -> InferenceRequest:
    """The neutral request of a ``/v1/responses`` body."""
    if body.messages is not None:
        last = body.messages[-1]
        if not (
            isinstance(last, FunctionCallOutputItem)
            or (isinstance(last, Message) and last.role == "user")
        ):
            raise PoolError(
                "invalid_conversation",
                "the last message must have role `user` (or be a function_call_output)",
            )
        turns = _conversation(body.messages)
    else:
        assert body.input is not None
        turns = (Turn("user", _parts(body.input)),)
    return InferenceRequest(
        model=body.model,
        turns=turns,
        multi_turn=body.messages is not None,
        instructions=body.instructions,
        decoding=decoding_overrides(body.decoding),
        thinking=body.thinking,
        allow_remote=body.allow_remote,
        keep_alive=body.keep_alive,
        source_lang_code=body.source_lang_code,
        target_lang_code=body.target_lang_code,
        **tool_fields(
            body.tools,
            body.tool_choice,
            body.parallel_tool_calls,
            body.text.format if body.text else None,
        ),
    )


def request_from_responses(body: ResponseRequest | dict[str, Any]) -> InferenceRequest:
    """The neutral request of a Responses-format body (embedded use builds them so).

    Raises:
        pydantic.ValidationError: ``body`` is a dict that fails the schema.
        PoolError: ``invalid_request`` for a conversation that does not end with the
            user's turn (or a function call's output).
    """
    if not isinstance(body, ResponseRequest):
        body = ResponseRequest.model_validate(body)
    return inference_request(body)
