"""The OpenAPI document, generated from the pydantic models, and a small docs page.

Every route the app serves is declared where it is registered (pool/http/_route.py): its
request model (for a route that takes a body) and the model of its success body, or the
media type of a text answer. The document collects them from the modules that register
them (pool/http/_surfaces.py). tests/http/test_openapi.py checks them against the app's
URL map, validates the document, and validates real answers against the response schemas.

Around the routes, tables say who may call each (its ``security``), which statuses it
can refuse with (each with its surface's error body), the example bodies (naming models
of the pool that serves the document) and the links between operations that clients
follow; tests/http/test_schemathesis.py holds a served pool to all of it.
"""

from __future__ import annotations

import html
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from pool._version import __version__
from pool.actors import STATE_DESCRIPTIONS
from pool.errors import STATUS_BY_CODE
from pool.http._route import HTML, SSE, ErrorShape, Route
from pool.http._surfaces import SURFACES
from pool.schemas import (
    ChatCompletionStreamEvent,
    MessagesError,
    OllamaError,
    OpenAIError,
    TextCompletionStreamEvent,
    with_components,
)

# The document's own routes (pool/http/_app.py serves them).
OPENAPI_JSON = Route(
    "get",
    "/openapi.json",
    "operations",
    "This document",
    "OpenAPI 3.1.",
    text=("application/json", {"type": "object"}),
)
DOCS_PAGE = Route(
    "get",
    "/docs",
    "operations",
    "Readable API docs",
    "A self-contained HTML page of every route.",
    text=HTML,
)
# Every route the app serves, as each module that registers it declares it.
ROUTES: list[Route] = [
    *(route for surface in SURFACES for route in surface.ROUTES), OPENAPI_JSON, DOCS_PAGE
]  # fmt: skip


# -- who may call what ----------------------------------------------------------------
# "inference": an inference or the admin token; "admin": the admin token; "lifecycle":
# the admin token or a `verifiedOpToken` in the body (docs/operations.md); None: open.
Access = Literal["inference", "admin", "lifecycle"] | None
_OPEN = {"/ui", "/ui/", "/ui/app.js", "/ui/app.css", "/", "/api/version", "/health",
         "/openapi.json", "/docs"}  # fmt: skip
_ADMIN_PATHS = ("/v1/admin/", "/api/pull", "/api/delete", "/api/copy", "/metrics",
                "/v1/models/load/")  # fmt: skip
_LIFECYCLE = {"/v1/models/load", "/v1/models/unload", "/v1/cache/flush"}


def _access(route: Route) -> Access:
    if route.path in _OPEN:
        return None
    if route.path in _LIFECYCLE:
        return "lifecycle"
    if route.path.startswith(_ADMIN_PATHS):
        return "admin"
    return "inference"


_SECURITY_SCHEMES = {
    "inferenceToken": {
        "type": "http",
        "scheme": "bearer",
        "description": "One of `service.auth.inference_tokens` (or `$LLM_POOL_API_TOKENS`),"
        " or a key of `service.auth.keys` or `/v1/admin/keys` (any role; a key with a"
        " `tenant` fixes the request's tenant). The admin token is accepted wherever an"
        " inference token is.",
    },
    "adminToken": {
        "type": "http",
        "scheme": "bearer",
        "description": "`service.auth.admin_token` (or `$LLM_POOL_ADMIN_TOKEN`), or a key"
        " with the `admin` role. The runner API's lifecycle routes also accept a signed"
        " `verifiedOpToken` in the body instead.",
    },
    "apiKey": {
        "type": "apiKey",
        "in": "header",
        "name": "x-api-key",
        "description": "An inference (or the admin) token in Anthropic's header: the"
        " Messages routes take it as `Authorization: Bearer`.",
    },
}

