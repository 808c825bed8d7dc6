"""The OpenAPI document, generated from the pydantic models, and a small docs page.

Every route the app serves has a :class:`Route` here: its request model (for a route
that takes a body) and the model of its success body, or the media type of a text
answer. tests/http/test_openapi.py checks the list against the app's URL map, validates
the document, and validates real answers against the response schemas.

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
from pool.backends import LoadRequest
from pool.errors import STATUS_BY_CODE
from pool.schemas import (
    CacheFlushed,
    CacheFlushRequest,
    ChatCompletion,
    ChatCompletionRequest,
    ChatCompletionStreamEvent,
    CompletionRequest,
    Decisions,
    EmbeddingList,
    EmbeddingsRequest,
    GpuMemory,
    Health,
    InputItemList,
    KeyCreated,
    KeyCreateRequest,
    KeyList,
    KeyRevoked,
    LoadAnswer,
    LoadTaskState,
    MessagesError,
    MessagesReply,
    MessagesRequest,
    MessagesStreamEvent,
    MessagesTokenCount,
    MessagesTokensRequest,
    ModelCard,
    ModelList,
    ModelRow,
    ModelRows,
    OllamaChatReply,
    OllamaChatRequest,
    OllamaChatStreamLine,
    OllamaCopyRequest,
    OllamaEmbeddingsReply,
    OllamaEmbeddingsRequest,
    OllamaEmbedReply,
    OllamaEmbedRequest,
    OllamaError,
    OllamaGenerateReply,
    OllamaGenerateRequest,
    OllamaGenerateStreamLine,
    OllamaModelRequest,
    OllamaRunning,
    OllamaShowReply,
    OllamaStoreRequest,
    OllamaTags,
    OllamaVersion,
    OpenAIError,
    OpenAIResponse,
    OpenAIResponseRequest,
    OpenAIResponseStreamEvent,
    PoolStatus,
    PullCancelled,
    PullState,
    ResponseDeleted,
    ResponseEnvelope,
    ResponseRequest,
    ResponseStreamEvent,
    RunnerDescriptor,
    RunnerLoadRequest,
    RunnerUnloaded,
    RunnerUnloadRequest,
    StatusSuccess,
    TextCompletion,
    TextCompletionStreamEvent,
    UsageReport,
    with_components,
)

ErrorShape = Literal["pool", "openai", "ollama", "anthropic"]
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
        stream: the media type of the streamed answer (``stream: true``).
        events: the model of one streamed event's JSON (an SSE event's ``data``, an NDJSON
            line): the union of every event the stream can send.
        errors: the error body of this surface: the pool's, OpenAI's, Ollama's or
            Anthropic's.
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
    events: type[BaseModel] | None = None
    errors: ErrorShape = "pool"
    body_required: bool = True
    # Query parameters: (name, JSON type or the whole schema, description).
    query: tuple[tuple[str, str | dict[str, Any], str], ...] = ()


_PLAIN = ("text/plain", {"type": "string"})
# A time in a query: RFC 3339 or seconds since the epoch (pool/http/admin/_parse.py).
_INSTANT: dict[str, Any] = {
    "anyOf": [
        {"type": "string", "format": "date-time"},
        {"const": "", "description": "No bound."},
        {"type": "string", "pattern": "^[+-]?[0-9]{1,15}(\\.[0-9]{1,9})?$"},
    ]
}
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
     ResponseRequest, reply=ResponseEnvelope, stream=SSE, events=ResponseStreamEvent),
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
     " VRAM (`vram_estimate_mib`; its `vram_estimate_source`, the spec's"
     " observed_load_delta, model_artifact_size or unavailable; `vram_estimate_basis`, the"
     " step of the pool's chain: configured_vram_mb, observed_load_delta, artifact_metadata,"
     " model_artifact_size, name_heuristic or unavailable; `observed_load_delta`: MiB"
     " measured for this load, or kept from the same earlier load, null when never"
     " measured; `gpus`: the GPUs of each replica, `gpu_split_mib`: the MiB planned on"
     " each of them), `unload_reason` (why it is unloaded: `evicted` by the pool, so its"
     " next request loads it again; `requested`; `keep_alive`), capabilities, load"
     " constraints and"
     " recommendations, load override and definition. In a cluster, `cluster` lists every"
     " peer's models (`node`, `name`, `state`, `replicas`, `in_flight`, `queue_depth`,"
     " `on_demand`, `vram_mib`).", reply=ModelRows),
    Route("get", "/v1/admin/models/{name}", "admin", "One model's row", "As in the list.",
     reply=ModelRow),
    Route("post", "/v1/admin/models/{name}/load", "admin", "Load a model",
     "Optional body: `replicas`, `stay_warm_s` and the backend's live-only load overrides"
     " (see the row's `load_constraints`). Answers when the load has finished: 200 with"
     " the row, or 500 `load_failed` with `last_error`. On GPUs the load must fit its VRAM"
     " budget: idle models it may evict (docs/vram.md) are unloaded first, else 500"
     " `load_failed` at once. Idempotent while loaded or loading (overrides then give 400);"
     " 409 `model_unloading` while unloading. A schema failure is 422, a value the"
     " backend does not accept is 400 `invalid_load_request`. With `dry_run=true` nothing"
     " changes: 200 with what the load would do now (`LoadPreview`: `fits`, `gpus` and"
     " `gpu_split_mib` per replica, the models it would `evict`, those it spares for their"
     " stay-warm windows (`spared_warm`), what it would `wait_for`,"
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
            ("limit", {"type": "integer", "minimum": 1},
             "At most this many (the newest)."))),
    Route("get", "/v1/admin/keys", "admin", "List keys",
     "The keys in force, from `service.auth.keys` (`source: settings`) and added through"
     " this API (`source: runtime`), with the identity each gives its requests: `tenant`"
     " (null: `X-Tenant-ID` decides), `role`, `priority`, `rate_limit_rpm`, `created_at`."
     " Never a key nor its digest.", reply=KeyList),
    Route("post", "/v1/admin/keys", "admin", "Add a key",
     "Adds a key, in force at once and kept across restarts (`keys.json` in the state"
     " directory, which holds only SHA-256 digests). Without `key_sha256` the pool"
     " generates the key (`sk-pool-` and 43 random characters) and answers it in `key` this"
     " once: it cannot be shown again. 409 `key_exists` when a key of that name or with"
     " that secret is in force.", KeyCreateRequest, status=201, reply=KeyCreated),
    Route("delete", "/v1/admin/keys/{name}", "admin", "Revoke a key",
     "Revokes a key, a settings key too (kept across restarts, until the settings give the"
     " name another key). From the answer on, the key is refused (401) on every route, and"
     " a WebSocket opened with it is closed with code 1008 after an `error` event. 404"
     " `unknown_key` when no key of that name is in force.", reply=KeyRevoked),
    Route("get", "/v1/admin/usage", "admin", "Token usage by key, tenant or model",
     "Sums of the usage database (`usage.sqlite3` in the state directory; docs/operations.md):"
     " one row per `group_by` value (`key`, `tenant` or `model`; default `tenant`) with"
     " `requests` (finished requests of any status), `prompt_tokens`, `cached_tokens` and"
     " `output_tokens`, over the requests that finished in `[since, until)`; with `bucket`,"
     " one row per group and UTC hour or day, whose start is `bucket` (RFC 3339). Times are"
     " RFC 3339 or seconds since the epoch; either bound may be left out. Records reach the"
     " database within `service.usage.flush_ms`. 400 `invalid_request` for a bad parameter,"
     " 409 `usage_disabled` when `service.usage.enabled` is off.", reply=UsageReport,
     query=(("group_by", "string", "`key`, `tenant` (default) or `model`."),
            ("since", _INSTANT, "From this time on (RFC 3339 or epoch seconds)."),
            ("until", _INSTANT, "Before this time (RFC 3339 or epoch seconds); a window that"
             " ends before it starts holds nothing."),
            ("bucket", "string", "`hour` or `day`: one row per UTC hour or day."))),
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
     " them) and health; 503 with the same body while unhealthy, and 503 `starting`"
     " (`Retry-After`) on every route while the pool starts. In a cluster, `cluster`"
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
     stream=SSE, events=ChatCompletionStreamEvent, errors="openai"),
    Route("post", "/v1/completions", "openai", "Completions (OpenAI, legacy)",
     "One choice per prompt (`prompt` a string or a list); `stream: true` (one prompt) answers"
     " `text_completion` chunks as Server-Sent Events, then `data: [DONE]`. `max_tokens`"
     " defaults to 16 as in OpenAI's API; `echo` must be false; `logprobs` is a 400"
     " `logprobs_unsupported`. The prompt is one user turn rendered by the model's prompt"
     " format; `keep_alive` as on Ollama's routes. Headers as `/v1/responses`"
     " (`X-Queue-Wait-Ms`, `X-GPU-Time-Ms`, ...).",
     CompletionRequest, reply=TextCompletion, stream=SSE, events=TextCompletionStreamEvent,
     errors="openai"),
    Route("post", "/v1/embeddings", "openai", "Embeddings (OpenAI)",
     "One vector per input, in order, for a model with `embedding: true` (llama_cpp,"
     " llama_server, vllm_serve, openai_remote, stub); `encoding_format` `float` or `base64`"
     " (little-endian float32); `dimensions` only where the model can shorten its vectors"
     " (else 400 naming `dimensions`). The inputs go through the same queue, replicas,"
     " tenant limits and on-demand loads as generation, as one backend call (a server"
     " backend splits them into requests of `embedding_batch_size`); `keep_alive` as on"
     " Ollama's routes; a generation model answers 400 `embeddings_unsupported`.",
     EmbeddingsRequest, reply=EmbeddingList, errors="openai"),
    Route("post", "/openai/v1/responses", "openai", "Create a response (OpenAI Responses API)",
     "OpenAI's Responses API as OpenAI's SDKs, the Agents SDK and Codex speak it (the pool's"
     " own shape is `/v1/responses`). `input` is text or items: messages (`system` and"
     " `developer` ones join `instructions`), `function_call`, `function_call_output` and"
     " `reasoning` items (left out of the prompt). `output` holds `reasoning` items (the"
     " `<think>` block a thinking model opens its reply with), `message` items with one"
     " `output_text` part (`annotations: []`) and `function_call` items. `status` is"
     " `completed`, or `incomplete` with `incomplete_details.reason: max_output_tokens`;"
     " `usage` has `input_tokens` (`input_tokens_details.cached_tokens`: reused from the"
     " runtime's prefix cache), `output_tokens` (`output_tokens_details.reasoning_tokens`),"
     " `total_tokens`. Fields: `instructions`, `max_output_tokens`, `temperature`, `top_p`,"
     " `tools` (function tools only; others are a 400 naming `tools[i].type`),"
     " `tool_choice`, `parallel_tool_calls`, `text.format` (json_object, json_schema),"
     " `metadata` (echoed), `store` (default true: kept per tenant for"
     " `service.responses_retention_s`), `previous_response_id` (a stored response of the"
     " same `X-Tenant-ID`; 404 otherwise); the pool adds `top_k`, `seed`, `thinking`,"
     " `keep_alive`, `allow_remote`. `stream: true` answers Server-Sent Events, each with"
     " `sequence_number`: `response.created`, `response.in_progress`, per item"
     " `response.output_item.added`, `response.content_part.added`,"
     " `response.output_text.delta`/`response.reasoning_text.delta` (or"
     " `response.function_call_arguments.delta`), `response.output_text.done`"
     " (`response.reasoning_text.done`, `response.function_call_arguments.done`),"
     " `response.content_part.done`, `response.output_item.done`, and last"
     " `response.completed`, `response.incomplete` or, for a failure after the stream"
     " started, `response.failed` (`response.error`). Errors are OpenAI's error object.",
     OpenAIResponseRequest, reply=OpenAIResponse, stream=SSE, events=OpenAIResponseStreamEvent,
     errors="openai"),
    Route("get", "/openai/v1/responses/{response_id}", "openai", "Retrieve a stored response",
     "The response object as it was answered, for the tenant (`X-Tenant-ID`) that created"
     " it; 404 for an unknown, expired, deleted or other tenant's id.", reply=OpenAIResponse,
     errors="openai"),
    Route("delete", "/openai/v1/responses/{response_id}", "openai", "Delete a stored response",
     "Removes it (404 when this tenant has no such response); a continuation of it can no"
     " longer see it.", reply=ResponseDeleted, errors="openai"),
    Route("get", "/openai/v1/responses/{response_id}/input_items", "openai",
     "Input items of a stored response",
     "The items the response was created with (each with an `id`; text input as one user"
     " `message`), a page at a time: `limit` 1 to 100 (20), `order` `desc` (default) or"
     " `asc`, `after` an item id.", reply=InputItemList, errors="openai"),
    Route("post", "/openai/v1/chat/completions", "openai", "Chat Completions (OpenAI base URL)",
     "`POST /v1/chat/completions` under the base URL `/openai/v1`.", ChatCompletionRequest,
     reply=ChatCompletion, stream=SSE, events=ChatCompletionStreamEvent, errors="openai"),
    Route("post", "/openai/v1/completions", "openai", "Completions (OpenAI base URL)",
     "`POST /v1/completions` under the base URL `/openai/v1`.", CompletionRequest,
     reply=TextCompletion, stream=SSE, events=TextCompletionStreamEvent, errors="openai"),
    Route("post", "/openai/v1/embeddings", "openai", "Embeddings (OpenAI base URL)",
     "`POST /v1/embeddings` under the base URL `/openai/v1`.", EmbeddingsRequest,
     reply=EmbeddingList, errors="openai"),
    Route("get", "/openai/v1/models", "openai", "List models (OpenAI base URL)",
     "As `GET /v1/models`, with OpenAI's error object.", reply=ModelList, errors="openai"),
    Route("get", "/openai/v1/models/{model}", "openai", "One model (OpenAI base URL)",
     "The entry of `GET /openai/v1/models` for `model`; 404 `unknown_model` for a name that"
     " is not servable.", reply=ModelCard, errors="openai"),
    Route("post", "/v1/messages", "anthropic", "Messages (Anthropic)",
     "Anthropic's Messages API on every chat backend. `system` (a string or text blocks),"
     " `messages` with `text`, `image` (`base64` or `url` sources, under the media policy"
     " of `/v1/responses`), `tool_use` and `tool_result` blocks (earlier `thinking` blocks"
     " are accepted and not shown to the model); `max_tokens` (required), `stop_sequences`,"
     " `temperature`, `top_p`, `top_k`, `metadata`, `tools` (client tools with"
     " `input_schema`; server tools are a 400) and `tool_choice` (`auto`, `any`, `tool`,"
     " `none`; `disable_parallel_tool_use`) where the backend has tools, `thinking` where"
     " the model can think. The answer's `content` holds `thinking` (a reply that opens with"
     " `<think>...</think>`), `text` and `tool_use` blocks (`input` parsed); `stop_reason` is"
     " `end_turn`, `max_tokens`, `stop_sequence` (with `stop_sequence`, where the backend"
     " names the string it stopped at: stub, llama_cpp, ct2, exllamav3, vllm, vllm_serve) or"
     " `tool_use`; `usage.input_tokens` counts the prompt tokens not served from the"
     " prefix cache, `cache_read_input_tokens` those that were. `stream: true` answers"
     " Server-Sent Events: `message_start`, `ping`, then per block `content_block_start`,"
     " `content_block_delta` (`text_delta`, `thinking_delta`, `input_json_delta`) and"
     " `content_block_stop`, then `message_delta` (stop reason, usage) and `message_stop`;"
     " an error after the start is an `error` event. A stream that must wait (a busy"
     " replica, a load, room on the GPUs) starts at once and sends a `ping` at least every"
     " 5 s while it waits. Authentication: `x-api-key` or `Authorization: Bearer` with an"
     " inference token; `anthropic-version` is accepted. Errors are"
     " `{\"type\": \"error\", \"error\": {\"type\", \"message\"}}` with the pool's"
     " statuses (400 invalid_request_error, also for a body that does not validate; 401"
     " authentication_error; 403 permission_error; 404 not_found_error; 413"
     " request_too_large; 429 rate_limit_error; 503 overloaded_error; 504 timeout_error;"
     " other 5xx api_error). Headers as `/v1/responses` (`X-Tenant-ID`, `X-Priority`,"
     " `X-Cache-Mode`, `X-Cache-Tag`); answers carry `request-id`.",
     MessagesRequest, reply=MessagesReply, stream=SSE, events=MessagesStreamEvent,
     errors="anthropic"),
    Route("post", "/v1/messages/count_tokens", "anthropic", "Count tokens (Anthropic)",
     "`input_tokens`: the prompt of a Messages request (`model`, `system`, `messages`,"
     " `tools`, `tool_choice`, `thinking`) in the model's own tokens, counted by the model"
     " itself: it renders and prefills the prompt and generates one token, through the same"
     " queue and on-demand load as a request (so the prefix is cached for the request that"
     " follows). Authentication and errors as `/v1/messages`.",
     MessagesTokensRequest, reply=MessagesTokenCount, errors="anthropic"),
    Route("post", "/api/chat", "ollama", "Chat (Ollama)",
     "NDJSON stream by default (one line per piece, the last with `done: true` and the"
     " timings), one object with `stream: false`; no messages loads the model"
     " (`keep_alive: 0` unloads it). `tools` and `tool` messages where the backend can call"
     " tools (`message.tool_calls` in the reply); `format` (`\"json\"` or a schema)"
     " constrains the reply.", OllamaChatRequest, reply=OllamaChatReply,
     stream=NDJSON, events=OllamaChatStreamLine, errors="ollama"),
    Route("post", "/api/generate", "ollama", "Generate (Ollama)",
     "One prompt; NDJSON stream by default as `/api/chat`; an empty prompt loads the model.",
     OllamaGenerateRequest, reply=OllamaGenerateReply, stream=NDJSON,
     events=OllamaGenerateStreamLine, errors="ollama"),
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
     " (the pull's state), repeated every `service.pull_heartbeat_s` (30 s) while nothing"
     " moves (queued, or a stalled download); with `stream: false` the final state (400,"
     " with `error`, when the pull failed or was cancelled). A model the store already"
     " holds from the same source succeeds at once, downloading nothing. A client that"
     " disconnects stops watching only. Admin token.",
     OllamaStoreRequest, reply=PullState, stream=NDJSON, events=PullState, errors="ollama"),
    Route("get", "/api/pull/status/{model}", "ollama", "Pull status",
     "The current or last pull of a model (404 when none): its state in the pool's"
     " terms (`status`, `completed`, `total`) and the embedded-engine spec's (`state`,"
     " `progress` in percent, `total_bytes`, `downloaded_bytes`).", reply=PullState,
     errors="ollama"),
    Route("delete", "/api/pull/{model}", "ollama", "Cancel a pull",
     "Cancels a running pull; its partial files are removed (404 when none runs).",
     reply=PullCancelled, errors="ollama"),
    Route("delete", "/api/delete", "ollama", "Delete a pulled model (Ollama)",
     "Removes a pulled model from the store: `{\"status\": \"success\"}`; 409 while it is"
     " loaded, 404 when it is not in the store.", OllamaStoreRequest, reply=StatusSuccess,
     errors="ollama"),
    Route("get", "/health", "operations", "Health",
     "200 while serving: `healthy`, or `degraded` with `reasons` (a queue at or near its"
     " max_queue, a GPU out of memory within `service.health_oom_window_s`, a failed"
     " model); 503 `degraded` with `reason` while a queue is saturated or a GPU ran out of"
     " memory; 503 `unhealthy` with `reason` when every model failed or on shutdown. In a"
     " cluster, `cluster`: `node_id`, `epoch`, `gpu_host`, `redis` (`ok` or `unreachable`:"
     " the node serves on by itself), `error`, `peers`.", reply=Health),
    Route("get", "/api/status", "operations", "Full status",
     "Health with its `reasons` (as /health), each model's engine state (`keep_alive`,"
     " `idle_seconds`, `will_unload_in`, `error`, queue), `engine.gpu_memory` (the"
     " embedded-engine spec's `allocated_gb`, `reserved_gb`, `total_gb`), the pulls under"
     " way (with the spec's `state`, `progress` in percent, `total_bytes`), `cache` (the"
     " models the model store holds, and their `count`) and each GPU's memory in MiB."
     " Always 200: `status` says whether the pool serves.", reply=PoolStatus),
    Route("get", "/metrics", "operations", "Prometheus metrics",
     "Text exposition format; 404 while `service.metrics` is off (ENABLE_METRICS)."
     " `service.metrics_port` serves it alone on a port of its own too. Each loaded model's"
     " GPU memory is `llm_pool_model_gpu_memory_bytes{model,part}`: `weights` and"
     " `kv_cache` where the runtime reports its split (llama.cpp, vllm serve), else"
     " `unknown` (the measured total, NaN when unmeasured).", text=_PLAIN),
    Route("get", "/openapi.json", "operations", "This document", "OpenAPI 3.1.",
     text=("application/json", {"type": "object"})),
    Route("get", "/docs", "operations", "Readable API docs",
     "A self-contained HTML page of every route.", text=("text/html", {"type": "string"})),
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

# -- what each route can refuse, beyond what every route of its kind can -----------------
# Statuses of refusals by route: a 400 here is one a schema cannot express (a value valid
# in shape, refused for this model, backend or state).
_REFUSALS: dict[tuple[str, str], tuple[int, ...]] = {
    ("post", "/v1/responses"): (400, 404, 409, 429),
    ("get", "/v1/responses"): (426,),
    ("get", "/v1/admin/models/{name}"): (404,),
    ("get", "/v1/admin/decisions"): (400, 404),
    ("post", "/v1/admin/keys"): (409,),
    ("delete", "/v1/admin/keys/{name}"): (404,),
    ("post", "/v1/admin/models/{name}/load"): (400, 404, 409),
    ("post", "/v1/admin/models/{name}/unload"): (404,),
    ("get", "/v1/admin/usage"): (400, 409),
    ("post", "/v1/models/load"): (400, 404, 409),
    ("get", "/v1/models/load/{task_id}"): (404,),
    ("post", "/v1/models/unload"): (404,),
    ("post", "/v1/cache/flush"): (404,),
    ("post", "/v1/chat/completions"): (400, 404, 409, 429),
    ("post", "/v1/completions"): (400, 404, 409, 429),
    ("post", "/v1/embeddings"): (400, 404, 409, 429),
    ("post", "/api/chat"): (400, 404, 409, 429),
    ("post", "/api/generate"): (400, 404, 409, 429),
    ("post", "/api/embed"): (400, 404, 409, 429),
    ("post", "/api/embeddings"): (400, 404, 409, 429),
    ("post", "/api/show"): (404,),
    ("post", "/api/copy"): (404,),
    ("post", "/api/pull"): (400, 404),
    ("get", "/api/pull/status/{model}"): (404,),
    ("delete", "/api/pull/{model}"): (404,),
    ("delete", "/api/delete"): (404, 409),
}
# A route not listed above (one added without an entry): a route with a body is taken
# for an inference route, one with a path parameter may not find what it names.
_DEFAULT_BODY_REFUSALS = (400, 404, 409, 429)
# The mark on an operation's 400 (OpenAPI extension): the codes a request that this
# document calls valid can still get, because what refuses it lies outside the document:
# the model it names (its kind, backend, capabilities), the pool's settings (the media
# policy, remote models) or its state (a load's overrides while loaded). Every error
# answer carries its code in X-Error-Code (and, where the dialect has one, in the body);
# a 400 with any other code says the request broke the document.
# tests/http/test_schemathesis.py holds the pool to it.
VALID_INPUT_CODES = "x-valid-input-codes"
# Refusals of the model a generation request names (pool/actors/serving/_intake.py) and of the
# media it links (pool/media).
_GENERATION_REFUSALS = (
    "generation_unsupported",
    "image_refused",
    "modality_unsupported",
    "multi_turn_unsupported",
    "remote_not_allowed",
    "sampling_unsupported",
    "structured_output_unsupported",
    "thinking_unsupported",
    "tools_unsupported",
    # Rules between fields: `tool_choice` names a tool that `tools` lacks, two tools
    # share a name, the last turn is not the user's, a block its role cannot carry.
    "duplicate_tool",
    "invalid_conversation",
    "tool_choice_unmatched",
    # A tool's or output format's JSON schema deeper than the document describes it.
    "invalid_json_schema",
)
_COMPLETION_REFUSALS = (*_GENERATION_REFUSALS, "logprobs_unsupported", "stream_multiple_prompts")
_EMBEDDING_REFUSALS = ("dimensions_unsupported", "embeddings_unsupported", "remote_not_allowed")
_VALID_INPUT_REFUSALS: dict[tuple[str, str], tuple[str, ...]] = {
    ("post", "/v1/responses"): _GENERATION_REFUSALS,
    ("post", "/v1/chat/completions"): _GENERATION_REFUSALS,
    ("post", "/openai/v1/chat/completions"): _GENERATION_REFUSALS,
    # A stream of several prompts (the schema cannot tie `stream` to `prompt`).
    ("post", "/v1/completions"): (*_COMPLETION_REFUSALS,),
    ("post", "/openai/v1/completions"): (*_COMPLETION_REFUSALS,),
    ("post", "/openai/v1/responses"): _GENERATION_REFUSALS,
    ("post", "/v1/messages"): _GENERATION_REFUSALS,
    ("post", "/v1/messages/count_tokens"): _GENERATION_REFUSALS,
    ("post", "/api/chat"): _GENERATION_REFUSALS,
    ("post", "/api/generate"): _GENERATION_REFUSALS,
    ("post", "/v1/embeddings"): _EMBEDDING_REFUSALS,
    ("post", "/openai/v1/embeddings"): _EMBEDDING_REFUSALS,
    ("post", "/api/embed"): _EMBEDDING_REFUSALS,
    ("post", "/api/embeddings"): _EMBEDDING_REFUSALS,
    # Another backend's override, or overrides while the model is loaded.
    ("post", "/v1/admin/models/{name}/load"): ("invalid_load_request",),
    ("post", "/v1/models/load"): ("invalid_load_request",),
    ("post", "/api/pull"): ("no_pull_source",),
    ("post", "/api/copy"): ("copy_unsupported",),
}
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
    413: "The body is larger than `service.max_body_bytes`",
    422: "The body does not match the schema",
    426: "A plain GET of the WebSocket route: upgrade to a WebSocket",
    429: "Tenant over its rate limit (`rate_limit_exceeded`), or a key or tenant past its"
    " token budget (`budget_exceeded`); `Retry-After` set",
}

# A body the server answers with 503 other than an error (the health while unhealthy).
_SERVER_REPLIES: dict[tuple[str, str], tuple[int, type[BaseModel]]] = {
    ("get", "/health"): (503, Health),
    ("get", "/v1/capabilities"): (503, RunnerDescriptor),
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
    listed = _REFUSALS.get((route.method, route.path))
    if listed is not None:
        return listed
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
_DIALECTS = ("inference", "openai", "anthropic", "ollama")
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
    if content:
        success["content"] = content
    valid_input_codes = list(_VALID_INPUT_REFUSALS.get(key, ()))
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
    server_reply = _SERVER_REPLIES.get(key)
    if server_reply is not None:
        status, model = server_reply
        responses[str(status)] = {
            "description": "Unhealthy (or, on /health, degraded by a GPU out of memory or a"
            " saturated queue): the same body as a success",
            "content": {"application/json": {"schema": keyed[(model, "serialization")]}},
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
            "content": {"application/json": media},
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
    replies |= {model for _, model in _SERVER_REPLIES.values()}
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
