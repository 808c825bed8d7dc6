"""Success bodies of the routes that are not the Responses API, for the OpenAPI document.

Written once, as the description; the renderers in ``pool/http/*/_render.py`` build
the same bodies as dicts and name the model of each with
:func:`~pool.schemas.renders`. The two are kept in step where each dict is built, not by
replaying routes: under ``LLM_POOL_CHECK_REPLIES=1`` (the test suite) every rendered
dict is validated strictly against its model and may carry no field the model leaves
out. The pool does not build its replies from these models: the bytes on the wire are
pinned by the golden tests, and a pydantic object per reply, or per streamed chunk,
would be paid by every request (served, the check costs nothing; see
``pool/schemas/_checked.py``). The streamed chunks, the inference's hot path, are
encoded straight to bytes (from templates, or inside the stream renderers' methods)
with no dict-returning function between to mark: the stream unions below
(``ChatCompletionStreamEvent``, ``OllamaChatStreamLine``, ...) are held to real streams
on the wire by tests/http/test_stream_events.py.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, RootModel, Tag

# The kinds of model (pool.backends.ModelKind; the schemas import no actors or backends).
ModelKindName = Literal["chat", "embedding", "rerank", "transcription", "speech", "image"]
_KIND_DESCRIPTION = (
    "What the model serves: chat (generation), embedding, rerank, transcription, speech"
    ' or image (docs/backends.md, "Model kinds").'
)


class _Reply(BaseModel):
    # A client may meet fields added later; the document lists those we send today.
    model_config = ConfigDict(extra="allow")


# -- OpenAI --------------------------------------------------------------------------------
class PromptTokensDetails(_Reply):
    cached_tokens: int = Field(description="Prompt tokens the runtime's prefix cache served.")


class CompletionUsage(_Reply):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = Field(
        None, description="Only where the backend reports what its prefix cache served."
    )


class MessageFunction(_Reply):
    name: str
    arguments: str = Field(description="The arguments as JSON text.")


class MessageToolCall(_Reply):
    id: str
    type: Literal["function"]
    function: MessageFunction


class ChatCompletionMessage(_Reply):
    role: Literal["assistant"]
    content: str | None = Field(description="Null when the model only called tools.")
    tool_calls: list[MessageToolCall] | None = Field(
        None, description="The tools the model called; left out when it called none."
    )


class ChatCompletionChoice(_Reply):
    index: int
    message: ChatCompletionMessage
    logprobs: None
    finish_reason: Literal["stop", "length", "tool_calls"]


class ChatCompletion(_Reply):
    """A non-streamed Chat Completion; streamed, ``chat.completion.chunk`` events follow
    OpenAI's shape (``delta`` in place of ``message``), then ``data: [DONE]``."""

    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatCompletionChoice]
    usage: CompletionUsage


class TextCompletionChoice(_Reply):
    text: str
    index: int
    logprobs: None
    finish_reason: Literal["stop", "length"] | None


class TextCompletion(_Reply):
    """A legacy completion: one choice per prompt (streamed: the same object per piece)."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[TextCompletionChoice]
    usage: CompletionUsage | None = None


class ChunkFunction(_Reply):
    name: str | None = Field(None, description="In a call's first piece only.")
    arguments: str = Field(description="The next piece of the arguments' JSON text.")


class ChunkToolCall(_Reply):
    """A piece of a streamed tool call: ``id`` and ``type`` come in its first piece."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: ChunkFunction


class ChunkDelta(_Reply):
    """What a chunk adds: the role (first chunk), text, or tool-call pieces; the last
    chunk of a choice has an empty delta and its ``finish_reason``."""

    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ChunkToolCall] | None = None


class ChatCompletionChunkChoice(_Reply):
    index: int
    delta: ChunkDelta
    logprobs: None
    finish_reason: Literal["stop", "length", "tool_calls"] | None


class ChatCompletionChunk(_Reply):
    """One ``data:`` event of a streamed Chat Completion. With
    ``stream_options.include_usage`` every chunk has ``usage: null`` and one more chunk
    with no choices carries the usage before ``data: [DONE]``."""

    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatCompletionChunkChoice]
    usage: CompletionUsage | None = None


class EmbeddingItem(_Reply):
    object: Literal["embedding"]
    index: int
    embedding: list[float] | str = Field(
        description="Floats, or base64 of little-endian float32 (`encoding_format: base64`)."
    )


class EmbeddingUsage(_Reply):
    prompt_tokens: int
    total_tokens: int


class EmbeddingList(_Reply):
    object: Literal["list"]
    data: list[EmbeddingItem]
    model: str
    usage: EmbeddingUsage


RERANK_METHOD_DESCRIPTION = (
    "Pool extension: how the scores were made: `rank_head` (the model's rank head read each"
    " query and document together) or `embedding_cosine` (an embedding model's fallback:"
    " the cosine similarity of the query's and the document's embeddings)."
)


