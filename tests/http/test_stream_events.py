"""Every event of every streamed route, held to the model the OpenAPI document names for it.

Each case drives a real stream through the app (stub backends, the tool-calling test
backend, a stub made to fail after two tokens) and parses every SSE event or NDJSON line:
its JSON must validate, strictly (no type coercion), against the route's event union
(``x-stream-events`` in the document), an SSE ``event:`` name must be its ``type``, and
nothing else may be on the wire (an unknown SSE field, a JSON-less data, a ``[DONE]``
where it does not belong). Each case also names the events it must produce, so a case
that silently stops exercising its path fails; and the table as a whole must produce
every member of every union, so no event model is left unexercised.
"""

from __future__ import annotations

import io
import json
import typing
import wave
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import httpx
import pytest
import trio
from pydantic import BaseModel, RootModel

from pool.backends import register_backend, unregister_backend
from pool.backends.stub import StubRuntime
from pool.errors import BackendError
from pool.schemas import (
    ChatCompletionStreamEvent,
    MessagesStreamEvent,
    OllamaChatStreamLine,
    OllamaGenerateStreamLine,
    OpenAIResponseStreamEvent,
    PullState,
    ResponseStreamEvent,
    TextCompletionStreamEvent,
    TranscriptionStreamEvent,
)

from . import tool_backend
from .conftest import WAITING_MODELS, start_server

Framing = Literal["sse", "sse-done", "ndjson"]


@dataclass(frozen=True)
class Surface:
    """How a route streams: its event model and framing (``sse``: named events whose
    name is the JSON's ``type``; ``sse-done``: unnamed events ended by ``[DONE]``)."""

    events: type[BaseModel]
    framing: Framing


RESPONSES = Surface(ResponseStreamEvent, "sse")
OPENAI_RESPONSES = Surface(OpenAIResponseStreamEvent, "sse")
MESSAGES = Surface(MessagesStreamEvent, "sse")
CHAT = Surface(ChatCompletionStreamEvent, "sse-done")
COMPLETIONS = Surface(TextCompletionStreamEvent, "sse-done")
OLLAMA_CHAT = Surface(OllamaChatStreamLine, "ndjson")
OLLAMA_GENERATE = Surface(OllamaGenerateStreamLine, "ndjson")
PULL = Surface(PullState, "ndjson")
# Unnamed events as OpenAI's transcription streams send them, without a closing [DONE].
TRANSCRIPTION = Surface(TranscriptionStreamEvent, "sse-done")

# Every streamed route of the app and its surface; the document must agree.
STREAMED: dict[str, Surface] = {
    "/v1/responses": RESPONSES,
    "/openai/v1/responses": OPENAI_RESPONSES,
    "/v1/messages": MESSAGES,
    "/v1/chat/completions": CHAT,
    "/openai/v1/chat/completions": CHAT,
    "/v1/completions": COMPLETIONS,
    "/openai/v1/completions": COMPLETIONS,
    "/api/chat": OLLAMA_CHAT,
    "/api/generate": OLLAMA_GENERATE,
    "/api/pull": PULL,
    "/v1/audio/transcriptions": TRANSCRIPTION,
    "/openai/v1/audio/transcriptions": TRANSCRIPTION,
}

MODELS: dict[str, dict[str, Any]] = {
    "echo": {"backend": "stub", "enabled": True},
    "think": {
        "backend": "stub",
        "enabled": True,
        "stub_reply": "<think> Paris is the capital. </think> It is Paris.",
    },
    "long": {"backend": "stub", "enabled": True, "stub_reply": "one two three four five six"},
    "caller": {"backend": "toolcaller", "enabled": True},
    "ears": {"backend": "stub", "enabled": True, "kind": "transcription"},
    # lazy: loads on the first request (0.4 s); never: its queue times out during the load.
    **WAITING_MODELS,
}

PARAMETERS = {"type": "object", "properties": {"n": {"type": "integer"}}}
CHAT_TOOLS = [{"type": "function", "function": {"name": "count", "parameters": PARAMETERS}}]
RESPONSE_TOOLS = [{"type": "function", "name": "count", "parameters": PARAMETERS}]
MESSAGES_TOOLS = [{"name": "count", "description": "Count", "input_schema": PARAMETERS}]
HI = [{"role": "user", "content": "hello there"}]