# -- what each route can refuse (its Route's `refusals`, else its kind's) ----------------
# A route that declares none: one with a body is taken for an inference route, one with
# a path parameter may not find what it names.
_DEFAULT_BODY_REFUSALS = (400, 404, 409, 429)
# The mark on an operation's 400 (OpenAPI extension): the codes a request that this
# document calls valid can still get, because what refuses it lies outside the document:
# the model it names (its kind, backend, capabilities), the pool's settings (the media
# policy, remote models) or its state (a load's overrides while loaded). Every error
# answer carries its code in X-Error-Code (and, where the dialect has one, in the body);
# a 400 with any other code says the request broke the document.
# tests/http/test_schemathesis.py holds the pool to it.
VALID_INPUT_CODES = "x-valid-input-codes"
_ERROR_CODE_HEADER = {
    "description": "The error's code (one of the codes the document's description lists),"
    " on every dialect.",
    "schema": {"type": "string", "enum": sorted(STATUS_BY_CODE)},
}
# Why a status is answered, by status (the codes are STATUS_BY_CODE's).
_WHY: dict[int, str] = {
    400: "The body is not JSON, or a query parameter is out of range",
    401: "No valid bearer token (where tokens are configured)",
    403: "`Host` or `Origin` not allowed, or `X-Tenant-ID` names another tenant than the"
    " key's (`tenant_forbidden`)",
    404: "Unknown model, task, pull or key",
    408: "The body arrived slower than `service.body_timeout_s`",
    409: "The model's state forbids the request (on `/v1/admin/usage`: usage recording is"
    " off, `usage_disabled`)",
    413: "The body is larger than `service.max_body_bytes` (on the audio routes, or the"
    " file than `service.audio.max_bytes`: `audio_too_large`)",
    422: "The body does not match the schema",
    426: "A plain GET of the WebSocket route: upgrade to a WebSocket",
    429: "Tenant over its rate limit (`rate_limit_exceeded`), or a key or tenant past its"
    " token budget (`budget_exceeded`); `Retry-After` set",
}

# -- examples and links ------------------------------------------------------------------
# "{model}" stands for a configured model's name, "{embedding}" for an embedding model's,
# "{pullable}" for one with a `source` to pull from.
_EXAMPLES: dict[tuple[str, str], dict[str, Any]] = {
    ("post", "/v1/responses"): {"model": "{model}", "input": "Say hello."},
    ("post", "/v1/admin/models/{name}/load"): {},
    ("post", "/v1/admin/keys"): {
        "name": "ci-runner",
        "tenant": "team-a",
        "role": "inference",
        "priority": "normal",
        "rate_limit_rpm": 60,
    },
    ("post", "/v1/models/load"): {"modelId": "{model}"},
    ("post", "/v1/models/unload"): {"modelId": "{model}"},
    ("post", "/v1/cache/flush"): {"scope": "model", "modelId": "{model}"},
    ("post", "/v1/chat/completions"): {
        "model": "{model}",
        "messages": [{"role": "user", "content": "Say hello."}],
    },
    ("post", "/v1/completions"): {"model": "{model}", "prompt": "Once upon a time"},
    ("post", "/v1/embeddings"): {"model": "{embedding}", "input": ["hello", "world"]},
    ("post", "/api/chat"): {
        "model": "{model}",
        "messages": [{"role": "user", "content": "Say hello."}],
        "stream": False,
    },
    ("post", "/api/generate"): {"model": "{model}", "prompt": "Say hello.", "stream": False},
    ("post", "/api/embed"): {"model": "{embedding}", "input": ["hello"]},
    ("post", "/api/embeddings"): {"model": "{embedding}", "prompt": "hello"},
    ("post", "/api/show"): {"model": "{model}"},
    ("post", "/api/copy"): {"source": "{model}", "destination": "{model}-copy"},
    ("post", "/api/pull"): {"model": "{pullable}", "stream": False},
    ("delete", "/api/delete"): {"model": "{pullable}"},
    ("post", "/v1/messages"): {
        "model": "{model}",
        "max_tokens": 64,
        "messages": [{"role": "user", "content": "Say hello."}],
    },
    ("post", "/v1/messages/count_tokens"): {
        "model": "{model}",
        "messages": [{"role": "user", "content": "Say hello."}],
    },
    ("post", "/openai/v1/responses"): {"model": "{model}", "input": "Say hello."},
    ("post", "/openai/v1/chat/completions"): {
        "model": "{model}",
        "messages": [{"role": "user", "content": "Say hello."}],
    },
    ("post", "/openai/v1/completions"): {"model": "{model}", "prompt": "Once upon a time"},
    ("post", "/openai/v1/embeddings"): {"model": "{embedding}", "input": ["hello", "world"]},
    # An embedding model answers rerank too (by cosine similarity).
    **{
        ("post", path): {
            "model": "{embedding}",
            "query": "What is the capital of France?",
            "documents": ["Paris is the capital of France.", "Berlin is in Germany."],
        }
        for path in ("/v1/rerank", "/rerank", "/v2/rerank", "/openai/v1/rerank")
    },
    **{
        ("post", path): {
            "model": "{embedding}",
            "text_1": "What is the capital of France?",
            "text_2": ["Paris is the capital of France.", "Berlin is in Germany."],
        }
        for path in ("/v1/score", "/score", "/openai/v1/score")
    },
}
_PATH_EXAMPLES = {"name": "{model}", "model": "{pullable}", "task_id": "0" * 32}
# Query parameters with a closed set of values, and examples: (path, name) -> ...
_QUERY_SCHEMAS: dict[tuple[str, str], dict[str, Any]] = {
    ("/v1/admin/usage", "group_by"): {"enum": ["key", "tenant", "model"], "default": "tenant"},
    ("/v1/admin/usage", "bucket"): {"enum": ["hour", "day"]},
    ("/v1/admin/decisions", "limit"): {"type": "integer", "minimum": 1},
}
_QUERY_EXAMPLES: dict[tuple[str, str], str] = {
    ("/v1/admin/usage", "group_by"): "tenant",
    ("/v1/admin/usage", "since"): "2026-11-01T00:00:00Z",
    ("/v1/admin/usage", "until"): "1798761600",
    ("/v1/admin/usage", "bucket"): "day",
}