class RerankedDocument(_Reply):
    text: str


class RerankResult(_Reply):
    index: int = Field(description="The document's place in the request's `documents`.")
    relevance_score: float
    document: RerankedDocument | None = Field(
        None, description="The document, with `return_documents: true`."
    )


class RerankUsage(_Reply):
    prompt_tokens: int
    total_tokens: int


class RerankReply(_Reply):
    id: str
    model: str
    results: list[RerankResult] = Field(description="Best first (`top_n` of them if given).")
    usage: RerankUsage
    method: Literal["rank_head", "embedding_cosine"] = Field(description=RERANK_METHOD_DESCRIPTION)


class ScoreItem(_Reply):
    index: int
    object: Literal["score"]
    score: float


class ScoreReply(_Reply):
    id: str
    object: Literal["list"]
    created: int
    model: str
    data: list[ScoreItem] = Field(description="One score per pair, in request order.")
    usage: RerankUsage
    method: Literal["rank_head", "embedding_cosine"] = Field(description=RERANK_METHOD_DESCRIPTION)


class VoiceCard(_Reply):
    id: str = Field(description="The name to give as a speech request's `voice`.")
    model: str = Field(description="The speech model that speaks in it.")
    language: str | None = Field(None, description="Its language, as the voice names it.")


class VoiceList(_Reply):
    object: Literal["list"]
    data: list[VoiceCard]


class ModelCard(_Reply):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    kind: ModelKindName | None = Field(
        None,
        description=_KIND_DESCRIPTION[:-1] + "; null for a model known only from a peer"
        " of the cluster.",
    )
    context_length: int | None = Field(
        None,
        description="The context a request gets: the configured one (the backend's context"
        " field), else the model's own from its artifact; null when neither is known.",
    )
    loaded: bool = Field(
        description="Whether the model is loaded now (in a cluster: on some node); an"
        " on-demand or evicted model that is not loads on its first request."
    )
    nodes: list[str] | None = Field(
        None, description="In a cluster: the nodes that have the model loaded (docs/cluster.md)."
    )
    parent: str | None = Field(
        None,
        description="For a LoRA adapter: the base model that serves it (its `loaded` and"
        " `context_length` are the base's); absent for a model of its own.",
    )


class ModelList(_Reply):
    object: Literal["list"]
    data: list[ModelCard]


class OpenAIErrorDetail(_Reply):
    message: str
    type: str
    param: str | None
    code: str
    # The runner API's backpressure fields, on a 503 queue_full and a 429.
    queueDepth: int | None = Field(None, description="queue_full: requests waiting.")
    avgWaitMs: float | None = Field(None, description="queue_full: the model's mean queue wait.")
    limit: int | None = Field(None, description="rate_limit_exceeded: the limit per minute.")
    remaining: int | None = Field(None, description="rate_limit_exceeded: requests left (0).")
    resetAt: int | None = Field(
        None, description="rate_limit_exceeded: Unix time the whole burst is back."
    )


class OpenAIError(_Reply):
    """The error body of ``/v1/chat/completions``, ``/v1/completions``, ``/v1/embeddings``."""

    error: OpenAIErrorDetail


def _openai_event_kind(event: Any) -> str | None:
    """An error event is OpenAI's error object (no ``object``); the rest say what they are."""
    if isinstance(event, dict):
        return "error" if "error" in event else event.get("object")
    return "error" if hasattr(event, "error") else getattr(event, "object", None)


class ChatCompletionStreamEvent(
    RootModel[
        Annotated[
            Annotated[ChatCompletionChunk, Tag("chat.completion.chunk")]
            | Annotated[OpenAIError, Tag("error")],
            Discriminator(_openai_event_kind),
        ]
    ]
):
    """The JSON of each ``data:`` event of ``stream: true`` on ``/v1/chat/completions``
    (``data: [DONE]`` ends a stream that did not fail): chunks, or OpenAI's error
    object for a failure after the stream started."""


class TextCompletionStreamEvent(
    RootModel[
        Annotated[
            Annotated[TextCompletion, Tag("text_completion")]
            | Annotated[OpenAIError, Tag("error")],
            Discriminator(_openai_event_kind),
        ]
    ]
):
    """The JSON of each ``data:`` event of ``stream: true`` on ``/v1/completions``
    (``data: [DONE]`` ends a stream that did not fail): ``text_completion`` chunks (with
    ``stream_options.include_usage``, ``usage: null`` on each and a last one with no
    choices and the usage), or OpenAI's error object after the stream started."""


# -- Ollama --------------------------------------------------------------------------------
class OllamaReplyFunction(_Reply):
    name: str
    arguments: dict[str, Any] = Field(description="The arguments, parsed (as Ollama sends).")


class OllamaReplyToolCall(_Reply):
    function: OllamaReplyFunction


