"""The OpenAPI document, generated from the pydantic models, and a small docs page."""

from __future__ import annotations

import html
from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from pool._version import __version__
from pool.actors import STATE_DESCRIPTIONS
from pool.config import LoadRequest
from pool.errors import STATUS_BY_CODE
from pool.schemas import (
    CacheFlushRequest,
    ChatCompletionRequest,
    CompletionRequest,
    EmbeddingsRequest,
    OllamaChatRequest,
    OllamaCopyRequest,
    OllamaEmbeddingsRequest,
    OllamaEmbedRequest,
    OllamaGenerateRequest,
    OllamaModelRequest,
    ResponseEnvelope,
    ResponseRequest,
    RunnerLoadRequest,
    RunnerUnloadRequest,
)

# (method, path, tag, summary, description, request model, success status)
ROUTES: list[tuple[str, str, str, str, str, type[BaseModel] | None, int]] = [
    ("post", "/v1/responses", "inference", "Run a request",
     "`stream: false` answers one response envelope. `stream: true` answers Server-Sent Events:"
     " `response.created`, one `response.output_text.delta` per generated piece,"
     " `response.metrics`, `response.completed`; an error after the stream started is an"
     " `error` event. The same path accepts a WebSocket: send request bodies as JSON text"
     " frames (one at a time), receive the same events as frames; send"
     " `{\"type\": \"response.cancel\"}` to cancel the running one (`response.cancelled`)."
     " Headers: `X-Tenant-ID`, `X-Priority` (high/normal/low), `X-Cache-Mode` (prefix/auto"
     " reuse the scope's cached prefix, none reuses nothing), `X-Cache-Tag` (cached state is"
     " shared only within one tenant and tag); responses carry `X-Request-Id`,"
     " `X-Queue-Wait-Ms`, `X-GPU-Time-Ms`, `X-Cache-Hit`, `X-Cache-Tokens-Reused` (prompt"
     " tokens the runtime reused; on a stream, only `metrics.engine_cached_prompt_tokens`"
     " knows). Images are inlined before queueing: `data:` URLs always,"
     " `file://` only under `service.media_dirs`, `http(s)` only with `service.media_fetch`"
     " and from public addresses; a refusal is 400 `image_refused` with a `reason`.",
     ResponseRequest, 200),
    ("get", "/v1/models", "inference", "List servable models",
     "OpenAI list format of the model ids that accept requests now: loaded models and"
     " on-demand models.", None, 200),
    ("get", "/v1/admin/models", "admin", "List configured models",
     "Every model of the merged config with its runtime state, queue and replica figures,"
     " VRAM (`vram_estimate_mib` and its `vram_estimate_source`: configured_vram_mb,"
     " observed_load_delta, artifact_metadata, model_artifact_size, name_heuristic or"
     " unavailable; `observed_load_delta`: MiB the current load was measured to take, null"
     " when none; `gpus`: the GPU of each replica), capabilities, load constraints and"
     " recommendations, load override and definition.",
     None, 200),
    ("get", "/v1/admin/models/{name}", "admin", "One model's row", "As in the list.", None, 200),
    ("post", "/v1/admin/models/{name}/load", "admin", "Load a model",
     "Optional body: `replicas` and the backend's live-only load overrides (see the row's"
     " `load_constraints`). Answers when the load has finished: 200 with the row, or 500"
     " `load_failed` with `last_error`. On GPUs the load must fit its VRAM budget: idle"
     " models it may evict (docs/vram.md) are unloaded first, else 500 `load_failed` at"
     " once. Idempotent while loaded or loading (overrides then"
     " give 400); 409 `model_unloading` while unloading. A schema failure is 422, a value the"
     " backend does not accept is 400 `invalid_load_request`.", LoadRequest, 200),
    ("post", "/v1/admin/models/{name}/unload", "admin", "Unload a model",
     "Graceful: new requests are refused at once, queued ones get `model_unloading`, running"
     " ones finish (within `engine.unload_drain_s`; past it they end with `model_unloading`),"
     " then the runtime is released. 200 if already unloaded.", None, 200),
    ("get", "/v1/admin/gpu-memory", "admin", "GPU memory and VRAM estimates",
     "NVML readings per GPU (or the virtual GPUs of `engine.gpu_budget_mib`) and each"
     " model's VRAM estimate, measured delta and GPUs; with no GPU, `gpus` is empty and"
     " `error` says why.", None, 200),
    ("get", "/v1/capabilities", "runner", "Runner descriptor",
     "Loaded, loading and available models, resources, queue figures (average and p95 wait"
     " over a recent window), capability flags and health.", None, 200),
    ("post", "/v1/models/load", "runner", "Start an asynchronous load",
     "202 with a task id; `evictModel` is unloaded first. Needs the admin token or a"
     " `verifiedOpToken` where configured.", RunnerLoadRequest, 202),
    ("get", "/v1/models/load/{taskId}", "runner", "Load task status",
     "`loading`, `completed` or `failed`, with `loadTimeMs`.", None, 200),
    ("post", "/v1/models/unload", "runner", "Unload (runner API)", "Graceful unload.",
     RunnerUnloadRequest, 200),
    ("post", "/v1/cache/flush", "runner", "Flush prompt caches",
     "Scopes `all`, `model` (`modelId`), `tenant` (`tenantId`, narrowed by `tag`) and `tag`"
     " (`tag`, narrowed by `tenantId`); `modelId` narrows any scope. Answers the entries"
     " removed (saved states, llama-server slots, vLLM salt scopes) and the memory freed;"
     " backends without a prompt cache report 0.",
     CacheFlushRequest, 200),
    ("post", "/v1/chat/completions", "openai", "Chat Completions (OpenAI)",
     "OpenAI's Chat Completions, plain or streamed (`stream_options.include_usage`). Prefix"
     " cache headers as `/v1/responses`; `usage.prompt_tokens_details.cached_tokens` counts"
     " the prompt tokens the runtime reused. Sampling"
     " fields a model's backend cannot honour (`min_p`, `seed`, penalties, `logit_bias`) are"
     " a 400 `sampling_unsupported`; `keep_alive` as on Ollama's routes. An embedding model"
     " answers 400 `generation_unsupported`.", ChatCompletionRequest, 200),
    ("post", "/v1/completions", "openai", "Completions (OpenAI, legacy)",
     "One choice per prompt (`prompt` a string or a list); `stream: true` (one prompt) answers"
     " `text_completion` chunks as Server-Sent Events, then `data: [DONE]`. `max_tokens`"
     " defaults to 16 as in OpenAI's API; `echo` must be false; `logprobs` is a 400"
     " `logprobs_unsupported`. The prompt is one user turn rendered by the model's prompt"
     " format. Headers as `/v1/responses` (`X-Queue-Wait-Ms`, `X-GPU-Time-Ms`, ...).",
     CompletionRequest, 200),
    ("post", "/v1/embeddings", "openai", "Embeddings (OpenAI)",
     "One vector per input, in order, for a model with `embedding: true`; `encoding_format`"
     " `float` or `base64` (little-endian float32); `dimensions` only where the model can"
     " shorten its vectors (else 400). The inputs go through the same queue, replicas,"
     " tenant limits and on-demand loads as generation; a generation model answers 400"
     " `embeddings_unsupported`.", EmbeddingsRequest, 200),
    ("post", "/api/chat", "ollama", "Chat (Ollama)",
     "NDJSON stream by default; no messages loads the model (`keep_alive: 0` unloads).",
     OllamaChatRequest, 200),
    ("post", "/api/generate", "ollama", "Generate (Ollama)",
     "One prompt; NDJSON stream by default; an empty prompt loads the model.",
     OllamaGenerateRequest, 200),
    ("post", "/api/embed", "ollama", "Embed (Ollama)",
     "`embeddings`: one L2-normalized vector per input.", OllamaEmbedRequest, 200),
    ("post", "/api/embeddings", "ollama", "Embeddings (Ollama, older)",
     "`embedding`: the vector of one `prompt`.", OllamaEmbeddingsRequest, 200),
    ("get", "/api/tags", "ollama", "List models (Ollama)",
     "Every configured (and pulled) model: `loaded`, the artifact's `modified_at`, `size` and"
     " SHA-256 `digest` (a model without a file: the settings file's mtime and the digest of"
     " its definition).", None, 200),
    ("get", "/api/ps", "ollama", "Loaded models (Ollama)",
     "As `/api/tags`, loaded models only, with `expires_at` and `size_vram`.", None, 200),
    ("post", "/api/show", "ollama", "Show a model (Ollama)",
     "Template (the pool's prompt format), parameters (decoding defaults), capabilities"
     " (`completion` or `embedding`, `thinking`, `vision`), details and the definition.",
     OllamaModelRequest, 200),
    ("post", "/api/copy", "ollama", "Copy a model (Ollama): refused",
     "Always 400 `copy_unsupported` (404 for an unknown source): model names come from the"
     " settings files; add an entry there instead.", OllamaCopyRequest, 200),
    ("get", "/", "ollama", "Ollama probe", "`Ollama is running` (text/plain); HEAD too.",
     None, 200),
    ("get", "/health", "operations", "Health",
     "200 while serving; 503 with `reason` when every model failed or on shutdown.", None, 200),
    ("get", "/metrics", "operations", "Prometheus metrics", "Text exposition format.", None, 200),
]  # fmt: skip

