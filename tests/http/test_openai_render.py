"""OpenAI's stream renderers on their own (pool/http/openai/_render.py and
pool/http/openai_responses/_render.py), without a server.

The goldens pin whole exchanges; these pin what a golden's few tokens cannot: that the
per-token fast path of chat completions writes the bytes ``dumps`` gives for the same
chunk whatever the text holds, and how each stream ends.
"""

from __future__ import annotations

import json
from typing import Any, cast

import pytest

from pool.actors import Admission, Delta, Finished, Timings, Usage
from pool.backends import FinishReason, ToolCall, ToolCallDelta
from pool.errors import PoolError
from pool.http._common import dumps
from pool.http.openai._render import ChatCompletionStream, CompletionStream, completion_body
from pool.http.openai_responses._render import OutputBuilder, ResponseFrame, ResponseStream

# The renderers take the admission because admitted_stream passes it; none reads it.
ADMISSION = cast(Admission, None)

TEXTS = [
    "plain",
    "",
    'quotes " and \\ backslashes',
    "new\nline\ttab \x00 nul \x1f",
    "unicode é 漢字 🙂 \u2028",
    "\x00content\x00",  # the marker the fast path splits its template at
    '{"content": "nested"}',
]


def _data(raw: bytes) -> list[Any]:
    """The JSON of each ``data:`` event (``[DONE]`` as a string)."""
    events = []
    for block in raw.decode().split("\n\n"):
        if block.startswith("data: "):
            payload = block[len("data: ") :]
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def _finished(reason: FinishReason = "stop", cached: int | None = None) -> Finished:
    return Finished(
        "hi", reason, Usage(prompt_tokens=3, output_tokens=2, cached_tokens=cached), Timings()
    )


@pytest.mark.parametrize("include_usage", [False, True])
@pytest.mark.parametrize("text", TEXTS)
def test_chat_content_chunk_is_the_bytes_of_its_dict(text: str, include_usage: bool) -> None:
    stream = ChatCompletionStream("chatcmpl-1", 1700000000, "m", include_usage)
    chunk: dict[str, Any] = {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "created": 1700000000,
        "model": "m",
        "choices": [
            {"index": 0, "delta": {"content": text}, "logprobs": None, "finish_reason": None}
        ],
    }
    if include_usage:
        chunk["usage"] = None
    assert stream.render(ADMISSION, Delta(text)) == b"data: " + dumps(chunk) + b"\n\n"