# OpenAPI links: the sequences clients run, so a stateful client (schemathesis) follows
# them: operation -> {link name: (target operation, parameters, request body)}.
_LINKS: dict[tuple[str, str], dict[str, tuple[str, dict[str, str], Any]]] = {
    ("post", "/v1/models/load"): {
        "LoadTaskStatus": ("get_v1_models_load_task_id", {"task_id": "$response.body#/taskId"},
                           None),
        "RunnerUnload": ("post_v1_models_unload", {},
                         {"modelId": "$response.body#/modelId"}),
    },
    ("get", "/v1/models/load/{task_id}"): {
        "LoadedRow": ("get_v1_admin_models_name", {"name": "$response.body#/modelId"}, None),
    },
    ("post", "/api/pull"): {
        # (No link to the cancel: the answer comes once the pull is over, and a pull
        # that is over has nothing to cancel: 404.)
        "PullStatus": ("get_api_pull_status_model", {"model": "$response.body#/model"}, None),
    },
    ("get", "/v1/models"): {
        "Respond": ("post_v1_responses", {}, {"model": "$response.body#/data/0/id"}),
        "ChatCompletion": ("post_v1_chat_completions", {},
                           {"model": "$response.body#/data/0/id"}),
        "OllamaChat": ("post_api_chat", {}, {"model": "$response.body#/data/0/id"}),
    },
    ("post", "/v1/admin/keys"): {
        "Revoke": ("delete_v1_admin_keys_name", {"name": "$response.body#/name"}, None),
    },
    ("get", "/v1/admin/models"): {
        "ModelRow": ("get_v1_admin_models_name", {"name": "$response.body#/models/0/name"},
                     None),
    },
    ("post", "/v1/admin/models/{name}/load"): {
        "LoadedRow": ("get_v1_admin_models_name", {"name": "$response.body#/name"}, None),
        "Unload": ("post_v1_admin_models_name_unload", {"name": "$response.body#/name"}, None),
    },
    ("get", "/v1/admin/models/{name}"): {
        "Unload": ("post_v1_admin_models_name_unload", {"name": "$response.body#/name"}, None),
        "Load": ("post_v1_admin_models_name_load", {"name": "$response.body#/name"}, None),
    },
}  # fmt: skip


PLACEHOLDER_MODEL = "my-model"


@dataclass(frozen=True, slots=True)
class Served:
    """What the document says about the pool that serves it.

    Attributes:
        model: a configured model's name, for the examples.
        embedding: a configured embedding model's name (else ``model``).
        pullable: a configured model with a ``source`` (else ``model``).
        inference_open: no token is needed for the inference routes.
        admin_open: no token is needed for the admin routes.
        lifecycle_open: neither the admin token nor a ``verifiedOpToken`` is needed for
            the runner's lifecycle routes.
    """

    model: str = PLACEHOLDER_MODEL
    embedding: str = "my-embedding-model"
    pullable: str = PLACEHOLDER_MODEL
    inference_open: bool = True
    admin_open: bool = True
    lifecycle_open: bool = True