_VECTOR: dict[str, Any] = {"type": "array", "items": {"type": "number"}}
_USAGE: dict[str, Any] = {
    "type": "object",
    "properties": {
        k: {"type": "integer"} for k in ("prompt_tokens", "completion_tokens", "total_tokens")
    },
}
_TAG: dict[str, Any] = {
    "type": "object",
    "required": ["name", "model", "modified_at", "size", "digest", "loaded"],
    "properties": {
        "name": {"type": "string"},
        "model": {"type": "string"},
        "modified_at": {"type": "string", "format": "date-time"},
        "size": {"type": "integer"},
        "digest": {"type": "string"},
        "loaded": {"type": "boolean"},
        "details": {"type": "object"},
        "expires_at": {"type": "string", "format": "date-time", "description": "/api/ps"},
        "size_vram": {"type": "integer", "description": "/api/ps"},
    },
}


def _json(schema: dict[str, Any]) -> dict[str, Any]:
    return {"application/json": {"schema": schema}}


def _object(**properties: Any) -> dict[str, Any]:
    return {"type": "object", "required": list(properties), "properties": properties}


_CHOICES_COMPLETION = _object(
    id={"type": "string"},
    object={"const": "text_completion"},
    created={"type": "integer"},
    model={"type": "string"},
    choices={
        "type": "array",
        "items": _object(
            text={"type": "string"},
            index={"type": "integer"},
            logprobs={"type": "null"},
            finish_reason={"type": ["string", "null"], "enum": ["stop", "length", None]},
        ),
    },
    usage=_USAGE,
)
# The success bodies of the routes whose request models live in pool.schemas.
RESPONSE_SCHEMAS: dict[str, dict[str, Any]] = {
    "/v1/embeddings": _json(
        _object(
            object={"const": "list"},
            data={
                "type": "array",
                "items": _object(
                    object={"const": "embedding"},
                    index={"type": "integer"},
                    embedding={"oneOf": [_VECTOR, {"type": "string", "contentEncoding": "base64"}]},
                ),
            },
            model={"type": "string"},
            usage=_USAGE,
        )
    ),
    "/v1/completions": _json(_CHOICES_COMPLETION)
    | {"text/event-stream": {"schema": {"type": "string"}}},
    "/v1/chat/completions": _json({"type": "object", "description": "OpenAI chat.completion"})
    | {"text/event-stream": {"schema": {"type": "string"}}},
    "/api/embed": _json(
        _object(
            model={"type": "string"},
            embeddings={"type": "array", "items": _VECTOR},
            total_duration={"type": "integer"},
            load_duration={"type": "integer"},
            prompt_eval_count={"type": "integer"},
        )
    ),
    "/api/embeddings": _json(_object(embedding=_VECTOR)),
    "/api/tags": _json(_object(models={"type": "array", "items": _TAG})),
    "/api/ps": _json(_object(models={"type": "array", "items": _TAG})),
    "/api/show": _json(
        _object(
            template={"type": "string"},
            parameters={"type": "string"},
            capabilities={
                "type": "array",
                "items": {"enum": ["completion", "embedding", "thinking", "vision"]},
            },
            details={"type": "object"},
            model_info={"type": "object"},
            modified_at={"type": "string", "format": "date-time"},
        )
    ),
    "/": {"text/plain": {"schema": {"const": "Ollama is running"}}},
}