@dataclass(frozen=True)
class Case:
    """One stream: what to send and the labels (:func:`labels`) it must produce."""

    id: str
    path: str
    body: dict[str, Any]
    expect: frozenset[str]
    failing: bool = False  # every stub fails after two tokens


def case(id: str, path: str, body: dict[str, Any], *expect: str, failing: bool = False) -> Any:
    return pytest.param(Case(id, path, body, frozenset(expect), failing), id=id)


def _chat(**fields: Any) -> dict[str, Any]:
    return {"messages": HI, "stream": True, **fields}


def _prompt(**fields: Any) -> dict[str, Any]:
    return {"prompt": "hello there", "stream": True, **fields}


def _responses(**fields: Any) -> dict[str, Any]:
    return {"input": "hello there", "stream": True, **fields}


def _messages(**fields: Any) -> dict[str, Any]:
    return {"messages": HI, "max_tokens": 64, "stream": True, **fields}


def _ollama_chat(**fields: Any) -> dict[str, Any]:
    return {"messages": HI, **fields}  # Ollama streams by default


CASES = [
    # -- the pool's own /v1/responses ----------------------------------------------------
    case("responses-text", "/v1/responses", _responses(model="echo"),
         "ResponseCreatedEvent", "ResponseTextDeltaEvent", "ResponseMetricsEvent",
         "ResponseCompletedEvent:stop"),
    case("responses-length", "/v1/responses",
         _responses(model="long", decoding={"max_tokens": 2}), "ResponseCompletedEvent:length"),
    case("responses-tools", "/v1/responses", _responses(model="caller", tools=RESPONSE_TOOLS),
         "ResponseItemAddedEvent", "ResponseArgumentsDeltaEvent", "ResponseArgumentsDoneEvent",
         "ResponseItemDoneEvent", "ResponseCompletedEvent:tool_calls"),
    case("responses-waiting", "/v1/responses", _responses(model="lazy"),
         "ResponseQueuedEvent", "ResponseLoadingEvent", "ResponseCompletedEvent:stop"),
    case("responses-queue-timeout", "/v1/responses", _responses(model="never"),
         "ResponseQueuedEvent", "ResponseErrorEvent:queue_timeout"),
    case("responses-error", "/v1/responses", _responses(model="echo"),
         "ResponseTextDeltaEvent", "ResponseErrorEvent:backend_error", failing=True),
    # -- Chat Completions, under both base URLs --------------------------------------------
    *(
        c
        for base in ("/v1", "/openai/v1")
        for c in (
            case(f"chat-text{base}", f"{base}/chat/completions", _chat(model="echo"),
                 "ChatCompletionChunk:role", "ChatCompletionChunk:content",
                 "ChatCompletionChunk:finish=stop", "[DONE]"),
            case(f"chat-usage{base}", f"{base}/chat/completions",
                 _chat(model="echo", stream_options={"include_usage": True}),
                 "ChatCompletionChunk:content", "ChatCompletionChunk:usage", "[DONE]"),
            case(f"chat-length{base}", f"{base}/chat/completions",
                 _chat(model="long", max_tokens=2), "ChatCompletionChunk:finish=length"),
            case(f"chat-tools{base}", f"{base}/chat/completions",
                 _chat(model="caller", tools=CHAT_TOOLS), "ChatCompletionChunk:tool_calls",
                 "ChatCompletionChunk:finish=tool_calls"),
            case(f"chat-waiting{base}", f"{base}/chat/completions", _chat(model="lazy"),
                 ": keep-alive", "ChatCompletionChunk:content", "[DONE]"),
            case(f"chat-queue-timeout{base}", f"{base}/chat/completions",
                 _chat(model="never"), ": keep-alive", "OpenAIError:queue_timeout"),
            case(f"chat-error{base}", f"{base}/chat/completions", _chat(model="echo"),
                 "ChatCompletionChunk:content", "OpenAIError:backend_error", failing=True),
        )
    ),
    # -- legacy Completions --------------------------------------------------------------
    *(
        c
        for base in ("/v1", "/openai/v1")
        for c in (
            case(f"completions-text{base}", f"{base}/completions", _prompt(model="echo"),
                 "TextCompletion:text", "TextCompletion:finish=stop", "[DONE]"),
            case(f"completions-usage{base}", f"{base}/completions",
                 _prompt(model="echo", stream_options={"include_usage": True}),
                 "TextCompletion:usage", "[DONE]"),
            case(f"completions-length{base}", f"{base}/completions",
                 _prompt(model="long", max_tokens=2), "TextCompletion:finish=length"),
            case(f"completions-waiting{base}", f"{base}/completions", _prompt(model="lazy"),
                 ": keep-alive", "TextCompletion:text", "[DONE]"),
            case(f"completions-error{base}", f"{base}/completions", _prompt(model="echo"),
                 "TextCompletion:text", "OpenAIError:backend_error", failing=True),
        )
    ),
    # -- OpenAI's Responses API ----------------------------------------------------------
    case("openai-responses-text", "/openai/v1/responses", _responses(model="echo"),
         "OpenAIResponseLifecycleEvent:response.created",
         "OpenAIResponseLifecycleEvent:response.in_progress",
         "OpenAIOutputItemEvent:response.output_item.added",
         "OpenAIContentPartEvent:response.content_part.added", "OpenAIOutputTextDeltaEvent",
         "OpenAIOutputTextDoneEvent", "OpenAIContentPartEvent:response.content_part.done",
         "OpenAIOutputItemEvent:response.output_item.done",
         "OpenAIResponseLifecycleEvent:response.completed"),
    case("openai-responses-reasoning", "/openai/v1/responses", _responses(model="think"),
         "OpenAIReasoningTextDeltaEvent", "OpenAIReasoningTextDoneEvent",
         "OpenAIOutputTextDeltaEvent", "OpenAIResponseLifecycleEvent:response.completed"),
    case("openai-responses-tools", "/openai/v1/responses",
         _responses(model="caller", tools=RESPONSE_TOOLS), "OpenAIArgumentsDeltaEvent",
         "OpenAIArgumentsDoneEvent", "OpenAIResponseLifecycleEvent:response.completed"),
    case("openai-responses-length", "/openai/v1/responses",
         _responses(model="long", max_output_tokens=2),
         "OpenAIResponseLifecycleEvent:response.incomplete"),
    case("openai-responses-waiting", "/openai/v1/responses", _responses(model="lazy"),
         "OpenAIOutputTextDeltaEvent", "OpenAIResponseLifecycleEvent:response.completed"),
    case("openai-responses-error", "/openai/v1/responses", _responses(model="echo"),
         "OpenAIOutputTextDeltaEvent", "OpenAIResponseLifecycleEvent:response.failed",
         failing=True),
    # -- Anthropic's Messages ------------------------------------------------------------
    case("messages-text", "/v1/messages", _messages(model="echo"),
         "MessageStartEvent", "MessagesPingEvent", "ContentBlockStartEvent:text",
         "ContentBlockDeltaEvent:text_delta", "ContentBlockStopEvent",
         "MessageDeltaEvent:end_turn", "MessageStopEvent"),
    case("messages-thinking", "/v1/messages", _messages(model="think"),
         "ContentBlockStartEvent:thinking", "ContentBlockDeltaEvent:thinking_delta",
         "ContentBlockDeltaEvent:text_delta"),
    case("messages-tools", "/v1/messages", _messages(model="caller", tools=MESSAGES_TOOLS),
         "ContentBlockStartEvent:tool_use", "ContentBlockDeltaEvent:input_json_delta",
         "MessageDeltaEvent:tool_use"),
    case("messages-length", "/v1/messages", _messages(model="long", max_tokens=2),
         "MessageDeltaEvent:max_tokens"),
    case("messages-waiting", "/v1/messages", _messages(model="lazy"),
         "MessagesPingEvent", "ContentBlockDeltaEvent:text_delta", "MessageStopEvent"),
    case("messages-queue-timeout", "/v1/messages", _messages(model="never"),
         "MessagesPingEvent", "MessagesError:timeout_error"),
    case("messages-error", "/v1/messages", _messages(model="echo"),
         "ContentBlockDeltaEvent:text_delta", "MessagesError:api_error", failing=True),
    # -- Ollama --------------------------------------------------------------------------
    case("ollama-chat-text", "/api/chat", _ollama_chat(model="echo"),
         "OllamaChatChunk:text", "OllamaChatLast:stop"),
    case("ollama-chat-length", "/api/chat",
         _ollama_chat(model="long", options={"num_predict": 2}), "OllamaChatLast:length"),
    case("ollama-chat-tools", "/api/chat", _ollama_chat(model="caller", tools=CHAT_TOOLS),
         "OllamaChatChunk:tool_calls", "OllamaChatLast:stop"),
    case("ollama-chat-waiting", "/api/chat", _ollama_chat(model="lazy"),
         "OllamaChatChunk:empty", "OllamaChatChunk:text", "OllamaChatLast:stop"),
    case("ollama-chat-queue-timeout", "/api/chat", _ollama_chat(model="never"),
         "OllamaChatChunk:empty", "OllamaError"),
    case("ollama-chat-error", "/api/chat", _ollama_chat(model="echo"),
         "OllamaChatChunk:text", "OllamaError", failing=True),
    case("ollama-generate-text", "/api/generate", {"model": "echo", "prompt": "hello there"},
         "OllamaGenerateChunk:text", "OllamaGenerateLast:stop"),
    case("ollama-generate-length", "/api/generate",
         {"model": "long", "prompt": "hi", "options": {"num_predict": 2}},
         "OllamaGenerateLast:length"),
    case("ollama-generate-waiting", "/api/generate", {"model": "lazy", "prompt": "hi"},
         "OllamaGenerateChunk:empty", "OllamaGenerateLast:stop"),
    case("ollama-generate-error", "/api/generate", {"model": "echo", "prompt": "hi"},
         "OllamaGenerateChunk:text", "OllamaError", failing=True),
    # -- transcriptions (a multipart form: the case's body is its fields, plus a WAV) -----
    *(
        c
        for base in ("/v1", "/openai/v1")
        for c in (
            case(f"transcription-text{base}", f"{base}/audio/transcriptions",
                 {"model": "ears", "stream": "true"},
                 "TranscriptTextDelta", "TranscriptTextDone"),
            case(f"transcription-error{base}", f"{base}/audio/transcriptions",
                 {"model": "ears", "stream": "true"},
                 "TranscriptTextDelta", "OpenAIError:backend_error", failing=True),
        )
    ),
]  # fmt: skip