_POOL_ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["code", "message"],
            "properties": {
                "code": {"type": "string", "enum": sorted(STATUS_BY_CODE)},
                "message": {"type": "string"},
            },
            "additionalProperties": True,
        }
    },
}
_ERROR_MODELS: dict[ErrorShape, type[BaseModel] | None] = {
    "pool": None,
    "openai": OpenAIError,
    "ollama": OllamaError,
    "anthropic": MessagesError,
}
# One event of a Server-Sent Events answer, as a client parses it; `data` is JSON unless
# it is OpenAI's closing `[DONE]`.
_SSE_EVENT: dict[str, Any] = {
    "type": "object",
    "properties": {
        "event": {"type": "string"},
        "data": {"type": "string"},
        "id": {"type": "string"},
        "retry": {"type": "integer"},
    },
}


# The media-type extension that names the model of one streamed event's JSON, for SSE and
# NDJSON alike (OpenAPI 3.1 has no item schema for a stream; 3.2's ``itemSchema`` is it).
STREAM_EVENTS = "x-stream-events"


# The streams whose last event (when nothing failed) is ``data: [DONE]``, as OpenAI's.
_ENDS_WITH_DONE: set[type[BaseModel]] = {ChatCompletionStreamEvent, TextCompletionStreamEvent}


def _stream_media(route: Route, keyed: dict[Any, Any]) -> dict[str, Any]:
    """The streamed answer's media type: an SSE event whose ``data`` is JSON of the
    route's event model (``contentSchema``), or NDJSON lines of it."""
    events = None if route.events is None else keyed[(route.events, "serialization")]
    if route.stream == SSE:
        schema: dict[str, Any] = dict(_SSE_EVENT)
        if events is not None:
            data: dict[str, Any] = {
                "type": "string",
                "description": "The event's JSON.",
                "contentMediaType": "application/json",
                "contentSchema": events,
            }
            if route.events in _ENDS_WITH_DONE:
                data = {
                    "description": "The event's JSON, or `[DONE]`: the end of a stream that"
                    " did not fail.",
                    "anyOf": [{"const": "[DONE]"}, data],
                }
            schema["properties"] = {**_SSE_EVENT["properties"], "data": data}
    else:
        schema = {"type": "string", "description": "one JSON object a line"}
    media: dict[str, Any] = {"schema": schema}
    if events is not None:
        media[STREAM_EVENTS] = events
    return media


# Anthropic's clients authenticate with x-api-key and name the API version they speak.
_ANTHROPIC_HEADERS: list[dict[str, Any]] = [
    {
        "name": "x-api-key",
        "in": "header",
        "required": False,
        "description": "An inference token, as `Authorization: Bearer` takes (either one).",
        "schema": {"type": "string"},
    },
    {
        "name": "anthropic-version",
        "in": "header",
        "required": False,
        "description": "Accepted and not needed.",
        "schema": {"type": "string"},
    },
]


def _ref(name: str) -> dict[str, Any]:
    return {"$ref": f"#/components/schemas/{name}"}


def _error_schema(shape: ErrorShape) -> dict[str, Any]:
    model = _ERROR_MODELS[shape]
    return _ref("Error" if model is None else model.__name__)


def _operation_id(route: Route) -> str:
    """``get_v1_admin_models_name``; ``get_root`` for ``/``, ``get_ui_index`` for ``/ui/``."""
    words = re.findall(r"[A-Za-z0-9]+", route.path) or ["root"]
    if route.path != "/" and route.path.endswith("/"):
        words.append("index")  # apart from the same path without the slash
    return "_".join([route.method, *words])


def _filled(value: Any, served: Served) -> Any:
    """``value`` with ``{model}`` and ``{embedding}`` replaced by configured names."""
    if isinstance(value, str):
        for placeholder, name in (
            ("{model}", served.model),
            ("{embedding}", served.embedding),
            ("{pullable}", served.pullable),
        ):
            value = value.replace(placeholder, name)
        return value
    if isinstance(value, dict):
        return {k: _filled(v, served) for k, v in value.items()}
    if isinstance(value, list):
        return [_filled(v, served) for v in value]
    return value