class OllamaAssistantMessage(_Reply):
    role: Literal["assistant"]
    content: str
    tool_calls: list[OllamaReplyToolCall] | None = Field(
        None, description="Whole calls; streamed, in a line of their own before the last."
    )


class _OllamaDone(_Reply):
    """The last line of a stream (or the one object of ``stream: false``) adds timings."""

    model: str
    created_at: str = Field(description="RFC 3339 time.")
    done: bool
    done_reason: Literal["stop", "length", "load", "unload"] | None = None
    total_duration: int | None = Field(None, description="Nanoseconds, as Ollama reports.")
    load_duration: int | None = None
    prompt_eval_count: int | None = None
    prompt_eval_duration: int | None = None
    eval_count: int | None = None
    eval_duration: int | None = None


class OllamaChatReply(_OllamaDone):
    """One NDJSON line of ``/api/chat`` (or its one object with ``stream: false``)."""

    message: OllamaAssistantMessage


class OllamaGenerateReply(_OllamaDone):
    """One NDJSON line of ``/api/generate`` (or its one object with ``stream: false``)."""

    response: str


class _OllamaLine(_Reply):
    model: str
    created_at: str = Field(description="RFC 3339 time.")


class _OllamaPiece(_OllamaLine):
    done: Literal[False]


class _OllamaLast(_OllamaLine):
    """The last line of a stream: why it ended and its timings (nanoseconds)."""

    done: Literal[True]
    done_reason: Literal["stop", "length"]
    total_duration: int
    load_duration: int = Field(description="The wait in the queue (a load included).")
    prompt_eval_count: int
    prompt_eval_duration: int
    eval_count: int
    eval_duration: int


class OllamaChatChunk(_OllamaPiece):
    """A piece of the reply: text, whole tool calls, or nothing (a line that keeps the
    stream alive while the request waits for a load or a slot)."""

    message: OllamaAssistantMessage


class OllamaChatLast(_OllamaLast):
    message: OllamaAssistantMessage


class OllamaGenerateChunk(_OllamaPiece):
    """A piece of the reply, or an empty one while the request waits."""

    response: str


class OllamaGenerateLast(_OllamaLast):
    response: str


class OllamaEmbedReply(_Reply):
    model: str
    embeddings: list[list[float]]
    total_duration: int
    load_duration: int
    prompt_eval_count: int


class OllamaEmbeddingsReply(_Reply):
    embedding: list[float]


class OllamaModelDetails(_Reply):
    parent_model: str
    format: str
    family: str
    families: list[str] | None
    parameter_size: str
    quantization_level: str


class OllamaTag(_Reply):
    name: str
    model: str
    kind: ModelKindName = Field(description=_KIND_DESCRIPTION)
    modified_at: str = Field(description="The artifact's mtime (RFC 3339).")
    size: int = Field(description="Bytes of the artifact.")
    digest: str = Field(description="SHA-256 of the artifact, or of the definition.")
    details: OllamaModelDetails
    loaded: bool


class OllamaRunningModel(OllamaTag):
    size: int = Field(description="Bytes the loaded model takes (its VRAM footprint).")
    expires_at: str = Field(description="When the keep-alive unloads it (RFC 3339).")
    size_vram: int = Field(description="Bytes of `size` on GPUs: 0 on CPU or remote.")


class OllamaTags(_Reply):
    models: list[OllamaTag]


class OllamaRunning(_Reply):
    models: list[OllamaRunningModel]


class OllamaShowReply(_Reply):
    modelfile: str
    parameters: str = Field(description="Decoding defaults, one `name value` a line.")
    template: str = Field(description="The pool's prompt format of the model.")
    details: OllamaModelDetails
    model_info: dict[str, Any] = Field(
        description="The model's definition, and from its artifact (where it says):"
        " `general.architecture`, `general.parameter_count`, `<family>.context_length` and"
        " the plain `context_length`, `hidden_size`, `num_layers`, `vocab_size`."
    )
    capabilities: list[Literal["completion", "embedding", "tools", "thinking", "vision"]]
    modified_at: str


class OllamaVersion(_Reply):
    version: str


class PullState(_Reply):
    """A pull's state: each NDJSON progress line, and ``/api/pull/status/{model}``.

    Fields not known yet are left out."""

    model: str
    source: str
    status: str = Field(description="queued, downloading, ..., then success, error, cancelled.")
    completed: int | None = Field(None, description="Bytes done over all files.")
    total: int | None = None
    files_done: int | None = None
    files_total: int | None = None
    file: str | None = None
    error: str | None = None
    path: str | None = None
    started_at: float | None = None
    finished_at: float | None = None
    state: Literal["queued", "downloading", "completed", "failed", "cancelled"] = Field(
        description="The embedded-engine spec's state: `status` in five values."
    )
    progress: float = Field(
        description="Percent of `total_bytes` done: 100 once completed, 0 while the size"
        " is unknown."
    )
    total_bytes: int = Field(description="`total`, 0 while unknown.")
    downloaded_bytes: int = Field(description="`completed`.")