# -- labels: what an event is, for the cases' expectations ----------------------------------
# Models that stand for several event types: the type is the detail.
_SEVERAL_TYPES = ("OpenAIResponseLifecycleEvent", "OpenAIOutputItemEvent", "OpenAIContentPartEvent")


def _detail(event: BaseModel) -> Iterator[str]:
    """The facts of an event a case may ask for, beside its model (see CASES)."""
    data = event.model_dump()
    kind = type(event).__name__
    if kind == "ChatCompletionChunk":
        if not data["choices"]:
            yield "usage"
        for choice in data["choices"]:
            delta = choice["delta"]
            yield from (k for k in ("role", "tool_calls") if delta.get(k))
            if delta.get("content"):
                yield "content"
            if choice["finish_reason"]:
                yield f"finish={choice['finish_reason']}"
    elif kind == "TextCompletion":
        if not data["choices"]:
            yield "usage"
        for choice in data["choices"]:
            if choice["text"]:
                yield "text"
            if choice["finish_reason"]:
                yield f"finish={choice['finish_reason']}"
    elif kind in ("OllamaChatChunk", "OllamaGenerateChunk"):
        message = data.get("message") or {}
        if message.get("tool_calls"):
            yield "tool_calls"
        elif message.get("content") or data.get("response"):
            yield "text"
        else:
            yield "empty"  # what a waiting stream sends to keep alive
    elif kind in ("OllamaChatLast", "OllamaGenerateLast"):
        yield data["done_reason"]
    elif kind == "OpenAIError":
        yield data["error"]["code"]
    elif kind == "MessagesError":
        yield data["error"]["type"]
    elif kind == "ResponseErrorEvent":
        yield data["error"]["code"]
    elif kind == "ResponseCompletedEvent":
        yield data["response"]["finish_reason"]
    elif kind == "ContentBlockStartEvent":
        yield data["content_block"]["type"]
    elif kind == "ContentBlockDeltaEvent":
        yield data["delta"]["type"]
    elif kind == "MessageDeltaEvent":
        yield data["delta"]["stop_reason"]
    elif kind in (
        "OpenAIResponseLifecycleEvent",
        "OpenAIOutputItemEvent",
        "OpenAIContentPartEvent",
    ):
        yield data["type"]