def _listed_refusals(route: Route) -> tuple[int, ...]:
    if route.refusals is not None:
        return route.refusals
    if route.request is not None:
        return _DEFAULT_BODY_REFUSALS
    return (404,) if "{" in route.path else ()


def _refusal_statuses(route: Route) -> list[int]:
    """Every 4xx status ``route`` can answer, in order."""
    statuses = set(_listed_refusals(route))
    statuses.add(403)
    if _access(route) is not None:
        statuses.add(401)
    if route.request is not None:
        # Not JSON (400); too slow or too large (408, 413); not the schema (422; 400 on
        # the Ollama routes, as Ollama answers).
        statuses |= {400, 408, 413, 400 if route.errors == "ollama" else 422}
    elif route.query:
        statuses.add(400)  # a query parameter out of its range
    statuses.discard(route.status)
    return sorted(statuses)


def _security(route: Route, served: Served) -> list[dict[str, list[str]]]:
    access = _access(route)
    if access is None:
        return []
    if access == "inference":
        required: list[dict[str, list[str]]] = [{"inferenceToken": []}, {"adminToken": []}]
        if route.errors == "anthropic":
            required.append({"apiKey": []})
        open_now = served.inference_open
    else:
        required = [{"adminToken": []}]
        open_now = served.admin_open if access == "admin" else served.lifecycle_open
    # A pool without tokens serves everyone: the empty requirement says so.
    return [*required, {}] if open_now else required


def _overrides_by_backend() -> str:
    """Which load-override fields each backend takes: the body's schema is all of them
    together, and a model refuses another backend's fields (400)."""
    from pool.backends import backend_names, get_backend

    lines = []
    for name in backend_names():
        fields = ", ".join(f"`{f}`" for f in get_backend(name).load_overrides.model_fields)
        lines.append(f"- `{name}`: {fields or 'none'}")
    return (
        "\n\nThe schema is every backend's override fields together; a model takes only"
        " its backend's (and `replicas`), another's is a 400 `invalid_load_request` naming"
        " the `field`:\n" + "\n".join(lines)
    )


# Text added to an operation's description when the document is built.
_MORE: dict[tuple[str, str], Callable[[], str]] = {
    ("post", "/v1/admin/models/{name}/load"): _overrides_by_backend,
    ("post", "/v1/models/load"): lambda: (
        "\n\n`overrides` is the admin load body: see `POST /v1/admin/models/{name}/load`"
        " for the fields each backend takes."
    ),
}


# The routes that run a model: their answers carry the X-RateLimit-* headers of a tenant
# with a request limit (pool/http/_common.py, rate_limit_headers).
_DIALECTS = ("inference", "openai", "rerank", "anthropic", "ollama")
_RUN_NO_MODEL = {"/api/pull", "/api/copy", "/api/show"}
_RATE_LIMIT_HEADERS = {
    "X-RateLimit-Limit": {
        "description": "The tenant's requests per minute (a tenant with a request limit).",
        "schema": {"type": "string"},
    },
    "X-RateLimit-Remaining": {
        "description": "Requests that would be admitted now, this one counted.",
        "schema": {"type": "string"},
    },
    "X-RateLimit-Reset": {
        "description": "Unix time at which the full burst is available again.",
        "schema": {"type": "string"},
    },
}


def runs_a_model(route: Route) -> bool:
    """Whether ``route`` is an inference route (one that runs a model for a tenant)."""
    return route.method == "post" and route.tag in _DIALECTS and route.path not in _RUN_NO_MODEL


# Inference POSTs that never reach a model (so never carry a request span's header).
_NOT_ADMITTED = {"/api/show", "/v1/messages/count_tokens"}
_TRACE_HEADER = {
    "description": 'Where the pool traces (docs/operations.md, "Tracing"): the W3C'
    " `traceparent` of this request's span, `00-<trace id>-<span id>-<flags>`.",
    "schema": {"type": "string", "pattern": "^00-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}$"},
}


def _traced(route: Route) -> bool:
    """Whether the route's answer carries ``traceparent`` where the pool traces."""
    return (
        route.method == "post" and _access(route) == "inference" and route.path not in _NOT_ADMITTED
    )