class PullCancelled(_Reply):
    model: str
    cancelled: Literal[True]


class StatusSuccess(_Reply):
    """``{"status": "success"}``, as Ollama and the embedded-engine spec answer."""

    status: Literal["success"]


class OllamaError(_Reply):
    """The error body of the Ollama routes: a message only, as Ollama sends."""

    error: str


def _ollama_line_kind(line: Any) -> str:
    if isinstance(line, dict):
        fields = line
    else:
        fields = {"error": True} if hasattr(line, "error") else {"done": line.done}
    if "error" in fields:
        return "error"
    return "last" if fields.get("done") is True else "piece"


class OllamaChatStreamLine(
    RootModel[
        Annotated[
            Annotated[OllamaChatChunk, Tag("piece")]
            | Annotated[OllamaChatLast, Tag("last")]
            | Annotated[OllamaError, Tag("error")],
            Discriminator(_ollama_line_kind),
        ]
    ]
):
    """One NDJSON line of a streamed ``/api/chat``: pieces (``done: false``), the last
    line (``done: true``, with timings), or ``{"error": ...}`` for a failure after the
    stream started."""


class OllamaGenerateStreamLine(
    RootModel[
        Annotated[
            Annotated[OllamaGenerateChunk, Tag("piece")]
            | Annotated[OllamaGenerateLast, Tag("last")]
            | Annotated[OllamaError, Tag("error")],
            Discriminator(_ollama_line_kind),
        ]
    ]
):
    """One NDJSON line of a streamed ``/api/generate``, as :class:`OllamaChatStreamLine`."""


# -- admin ---------------------------------------------------------------------------------
class RowCapabilities(_Reply):
    modalities: list[str]
    multi_turn: bool
    thinking_modes: list[Literal["default", "enabled", "disabled"]]


class RowCanary(_Reply):
    """What the model's output canary found (docs/reliability.md, "Output canaries")."""

    health: Literal["pending", "ok", "degraded", "failed"] = Field(
        description="`pending`: no answer since the load yet; `ok`: the last answer kept to"
        " the reference; `degraded`: it did not (`reason` says how) and the model is"
        " drained and reloaded; `failed`: degraded past engine.canary_reloads_per_hour,"
        " the model was marked failed."
    )
    reason: str | None = Field(description="Why the last answer was found degraded.")
    interval_s: float = Field(description="Seconds between canaries while the model is idle.")
    reference: str | None = Field(
        description="The answer later ones are held to: the operator's `canary_reference`,"
        " else the first sound answer after a load of the current definition."
    )
    answer: str | None = Field(description="The last answer.")
    checked_at: float | None = Field(description="When (seconds since the epoch).")
    reloads_last_hour: int = Field(description="Reloads the canary asked for in the last hour.")


class RowDetails(_Reply):
    """What the artifact's own metadata says (GGUF header, ``config.json``); null where
    it says nothing (a stub or remote model has no artifact)."""

    format: str | None = Field(description="gguf, safetensors, transformers or exl3.")
    family: str | None = Field(description="The architecture (`llama`, `qwen3`, ...).")
    parameter_size: str | None = Field(description="As Ollama writes it: `134.52M`, `8.0B`.")
    parameter_count: int | None
    quantization_level: str | None = Field(
        description="GGUF file type (`Q4_1`, `Q4_K_M`, ...), the quantization method and bits"
        " (`EXL3 4-bit`, `AWQ 4-bit`), or the weights' dtype (`BF16`)."
    )
    context_length: int | None = Field(description="The context the model was trained for.")
    served_context_length: int | None = Field(
        description="The context a request gets: the configured one, else the model's own."
    )


# A row's VRAM fields (spec: runtime-admin-api; docs/vram.md, "The estimate chain").
_SOURCE = (
    "The spec's three: `observed_load_delta` (measured), `model_artifact_size` (estimated"
    " without a measurement: `vram_estimate_basis` says how) or `unavailable`"
    " (`vram_estimate_mib` null)."
)
_BASIS = (
    "The step of the pool's estimate chain that gave `vram_estimate_mib`:"
    " configured_vram_mb, observed_load_delta, artifact_metadata, model_artifact_size,"
    " name_heuristic or unavailable."
)
_MEASURED = (
    "MiB measured for this load: its delta (or its runtime's own figure) while loaded,"
    " the footprint kept from the same earlier load when not; null when never measured."
    " Never null when `vram_estimate_source` is `observed_load_delta`."
)