def test_chat_stream_opens_and_ends() -> None:
    stream = ChatCompletionStream("chatcmpl-1", 1, "m", include_usage=True)
    (opening,) = _data(stream.opening(ADMISSION))
    assert opening["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    finish, usage, done = _data(stream.render(ADMISSION, _finished("length", cached=1)))
    assert finish["choices"][0]["finish_reason"] == "length" and finish["usage"] is None
    assert usage["choices"] == [] and usage["usage"] == {
        "prompt_tokens": 3,
        "completion_tokens": 2,
        "total_tokens": 5,
        "prompt_tokens_details": {"cached_tokens": 1},
    }
    assert done == "[DONE]"
    # Without include_usage: no usage chunk, no usage field.
    plain = ChatCompletionStream("chatcmpl-1", 1, "m", include_usage=False)
    finish, done = _data(plain.render(ADMISSION, _finished("cancelled")))
    assert finish["choices"][0]["finish_reason"] == "stop" and "usage" not in finish


def test_chat_tool_call_pieces() -> None:
    stream = ChatCompletionStream("chatcmpl-1", 1, "m", include_usage=False)
    (first,) = _data(stream.render_tool_call(ADMISSION, ToolCallDelta(0, "call_1", "f", "")))
    (later,) = _data(stream.render_tool_call(ADMISSION, ToolCallDelta(0, arguments='{"a"')))
    assert first["choices"][0]["delta"]["tool_calls"] == [
        {"index": 0, "id": "call_1", "type": "function", "function": {"arguments": "", "name": "f"}}
    ]
    assert later["choices"][0]["delta"]["tool_calls"] == [
        {"index": 0, "function": {"arguments": '{"a"'}}
    ]


@pytest.mark.parametrize("stream_kind", [ChatCompletionStream, CompletionStream])
def test_a_failure_is_one_error_event_without_done(stream_kind: type[Any]) -> None:
    stream = stream_kind("id-1", 1, "m", True)
    out = stream.render_error(ADMISSION, PoolError("backend_error", "it fell over"))
    assert _data(out) == [
        {
            "error": {
                "message": "it fell over",
                "type": "server_error",
                "param": None,
                "code": "backend_error",
            }
        }
    ]


def test_completion_stream_usage_rides_every_chunk() -> None:
    stream = CompletionStream("cmpl-1", 1, "m", include_usage=True)
    (delta,) = _data(stream.render(ADMISSION, Delta("a b")))
    assert delta["choices"][0]["text"] == "a b" and delta["usage"] is None
    finish, usage, done = _data(stream.render(ADMISSION, _finished()))
    assert finish["choices"][0] == {
        "text": "",
        "index": 0,
        "logprobs": None,
        "finish_reason": "stop",
    }
    assert usage["choices"] == [] and usage["usage"]["total_tokens"] == 5
    assert done == "[DONE]"


def test_completion_body_sums_its_prompts() -> None:
    body = completion_body(
        "cmpl-1", 1, "m", [_finished("length"), _finished(cached=2), _finished(cached=None)]
    )
    assert [(c["index"], c["finish_reason"]) for c in body["choices"]] == [
        (0, "length"),
        (1, "stop"),
        (2, "stop"),
    ]
    assert body["usage"] == {
        "prompt_tokens": 9,
        "completion_tokens": 6,
        "total_tokens": 15,
        "prompt_tokens_details": {"cached_tokens": 2},
    }
    # No backend reported cached tokens: OpenAI's details field stays out.
    assert "prompt_tokens_details" not in completion_body("c", 1, "m", [_finished()])["usage"]


def _frame() -> ResponseFrame:
    return ResponseFrame(
        id="resp_1",
        model="m",
        created_at=1,
        instructions=None,
        max_output_tokens=None,
        temperature=None,
        top_p=None,
        tools=[],
        tool_choice="auto",
        parallel_tool_calls=True,
        text={"format": {"type": "text"}},
        metadata={},
        previous_response_id=None,
        store=True,
    )


def _kinds(raw: bytes | None) -> list[str]:
    return [
        line[len("event: ") :]
        for line in (raw or b"").decode().splitlines()
        if line.startswith("event: ")
    ]


def test_response_stream_holds_its_last_event_back() -> None:
    stream = ResponseStream(OutputBuilder(_frame()))
    assert _kinds(stream.opening(ADMISSION)) == ["response.created", "response.in_progress"]
    assert "response.output_text.delta" in _kinds(stream.render(ADMISSION, Delta("hi")))
    call = ToolCall("call_1", "f", "{}")
    ended = Finished("hi", "tool_calls", Usage(1, 2), Timings(), tool_calls=(call,))
    rendered = _kinds(stream.render(ADMISSION, ended))
    assert "response.completed" not in rendered and "response.output_item.done" in rendered
    assert [_kinds(e) for e in stream.ending] == [["response.completed"]]


def test_response_stream_failure_ends_with_failed_held_back() -> None:
    stream = ResponseStream(OutputBuilder(_frame()))
    stream.opening(ADMISSION)
    stream.render(ADMISSION, Delta("partial"))
    rendered = _kinds(stream.render_error(ADMISSION, PoolError("backend_error", "down")))
    assert "response.failed" not in rendered
    assert [_kinds(e) for e in stream.ending] == [["response.failed"]]
    assert stream.builder.response is not None
    assert stream.builder.response["error"] == {"code": "backend_error", "message": "down"}
