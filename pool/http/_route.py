"""A documented route: what its operation in the OpenAPI document says (body, replies,
errors), declared beside the view that serves it.

Each routes module declares its :class:`Route` values and lists them in ``ROUTES``; its
views are registered through :func:`serves`, which takes the method and path from the
declaration, so the document (pool/http/_openapi.py) and the URL map read the same
values. tests/http/test_openapi.py checks that every rule of the app is documented.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

from pydantic import BaseModel
from quart import Blueprint

ErrorShape = Literal["pool", "openai", "ollama", "anthropic"]
SSE = "text/event-stream"
PLAIN_TEXT = ("text/plain", {"type": "string"})
HTML = ("text/html", {"type": "string"})


@dataclass(frozen=True, slots=True)
class Route:
    """One operation of the document.

    Attributes:
        request: the body's model; None for a route without a body.
        request_media: the body's media type (a multipart form's fields are the model's).
        status: the success status.
        reply: the model of the success body (JSON); None for a text answer or none.
        text: the media type of a success body that is not JSON, and its schema.
        media: the media types (and schemas) of a binary success body, one of which is
            answered (audio in the formats a request may ask for).
        stream: the media type of the streamed answer (``stream: true``).
        events: the model of one streamed event's JSON (an SSE event's ``data``, an NDJSON
            line): the union of every event the stream can send.
        errors: the error body of this surface: the pool's, OpenAI's, Ollama's or
            Anthropic's.
        unavailable_reply: a 503 answers the success body too, not an error (the health
            while unhealthy).
        refusals: the 4xx statuses this route answers beyond every route's (403, 401
            where it needs a token, and a body's 400, 408, 413, 422); None for its kind's
            (pool/http/_openapi.py: a body's inference refusals, a path parameter's 404).
        valid_input_codes: the error codes a request the document calls valid may still
            get as a 400, because what refuses it lies outside the document (below).
    """

    method: str
    path: str
    tag: str
    summary: str
    description: str
    request: type[BaseModel] | None = None
    status: int = 200
    reply: type[BaseModel] | None = None
    text: tuple[str, dict[str, Any]] | None = None
    media: tuple[tuple[str, dict[str, Any]], ...] = ()
    stream: str | None = None
    events: type[BaseModel] | None = None
    errors: ErrorShape = "pool"
    body_required: bool = True
    unavailable_reply: bool = False
    # Query parameters: (name, JSON type or the whole schema, description).
    query: tuple[tuple[str, str | dict[str, Any], str], ...] = ()
    refusals: tuple[int, ...] | None = None
    valid_input_codes: tuple[str, ...] = ()
    request_media: str = "application/json"


# The codes a schema-valid request may still be refused with (``valid_input_codes``), by
# what refuses it. The model a generation request names (pool/actors/serving/_intake.py)
# and the media it links (pool/media):
GENERATION_REFUSALS = (
    "image_refused",
    "modality_unsupported",
    "multi_turn_unsupported",
    "remote_not_allowed",
    "sampling_unsupported",
    "structured_output_unsupported",
    "thinking_unsupported",
    "tools_unsupported",
    "wrong_model_kind",
    # Rules between fields: `tool_choice` names a tool that `tools` lacks, two tools
    # share a name, the last turn is not the user's, a block its role cannot carry.
    "duplicate_tool",
    "invalid_conversation",
    "tool_choice_unmatched",
    # A tool's or output format's JSON schema deeper than the document describes it.
    "invalid_json_schema",
)
# A stream of several prompts too (the schema cannot tie `stream` to `prompt`).
COMPLETION_REFUSALS = (*GENERATION_REFUSALS, "logprobs_unsupported", "stream_multiple_prompts")
EMBEDDING_REFUSALS = ("dimensions_unsupported", "remote_not_allowed", "wrong_model_kind")
# Rerank and score: the model's kind, and the bounds of `engine.rerank` (settings the
# document cannot show).
RERANK_REFUSALS = (
    "document_too_long",
    "remote_not_allowed",
    "rerank_too_long",
    "too_many_documents",
    "wrong_model_kind",
)
# A route forwarded to a model's server (pool/http/_forwarding.py): the model's kind, and
# the server's own refusal of the request (invalid_request quoting it).
FORWARD_REFUSALS = ("invalid_request", "remote_not_allowed", "wrong_model_kind")
# An upload that is no audio, or longer than `service.audio.max_seconds`; a stream or
# granularities with a format that has no place for them.
AUDIO_REFUSALS = (
    "audio_too_long",
    "invalid_audio",
    "invalid_request",
    "remote_not_allowed",
    "wrong_model_kind",
)
# A load: another backend's override, or overrides while the model is loaded.
LOAD_REFUSALS = ("invalid_load_request",)


View = TypeVar("View", bound=Callable[..., Any])


def serves(
    blueprint: Blueprint, *routes: Route, converters: Mapping[str, str] | None = None
) -> Callable[[View], View]:
    """Register the decorated view on ``blueprint`` for each of ``routes`` (its method and
    path, ``{name}`` read as Quart's ``<name>``, or ``<converter:name>`` where
    ``converters`` names one)."""
    converters = converters or {}

    def rule(path: str) -> str:
        def variable(match: re.Match[str]) -> str:
            name = match.group(1)
            return f"<{converters[name]}:{name}>" if name in converters else f"<{name}>"

        return re.sub(r"\{(\w+)\}", variable, path)

    def register(view: View) -> View:
        for route in routes:
            blueprint.add_url_rule(rule(route.path), view_func=view, methods=[route.method.upper()])
        return view

    return register
