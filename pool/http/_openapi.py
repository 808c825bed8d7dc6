"""The OpenAPI document, generated from the pydantic models, and a small docs page.

Every route the app serves has a :class:`Route` here: its request model (for a route
that takes a body) and the model of its success body, or the media type of a text
answer. tests/http/test_openapi.py checks the list against the app's URL map, validates
the document, and validates real answers against the response schemas.
"""

from __future__ import annotations

import html
import re
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from pool._version import __version__
from pool.actors import STATE_DESCRIPTIONS
from pool.backends import LoadRequest
from pool.errors import STATUS_BY_CODE
from pool.schemas import (
    CacheFlushed,
    CacheFlushRequest,
    ChatCompletion,
    ChatCompletionRequest,
    CompletionRequest,
    Decisions,
    EmbeddingList,
    EmbeddingsRequest,
    Empty,
    GpuMemory,
    Health,
    LoadAnswer,
    LoadTaskState,
    ModelList,
    ModelRow,
    ModelRows,
    OllamaChatReply,
    OllamaChatRequest,
    OllamaCopyRequest,
    OllamaEmbeddingsReply,
    OllamaEmbeddingsRequest,
    OllamaEmbedReply,
    OllamaEmbedRequest,
    OllamaError,
    OllamaGenerateReply,
    OllamaGenerateRequest,
    OllamaModelRequest,
    OllamaRunning,
    OllamaShowReply,
    OllamaTags,
    OllamaVersion,
    OpenAIError,
    PullCancelled,
    PullState,
    ResponseEnvelope,
    ResponseRequest,
    RunnerDescriptor,
    RunnerLoadRequest,
    RunnerUnloaded,
    RunnerUnloadRequest,
    TextCompletion,
)

ErrorShape = Literal["pool", "openai", "ollama"]
SSE = "text/event-stream"
NDJSON = "application/x-ndjson"