def labels(event: BaseModel) -> set[str]:
    kind = type(event).__name__
    return {kind} | {f"{kind}:{detail}" for detail in _detail(event) if detail}


# -- the wire ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Wire:
    """One event as sent: an SSE comment, ``[DONE]``, or JSON with its SSE event name."""

    comment: str | None = None
    name: str | None = None
    data: str | None = None


def sse_blocks(text: str) -> list[Wire]:
    """Every SSE event of ``text``; a field other than ``event`` and ``data`` fails."""
    assert text.endswith("\n\n"), f"an SSE stream ends with a blank line: {text[-80:]!r}"
    out = []
    for block in text[:-2].split("\n\n"):
        lines = block.split("\n")
        if all(line.startswith(":") for line in lines):
            out.append(Wire(comment=block))
            continue
        fields: dict[str, list[str]] = {}
        for line in lines:
            name, sep, value = line.partition(": ")
            assert sep and name in ("event", "data"), f"not an SSE field we send: {line!r}"
            fields.setdefault(name, []).append(value)
        assert len(fields.get("event", [])) <= 1 and len(fields["data"]) == 1, block
        out.append(Wire(name=(fields.get("event") or [None])[0], data=fields["data"][0]))
    return out


def ndjson_lines(text: str) -> list[Wire]:
    assert text.endswith("\n"), f"an NDJSON stream ends with a newline: {text[-80:]!r}"
    return [Wire(data=line) for line in text[:-1].split("\n")]


