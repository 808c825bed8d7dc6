"""A Messages body as the pool's neutral request.

The system prompt becomes ``instructions``; user and assistant messages become turns,
``tool_use`` blocks the assistant's calls and ``tool_result`` blocks ``tool`` turns, as
the other chat surfaces build them; earlier ``thinking`` blocks are not shown to the
model again. ``count_tokens`` bodies take the same path, generating one token.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

from pool.actors import DecodingOverrides, InferenceRequest
from pool.backends import (
    ImagePart,
    OutputFormat,
    TextPart,
    ThinkingMode,
    ToolCall,
    ToolChoice,
    Turn,
)
from pool.http._common import chat_request
from pool.http._tools import check_schema, invalid, messages_tool_choice, messages_tools
from pool.schemas import (
    MessagesImageBlock,
    MessagesImageSource,
    MessagesMessage,
    MessagesRequest,
    MessagesTextBlock,
    MessagesThinking,
    MessagesThinkingBlock,
    MessagesTokensRequest,
    MessagesToolResultBlock,
    MessagesToolUseBlock,
)


def _image(source: MessagesImageSource, where: str) -> ImagePart:
    if source.type == "url":
        if not source.url:
            raise invalid(f"{where}.source.url", "a url image needs its url")
        return ImagePart(source.url)
    if not source.data or not source.media_type:
        raise invalid(f"{where}.source", "a base64 image needs media_type and data")
    return ImagePart(f"data:{source.media_type};base64,{source.data}")


def _result_parts(block: MessagesToolResultBlock, where: str) -> tuple[TextPart | ImagePart, ...]:
    content = block.content
    if content is None or isinstance(content, str):
        return (TextPart(content or ""),)
    parts: list[TextPart | ImagePart] = []
    for index, item in enumerate(content):
        if isinstance(item, MessagesTextBlock):
            parts.append(TextPart(item.text))
        else:
            parts.append(_image(item.source, f"{where}.content[{index}]"))
    return tuple(parts) or (TextPart(""),)


def _turns(index: int, message: MessagesMessage) -> Iterator[Turn]:
    """The turns of one message: a user message's tool results come first (one ``tool``
    turn each), then its text and images; an assistant message is one turn with its
    calls."""
    if isinstance(message.content, str):
        yield Turn(message.role, (TextPart(message.content),))
        return
    parts: list[TextPart | ImagePart] = []
    calls: list[ToolCall] = []
    for position, block in enumerate(message.content):
        where = f"messages[{index}].content[{position}]"
        if isinstance(block, MessagesTextBlock):
            parts.append(TextPart(block.text))
        elif isinstance(block, MessagesImageBlock):
            parts.append(_image(block.source, where))
        elif isinstance(block, MessagesThinkingBlock):
            continue  # earlier reasoning is not shown again
        elif isinstance(block, MessagesToolUseBlock) and message.role == "assistant":
            calls.append(
                ToolCall(block.id, block.name, json.dumps(block.input, ensure_ascii=False))
            )
        elif isinstance(block, MessagesToolResultBlock) and message.role == "user":
            yield Turn("tool", _result_parts(block, where), tool_call_id=block.tool_use_id)
        else:
            raise invalid(
                f"{where}.type",
                f"{block.type!r} blocks are not supported in {message.role} messages",
                "invalid_conversation",
            )
    if message.role == "assistant":
        yield Turn("assistant", tuple(parts) or (TextPart(""),), tuple(calls))
    elif parts:
        yield Turn("user", tuple(parts))


def _thinking(value: MessagesThinking | None) -> ThinkingMode:
    if value is None:
        return "default"
    return "disabled" if value.type == "disabled" else "enabled"


def _output_format(body: MessagesRequest) -> OutputFormat | None:
    wanted = body.output_config.format if body.output_config else None
    if wanted is None:
        return None
    check_schema(wanted.schema_, "output_config.format.schema")
    return OutputFormat("json_schema", wanted.schema_)


def _system(body: MessagesTokensRequest) -> str | None:
    if body.system is None or isinstance(body.system, str):
        return body.system or None
    return "\n\n".join(block.text for block in body.system) or None


def inference_request(body: MessagesTokensRequest, *, counting: bool = False) -> InferenceRequest:
    """The neutral request of a Messages body (``counting``: of a ``count_tokens`` body:
    one token is generated, and a forced call is not forced, as it constrains the
    output, not the prompt being counted)."""
    turns = [turn for index, m in enumerate(body.messages) for turn in _turns(index, m)]
    tools = messages_tools(body.tools)
    choice, parallel = messages_tool_choice(body.tool_choice, tools)
    if isinstance(body, MessagesRequest) and not counting:
        decoding = DecodingOverrides(
            temperature=body.temperature,
            top_p=body.top_p,
            top_k=body.top_k,
            max_tokens=body.max_tokens,
            stop=tuple(body.stop_sequences or ()),
        )
        extra: dict[str, Any] = {
            "keep_alive": body.keep_alive,
            "allow_remote": body.allow_remote,
            "output_format": _output_format(body),
        }
    else:
        decoding = DecodingOverrides(max_tokens=1)
        extra = {}
        if choice.forced:
            choice = ToolChoice("auto")
    return chat_request(
        body.model,
        turns,
        tools=tools,
        tool_choice=choice,
        parallel_tool_calls=parallel,
        instructions=_system(body),
        thinking=_thinking(body.thinking),
        decoding=decoding,
        **extra,
    )