class AdapterRow(_Reply):
    """A LoRA adapter served on a base model (docs/backends.md, "LoRA adapters")."""

    name: str = Field(description="The model name requests use for it.")
    path: str
    scale: float
    size_mib: float = Field(
        description="Its file's size: what it adds to the base's memory on each replica."
    )
    requests: int = Field(description="Requests admitted for it since it was added.")
    evicted: bool = Field(
        description="The pool evicted it alone to make room (least recently used adapter"
        " first, before its base is considered); its next request loads it again."
    )


class ModelRow(_Reply):
    """One configured model with its live state (spec: runtime-admin-api)."""

    name: str
    resolved_backend: str
    kind: ModelKindName = Field(description=_KIND_DESCRIPTION)
    configured_enabled: bool
    runtime_state: Literal["unloaded", "loading", "loaded", "unloading", "failed"]
    is_loaded: bool
    replicas: int
    replica_max: int
    loaded_replicas: int
    inflight_requests: int
    queue_depth: int
    runtime_inflight: int
    configured_target_inflight: int
    effective_target_inflight: int
    last_error: str | None
    unload_reason: Literal["evicted", "requested", "keep_alive", "canary"] | None = Field(
        description="Why the model was last unloaded, until it loads again: `evicted` (the"
        " pool made room for another model; its next request loads it again), `requested`"
        " (an unload was asked for; it stays unloaded), `keep_alive` (idle past its"
        " keep_alive), `canary` (its output canary found it degraded: reloaded, or marked"
        " failed); null if it never was."
    )
    asleep_ram_mib: int | None = Field(
        description="Host RAM its sleeping replicas hold: an eviction put its engines to"
        " sleep (vLLM's sleep mode, level 1) and its next request wakes them instead of"
        " loading; null when none sleeps (docs/vram.md)."
    )
    vram_estimate_mib: int | None
    vram_estimate_replica_count: int
    vram_estimate_source: Literal["observed_load_delta", "model_artifact_size", "unavailable"] = (
        Field(description=_SOURCE)
    )
    vram_estimate_basis: str = Field(description=_BASIS)
    observed_load_delta: int | None = Field(description=_MEASURED)
    gpus: list[list[int]] = Field(
        description="Per replica, the GPUs it runs on (one, or several for a split)."
    )
    gpu_split_mib: list[list[int]] = Field(
        description="Per replica, the MiB planned on each of its GPUs, in the same order."
    )
    load_constraints: dict[str, dict[str, Any]]
    load_recommendations: dict[str, dict[str, Any]]
    load_override: dict[str, Any]
    capabilities: RowCapabilities
    details: RowDetails
    canary: RowCanary | None = Field(
        description="Its output canary; null where canaries are off for the model"
        " (canary_interval_s 0, a remote model that sets none, a model that does not"
        " generate text)."
    )
    parent: str | None = Field(
        None,
        description="On an adapter's row: the base model that serves it; the row's state,"
        " queue and memory are the base's.",
    )
    adapter: AdapterRow | None = Field(None, description="On an adapter's row: the adapter.")
    adapters: list[AdapterRow] = Field(
        default_factory=list, description="On a base's row: the LoRA adapters it serves."
    )
    adapter_group_wait_ms: float | None = Field(
        None,
        description="Where the backend applies one adapter at a time (llama_cpp) and the"
        " model has adapters: the longest extra wait (ms) the scheduler may add to a request"
        " to run requests of an already applied adapter first; null otherwise.",
    )
    definition: dict[str, Any]


class ModelRows(_Reply):
    models: list[ModelRow]


# -- residency: decisions and the load preview (docs/vram.md) -------------------------------
class DecisionRow(_Reply):
    """One residency decision, with its reason (further fields carry its numbers)."""

    seq: int = Field(description="Increases by one with each decision.")
    action: Literal[
        "place",
        "evict",
        "wait",
        "yield",
        "refuse",
        "comeback",
        "reload",
        "fail",
        "pause",
        "cut",
        "resume",
    ] = Field(
        description="`pause`: the model's preemptible streams were paused at a token"
        " boundary for a swap (`requests` names them), `cut`: ended instead"
        " (engine.preemption: cut), `resume`: a paused stream runs again"
        ' (docs/vram.md, "Pause and resume"); '
        "`reload`: the output canary found the model degraded and it was"
        " drained and reloaded, or the loaded copy did not serve a request's or a"
        " runner load's load hints (the reason names the field; docs/vram.md, \"Load"
        ' hints"), or the watchdog recycled a replica that hung or whose process'
        " exited (`fault`: `hang` or `exit`, `replica`: its index; docs/faults.md);"
        " `fail`: degraded past engine.canary_reloads_per_hour, or faulty past"
        " engine.watchdog_recycles_per_hour, marked failed (docs/reliability.md)."
    )
    model: str = Field(description="The model decided about.")
    for_model: str | None = Field(
        alias="for", description="The model it was decided for (evict, yield); else null."
    )
    reason: str
    at: float = Field(description="When (seconds since the epoch).")


class Decisions(_Reply):
    decisions: list[DecisionRow] = Field(description="Newest first.")