def check_stream(surface: Surface, text: str) -> list[set[str]]:
    """Validate every event of one stream; answer each event's labels, in order."""
    wires = ndjson_lines(text) if surface.framing == "ndjson" else sse_blocks(text)
    seen: list[set[str]] = []
    for position, wire in enumerate(wires):
        if wire.comment is not None:
            assert surface.framing != "ndjson"
            seen.append({wire.comment})
            continue
        assert wire.data is not None
        if surface.framing == "sse-done" and wire.data == "[DONE]":
            assert position == len(wires) - 1, "[DONE] ends the stream"
            seen.append({"[DONE]"})
            continue
        # strict: a number sent as a string (or a bool as 0/1) is a failure, not coerced.
        parsed = surface.events.model_validate_json(wire.data, strict=True)
        event = parsed.root if isinstance(parsed, RootModel) else parsed
        # Nothing sent is lost on the way: a field the model does not know (where its
        # surface's models do not keep unknown fields) would be missing here.
        kept = event.model_dump(mode="json", by_alias=True, exclude_unset=True)
        assert kept == json.loads(wire.data), wire
        if surface.framing == "sse":
            assert wire.name == json.loads(wire.data)["type"], wire
        else:
            assert wire.name is None, wire
        seen.append(labels(event))
    return seen


# -- the cases ------------------------------------------------------------------------------
async def _fail_after_two_tokens(self: StubRuntime, request: Any, sink: Any) -> Any:
    await sink.send("The")
    await sink.send(" capital")
    raise BackendError("the runtime fell over")


def _silence_wav() -> bytes:
    """Half a second of silence, the upload of the transcription cases."""
    out = io.BytesIO()
    with wave.open(out, "wb") as wav:
        wav.setnchannels(1)
        wav.setsampwidth(2)
        wav.setframerate(16000)
        wav.writeframes(b"\x00\x00" * 8000)
    return out.getvalue()


