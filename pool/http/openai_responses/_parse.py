"""OpenAI's Responses request as the pool's neutral request.

The input (a string, or message, ``function_call``, ``function_call_output`` and
``reasoning`` items) is first read as the items OpenAI lists back (``input_items``,
and what a stored response keeps); the conversation is then read from the stored
history and those items, so a continued response (``previous_response_id``) and a new
one become turns the same way.
"""

from __future__ import annotations

import time
from typing import Any

from pool.actors import DecodingOverrides, InferenceRequest
from pool.backends import ImagePart, TextPart, ToolCall, Turn
from pool.http._common import chat_request
from pool.http._responses_core import Conversation, Parts, tool_fields
from pool.http._tools import invalid
from pool.http.openai_responses._render import ResponseFrame, new_id
from pool.schemas import (
    FunctionCallInput,
    FunctionCallOutputInput,
    FunctionChoice,
    FunctionTool,
    MessageInput,
    OpenAIResponseRequest,
    ReasoningInput,
)


# -- input items ---------------------------------------------------------------------------
def input_items(body: OpenAIResponseRequest) -> list[dict[str, Any]]:
    """The request's input as the items OpenAI lists (``input_items``): every item with
    an ``id``, message content as parts."""
    if body.input is None:
        return []
    if isinstance(body.input, str):
        text = {"type": "input_text", "text": body.input}
        return [_message_item(new_id("msg"), "user", [text])]
    items: list[dict[str, Any]] = []
    for item in body.input:
        if isinstance(item, MessageInput):
            content = item.content
            if isinstance(content, str):
                kind = "output_text" if item.role == "assistant" else "input_text"
                parts = [{"type": kind, "text": content}]
            else:
                parts = [p.model_dump(exclude_none=True) for p in content]
            items.append(_message_item(item.id or new_id("msg"), item.role, parts))
        elif isinstance(item, FunctionCallInput):
            items.append(
                {
                    "type": "function_call",
                    "id": item.id or "fc_" + item.call_id,
                    "call_id": item.call_id,
                    "name": item.name,
                    "arguments": item.arguments,
                    "status": "completed",
                }
            )
        elif isinstance(item, FunctionCallOutputInput):
            output = item.output
            items.append(
                {
                    "type": "function_call_output",
                    "id": item.id or new_id("fco"),
                    "call_id": item.call_id,
                    "output": (
                        output
                        if isinstance(output, str)
                        else [p.model_dump(exclude_none=True) for p in output]
                    ),
                    "status": "completed",
                }
            )
        else:
            assert isinstance(item, ReasoningInput)
            items.append({**item.model_dump(exclude_none=True), "id": item.id or new_id("rs")})
    return items


def _message_item(item_id: str, role: str, parts: list[dict[str, Any]]) -> dict[str, Any]:
    return {"type": "message", "id": item_id, "role": role, "content": parts, "status": "completed"}


def _parts(content: Any) -> Parts:
    if isinstance(content, str):
        return (TextPart(content),)
    parts: list[TextPart | ImagePart] = []
    for part in content:
        kind = part.get("type")
        if kind == "input_image":
            parts.append(ImagePart(part["image_url"], part.get("detail")))
        elif kind == "refusal":
            parts.append(TextPart(part.get("refusal", "")))
        else:
            parts.append(TextPart(part.get("text", "")))
    return tuple(parts) or (TextPart(""),)


def _text_of(content: Any) -> str:
    return "".join(p.text for p in _parts(content) if isinstance(p, TextPart))


def conversation(items: list[dict[str, Any]]) -> tuple[list[str], list[Turn]]:
    """System texts and turns of input and output items, in order (a
    :class:`~pool.http._responses_core.Conversation`); reasoning items stay out of the
    prompt."""
    system: list[str] = []
    turns = Conversation()
    for item in items:
        kind = item.get("type", "message")
        if kind == "message":
            role = item["role"]
            if role in ("system", "developer"):
                system.append(_text_of(item["content"]))
            else:
                turns.message(role, _parts(item["content"]))
        elif kind == "function_call":
            turns.call(ToolCall(item["call_id"], item["name"], item.get("arguments", "{}")))
        elif kind == "function_call_output":
            turns.output(item["call_id"], _parts(item["output"]))
    return system, turns.turns