# -- usage (docs/operations.md, "Keys, usage and budgets") ----------------------------------
class UsageRow(_Reply):
    """The sums of one key, tenant or model (the one ``group_by`` named), and with
    ``bucket`` of one UTC hour or day."""

    key: str | None = Field(
        None, description="With group_by=key: the key's name (null: requests without one)."
    )
    tenant: str | None = Field(None, description="With group_by=tenant: the tenant.")
    model: str | None = Field(None, description="With group_by=model: the model.")
    bucket: str | None = Field(
        None, description="With bucket=hour|day: the start of the UTC hour or day (RFC 3339)."
    )
    requests: int = Field(description="Finished requests, whatever their status.")
    prompt_tokens: int
    cached_tokens: int = Field(description="Prompt tokens a prefix cache served.")
    output_tokens: int
    audio_seconds: float = Field(
        0.0, description="Seconds of audio transcribed (/v1/audio/transcriptions, translations)."
    )
    characters: int = Field(
        0, description="Characters of text that speech models said (`/v1/audio/speech`)."
    )
    load_seconds: float = Field(
        0.0,
        description="Seconds of model loading these requests caused: each load a request"
        " started (an on-demand model, an evicted one coming back for it) is charged to"
        " that request's key and tenant.",
    )


class UsageReport(_Reply):
    model_config = ConfigDict(
        extra="allow",
        json_schema_extra={
            "examples": [
                {
                    "usage": [
                        {
                            "tenant": "default",
                            "requests": 12,
                            "prompt_tokens": 3400,
                            "cached_tokens": 1200,
                            "output_tokens": 980,
                            "load_seconds": 0.0,
                        },
                        {
                            "tenant": "team-a",
                            "requests": 3,
                            "prompt_tokens": 410,
                            "cached_tokens": 0,
                            "output_tokens": 150,
                            "load_seconds": 2.5,
                        },
                    ]
                }
            ]
        },
    )

    usage: list[UsageRow] = Field(description="Ordered by bucket, then group.")


class LoadPreview(_Reply):
    """What a load would do now (``dry_run=true``), changing nothing."""

    model: str
    state: Literal["unloaded", "loading", "loaded", "unloading", "failed"]
    fits: bool
    gpus: list[list[int]] = Field(description="Per replica, the GPUs it would go to.")
    gpu_split_mib: list[list[int]] = Field(description="Per replica, MiB on each of its GPUs.")
    evict: list[str] = Field(description="The models it would evict first, in order.")
    spared_warm: list[str] = Field(
        description="Models it leaves loaded because they are in their stay-warm windows"
        " (`stay_warm_s`) while others can make the room; `reason` says for how long."
    )
    wait_for: list[str] = Field(
        description="Models whose end it waits for (a load under way of this model), or the"
        " busy models that could make room once idle when it is refused."
    )
    pause: list[str] = Field(
        default_factory=list,
        description="The request ids of the preemptible streams that a request above"
        " `low` for this model would pause to make its room (engine.preemption: pause;"
        ' docs/vram.md, "Pause and resume"); empty when none would.',
    )
    need_mib: int = Field(description="MiB per replica, as the estimate chain says.")
    estimate_source: str
    expected_load_s: float | None = Field(
        description="How long its last load took (measured, kept across restarts); null"
        " before the first."
    )
    error: str | None = Field(
        description="The error code the load would answer (`load_failed`, `model_unloading`,"
        " `invalid_load_request`); null when it would load."
    )
    reason: str


class LoadAnswer(RootModel[ModelRow | LoadPreview]):
    """The model's row once loaded; with ``dry_run=true``, the preview."""


class GpuRow(_Reply):
    index: int
    name: str
    used_mib: int
    total_mib: int
    used_over_total: str


class GpuModelRow(_Reply):
    name: str
    runtime_state: str
    is_loaded: bool
    configured_target_inflight: int
    effective_target_inflight: int
    vram_estimate_mib: int | None
    vram_estimate_replica_count: int
    vram_estimate_source: Literal["observed_load_delta", "model_artifact_size", "unavailable"] = (
        Field(description=_SOURCE)
    )
    vram_estimate_basis: str = Field(description=_BASIS)
    observed_load_delta: int | None = Field(description=_MEASURED)
    gpus: list[list[int]] = Field(
        description="Per replica, the GPUs it runs on (one, or several for a split)."
    )
    gpu_split_mib: list[list[int]] = Field(
        description="Per replica, the MiB planned on each of its GPUs, in the same order."
    )


class GpuMemory(_Reply):
    gpus: list[GpuRow]
    models: list[GpuModelRow]
    error: str | None = Field(description="Why there are no readings (none when there are).")
    read_at: float