@pytest.fixture
async def toolcaller() -> AsyncIterator[None]:
    register_backend("toolcaller", tool_backend.__name__)
    try:
        yield
    finally:
        unregister_backend("toolcaller")


@pytest.mark.parametrize("c", CASES)
async def test_every_streamed_event_matches_its_model(
    nursery: trio.Nursery, toolcaller: None, monkeypatch: pytest.MonkeyPatch, c: Case
) -> None:
    if c.failing:
        monkeypatch.setattr(StubRuntime, "generate", _fail_after_two_tokens)
        monkeypatch.setattr(StubRuntime, "transcribe", _fail_after_two_tokens)
    info = await start_server(nursery, MODELS)
    async with httpx.AsyncClient(base_url=info.url, timeout=30) as client:
        if "/audio/" in c.path:
            upload = {"file": ("silence.wav", _silence_wav(), "audio/wav")}
            reply = await client.post(c.path, data=c.body, files=upload)
        else:
            reply = await client.post(c.path, json=c.body)
    assert reply.status_code == 200, reply.text
    seen = check_stream(STREAMED[c.path], reply.text)
    produced = set().union(*seen)
    assert c.expect <= produced, (sorted(c.expect - produced), seen)


async def test_pull_progress_lines_match_their_model(nursery: trio.Nursery, tmp_path: Path) -> None:
    from tests.pulls.test_pulls import FileServer

    files = FileServer()
    files.files["/m.bin"] = b"m" * 300_000
    models = {
        "m": {"backend": "stub", "source": files.url + "/m.bin"},
        "gone": {"backend": "stub", "source": files.url + "/missing.bin"},
    }
    info = await start_server(nursery, models, model_store=str(tmp_path / "store"))
    try:
        async with httpx.AsyncClient(base_url=info.url, timeout=30) as client:
            for model, last in (("m", "success"), ("gone", "error")):
                reply = await client.post("/api/pull", json={"model": model})
                assert reply.status_code == 200, reply.text
                seen = check_stream(PULL, reply.text)
                assert all(labels == {"PullState"} for labels in seen)
                assert json.loads(reply.text.splitlines()[-1])["status"] == last
    finally:
        files.httpd.shutdown()


# -- the table and the document agree --------------------------------------------------------
def _members(union: type[BaseModel]) -> set[str]:
    """The models of a stream's events: the members of its union (or the one model)."""
    if not issubclass(union, RootModel):
        return {union.__name__}
    found: set[str] = set()

    def walk(annotation: Any) -> None:
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            found.add(annotation.__name__)
        for argument in typing.get_args(annotation):
            walk(argument)

    walk(union.model_fields["root"].annotation)
    return found


def test_the_cases_produce_every_event_model_of_every_surface() -> None:
    """A union member no case asks for would be a model nothing holds to the wire."""
    asked: dict[type[BaseModel], set[str]] = {}
    for param in CASES:
        (c,) = param.values
        asked.setdefault(STREAMED[c.path].events, set()).update(
            label.split(":")[0] for label in c.expect
        )
    for surface in {s for s in STREAMED.values() if s is not PULL}:
        missing = _members(surface.events) - asked.get(surface.events, set())
        assert not missing, (surface.events.__name__, missing)


async def test_the_document_names_the_event_model_of_every_stream(
    client: httpx.AsyncClient,
) -> None:
    document = (await client.get("/openapi.json")).json()
    streamed: dict[str, str] = {}
    for path, operations in document["paths"].items():
        for operation in operations.values():
            for media, content in operation["responses"].get("200", {}).get("content", {}).items():
                if "x-stream-events" in content:
                    streamed[path] = content["x-stream-events"]["$ref"]
                    if media == "text/event-stream":
                        # The data is JSON of that model (or OpenAI's closing [DONE]).
                        data = content["schema"]["properties"]["data"]
                        schemas = [b.get("contentSchema") for b in data.get("anyOf", [data])]
                        assert content["x-stream-events"] in schemas, path
    assert streamed == {
        path: f"#/components/schemas/{surface.events.__name__}"
        for path, surface in STREAMED.items()
    }
    for name in {s.events.__name__ for s in STREAMED.values()}:
        assert name in document["components"]["schemas"], name
