"""The pool's results in OpenAI's shapes: chat completions and their chunks, legacy
completions and theirs, embeddings, and OpenAI's error object (:data:`ERRORS`, which
``/openai/v1/responses`` answers in too)."""

from __future__ import annotations

import base64
import json
import struct
from collections.abc import Callable, Sequence
from typing import Any

from quart import Response

from pool.actors import Admission, Delta, Embedded, Finished, Paused, ToolCallDelta, Waiting
from pool.errors import PoolError
from pool.http._common import (
    ErrorShape,
    SchemaError,
    backpressure_fields,
    dumps,
    json_response,
    retry_after,
)
from pool.http._streaming import SSE_KEEP_ALIVE, StreamRenderer
from pool.http._tools import chat_call
from pool.schemas import (
    ChatCompletion,
    EmbeddingList,
    EmbeddingsRequest,
    OpenAIError,
    TextCompletion,
    renders,
)

_FINISH = {"stop": "stop", "length": "length", "cancelled": "stop", "tool_calls": "tool_calls"}


# -- errors --------------------------------------------------------------------------------
@renders(OpenAIError)
def openai_error(status: int, code: str, message: str, param: str | None = None) -> dict[str, Any]:
    kind = "invalid_request_error" if status < 500 else "server_error"
    if status == 401:
        kind = "authentication_error"
    elif status == 429:
        kind = "rate_limit_error"
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def pool_error(exc: PoolError) -> Response:
    """A PoolError as OpenAI's error object."""
    # The field at fault, where the pool knows it (dimensions, logprobs, a sampling field).
    param = exc.details.get("param")
    body = openai_error(
        exc.status, exc.code, exc.message, param if isinstance(param, str) else None
    )
    # A 503 or 429 says how busy the pool is, as the runner API's own routes do.
    body["error"].update(backpressure_fields(exc))
    return json_response(body, exc.status, retry_after(exc))


def schema_error(exc: SchemaError) -> Response:
    """A schema failure as OpenAI's error object (422, ``param`` the field)."""
    loc = exc.errors[0]["loc"] if exc.errors else ()
    message = exc.errors[0]["msg"] if exc.errors else "invalid body"
    param = ".".join(str(p) for p in loc) or None
    return json_response(
        openai_error(422, "validation_error", f"{param or 'body'}: {message}", param), 422
    )


ERRORS = ErrorShape(pool_error, schema_error)


# -- chat completions ----------------------------------------------------------------------
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


@renders(ChatCompletion)
def chat_completion_body(
    completion_id: str, created: int, model: str, finished: Finished
) -> dict[str, Any]:
    """A ``chat.completion`` object: the one choice and its usage."""
    return {
        "id": completion_id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": _message(finished),
                "logprobs": None,
                "finish_reason": _FINISH[finished.finish_reason],
            }
        ],
        "usage": _usage(finished),
    }


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


def _event(payload: dict[str, Any]) -> bytes:
    return b"data: " + dumps(payload) + b"\n\n"


_DONE = b"data: [DONE]\n\n"


class _SseStream(StreamRenderer[bytes]):
    """What OpenAI's two completion streams share: a failure is one ``data:`` event
    with the error object, and the stream ends there (no ``[DONE]``); while a request
    waits for a load or a slot, SSE comments, which OpenAI's clients skip."""

    reports_waits = True

    def render_error(self, admission: Admission, exc: PoolError) -> bytes:
        body = openai_error(exc.status, exc.code, exc.message)
        body["error"].update(backpressure_fields(exc))
        return _event(body)

    def render_wait(self, admission: Admission, waiting: Waiting) -> bytes:
        return SSE_KEEP_ALIVE

    def render_pause(self, admission: Admission, paused: Paused) -> bytes:
        return SSE_KEEP_ALIVE