_ERROR_SCHEMA = {
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


def openapi_document(
    extra_routes: list[tuple[str, str, str, str, str, type[BaseModel] | None, int]] | None = None,
) -> dict[str, Any]:
    routes = ROUTES + (extra_routes or [])
    models = {m for *_, m, _ in routes if m is not None} | {ResponseEnvelope}
    keyed, schema = models_json_schema(
        [(m, "validation") for m in sorted(models, key=lambda m: m.__name__)],
        ref_template="#/components/schemas/{model}",
    )
    components = dict(schema.get("$defs", {}))
    components["Error"] = _ERROR_SCHEMA
    states = "\n".join(f"- `{k}`: {v}" for k, v in STATE_DESCRIPTIONS.items())
    paths: dict[str, Any] = {}
    for method, path, tag, summary, description, model, status in routes:
        operation: dict[str, Any] = {
            "tags": [tag],
            "summary": summary,
            "description": description,
            "responses": {
                str(status): {"description": "Success"},
                "4XX": {
                    "description": "Client error (see the error codes)",
                    "content": {
                        "application/json": {"schema": {"$ref": "#/components/schemas/Error"}}
                    },
                },
                "5XX": {
                    "description": "Load failure, queue full or timeout",
                    "content": {
                        "application/json": {"schema": {"$ref": "#/components/schemas/Error"}}
                    },
                },
            },
        }
        if path == "/v1/responses":
            operation["responses"]["200"]["content"] = {
                "application/json": {"schema": {"$ref": "#/components/schemas/ResponseEnvelope"}},
                "text/event-stream": {"schema": {"type": "string"}},
            }
        elif path in RESPONSE_SCHEMAS:
            operation["responses"][str(status)]["content"] = RESPONSE_SCHEMAS[path]
        if model is not None:
            operation["requestBody"] = {
                "required": model is not LoadRequest,
                "content": {"application/json": {"schema": keyed[(model, "validation")]}},
            }
        parameters = [
            {"name": p.strip("{}"), "in": "path", "required": True, "schema": {"type": "string"}}
            for p in path.split("/")
            if p.startswith("{")
        ]
        if parameters:
            operation["parameters"] = parameters
        paths.setdefault(path, {})[method] = operation
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
            + '\n\nErrors are `{"error": {"code", "message"}}`; codes and statuses: '
            + ", ".join(
                f"`{c}` {s}" for c, s in sorted(STATUS_BY_CODE.items(), key=lambda x: x[1])
            ),
        },
        "paths": paths,
        "components": {"schemas": components},
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
