"""Replies in Anthropic's shapes: the message, its event stream, the token count, errors.

A reply that opens with a reasoning block (``<think>...</think>``, as Qwen3-style models
write it) answers it as a ``thinking`` block before the text. Errors use Anthropic's
shape with the pool's statuses.
"""

from __future__ import annotations

import logging
from typing import Any, Literal

from quart import Response

from pool.actors import Admission, Delta, Finished, Paused, ToolCallDelta, Waiting
from pool.backends import ToolCall
from pool.errors import PoolError
from pool.http._common import ErrorShape, SchemaError, dumps, json_response, request_id, retry_after
from pool.http._streaming import StreamRenderer
from pool.http._thinking import Kind, ThinkSplitter, split_reasoning
from pool.http._tools import arguments_object

log = logging.getLogger("pool.http")

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


ERRORS = ErrorShape(_pool_error, _schema_error)


# -- the message -----------------------------------------------------------------------


def message_id(admission: Admission) -> str:
    return "msg_" + admission.id.removeprefix("resp_")


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
    admission: Admission, model: str, finished: Finished, stops: tuple[str, ...]
) -> dict[str, Any]:
    """The whole reply of a request without ``stream``."""
    thinking, text = split_reasoning(finished.text, trim_reasoning_end=True)
    content: list[dict[str, Any]] = []
    if thinking is not None:
        content.append({"type": "thinking", "thinking": thinking, "signature": ""})
    if text.strip() or not finished.tool_calls:
        content.append({"type": "text", "text": text})
    content += [tool_use_block(call) for call in finished.tool_calls]
    reason, sequence = stop_reason(finished, stops)
    return {
        "id": message_id(admission),
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": reason,
        "stop_sequence": sequence,
        "usage": usage_body(finished),
    }


def token_count_body(prompt_tokens: int) -> dict[str, Any]:
    """The reply of ``count_tokens``."""
    return {"input_tokens": prompt_tokens}


# -- the event stream ------------------------------------------------------------------


def sse(event: dict[str, Any]) -> bytes:
    kind: str = event["type"]
    return b"event: " + kind.encode() + b"\ndata: " + dumps(event) + b"\n\n"


PING = sse({"type": "ping"})


class MessageStream(StreamRenderer[bytes]):
    """The stream of one reply, as Anthropic sends it: ``message_start``; per content
    block ``content_block_start``, its deltas (``thinking_delta``, ``text_delta``,
    ``input_json_delta``) and ``content_block_stop``; ``message_delta`` (the stop
    reason and usage); ``message_stop``. A wait is a ``ping``, an error after the
    headers an ``error`` event.

    Its ``render*`` methods and :meth:`opening` are what
    :func:`~pool.http._streaming.admitted_stream` takes.
    """

    reports_waits = True

    def __init__(self, model: str, stops: tuple[str, ...], request_id: str) -> None:
        self.model = model
        self.stops = stops
        self.request_id = request_id
        self._splitter = ThinkSplitter(trim_reasoning_end=True)
        self._index = -1
        self._open: str | None = None  # "text", "thinking" or "tool:<call index>"

    def opening(self, admission: Admission) -> bytes:
        message: dict[str, Any] = {
            "id": message_id(admission),
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": 0, "output_tokens": 0},
        }
        return sse({"type": "message_start", "message": message}) + PING

    def render_delta(self, admission: Admission, delta: Delta) -> bytes:
        return self._pieces(self._splitter.feed(delta.text))

    def render_finished(self, admission: Admission, finished: Finished) -> bytes:
        return self._finish(finished)

    def render_tool_call(self, admission: Admission, piece: ToolCallDelta) -> bytes:
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

    def render_error(self, admission: Admission, exc: PoolError) -> bytes:
        # The status line went out as 200: only the log tells how this request ended.
        log.info(
            "request_id=%s model=%s stream=true error=%s", self.request_id, self.model, exc.code
        )
        return sse(messages_error(exc.status, exc.message))

    @staticmethod
    def render_wait(admission: Admission, waiting: Waiting) -> bytes:
        return PING

    @staticmethod
    def render_pause(admission: Admission, paused: Paused) -> bytes:
        return PING

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

    def _pieces(self, pieces: list[tuple[Kind, str]]) -> bytes:
        out = []
        for kind, text in pieces:
            if kind == "reasoning":
                out.append(
                    self._block("thinking", {"type": "thinking", "thinking": "", "signature": ""})
                )
                delta = {"type": "thinking_delta", "thinking": text}
            else:
                out.append(self._block("text", {"type": "text", "text": ""}))
                delta = {"type": "text_delta", "text": text}
            out.append(sse({"type": "content_block_delta", "index": self._index, "delta": delta}))
        return b"".join(out)

    def _finish(self, finished: Finished) -> bytes:
        out = self._pieces(self._splitter.flush())
        if self._index < 0:
            out += self._block("text", {"type": "text", "text": ""})
        out += self._close()
        reason, sequence = stop_reason(finished, self.stops)
        delta = {
            "type": "message_delta",
            "delta": {"stop_reason": reason, "stop_sequence": sequence},
            "usage": usage_body(finished),
        }
        return out + sse(delta) + sse({"type": "message_stop"})