@dataclass(frozen=True, slots=True)
class Route:
    """One operation of the document.

    Attributes:
        request: the JSON body's model; None for a route without a body.
        status: the success status.
        reply: the model of the success body (JSON); None for a text answer or none.
        text: the media type of a success body that is not JSON, and its schema.
        stream: the media type of the streamed answer (``stream: true``), whose events or
            lines are ``reply``-shaped unless ``stream_note`` says otherwise.
        errors: the error body of this surface: the pool's, OpenAI's or Ollama's.
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
    stream: str | None = None
    errors: ErrorShape = "pool"
    body_required: bool = True
    # Query parameters: (name, JSON type, description).
    query: tuple[tuple[str, str, str], ...] = ()


_PLAIN = ("text/plain", {"type": "string"})
ROUTES: list[Route] = [
    Route("post", "/v1/responses", "inference", "Run a request",
     "`stream: false` answers one response envelope. `stream: true` answers Server-Sent Events:"
     " `response.created`, one `response.output_text.delta` per generated piece,"
     " `response.metrics`, `response.completed`; an error after the stream started is an"
     " `error` event. A request that waits for VRAM or a load (an on-demand model not"
     " loaded yet) streams at once and shows the wait before the first delta:"
     " `response.queued` (`position`, `waiting_for`: vram/load/replica) and"
     " `response.loading` (`progress` 0..1, null where unknown); its timeout is then an"
     " `error` event. `queue_timeout` errors carry `waiting_for`. The same path accepts a"
     " WebSocket (see `GET /v1/responses`)."
     " Headers: `X-Tenant-ID`, `X-Priority` (high/normal/low), `X-Cache-Mode` (prefix/auto"
     " reuse the scope's cached prefix, none reuses nothing), `X-Cache-Tag` (cached state is"
     " shared only within one tenant and tag); responses carry `X-Request-Id`,"
     " `X-Queue-Wait-Ms`, `X-GPU-Time-Ms`, `X-Cache-Hit`, `X-Cache-Tokens-Reused` (prompt"
     " tokens the runtime reused; on a stream, only `metrics.engine_cached_prompt_tokens`"
     " knows). Images are inlined before queueing: `data:` URLs always,"
     " `file://` only under `service.media_dirs`, `http(s)` only with `service.media_fetch`"
     " and from public addresses; a refusal is 400 `image_refused` with a `reason`."
     " Function tools (`tools`, `tool_choice`; `function_call`/`function_call_output` items in"
     " `messages`) answer `function_call` output items (streamed as"
     " `response.output_item.added` and `response.function_call_arguments.delta`/`.done`);"
     " `text.format` constrains the reply to JSON.",
     ResponseRequest, reply=ResponseEnvelope, stream=SSE),
    Route("get", "/v1/responses", "inference", "Run requests over a WebSocket",
     "The WebSocket handshake (`Upgrade: websocket`, answered 101). Send request bodies"
     " (`ResponseRequest`) as JSON text frames, one at a time; receive the events of"
     " `stream: true` as frames; send `{\"type\": \"response.cancel\"}` to cancel the running"
     " one (`response.cancelled`).", status=101),
    Route("get", "/v1/models", "inference", "List servable models",
     "OpenAI list format of the model ids that accept requests now: loaded models,"
     " on-demand models and models the pool evicted (a request loads them again). In a"
     " cluster (`engine.cluster`, docs/cluster.md) the peers'"
     " models too, each entry with `nodes`: the nodes that have it loaded.", reply=ModelList),
    Route("get", "/v1/admin/models", "admin", "List configured models",
     "Every model of the merged config with its runtime state, queue and replica figures,"
     " VRAM (`vram_estimate_mib` and its `vram_estimate_source`: configured_vram_mb,"
     " observed_load_delta, artifact_metadata, model_artifact_size, name_heuristic or"
     " unavailable; `observed_load_delta`: MiB the current load was measured to take, null"
     " when none; `gpus`: the GPUs of each replica, `gpu_split_mib`: the MiB planned on"
     " each of them), `unload_reason` (why it is unloaded: `evicted` by the pool, so its"
     " next request loads it again; `requested`; `keep_alive`), capabilities, load"
     " constraints and"
     " recommendations, load override and definition. In a cluster, `cluster` lists every"
     " peer's models (`node`, `name`, `state`, `replicas`, `in_flight`, `queue_depth`,"
     " `on_demand`, `vram_mib`).", reply=ModelRows),
    Route("get", "/v1/admin/models/{name}", "admin", "One model's row", "As in the list.",
     reply=ModelRow),
    Route("post", "/v1/admin/models/{name}/load", "admin", "Load a model",
     "Optional body: `replicas` and the backend's live-only load overrides (see the row's"
     " `load_constraints`). Answers when the load has finished: 200 with the row, or 500"
     " `load_failed` with `last_error`. On GPUs the load must fit its VRAM budget: idle"
     " models it may evict (docs/vram.md) are unloaded first, else 500 `load_failed` at"
     " once. Idempotent while loaded or loading (overrides then"
     " give 400); 409 `model_unloading` while unloading. A schema failure is 422, a value the"
     " backend does not accept is 400 `invalid_load_request`. With `dry_run=true` nothing"
     " changes: 200 with what the load would do now (`LoadPreview`: `fits`, `gpus` and"
     " `gpu_split_mib` per replica, the models it would `evict`, what it would `wait_for`,"
     " `expected_load_s` from measurements, and the `error` with its `reason` it would"
     " answer).", LoadRequest, reply=LoadAnswer, body_required=False,
     query=(("dry_run", "boolean", "Answer what the load would do, changing nothing."),)),
    Route("post", "/v1/admin/models/{name}/unload", "admin", "Unload a model",
     "Graceful: new requests are refused at once, queued ones get `model_unloading`, running"
     " ones finish (within `engine.unload_drain_s`; past it they end with `model_unloading`),"
     " then the runtime is released. 200 if already unloaded. The model stays unloaded"
     " (`unload_reason` `requested`), even one the pool had evicted.", reply=ModelRow),
    Route("get", "/v1/admin/decisions", "admin", "Residency decisions, with their reasons",
     "The latest decisions of the residency owner (docs/vram.md), newest first, at most 500"
     " kept: `place` (a load let through, with `gpus` and `gpu_split_mib`), `evict` (whom,"
     " `for` whom, and why the policy chose it), `wait` (a load that found no room),"
     " `yield` (a busy model asked to make way), `refuse` (with `need_mib` and `room_mib`"
     " per GPU), `comeback` (an evicted enabled model loading again). `?model=` keeps those"
     " about one model (as `model` or `for`), `?limit=` the newest N.", reply=Decisions,
     query=(("model", "string", "Only decisions about this model."),
            ("limit", "integer", "At most this many (the newest)."))),
    Route("get", "/v1/admin/gpu-memory", "admin", "GPU memory and VRAM estimates",
     "NVML readings per GPU (or the virtual GPUs of `engine.gpu_budget_mib`) and each"
     " model's VRAM estimate, measured delta and GPUs; with no GPU, `gpus` is empty and"
     " `error` says why.", reply=GpuMemory),
    Route("get", "/v1/admin/events", "admin", "Admin state as Server-Sent Events",
     "A long response of `state` events: the first at once, then one whenever a model's state"
     " changes (at once) or a counter, pull or GPU reading does (looked at once a second; at"
     " most four events a second); a `: keep-alive` comment every 15 s otherwise. Each event's"
     " data is one JSON object: `models` (the rows of `/v1/admin/models`), `gpus` and"
     " `gpu_error` (as `/v1/admin/gpu-memory`), `pulls` (each model's current or last pull,"
     " as `/api/pull/status/{model}`), `shutting_down`. Each residency decision made while"
     " the stream is open follows as a `decision` event (one entry of `/v1/admin/decisions`)."
     " The stream ends when the pool shuts"
     " down. The dashboard (`/ui/`) and `llm-pool events` follow it.",
     text=(SSE, {"type": "string", "description": "Server-Sent Events"})),
    Route("get", "/ui", "operations", "Dashboard (redirect)",
     "308 to `ui/`, so the page's relative URLs resolve under `/ui/`.", status=308,
     text=("text/html", {"type": "string"})),
    Route("get", "/ui/", "operations", "Dashboard",
     "An HTML page that shows and steers the pool through the admin API with the"
     " operator's token (docs/operations.md, \"The dashboard\"); the page itself holds no"
     " data and needs no token.", text=("text/html", {"type": "string"})),
    Route("get", "/ui/app.js", "operations", "Dashboard script", "The page's script.",
     text=("text/javascript", {"type": "string"})),
    Route("get", "/ui/app.css", "operations", "Dashboard style", "The page's stylesheet.",
     text=("text/css", {"type": "string"})),
    Route("get", "/v1/capabilities", "runner", "Runner descriptor",
     "Loaded, loading and available models, resources, queue figures (average and p95 wait"
     " over a recent window), capability flags (`embeddings`: some configured model serves"
     " them) and health; 503 with the same body while unhealthy. In a cluster, `cluster`"
     " as in /health.", reply=RunnerDescriptor),
    Route("post", "/v1/models/load", "runner", "Start an asynchronous load",
     "202 with a task id; `evictModel` is unloaded first. Needs the admin token or a"
     " `verifiedOpToken` where configured. A model with a `source` that is not in the store"
     " yet is pulled first (the task's `phase` is `fetching`, its progress follows the"
     " bytes).", RunnerLoadRequest, 202, reply=LoadTaskState),
    Route("get", "/v1/models/load/{task_id}", "runner", "Load task status",
     "`loading`, `completed` or `failed`, with `loadTimeMs`.", reply=LoadTaskState),
    Route("post", "/v1/models/unload", "runner", "Unload (runner API)",
     "Graceful unload; says how much memory the model held.", RunnerUnloadRequest,
     reply=RunnerUnloaded),
    Route("post", "/v1/cache/flush", "runner", "Flush prompt caches",
     "Scopes `all`, `model` (`modelId`), `tenant` (`tenantId`, narrowed by `tag`) and `tag`"
     " (`tag`, narrowed by `tenantId`); `modelId` narrows any scope. Answers the entries"
     " removed (saved states, llama-server slots, vLLM salt scopes) and the memory freed;"
     " backends without a prompt cache report 0.",
     CacheFlushRequest, reply=CacheFlushed),
    Route("post", "/v1/chat/completions", "openai", "Chat Completions (OpenAI)",
     "OpenAI's Chat Completions, plain or streamed (`stream_options.include_usage`;"
     " `chat.completion.chunk` events, then `data: [DONE]`). Prefix cache headers as"
     " `/v1/responses`; `usage.prompt_tokens_details.cached_tokens` counts the prompt tokens"
     " the runtime reused. Sampling"
     " fields a model's backend cannot honour (`min_p`, `seed`, penalties, `logit_bias`) are"
     " a 400 `sampling_unsupported`; `keep_alive` as on Ollama's routes (the idle time of an"
     " on-demand model; 0 unloads it after the request). An embedding model"
     " answers 400 `generation_unsupported`. Tools (`tools`, `tool_choice`,"
     " `parallel_tool_calls`, `tool` messages; calls come back in `message.tool_calls` and"
     " streamed `delta.tool_calls`) and `response_format` where the backend has them, else"
     " 400 `tools_unsupported` / `structured_output_unsupported`; a bad definition is a 400"
     " naming the field in `param`.", ChatCompletionRequest, reply=ChatCompletion,
     stream=SSE, errors="openai"),
    Route("post", "/v1/completions", "openai", "Completions (OpenAI, legacy)",
     "One choice per prompt (`prompt` a string or a list); `stream: true` (one prompt) answers"
     " `text_completion` chunks as Server-Sent Events, then `data: [DONE]`. `max_tokens`"
     " defaults to 16 as in OpenAI's API; `echo` must be false; `logprobs` is a 400"
     " `logprobs_unsupported`. The prompt is one user turn rendered by the model's prompt"
     " format; `keep_alive` as on Ollama's routes. Headers as `/v1/responses`"
     " (`X-Queue-Wait-Ms`, `X-GPU-Time-Ms`, ...).",
     CompletionRequest, reply=TextCompletion, stream=SSE, errors="openai"),
    Route("post", "/v1/embeddings", "openai", "Embeddings (OpenAI)",
     "One vector per input, in order, for a model with `embedding: true` (llama_cpp,"
     " llama_server, vllm_serve, openai_remote, stub); `encoding_format` `float` or `base64`"
     " (little-endian float32); `dimensions` only where the model can shorten its vectors"
     " (else 400 naming `dimensions`). The inputs go through the same queue, replicas,"
     " tenant limits and on-demand loads as generation, as one backend call (a server"
     " backend splits them into requests of `embedding_batch_size`); `keep_alive` as on"
     " Ollama's routes; a generation model answers 400 `embeddings_unsupported`.",
     EmbeddingsRequest, reply=EmbeddingList, errors="openai"),
    Route("post", "/api/chat", "ollama", "Chat (Ollama)",
     "NDJSON stream by default (one line per piece, the last with `done: true` and the"
     " timings), one object with `stream: false`; no messages loads the model"
     " (`keep_alive: 0` unloads it). `tools` and `tool` messages where the backend can call"
     " tools (`message.tool_calls` in the reply); `format` (`\"json\"` or a schema)"
     " constrains the reply.", OllamaChatRequest, reply=OllamaChatReply,
     stream=NDJSON, errors="ollama"),
    Route("post", "/api/generate", "ollama", "Generate (Ollama)",
     "One prompt; NDJSON stream by default as `/api/chat`; an empty prompt loads the model.",
     OllamaGenerateRequest, reply=OllamaGenerateReply, stream=NDJSON, errors="ollama"),
    Route("post", "/api/embed", "ollama", "Embed (Ollama)",
     "`embeddings`: one L2-normalized vector per input.", OllamaEmbedRequest,
     reply=OllamaEmbedReply, errors="ollama"),
    Route("post", "/api/embeddings", "ollama", "Embeddings (Ollama, older)",
     "`embedding`: the vector of one `prompt`.", OllamaEmbeddingsRequest,
     reply=OllamaEmbeddingsReply, errors="ollama"),
    Route("get", "/api/tags", "ollama", "List models (Ollama)",
     "Every configured (and pulled) model: `loaded`, the artifact's `modified_at`, `size` and"
     " SHA-256 `digest` (a model without a file: the settings file's mtime and the digest of"
     " its definition).", reply=OllamaTags, errors="ollama"),
    Route("get", "/api/ps", "ollama", "Loaded models (Ollama)",
     "As `/api/tags`, loaded models only, with `expires_at` (when the keep-alive unloads"
     " it), `size` (its memory footprint: the VRAM measurement or estimate) and `size_vram`"
     " (the part on GPUs: 0 for a model on CPU or remote).", reply=OllamaRunning,
     errors="ollama"),
    Route("post", "/api/show", "ollama", "Show a model (Ollama)",
     "Template (the pool's prompt format), parameters (decoding defaults), capabilities"
     " (`completion` or `embedding`, `tools`, `thinking`, `vision`), details and the"
     " definition.", OllamaModelRequest, reply=OllamaShowReply, errors="ollama"),
    Route("post", "/api/copy", "ollama", "Copy a model (Ollama): refused",
     "Always 400 `copy_unsupported` (404 for an unknown source): model names come from the"
     " settings files; add an entry there instead.", OllamaCopyRequest, 400,
     reply=OllamaError, errors="ollama"),
    Route("get", "/", "ollama", "Ollama probe", "`Ollama is running` (text/plain).",
     text=("text/plain", {"const": "Ollama is running"}), errors="ollama"),
    Route("head", "/", "ollama", "Ollama probe (HEAD)", "200 with no body, as Ollama.",
     errors="ollama"),
    Route("get", "/api/version", "ollama", "Version (Ollama)", "The pool's version.",
     reply=OllamaVersion, errors="ollama"),
    Route("post", "/api/pull", "ollama", "Pull a model (Ollama)",
     "Pulls a configured model from its `source` in the background: NDJSON progress lines"
     " (the pull's state) by default; with `stream: false` the final state (500 when the"
     " pull failed). A client that disconnects stops watching only. Admin token.",
     OllamaModelRequest, reply=PullState, stream=NDJSON, errors="ollama"),
    Route("get", "/api/pull/status/{model}", "ollama", "Pull status",
     "The current or last pull of a model (404 when none).", reply=PullState,
     errors="ollama"),
    Route("delete", "/api/pull/{model}", "ollama", "Cancel a pull",
     "Cancels a running pull; its partial files are removed (404 when none runs).",
     reply=PullCancelled, errors="ollama"),
    Route("delete", "/api/delete", "ollama", "Delete a pulled model (Ollama)",
     "Removes a pulled model from the store: `{}`; 409 while it is loaded, 404 when it is"
     " not in the store.", OllamaModelRequest, reply=Empty, errors="ollama"),
    Route("get", "/health", "operations", "Health",
     "200 while serving; 503 with `reason` when every model failed or on shutdown. In a"
     " cluster, `cluster`: `node_id`, `epoch`, `gpu_host`, `redis` (`ok` or `unreachable`:"
     " the node serves on by itself), `error`, `peers`.", reply=Health),
    Route("get", "/metrics", "operations", "Prometheus metrics", "Text exposition format.",
     text=_PLAIN),
    Route("get", "/openapi.json", "operations", "This document", "OpenAPI 3.1.",
     text=("application/json", {"type": "object"})),
    Route("get", "/docs", "operations", "Readable API docs",
     "A self-contained HTML page of every route.", text=("text/html", {"type": "string"})),
]  # fmt: skip

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
}


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


def _operation(route: Route, keyed: dict[Any, Any]) -> dict[str, Any]:
    success: dict[str, Any] = {"description": "Success"}
    content: dict[str, Any] = {}
    if route.reply is not None:
        content["application/json"] = {"schema": keyed[(route.reply, "serialization")]}
    if route.stream is not None:
        what = "Server-Sent Events" if route.stream == SSE else "one JSON object a line"
        content[route.stream] = {"schema": {"type": "string", "description": what}}
    if route.text is not None:
        media_type, schema = route.text
        content[media_type] = {"schema": schema}
    if content:
        success["content"] = content
    error = {"application/json": {"schema": _error_schema(route.errors)}}
    responses: dict[str, Any] = {str(route.status): success}
    if route.status < 400:
        responses["4XX"] = {"description": "Client error (see the error codes)", "content": error}
    responses["5XX"] = {"description": "Load failure, queue full or timeout", "content": error}
    operation: dict[str, Any] = {
        "tags": [route.tag],
        "summary": route.summary,
        "description": route.description,
        "operationId": _operation_id(route),
        "responses": responses,
    }
    if route.request is not None:
        operation["requestBody"] = {
            "required": route.body_required,
            "content": {"application/json": {"schema": keyed[(route.request, "validation")]}},
        }
    parameters = [
        {"name": p.strip("{}"), "in": "path", "required": True, "schema": {"type": "string"}}
        for p in route.path.split("/")
        if p.startswith("{")
    ]
    parameters += [
        {"name": name, "in": "query", "required": False, "schema": {"type": kind},
         "description": text}
        for name, kind, text in route.query
    ]
    if parameters:
        operation["parameters"] = parameters
    return operation


def openapi_document(extra_routes: list[Route] | None = None) -> dict[str, Any]:
    routes = ROUTES + (extra_routes or [])
    requests = {r.request for r in routes if r.request is not None}
    replies = {r.reply for r in routes if r.reply is not None}
    replies |= {m for m in _ERROR_MODELS.values() if m is not None}
    keyed, schema = models_json_schema(
        [(m, "validation") for m in sorted(requests, key=lambda m: m.__name__)]
        + [(m, "serialization") for m in sorted(replies, key=lambda m: m.__name__)],
        ref_template="#/components/schemas/{model}",
    )
    components = dict(schema.get("$defs", {}))
    components["Error"] = _POOL_ERROR
    states = "\n".join(f"- `{k}`: {v}" for k, v in STATE_DESCRIPTIONS.items())
    paths: dict[str, Any] = {}
    for route in routes:
        paths.setdefault(route.path, {})[route.method] = _operation(route, keyed)
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
            + '\n\nErrors are `{"error": {"code", "message"}}` (OpenAI\'s error object on the'
            ' OpenAI routes, `{"error": message}` on the Ollama routes); a full queue (503)'
            " and a rate limit (429) carry `Retry-After`. Codes and statuses: "
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