# -- runner API ----------------------------------------------------------------------------
class LoadedModel(_Reply):
    id: str
    backend: str
    quantization: str | None = Field(
        description="From the model's own metadata, spelled as the runner spec does"
        " (`awq-4bit`, `fp16`, `bf16`; a GGUF type as `q4_k_m`); null where unknown."
    )
    contextLength: int | None
    loadedAt: int
    gpuMemoryMB: int | None
    replicas: int


class LoadingModel(_Reply):
    id: str
    progress: float | None
    eta: int | None = Field(
        description="Seconds left, by the last measured load of the same model and"
        " settings; null before a first measured load or while the model is fetched."
    )


class RunnerModels(_Reply):
    loaded: list[LoadedModel]
    loading: list[LoadingModel]
    available: list[str]


class RunnerResources(_Reply):
    gpuIds: list[int]
    gpuMemoryTotalMB: int
    gpuMemoryUsedMB: int
    gpuMemoryFreeMB: int
    gpuUtilization: float | None = Field(
        description="NVML's busy share over its last sample period, averaged over the GPUs;"
        " null without NVML."
    )
    kvCacheSizeMB: int | None = Field(
        description="The prompt caches the pool manages (llama_cpp's saved states, the KV"
        " cache of in-process vllm replicas); null where no loaded runtime can tell."
    )
    kvCacheUtilization: float | None = Field(description="Their used share; null as above.")
    error: str | None


class RunnerQueue(_Reply):
    depth: int
    maxDepth: int
    avgWaitMs: float
    p95WaitMs: float


class RunnerFlags(_Reply):
    streaming: bool
    prefixCaching: bool
    multiTenant: bool
    visionInput: bool
    audioInput: bool
    functionCalling: bool
    structuredOutput: bool = Field(
        description="Some configured model decodes to a JSON schema (structured outputs)."
    )
    embeddings: bool = Field(description="Some configured model serves embeddings.")


class RunnerDescriptor(_Reply):
    """``GET /v1/capabilities`` (503 with the same body while unhealthy)."""

    runnerType: str
    runnerId: str
    models: RunnerModels
    resources: RunnerResources
    queue: RunnerQueue
    capabilities: RunnerFlags
    health: Literal["healthy", "degraded", "unhealthy"] = Field(
        description="As /health's `status`: 503 only while unhealthy."
    )
    healthReason: str | None
    cluster: dict[str, Any] | None = Field(
        None,
        description="In a cluster: `redis` (`ok` or `unreachable`), the node id, epoch and"
        " peers (docs/cluster.md).",
    )


class LoadTaskState(_Reply):
    taskId: str
    status: Literal["loading", "completed", "failed"]
    modelId: str
    createdAt: int
    progress: float
    phase: Literal["fetching", "loading"] | None = Field(
        None, description="While loading: `fetching` while the model is pulled into the store."
    )
    evictModel: str | None = None
    loadTimeMs: int | None = None
    gpuMemoryUsedMB: int | None = None
    error: str | None = None
    errorCode: str | None = None
    eta: int | None = Field(
        None,
        description="Seconds: in the 202 the whole of the last measured load like this one,"
        " while polling what is left of it; null before a first measured load or while the"
        " model is fetched. Absent once the task ended.",
    )


class RunnerUnloaded(_Reply):
    modelId: str
    gpuMemoryFreedMB: int | None
    gpuMemoryFreedSource: str
    kvCacheFlushed: bool


class CacheFlushed(_Reply):
    flushed: bool
    entriesRemoved: int
    memoryFreedMB: int


class HealthReason(_Reply):
    """One thing that degrades the pool; the fields beside ``code`` and ``model`` depend
    on the code."""

    code: Literal["queue_saturated", "gpu_oom", "model_failed"] = Field(
        description="queue_saturated: the model's queue is at or near its max_queue;"
        " gpu_oom: its runtime reported a GPU out of memory within"
        " service.health_oom_window_s; model_failed: the model is `failed`."
    )
    model: str
    queueDepth: int | None = Field(None, description="queue_saturated: requests waiting.")
    maxQueue: int | None = Field(None, description="queue_saturated: the model's max_queue.")
    gpu: int | None = Field(
        None, description="gpu_oom: the GPU's index (null where the model had no placement)."
    )
    at: int | None = Field(None, description="gpu_oom: when, as a Unix time.")
    message: str | None = Field(None, description="gpu_oom: what the runtime said.")
    error: str | None = Field(None, description="model_failed: the model's last_error.")


class Health(_Reply):
    status: Literal["healthy", "degraded", "unhealthy"] = Field(
        description="degraded: serving, with `reasons` (503 on /health while a GPU ran out of"
        " memory or a queue is saturated); unhealthy (503): not serving."
    )
    uptime: int = Field(description="Seconds since the pool started.")
    modelsLoaded: int
    queueDepth: int
    reason: str | None = Field(
        None,
        description="Why /health answers 503: not serving, a GPU out of memory, a saturated queue.",
    )
    reasons: list[HealthReason] | None = Field(
        None, description="What degrades the pool; left out when nothing does."
    )
    cluster: dict[str, Any] | None = Field(
        None,
        description="In a cluster: `redis` (`ok` or `unreachable`), the node id, epoch and"
        " peers (docs/cluster.md).",
    )