def _operation(route: Route, keyed: dict[Any, Any], served: Served) -> dict[str, Any]:
    key = (route.method, route.path)
    more = _MORE.get(key)
    success: dict[str, Any] = {"description": "Success"}
    if _traced(route):
        success["headers"] = {"traceparent": _TRACE_HEADER}
    content: dict[str, Any] = {}
    if route.reply is not None:
        content["application/json"] = {"schema": keyed[(route.reply, "serialization")]}
    if route.stream is not None:
        content[route.stream] = _stream_media(route, keyed)
    if route.text is not None:
        media_type, schema = route.text
        content[media_type] = {"schema": _SSE_EVENT if media_type == SSE else schema}
    for media_type, schema in route.media:
        content[media_type] = {"schema": schema}
    if content:
        success["content"] = content
    valid_input_codes = list(route.valid_input_codes)
    if route.status == 400:
        success[VALID_INPUT_CODES] = valid_input_codes  # /api/copy: refused, whatever the body
    if route.status == 101:
        success["description"] = "Switching Protocols: the WebSocket is open"
    elif route.status == 308:
        success["headers"] = {"Location": {"schema": {"type": "string"}}}
    if runs_a_model(route):
        success["headers"] = dict(_RATE_LIMIT_HEADERS)
    responses: dict[str, Any] = {str(route.status): success}
    error = {"application/json": {"schema": _error_schema(route.errors)}}
    for status in _refusal_statuses(route):
        answer: dict[str, Any] = {
            "description": _WHY[status],
            "headers": {"X-Error-Code": _ERROR_CODE_HEADER},
            "content": error,
        }
        if status == 400 and valid_input_codes:
            answer["description"] += (
                ", or the model it names, its backend, the pool's settings or its state"
                " refuse a valid request: "
                + ", ".join(f"`{code}`" for code in valid_input_codes)
                + " (`X-Error-Code`)"
            )
            answer[VALID_INPUT_CODES] = valid_input_codes
        if status == 426:
            answer["headers"]["Upgrade"] = {"schema": {"const": "websocket"}, "required": True}
        elif status == 429:
            answer["headers"]["Retry-After"] = {"schema": {"type": "string"}, "required": True}
            if runs_a_model(route):
                answer["headers"].update(_RATE_LIMIT_HEADERS)
        responses[str(status)] = answer
    if route.reply is not None and route.unavailable_reply:
        responses["503"] = {
            "description": "Unhealthy (or, on /health, degraded by a GPU out of memory or a"
            " saturated queue): the same body as a success",
            "content": {"application/json": {"schema": keyed[(route.reply, "serialization")]}},
        }
    responses["5XX"] = {
        "description": "Load failure, backend error, queue full, shutting down or timeout"
        " (`Retry-After` on 503)",
        "content": error,
    }
    operation: dict[str, Any] = {
        "tags": [route.tag],
        "summary": route.summary,
        "description": route.description + (more() if more is not None else ""),
        "operationId": _operation_id(route),
        "security": _security(route, served),
        "responses": responses,
    }
    if route.request is not None:
        media: dict[str, Any] = {"schema": keyed[(route.request, "validation")]}
        example = _EXAMPLES.get(key)
        if example is not None:
            media["example"] = _filled(example, served)
        operation["requestBody"] = {
            "required": route.body_required,
            "content": {route.request_media: media},
        }
    parameters = [
        {
            "name": name,
            "in": "path",
            "required": True,
            "schema": {"type": "string", "minLength": 1},
            "example": _filled(_PATH_EXAMPLES.get(name, "x"), served),
        }
        for name in (p.strip("{}") for p in route.path.split("/") if p.startswith("{"))
    ]
    if route.errors == "anthropic":
        parameters += _ANTHROPIC_HEADERS
    parameters += [
        {
            "name": name,
            "in": "query",
            "required": False,
            "schema": kind
            if isinstance(kind, dict)
            else _QUERY_SCHEMAS.get((route.path, name), {"type": kind}),
            "description": text,
            **(
                {"example": _QUERY_EXAMPLES[(route.path, name)]}
                if (route.path, name) in _QUERY_EXAMPLES
                else {}
            ),
        }
        for name, kind, text in route.query
    ]
    if parameters:
        operation["parameters"] = parameters
    links = _LINKS.get(key)
    if links:
        target: dict[str, Any] = {}
        for name, (operation_id, parameters_of, body) in links.items():
            link: dict[str, Any] = {"operationId": operation_id}
            if parameters_of:
                link["parameters"] = parameters_of
            if body is not None:
                link["requestBody"] = body
            target[name] = link
        success["links"] = target
    return operation