class ChatCompletionStream(_SseStream):
    """The ``chat.completion.chunk`` events of one streamed chat completion: the
    renderers its view hands to :func:`~pool.http._streaming.admitted_stream`.

    Args:
        include_usage: ``stream_options.include_usage``: every chunk carries
            ``"usage": null`` and a last chunk without choices carries the usage.
        pass_through: the request may be relayed on the pass-through path (the
            upstream's own events, pool/backends/_pass_through.py). Whether it is comes
            out only once its runtime runs, so the opening chunk waits for the first
            event: on the translated path it goes out with it, on the pass-through path
            the upstream's own opening is in the events.
    """

    def __init__(
        self,
        completion_id: str,
        created: int,
        model: str,
        include_usage: bool,
        *,
        pass_through: bool = False,
    ) -> None:
        self._id = completion_id
        self._created = created
        self._model = model
        self._include_usage = include_usage
        self._content = content_chunk_encoder(self._chunk({"content": _MARK}, None))
        # Nothing went out yet (only while the opening waits for the first event).
        self._unopened = pass_through
        self._raw = False

    def _chunk(self, delta: dict[str, Any], finish: str | None) -> bytes:
        payload = {
            "id": self._id,
            "object": "chat.completion.chunk",
            "created": self._created,
            "model": self._model,
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
        }
        if self._include_usage:
            payload["usage"] = None
        return _event(payload)

    def _opening(self) -> bytes:
        return self._chunk({"role": "assistant", "content": ""}, None)

    def _late_opening(self) -> bytes:
        """The opening, where it waited and nothing went out yet (else nothing)."""
        if not self._unopened:
            return b""
        self._unopened = False
        return self._opening()

    def opening(self, admission: Admission) -> bytes | None:
        return None if self._unopened else self._opening()

    def render_delta(self, admission: Admission, delta: Delta) -> bytes:
        if self._unopened:
            return self._late_opening() + self._content(delta.text)
        return self._content(delta.text)

    def render_raw(self, admission: Admission, events: bytes) -> bytes:
        self._unopened = False
        self._raw = True
        return events

    def render_finished(self, admission: Admission, event: Finished) -> bytes:
        if self._raw:
            # The upstream's finish and usage events went through; the [DONE] is ours.
            return _DONE
        out = self._late_opening() + self._chunk({}, _FINISH[event.finish_reason])
        if self._include_usage:
            out += _event(
                {
                    "id": self._id,
                    "object": "chat.completion.chunk",
                    "created": self._created,
                    "model": self._model,
                    "choices": [],
                    "usage": _usage(event),
                }
            )
        return out + _DONE

    def render_error(self, admission: Admission, exc: PoolError) -> bytes:
        # A stream that fails before its first event still opens, as it always has.
        return self._late_opening() + super().render_error(admission, exc)

    def render_tool_call(self, admission: Admission, piece: ToolCallDelta) -> bytes:
        return self._late_opening() + self._chunk({"tool_calls": [_call_delta(piece)]}, None)


# -- legacy completions --------------------------------------------------------------------
def _choice(index: int, text: str, finish: str | None) -> dict[str, Any]:
    return {"text": text, "index": index, "logprobs": None, "finish_reason": finish}


def cached_tokens(finished: Sequence[Finished]) -> int | None:
    """The prompt tokens that several generations reused from a cache; None where no
    backend reported the figure."""
    reported = [f.usage.cached_tokens for f in finished if f.usage.cached_tokens is not None]
    return sum(reported) if reported else None


@renders(TextCompletion)
def completion_body(
    completion_id: str, created: int, model: str, finished: Sequence[Finished]
) -> dict[str, Any]:
    """A ``text_completion`` object: a choice per prompt, in order, and their usage summed."""
    prompt_tokens = completion_tokens = 0
    for one in finished:
        usage = _usage(one)
        prompt_tokens += usage["prompt_tokens"]
        completion_tokens += usage["completion_tokens"]
    cached = cached_tokens(finished)
    return {
        "id": completion_id,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [
            _choice(index, one.text, _FINISH[one.finish_reason])
            for index, one in enumerate(finished)
        ],
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            **({} if cached is None else {"prompt_tokens_details": {"cached_tokens": cached}}),
        },
    }


class CompletionStream(_SseStream):
    """The ``text_completion`` chunks of one streamed legacy completion (one prompt).

    Args:
        include_usage: ``stream_options.include_usage``: every chunk carries ``usage``
            (null until a last chunk without choices).
    """

    def __init__(self, completion_id: str, created: int, model: str, include_usage: bool) -> None:
        self._id = completion_id
        self._created = created
        self._model = model
        self._include_usage = include_usage

    def _chunk(self, choices: list[dict[str, Any]], usage: dict[str, int] | None = None) -> bytes:
        payload: dict[str, Any] = {
            "id": self._id,
            "object": "text_completion",
            "created": self._created,
            "model": self._model,
            "choices": choices,
        }
        if self._include_usage:
            payload["usage"] = usage
        return _event(payload)

    def render_delta(self, admission: Admission, delta: Delta) -> bytes:
        return self._chunk([_choice(0, delta.text, None)])

    def render_finished(self, admission: Admission, event: Finished) -> bytes:
        out = self._chunk([_choice(0, "", _FINISH[event.finish_reason])])
        if self._include_usage:
            out += self._chunk([], _usage(event))
        return out + _DONE


# -- embeddings ----------------------------------------------------------------------------
def encode_vector(vector: tuple[float, ...], encoding: str) -> list[float] | str:
    """A vector as OpenAI sends it: floats, or base64 of little-endian float32."""
    if encoding == "base64":
        return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")
    return list(vector)


@renders(EmbeddingList)
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