class EngineModelStatus(_Reply):
    name: str
    backend: str
    state: Literal["unloaded", "loading", "loaded", "unloading", "failed"]
    keep_alive: float = Field(
        description="Seconds an idle model stays loaded after its last request; -1: forever."
    )
    idle_seconds: float | None = Field(
        description="Loaded with nothing to do: seconds since its last request; else null."
    )
    will_unload_in: float | None = Field(
        description="Seconds until the keep-alive unloads it; null when not counting down."
    )
    error: str | None = Field(description="The last load or runtime error, while it stands.")
    queue_depth: int
    running: int
    max_queue: int
    replicas: int = Field(description="Loaded replicas.")
    gpus: list[list[int]] = Field(description="The GPUs of each replica, while placed.")
    vram_mib: int | None = Field(description="What the loaded model holds (or is estimated to).")


class EngineGpuMemory(_Reply):
    """The embedded-engine spec's GPU figures: GB (10^9 bytes), summed over the GPUs."""

    allocated_gb: float | None = Field(
        description="Held by this pool's runtimes; null where no GPU can tell."
    )
    reserved_gb: float = Field(description="In use on the GPUs, by this pool and others.")
    total_gb: float


class EngineStatus(_Reply):
    models: list[EngineModelStatus]
    gpu_memory: EngineGpuMemory | None = Field(
        description="The spec's summary of `gpu_memory` (below); null without GPUs."
    )


class GpuMemoryReading(_Reply):
    index: int
    name: str
    used_mib: int
    total_mib: int
    free_mib: int
    pool_used_mib: int | None = Field(description="Held by this pool's processes, where known.")
    virtual: bool = Field(description="A budget of engine.gpu_budget_mib, not a device.")


class GpuMemoryStatus(_Reply):
    gpus: list[GpuMemoryReading]
    error: str | None = Field(description="Why there are no readings (no NVIDIA driver).")


class StoreStatus(_Reply):
    """The model store: what pulls downloaded (and ``/api/delete`` removes)."""

    models: list[str] = Field(description="The models with a complete pull, by name.")
    count: int


_STATUS_EXAMPLE: dict[str, Any] = {
    "status": "degraded",
    "reason": None,
    "reasons": [
        {"code": "queue_saturated", "model": "qwen", "queueDepth": 9, "maxQueue": 10},
        {
            "code": "gpu_oom",
            "model": "llama",
            "gpu": 0,
            "at": 1764170000,
            "message": "CUDA error: out of memory",
        },
    ],
    "uptime": 3600,
    "engine": {
        "models": [
            {
                "name": "qwen",
                "backend": "llama_cpp",
                "state": "loaded",
                "keep_alive": 300.0,
                "idle_seconds": None,
                "will_unload_in": None,
                "error": None,
                "queue_depth": 9,
                "running": 4,
                "max_queue": 10,
                "replicas": 1,
                "gpus": [[0]],
                "vram_mib": 5120,
            }
        ],
        "gpu_memory": {"allocated_gb": 20.45, "reserved_gb": 20.97, "total_gb": 24.15},
    },
    "pulls": {
        "llama": {
            "model": "llama",
            "source": "org/llama-gguf",
            "status": "downloading",
            "completed": 1048576,
            "total": 4194304,
            "state": "downloading",
            "progress": 25.0,
            "total_bytes": 4194304,
            "downloaded_bytes": 1048576,
        }
    },
    "cache": {"models": ["qwen"], "count": 1},
    "gpu_memory": {
        "gpus": [
            {
                "index": 0,
                "name": "NVIDIA L4",
                "used_mib": 20000,
                "total_mib": 23034,
                "free_mib": 3034,
                "pool_used_mib": 19500,
                "virtual": False,
            }
        ],
        "error": None,
    },
}


class PoolStatus(_Reply):
    """``GET /api/status``: health, engine, pulls, the model store and GPU memory at once."""

    model_config = ConfigDict(extra="allow", json_schema_extra={"examples": [_STATUS_EXAMPLE]})

    status: Literal["healthy", "degraded", "unhealthy"] = Field(description="As /health's.")
    reason: str | None = Field(description="Why the pool is unhealthy.")
    reasons: list[HealthReason] = Field(description="What degrades the pool, as in /health.")
    uptime: int = Field(description="Seconds since the pool started.")
    engine: EngineStatus
    pulls: dict[str, PullState] = Field(description="The pulls under way, by model.")
    cache: StoreStatus = Field(description="The model store (the spec's model cache).")
    gpu_memory: GpuMemoryStatus = Field(description="Each GPU's memory, in MiB.")
