"""The routes of the dialect (its parsing and rendering stay beside them until they move
into ``_parse.py`` and ``_render.py``)."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from typing import Any, Literal

from quart import Blueprint, Quart, Response

from pool.actors import Admission, DecodingOverrides, Delta, Finished, InferenceRequest
from pool.backends import (
    ImagePart,
    OutputFormat,
    TextPart,
    ThinkingMode,
    ToolCall,
    ToolCallDelta,
    ToolChoice,
    Turn,
)
from pool.errors import PoolError
from pool.http._common import (
    AppContext,
    ErrorShape,
    SchemaError,
    cache_headers_in,
    chat_request,
    dumps,
    inference_headers,
    json_response,
    read_body,
    request_id,
    require,
    retry_after,
    tenant_and_priority,
    with_cache,
)
from pool.http._streaming import HEARTBEAT_S, admitted_stream
from pool.http._tools import (
    arguments_object,
    check_schema,
    invalid,
    messages_tool_choice,
    messages_tools,
)
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

log = logging.getLogger("pool.http")

# A waiting stream shows a ping at least this often (docs/api.md, "Messages").
PING_INTERVAL_S = HEARTBEAT_S

# Anthropic's error types by status; the status itself stays the pool's.
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    504: "timeout_error",
}

StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]


def error_type(status: int) -> str:
    if status in _ERROR_TYPES:
        return _ERROR_TYPES[status]
    return "invalid_request_error" if status < 500 else "api_error"


def messages_error(status: int, message: str) -> dict[str, Any]:
    """``{"type": "error", "error": {"type", "message"}}``."""
    return {"type": "error", "error": {"type": error_type(status), "message": message}}


# -- request ---------------------------------------------------------------------------


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


# -- reply -----------------------------------------------------------------------------

_OPEN, _CLOSE = "<think>", "</think>"
BlockKind = Literal["thinking", "text"]


class ThinkingSplitter:
    """Splits a reply that opens with ``<think>...</think>`` into its reasoning and its
    text, as pieces arrive. Text that could still be (the rest of) a tag is held back
    until the next piece tells; a reply that does not open with the tag is all text."""

    def __init__(self) -> None:
        self._state: Literal["start", "thinking", "after", "text"] = "start"
        self._pending = ""

    def feed(self, text: str) -> list[tuple[BlockKind, str]]:
        out: list[tuple[BlockKind, str]] = []
        self._pending += text
        while self._pending:
            if self._state == "start":
                stripped = self._pending.lstrip()
                if stripped.startswith(_OPEN):
                    self._state, self._pending = "thinking", stripped[len(_OPEN) :].lstrip("\n")
                    continue
                if _OPEN.startswith(stripped):
                    break  # still possibly the opening tag
                self._state = "text"
            elif self._state == "thinking":
                end = self._pending.find(_CLOSE)
                if end >= 0:
                    out.append(("thinking", self._pending[:end].rstrip("\n")))
                    self._state, self._pending = "after", self._pending[end + len(_CLOSE) :]
                    continue
                hold = next(
                    (
                        n
                        for n in range(len(_CLOSE) - 1, 0, -1)
                        if self._pending.endswith(_CLOSE[:n])
                    ),
                    0,
                )
                cut = len(self._pending) - hold
                out.append(("thinking", self._pending[:cut]))
                self._pending = self._pending[cut:]
                break
            elif self._state == "after":
                self._pending = self._pending.lstrip()
                if self._pending:
                    self._state = "text"
            else:
                out.append(("text", self._pending))
                self._pending = ""
        return [(kind, piece) for kind, piece in out if piece]

    def flush(self) -> list[tuple[BlockKind, str]]:
        pending, self._pending = self._pending, ""
        if not pending or self._state == "after":
            return []
        return [("thinking" if self._state == "thinking" else "text", pending)]


def split_thinking(text: str) -> tuple[str | None, str]:
    """``(thinking, text)`` of a whole reply; thinking is None when it has none."""
    splitter = ThinkingSplitter()
    pieces = splitter.feed(text) + splitter.flush()
    thinking = "".join(p for kind, p in pieces if kind == "thinking")
    answer = "".join(p for kind, p in pieces if kind == "text")
    opened = text.lstrip().startswith(_OPEN)
    return (thinking if opened else None), answer


def stop_reason(finished: Finished, stops: tuple[str, ...]) -> tuple[StopReason, str | None]:
    """Anthropic's ``stop_reason`` and ``stop_sequence`` of a finished reply.

    Only a stop sequence the client sent counts as one (the pool's own defaults and the
    prompt format's end markers end a turn)."""
    if finished.finish_reason == "tool_calls":
        return "tool_use", None
    if finished.finish_reason == "length":
        return "max_tokens", None
    if finished.stop_sequence is not None and finished.stop_sequence in stops:
        return "stop_sequence", finished.stop_sequence
    return "end_turn", None


def usage_body(finished: Finished) -> dict[str, Any]:
    """Anthropic counts prompt tokens served from a cache apart from ``input_tokens``."""
    usage = finished.usage
    prompt = usage.prompt_tokens or 0
    cached = usage.cached_tokens
    return {
        "input_tokens": max(0, prompt - (cached or 0)),
        "output_tokens": usage.output_tokens or 0,
        "cache_creation_input_tokens": None if cached is None else 0,
        "cache_read_input_tokens": cached,
    }


def tool_use_block(call: ToolCall) -> dict[str, Any]:
    return {
        "type": "tool_use",
        "id": call.id,
        "name": call.name,
        "input": arguments_object(call.arguments),
    }


def message_body(
    message_id: str, model: str, finished: Finished, stops: tuple[str, ...]
) -> dict[str, Any]:
    thinking, text = split_thinking(finished.text)
    content: list[dict[str, Any]] = []
    if thinking is not None:
        content.append({"type": "thinking", "thinking": thinking, "signature": ""})
    if text.strip() or not finished.tool_calls:
        content.append({"type": "text", "text": text})
    content += [tool_use_block(call) for call in finished.tool_calls]
    reason, sequence = stop_reason(finished, stops)
    return {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": reason,
        "stop_sequence": sequence,
        "usage": usage_body(finished),
    }


def sse(event: dict[str, Any]) -> bytes:
    kind: str = event["type"]
    return b"event: " + kind.encode() + b"\ndata: " + dumps(event) + b"\n\n"


PING = sse({"type": "ping"})


class MessageEvents:
    """The stream of one reply, as Anthropic sends it: ``message_start``; per content
    block ``content_block_start``, its deltas (``thinking_delta``, ``text_delta``,
    ``input_json_delta``) and ``content_block_stop``; ``message_delta`` (the stop
    reason and usage); ``message_stop``."""

    def __init__(self, message_id: str, model: str, stops: tuple[str, ...]) -> None:
        self.message_id = message_id
        self.model = model
        self.stops = stops
        self._splitter = ThinkingSplitter()
        self._index = -1
        self._open: str | None = None  # "text", "thinking" or "tool:<call index>"

    def start(self) -> bytes:
        message: dict[str, Any] = {
            "id": self.message_id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": 0, "output_tokens": 0},
        }
        return sse({"type": "message_start", "message": message}) + PING

    def _close(self) -> bytes:
        if self._open is None:
            return b""
        self._open = None
        return sse({"type": "content_block_stop", "index": self._index})

    def _block(self, key: str, block: dict[str, Any]) -> bytes:
        """Open a block under ``key`` unless it is the open one."""
        if self._open == key:
            return b""
        out = self._close()
        self._index += 1
        self._open = key
        return out + sse(
            {"type": "content_block_start", "index": self._index, "content_block": block}
        )

    def _pieces(self, pieces: list[tuple[BlockKind, str]]) -> bytes:
        out = []
        for kind, text in pieces:
            if kind == "thinking":
                out.append(
                    self._block("thinking", {"type": "thinking", "thinking": "", "signature": ""})
                )
                delta = {"type": "thinking_delta", "thinking": text}
            else:
                out.append(self._block("text", {"type": "text", "text": ""}))
                delta = {"type": "text_delta", "text": text}
            out.append(sse({"type": "content_block_delta", "index": self._index, "delta": delta}))
        return b"".join(out)

    def text(self, text: str) -> bytes:
        return self._pieces(self._splitter.feed(text))

    def tool_call(self, piece: ToolCallDelta) -> bytes:
        key = f"tool:{piece.index}"
        out = self._pieces(self._splitter.flush())
        if piece.id is not None or piece.name is not None:
            block = {
                "type": "tool_use",
                "id": piece.id or "",
                "name": piece.name or "",
                "input": {},
            }
            out += self._block(key, block)
        if piece.arguments and self._open == key:
            delta = {"type": "input_json_delta", "partial_json": piece.arguments}
            out += sse({"type": "content_block_delta", "index": self._index, "delta": delta})
        return out

    def finish(self, finished: Finished) -> bytes:
        out = self._pieces(self._splitter.flush())
        if self._index < 0:
            out += self._block("text", {"type": "text", "text": ""})
        out += self._close()
        reason, sequence = stop_reason(finished, self.stops)
        usage = usage_body(finished)
        delta = {
            "type": "message_delta",
            "delta": {"stop_reason": reason, "stop_sequence": sequence},
            "usage": usage,
        }
        return out + sse(delta) + sse({"type": "message_stop"})


def message_id(admission: Admission) -> str:
    return "msg_" + admission.id.removeprefix("resp_")


def _pool_error(exc: PoolError) -> Response:
    return json_response(
        messages_error(exc.status, exc.message),
        exc.status,
        retry_after(exc) | {"request-id": request_id()},
    )


def _schema_error(exc: SchemaError) -> Response:
    # Anthropic answers a body that does not validate with 400, naming the field.
    first = exc.errors[0] if exc.errors else {"loc": (), "msg": "invalid body"}
    where = ".".join(str(p) for p in first.get("loc", ())) or "body"
    return json_response(
        messages_error(400, f"{where}: {first.get('msg')}"), 400, {"request-id": request_id()}
    )


MESSAGES_ERRORS = ErrorShape(_pool_error, _schema_error)


# -- routes ----------------------------------------------------------------------------


def register(app: Quart, ctx: AppContext) -> None:
    pool = ctx.pool
    blueprint = Blueprint("messages", __name__)

    def authorize() -> None:
        require(ctx, "inference", api_key=True)

    ctx.error_shapes[blueprint.name] = MESSAGES_ERRORS

    @blueprint.post("/v1/messages")
    async def create_message() -> Response:
        """Anthropic Messages: one message, or its event stream with ``stream: true``."""
        authorize()
        tenant, priority = tenant_and_priority()
        cache = cache_headers_in()
        body = await read_body(MessagesRequest)
        request = with_cache(inference_request(body), cache)
        stops = tuple(body.stop_sequences or ())
        rid = request_id()
        if not body.stream:
            async with pool.admit(request, tenant=tenant, priority=priority) as admission:
                finished = await admission.collect()
            out = inference_headers(
                admission.queue_wait_ms, finished.timings.backend_ms, finished.usage.cached_tokens
            )
            out["request-id"] = rid
            return json_response(
                message_body(message_id(admission), body.model, finished, stops), headers=out
            )

        events: MessageEvents | None = None

        def opening(admission: Admission) -> bytes:
            nonlocal events
            events = MessageEvents(message_id(admission), body.model, stops)
            return events.start()

        def render(admission: Admission, event: Delta | Finished) -> bytes:
            assert events is not None
            if type(event) is Delta:
                return events.text(event.text)
            assert isinstance(event, Finished)
            return events.finish(event)

        def render_tool_call(admission: Admission, piece: ToolCallDelta) -> bytes:
            assert events is not None
            return events.tool_call(piece)

        def render_error(admission: Admission, exc: PoolError) -> bytes:
            log.info("request_id=%s model=%s stream=true error=%s", rid, body.model, exc.code)
            return sse(messages_error(exc.status, exc.message))

        admission, chunks = await admitted_stream(
            pool,
            request,
            tenant=tenant,
            priority=priority,
            render=render,
            render_error=render_error,
            opening=opening,
            render_wait=lambda admission, waiting: PING,
            render_tool_call=render_tool_call,
            heartbeat_s=PING_INTERVAL_S,
        )
        out = inference_headers(admission.queue_wait_ms, None)
        out.update({"Cache-Control": "no-cache", "X-Accel-Buffering": "no", "request-id": rid})
        response = Response(chunks, content_type="text/event-stream", headers=out)
        response.timeout = None
        return response

    @blueprint.post("/v1/messages/count_tokens")
    async def count_tokens() -> Response:
        """The prompt's tokens, counted by the model itself (it prefills the prompt)."""
        authorize()
        tenant, priority = tenant_and_priority()
        cache = cache_headers_in()
        body = await read_body(MessagesTokensRequest)
        request = with_cache(inference_request(body, counting=True), cache)
        async with pool.admit(request, tenant=tenant, priority=priority) as admission:
            finished = await admission.collect()
        if finished.usage.prompt_tokens is None:
            raise PoolError(
                "backend_error", f"model {body.model!r} did not report how long the prompt is"
            )
        out = inference_headers(admission.queue_wait_ms, finished.timings.backend_ms)
        out["request-id"] = request_id()
        return json_response({"input_tokens": finished.usage.prompt_tokens}, headers=out)

    app.register_blueprint(blueprint)