def openapi_document(
    extra_routes: list[Route] | None = None, served: Served | None = None
) -> dict[str, Any]:
    """The document; ``served`` names the serving pool's models in the examples and says
    which routes it leaves open (default: placeholder names, no tokens)."""
    served = served or Served()
    routes = ROUTES + (extra_routes or [])
    requests = {r.request for r in routes if r.request is not None}
    replies = {r.reply for r in routes if r.reply is not None}
    replies |= {r.events for r in routes if r.events is not None}
    replies |= {m for m in _ERROR_MODELS.values() if m is not None}
    keyed, schema = models_json_schema(
        [(m, "validation") for m in sorted(requests, key=lambda m: m.__name__)]
        + [(m, "serialization") for m in sorted(replies, key=lambda m: m.__name__)],
        ref_template="#/components/schemas/{model}",
    )
    components = with_components(schema.get("$defs", {}))
    components["Error"] = _POOL_ERROR
    states = "\n".join(f"- `{k}`: {v}" for k, v in STATE_DESCRIPTIONS.items())
    paths: dict[str, Any] = {}
    for route in routes:
        paths.setdefault(route.path, {})[route.method] = _operation(route, keyed, served)
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "llm-pool",
            "version": __version__,
            "description": "One HTTP API in front of many local LLM runtimes.\n\nRuntime states:\n"
            + states
            + "\n\nEvery route and the WebSocket handshake first check `Host` (and a browser's"
            " `Origin`) against the bound address, `localhost`, `127.0.0.1`, `[::1]` and"
            " `service.allowed_hosts`: others get 403 `host_not_allowed` / `origin_not_allowed`."
            " Then the bearer token, where tokens are configured (each operation's `security`;"
            " an empty requirement where this pool needs none): 401 `unauthorized` comes"
            " before anything about the body. A method a route does not serve is 405 with"
            " `Allow`."
            '\n\nWhere the pool traces (OpenTelemetry; docs/operations.md, "Tracing"), an'
            " inference request's W3C `traceparent` and `tracestate` request headers make its"
            " span a child of the caller's, and the answer's `traceparent` header names the"
            " request's own span."
            + '\n\nErrors are `{"error": {"code", "message"}}` (OpenAI\'s error object on the'
            ' OpenAI routes, `{"error": message}` on the Ollama routes, Anthropic\'s'
            ' `{"type": "error", "error": {"type", "message"}}` on `/v1/messages`); a full'
            " queue (503), a rate limit and a spent budget (429) carry `Retry-After`. Codes and"
            " statuses: "
            + ", ".join(
                f"`{c}` {s}" for c, s in sorted(STATUS_BY_CODE.items(), key=lambda x: x[1])
            ),
        },
        "paths": paths,
        "components": {"schemas": components, "securitySchemes": _SECURITY_SCHEMES},
    }


def docs_page(document: dict[str, Any]) -> str:
    """A self-contained page listing every endpoint (no CDN: this may run offline)."""
    rows = []
    for path, methods in document["paths"].items():
        for method, op in methods.items():
            rows.append(
                f"<h3><code>{method.upper()} {html.escape(path)}</code>"
                f" — {html.escape(op['summary'])}</h3>"
                f"<p>{html.escape(op['description'])}</p>"
            )
    info = document["info"]
    return (
        "<!doctype html><html><head><meta charset='utf-8'><title>llm-pool API</title>"
        "<style>body{font-family:sans-serif;max-width:60em;margin:2em auto;line-height:1.4}"
        "code{background:#eee;padding:0 .2em}</style></head><body>"
        f"<h1>llm-pool {html.escape(info['version'])}</h1>"
        f"<pre style='white-space:pre-wrap'>{html.escape(info['description'])}</pre>"
        "<p>Machine-readable: <a href='/openapi.json'>/openapi.json</a></p>"
        + "".join(rows)
        + "</body></html>"
    )