# -- the request ---------------------------------------------------------------------------
def _tools(body: OpenAIResponseRequest) -> list[FunctionTool]:
    tools = []
    for index, tool in enumerate(body.tools or ()):
        if tool.type != "function":
            raise invalid(
                f"tools[{index}].type",
                f'only "function" tools are supported, not {tool.type[:40]!r}',
            )
        tools.append(
            FunctionTool(
                type="function",
                name=tool.name,
                description=tool.description,
                parameters=tool.parameters,
                strict=tool.strict,
            )
        )
    return tools


def _choice(body: OpenAIResponseRequest) -> str | FunctionChoice | None:
    value = body.tool_choice
    if value is None or isinstance(value, str):
        return value
    if value.type != "function" or not value.name:
        raise invalid("tool_choice", 'only {"type": "function", "name": ...} names a tool')
    return FunctionChoice(type="function", name=value.name)


def refuse_unsupported(body: OpenAIResponseRequest) -> None:
    """400 for what the pool does not do (background runs, conversations) and for a
    request with nothing to answer; checked before the stored history is looked up."""
    if body.background:
        raise invalid("background", "background responses are not supported; leave it out")
    if body.conversation is not None:
        raise invalid("conversation", "conversations are not supported; use previous_response_id")
    if body.input is None and body.previous_response_id is None:
        raise invalid("input", "give input (or continue a response with previous_response_id)")


def inference_request(
    body: OpenAIResponseRequest, history: list[dict[str, Any]], items: list[dict[str, Any]]
) -> InferenceRequest:
    """The neutral request: ``history`` (a stored conversation) then ``items``."""
    system, turns = conversation([*history, *items])
    instructions = [body.instructions] if body.instructions else []
    instructions += system
    return chat_request(
        body.model,
        turns,
        instructions="\n\n".join(instructions) if instructions else None,
        decoding=DecodingOverrides(
            temperature=body.temperature,
            top_p=body.top_p,
            top_k=body.top_k,
            max_tokens=body.max_output_tokens,
            seed=body.seed,
        ),
        thinking=body.thinking,
        allow_remote=body.allow_remote,
        keep_alive=body.keep_alive,
        **tool_fields(
            _tools(body),
            _choice(body),
            body.parallel_tool_calls,
            body.text.format if body.text else None,
        ),
    )


def response_frame(body: OpenAIResponseRequest) -> ResponseFrame:
    """The request's settings as the response object echoes them."""
    tools = [
        {
            "type": "function",
            "name": t.name,
            "description": t.description,
            "parameters": t.parameters,
            "strict": t.strict if t.strict is not None else False,
        }
        for t in body.tools or ()
    ]
    choice: Any = body.tool_choice or "auto"
    if not isinstance(choice, str):
        choice = {"type": choice.type, "name": choice.name}
    text_format = body.text.format if body.text else None
    return ResponseFrame(
        id=new_id("resp"),
        model=body.model,
        created_at=int(time.time()),
        instructions=body.instructions,
        max_output_tokens=body.max_output_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        tools=tools,
        tool_choice=choice,
        parallel_tool_calls=body.parallel_tool_calls,
        text={
            "format": (
                text_format.model_dump(by_alias=True, exclude_none=True)
                if text_format
                else {"type": "text"}
            )
        },
        metadata=dict(body.metadata or {}),
        previous_response_id=body.previous_response_id,
        store=body.store,
        reasoning=body.reasoning.model_dump() if body.reasoning else None,
        truncation=body.truncation,
        user=body.user,
    )
