"""What every backend provides, and the neutral request/metrics types they speak.

A backend module has the same shape for every runtime (like hypercorn's per-worker
folders): a pydantic model of its config fields, its ``load_constraints`` and
``load_recommendations`` tables with the schema types of those override fields, its
context-length field, how it derives capabilities and an honest inflight target, and
``load()`` which returns a :class:`Runtime` for one replica. :class:`Backend` is that
shape, generic over the config class, so a backend's methods get its own settings type.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, Generic, Literal, Protocol, TypeGuard, runtime_checkable

from pydantic import BaseModel, ConfigDict
from typing_extensions import TypeVar

from pool.backends._placement import GpuPlacement
from pool.backends._tools import OutputFormat, ToolCall, ToolCallDelta, ToolChoice, ToolSpec
from pool.config import (
    CommonModelFields,
    Decoding,
    check_override_value,
    invalid_load_request,
    resolve_model_path,
)
from pool.errors import BackendError

# A backend's config class. The default lets code that holds any backend (the model
# actor, which looked it up by name) write plain ``Backend``.
ConfigT = TypeVar("ConfigT", bound=CommonModelFields, default=CommonModelFields)

# The stay-warm window of an embedding model that sets none (the seed's vision encoders:
# small, quick to load again).
EMBEDDING_STAY_WARM_S = 60.0

# What a model serves (docs/backends.md, "Model kinds"): its backend and settings say
# which, and a request for another kind is a 400 `wrong_model_kind`.
ModelKind = Literal["chat", "embedding", "rerank", "transcription", "speech", "image"]
MODEL_KINDS: tuple[ModelKind, ...] = (
    "chat",
    "embedding",
    "rerank",
    "transcription",
    "speech",
    "image",
)

ThinkingMode = Literal["default", "enabled", "disabled"]
# The request's `thinking` values of a model that can switch thinking per request.
ALL_THINKING_MODES: tuple[ThinkingMode, ...] = ("default", "enabled", "disabled")
Role = Literal["user", "assistant", "tool"]
# "tool_calls" is never a runtime's own report: the pool sets it when calls came back.
FinishReason = Literal["stop", "length", "cancelled", "tool_calls"]
RelayPath = Literal["translated", "pass_through"]


@dataclass(frozen=True, slots=True)
class TextPart:
    text: str


@dataclass(frozen=True, slots=True)
class ImagePart:
    url: str
    detail: str | None = None


@dataclass(frozen=True, slots=True)
class Turn:
    """One message of a conversation, already validated by the request schema.

    An assistant turn may carry the tool calls it made; a ``tool`` turn is the result
    of the call ``tool_call_id`` (its text is the result).
    """

    role: Role
    parts: tuple[TextPart | ImagePart, ...]
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = None

    @property
    def text(self) -> str:
        """The text parts joined by newlines (how text backends see a content array)."""
        return "\n".join(p.text for p in self.parts if isinstance(p, TextPart))

    @property
    def has_images(self) -> bool:
        return any(isinstance(p, ImagePart) for p in self.parts)


@dataclass(frozen=True, slots=True)
class EmbeddingJob:
    """What an embedding runtime is asked to embed: several texts in one call."""

    request_id: str
    model: str
    texts: tuple[str, ...]
    dimensions: int | None = None
    # False: a text longer than the model's context is a 400 rather than cut short.
    truncate: bool = True


@dataclass(frozen=True, slots=True)
class EmbeddingResult:
    """One vector per text, in order, and the tokens read (``None`` where unknown)."""

    vectors: tuple[tuple[float, ...], ...]
    prompt_tokens: int | None = None


@dataclass(frozen=True, slots=True)
class CacheScope:
    """Whose prompt state a request may reuse, and whether it may reuse any.

    A runtime that keeps a prefix cache reuses state only between requests of the same
    ``(tenant, tag)``: one tenant never gets (or times) another's cached prompt.
    ``enabled`` is false for ``X-Cache-Mode: none``: nothing is reused for the request.
    """

    tenant: str = "default"
    tag: str | None = None
    enabled: bool = True

    @property
    def key(self) -> tuple[str, str | None] | None:
        """The scope entries are filed under; None when caching is off for the request."""
        return (self.tenant, self.tag) if self.enabled else None


@dataclass(frozen=True, slots=True)
class PassThrough:
    """The client speaks the upstream's own dialect, and nothing the pool does needs the
    tokens: a runtime that relays an upstream may forward the upstream's bytes with only
    ``model`` rewritten (docs/performance.md, "Pass-through relay").

    Set by the route (only Chat Completions sets it); a runtime that must see the tokens
    (forced tool calls by the pool's grammar) or a sink that must (the reply recorder of
    prefix affinity, :func:`takes_raw`) keeps the translated path.

    Args:
        model: the name the client asked for: what the upstream's ``model`` becomes.
        stream: the client asked for a stream (else one body is forwarded).
        include_usage: the client asked for ``stream_options.include_usage``; the
            upstream is always asked for it (the pool's accounting reads it), and the
            usage event is dropped from what the client gets when it did not ask.
    """

    model: str
    stream: bool = True
    include_usage: bool = False


@dataclass(frozen=True, slots=True)
class CacheFlushed:
    """What one runtime's flush removed."""

    entries: int = 0
    memory_mib: float = 0.0


@dataclass(frozen=True, slots=True)
class CacheUsage:
    """The size and use of a runtime's prompt cache, in MiB."""

    size_mib: float
    used_mib: float


@dataclass(frozen=True, slots=True)
class AdapterUse:
    """The LoRA adapter a generation runs with: its name (the model name the client
    asked for) and how strongly it applies."""

    name: str
    scale: float = 1.0
    # The adapter's file: a runtime that gave the adapter back (the pool evicted it
    # alone) loads it again from here before the request runs.
    path: str | None = None


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    """What a runtime is asked to generate; built by the pool from an API request."""

    request_id: str
    model: str
    turns: tuple[Turn, ...]
    decoding: Decoding
    instructions: str | None = None
    multi_turn: bool = False
    thinking: ThinkingMode = "default"
    source_lang_code: str | None = None
    target_lang_code: str | None = None
    # Tools offered (empty: none) and whether/which one the model must call.
    tools: tuple[ToolSpec, ...] = ()
    tool_choice: ToolChoice = field(default_factory=ToolChoice)
    parallel_tool_calls: bool = True
    output_format: OutputFormat | None = None
    cache: CacheScope = CacheScope()
    # The W3C ``traceparent`` of the request's span where the pool traces (pool/tracing):
    # a runtime that calls another server over HTTP sends it on, so the trace continues.
    trace_parent: str | None = None
    # The client's dialect is the upstream's (see PassThrough); None: translate.
    pass_through: PassThrough | None = None
    # The LoRA adapter of the model the client named (None: the base model alone).
    adapter: AdapterUse | None = None
    # A generation resumed after a pause (docs/vram.md, "Pause and resume"): the reply
    # so far, which the runtime prefills after the prompt and continues from (its
    # ``decoding.max_tokens`` is what is left). Empty: a fresh generation.
    continue_text: str = ""

    @property
    def offers_tools(self) -> bool:
        """Tools are in play: offered, and the client did not rule calls out."""
        return bool(self.tools) and self.tool_choice.mode != "none"


def resumes_as_text(request: GenerationRequest) -> bool:
    """Whether ``request`` can resume through a prompt of token ids (docs/vram.md,
    "Pause and resume"): plain text in and out (no images, no tools, no output format,
    whose state a prompt of ids does not carry), and not relayed as an upstream's own
    bytes (pass-through)."""
    return (
        request.pass_through is None
        and not request.tools
        and request.output_format is None
        and all(isinstance(part, TextPart) for turn in request.turns for part in turn.parts)
    )


@dataclass(slots=True)
class GenerationStats:
    """What a runtime could measure about one generation; ``None`` where unknown.

    ``cached_tokens`` counts prompt tokens served from the runtime's prefix cache
    (None: the runtime keeps none, or could not tell).
    """

    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    output_tokens: int | None = None
    tokenize_ms: float | None = None
    time_to_first_token_ms: float | None = None
    generate_ms: float | None = None
    finish_reason: FinishReason = "stop"
    # The stop string that ended the generation, where the backend can tell (None: it
    # ended otherwise, or the backend does not say).
    stop_sequence: str | None = None
    # Time the request waited inside a batching engine's own scheduler before its first
    # step (vLLM's queued-to-scheduled); the pool's queue is measured by the pool.
    backend_queue_ms: float | None = None
    # How the reply crossed the pool: the upstream's bytes forwarded ("pass_through") or
    # tokens rendered again in the client's dialect ("translated").
    relay_path: RelayPath = "translated"


@dataclass(frozen=True, slots=True)
class Capabilities:
    """What a model accepts; checked before a request is queued.

    ``remote`` marks a model whose requests leave this machine: they need the client's
    ``allow_remote: true`` unless ``remote_allowed`` says the operator consented for the
    model in its settings. Both are gates, not row fields: admin rows leave them out.
    """

    modalities: tuple[str, ...] = ("text",)
    multi_turn: bool = False
    thinking_modes: tuple[ThinkingMode, ...] = ("default",)
    remote: bool = False
    remote_allowed: bool = False
    # What the model serves. Only a ``chat`` model generates; an ``embedding`` model's
    # runtime implements :class:`EmbeddingRuntime`; the other kinds run task jobs
    # (pool/backends/_tasks.py).
    kind: ModelKind = "chat"
    embedding_dimensions: bool = False
    # The optional Decoding fields the runtime honours (a request setting another is a 400).
    sampling: frozenset[str] = frozenset()
    # Function calling (tools, tool_choice, tool turns) and structured output
    # (response_format / Ollama format); a request using either elsewhere is a 400.
    tools: bool = False
    structured_output: bool = False
    # The routes the model's runtime forwards to its own server as they came (backend
    # `server`, pool/backends/_forward.py): pool paths such as /v1/images/generations.
    forwards: frozenset[str] = frozenset()
    # The runtime relays an upstream that speaks Chat Completions (llama_server,
    # vllm_serve, openai_remote): a Chat Completions client may get its bytes as they
    # are (PassThrough). A gate, not a row field.
    relays_chat: bool = False

    @property
    def generation(self) -> bool:
        return self.kind == "chat"

    @property
    def embeddings(self) -> bool:
        return self.kind == "embedding"


@dataclass(slots=True)
class TokensUsed:
    """What one generation has used so far, kept current while it runs.

    A request that ends before its :class:`GenerationStats` exist (the client left, a
    deadline or an unload cut it, the backend failed mid-stream) is charged from this.
    The runtime sets ``prompt_tokens`` once prefill happened (and ``cached_tokens``
    where it knows them) and ``output_tokens`` as it generates, counting tokens it made
    but never sent; a worker thread may write them. ``pieces`` is the pool's own count
    of what the sink received, the charge where the runtime counts no output tokens.
    """

    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    output_tokens: int | None = None
    pieces: int = 0

    @property
    def output(self) -> int:
        """Output tokens to charge: the runtime's count, else the pieces relayed."""
        return self.output_tokens if self.output_tokens is not None else self.pieces


class TokenSink(Protocol):
    """Where a runtime delivers text (and tool-call pieces) as it is generated.

    ``send`` may block (backpressure) and raises ``trio.Cancelled`` when the request
    is cancelled; runtimes that generate on a worker thread call it through
    ``trio.from_thread.run`` so that cancellation stops them within one token.
    ``used`` is where the runtime reports its token counts as it goes
    (:class:`TokensUsed`); a sink that wraps another shares the inner one's.
    """

    used: TokensUsed

    async def send(self, text: str | ToolCallDelta) -> None: ...


class RawSink(Protocol):
    """A :class:`TokenSink` that also takes an upstream's bytes, forwarded as they are
    (the pass-through relay, :class:`PassThrough`); ``takes_raw`` says it does now."""

    used: TokensUsed
    takes_raw: bool

    async def send(self, text: str | bytes | ToolCallDelta) -> None: ...


def takes_raw(sink: TokenSink) -> TypeGuard[RawSink]:
    """Whether ``sink`` takes the upstream's bytes in place of text now (a sink that
    wraps another answers for the inner one); a sink that must see the text (the reply
    recorder of prefix affinity) says no."""
    return bool(getattr(sink, "takes_raw", False))


class Runtime(Protocol):
    """One loaded replica of a model."""

    async def generate(self, request: GenerationRequest, sink: TokenSink) -> GenerationStats:
        """Generate for ``request``, sending text to ``sink`` as it is produced."""
        ...

    async def close(self) -> None:
        """Release every resource of this replica. Called once, even after a failure."""
        ...

    @property
    def vram_mib(self) -> int | None:
        """VRAM this replica holds, when the runtime can tell."""
        ...


class PrefixCachingRuntime(Runtime, Protocol):
    """A runtime that keeps a prompt prefix cache the pool can flush and measure."""

    async def flush_cache(
        self, *, scope: str, tenant: str | None = None, tag: str | None = None
    ) -> CacheFlushed:
        """Drop the entries of ``scope`` (all, model, tenant, tag); what was removed."""
        ...

    def cache_usage(self) -> CacheUsage | None:
        """The cache's size and use now (None where the runtime cannot tell)."""
        ...


@runtime_checkable
class SleepingRuntime(Runtime, Protocol):
    """A runtime that can sleep instead of unloading (vLLM's sleep mode, level 1): its
    weights move to host RAM and its KV cache is dropped, so its GPU memory is free
    while it sleeps, and waking it takes a fraction of a load (docs/vram.md)."""

    @property
    def sleep_ram_mib(self) -> int | None:
        """Host RAM a sleep would hold (its weights); None: it cannot sleep (started
        without sleep mode, or its weights' size is not known)."""
        ...

    async def sleep(self) -> None:
        """Go to sleep: GPU memory handed back, weights kept in host RAM.

        Raises:
            BackendError: the engine would not sleep (it is then closed, not kept).
        """
        ...

    async def wake(self) -> None:
        """Wake from :meth:`sleep`: weights back on the GPU, a fresh KV cache.

        Raises:
            BackendError: the engine would not wake (it is then closed and loaded anew).
        """
        ...


@dataclass(frozen=True, slots=True)
class MemorySplit:
    """The GPU memory a runtime reports it allocated, by part, in MiB."""

    weights_mib: float
    kv_cache_mib: float


@runtime_checkable
class SplitReportingRuntime(Runtime, Protocol):
    """A runtime whose engine reports its GPU memory as weights and KV cache (llama.cpp
    names each buffer as it loads); ``/metrics`` exports the split. Others' is unknown."""

    def memory_split(self) -> MemorySplit | None:
        """The split of this replica's GPU memory; None where the engine did not say."""
        ...


@runtime_checkable
class AdapterRuntime(Runtime, Protocol):
    """A runtime that takes LoRA adapters on and off while it serves (the backend's
    ``adapter_support`` is ``runtime``); a generation names its adapter in
    :attr:`GenerationRequest.adapter`."""

    async def add_adapter(self, name: str, path: Path, scale: float) -> None:
        """Load the adapter at ``path`` under ``name``, beside those already loaded.

        Raises:
            BackendError: the file is not an adapter of this model.
        """
        ...

    async def remove_adapter(self, name: str) -> None:
        """Free the adapter ``name``; a generation that runs with it finishes first."""
        ...


class EmbeddingRuntime(Runtime, Protocol):
    """A runtime of an embedding model (``Capabilities.embeddings``)."""

    async def embed(self, job: EmbeddingJob) -> EmbeddingResult:
        """One vector per text of ``job``, computed in one call where the engine batches."""
        ...


@dataclass(frozen=True, slots=True)
class MemoryProfile:
    """The settings of one load that change how much memory it takes.

    They feed the closed-form estimate (weights + KV cache for ``context`` tokens of
    ``parallel`` sequences in the ``type_k``/``type_v`` cache types + a compute
    buffer). ``None``: the backend's default, or not a knob of this backend. (Measured
    footprints are keyed by the whole load instead: pool/actors/residency/_footprints.py.)
    """

    context: int | None = None
    type_k: str | None = None
    type_v: str | None = None
    parallel: int = 1
    gpu_layers: int | str | None = None
    batch: int | None = None


@dataclass(frozen=True, slots=True)
class LoadContext:
    """Per-replica facts a backend needs at load time."""

    model_name: str
    replica_index: int
    settings_dir: str | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)
    # The GPUs the pool's VRAM gate placed this replica on; None without GPUs to gate.
    placement: GpuPlacement | None = None
    # A backend that knows how far its load has come reports it here (0..1); waiting
    # clients see it as ``response.loading``'s progress.
    report_progress: Callable[[float], None] | None = None

    def model_path(self, value: str | None, hint: str = "") -> Path:
        """The configured ``model_path`` as a path; BackendError if unset or unresolvable."""
        if not value:
            raise BackendError(f"model_path is not set{hint}")
        try:
            return resolve_model_path(value, self.settings_dir)
        except FileNotFoundError as exc:
            raise BackendError(str(exc)) from exc


class LoadOverrides(BaseModel):
    """The schema types of a backend's live load-override fields; none here.

    A backend's subclass declares one optional field per key of its ``load_constraints``
    table. The admin load body accepts every backend's fields (a wrong shape is a 422
    whatever the model); the table then decides what suits this backend (400).
    """

    model_config = ConfigDict(extra="forbid")


class Backend(ABC, Generic[ConfigT]):
    """A runtime family, described and implemented by one module of ``pool/backends``.

    Every backend module has the same shape: its config class (a
    :class:`~pool.config.CommonModelFields` subclass whose ``backend`` Literal is its
    registry name), its tables and :class:`LoadOverrides`, its runtime, a subclass of
    this class that names them, and last ``BACKEND = TheBackend()``. One line in
    ``pool/backends/_registry.py`` makes it known; the pool derives everything else
    (settings dispatch, the load body's schema, the context field) from these.

    Attributes:
        config: the class of this backend's model definitions.
        load_overrides: the schema types of its live load-override fields.
        load_constraints: the admin ``load_constraints`` table, served verbatim in rows
            and what override values are checked against (400 ``invalid_load_request``).
        load_recommendations: presets shown beside the constraints.
        context_field: the load override that sets the context length (the runner API's
            ``maxContextLength``, Ollama's ``num_ctx``); None where there is none.
        context_padding: the runtime rounds a context length up to a multiple of this
            (llama.cpp pads to 256), so a context chosen to fit is a multiple of it.
        cache_bytes_field: the load override that sizes the runtime's KV cache in bytes
            (vLLM's), which a runner load's ``gpuMemoryBudgetMB`` sets; None where there
            is none (the context length sizes the cache there).
        even_gpu_split: a replica split over several GPUs takes the same share of each
            (tensor parallelism), not shares in proportion to each GPU's free memory.
        stay_warm_s: the stay-warm window of this backend's generation models when the
            definition sets none (docs/vram.md, "Stay warm"); embedding models take
            ``EMBEDDING_STAY_WARM_S``.
        resumes_through_prompt: its runtimes honour ``GenerationRequest.continue_text``
            (prefill the reply so far after the prompt, continue from there), so its
            ``low`` streams may be paused for a swap and resumed after it.
    """

    config: type[ConfigT]
    load_overrides: type[LoadOverrides] = LoadOverrides
    load_constraints: Mapping[str, Mapping[str, Any]] = MappingProxyType({})
    load_recommendations: Mapping[str, Mapping[str, Any]] = MappingProxyType({})
    context_field: str | None = None
    context_padding: int = 1
    cache_bytes_field: str | None = None
    even_gpu_split: bool = False
    # The seed's per-kind windows (spec: coordinator-architecture, "Per-category
    # stay_warm"): an LLM 300 s; the slow loaders get the seed's longest (900 s, its
    # diffusion pipelines); small encoders the shortest (60 s, its vision models).
    stay_warm_s: float = 300.0
    # LoRA adapters (docs/backends.md, "LoRA adapters"): "none" refuses them, "preloaded"
    # takes those of the definition at load (one added later needs a reload), "runtime"
    # adds and removes them on a loaded model (an :class:`AdapterRuntime`).
    adapter_support: Literal["none", "preloaded", "runtime"] = "none"
    # One adapter set applies at a time per replica (a llama.cpp context): the scheduler
    # may run queued requests of the applied adapter first (``adapter_group_wait_ms``).
    groups_adapters: bool = False
    resumes_through_prompt: bool = False

    def resumes(self, request: GenerationRequest) -> bool:
        """Whether a pause of ``request`` can be resumed through its prompt (see
        ``resumes_through_prompt``); a backend that resumes only some requests (a
        server's completions route takes text alone) narrows it."""
        return self.resumes_through_prompt

    @property
    def name(self) -> str:
        """The backend's name: the ``backend`` default of its config class."""
        return str(self.config.model_fields["backend"].default)

    @abstractmethod
    def capabilities(self, definition: ConfigT) -> Capabilities:
        """What a model of this definition accepts."""

    @abstractmethod
    def effective_target_inflight(self, definition: ConfigT) -> int:
        """How many requests one replica can honestly run at once."""

    @abstractmethod
    async def load(self, definition: ConfigT, context: LoadContext) -> Runtime:
        """Load one replica; raise :class:`pool.errors.BackendError` with a clear message."""

    async def flush_stored(
        self,
        definition: ConfigT,
        settings_dir: str | None,
        scope: str,
        tenant: str | None,
        tag: str | None,
    ) -> CacheFlushed:
        """Remove, by flush scope, what a model that is not loaded keeps of its prompt
        cache outside memory (llama_cpp: its saved states on disk); most keep nothing."""
        return CacheFlushed()

    def memory_profile(self, definition: ConfigT) -> MemoryProfile:
        """The memory-relevant settings of a load of ``definition`` (context by default)."""
        context = getattr(definition, self.context_field, None) if self.context_field else None
        return MemoryProfile(context=context if isinstance(context, int) else None)

    def gpus_per_replica(self, definition: ConfigT) -> int | None:
        """How many GPUs one replica must span, where the definition fixes it (a
        tensor-parallel size); None lets the pool use one GPU, or split when none has room."""
        return None

    def holds_cuda_context(self, definition: ConfigT) -> bool:
        """Whether a load runs CUDA inside the pool process (an in-process runtime on the
        GPU): its process then keeps a CUDA context and allocator cache on the GPU after
        the model unloads. Managed servers free everything when their process exits."""
        return False

    def declared_vram_mib(self, definition: ConfigT) -> int | None:
        """VRAM per replica that the definition itself declares, for a backend whose
        runtime has no artifact to read (the stub); None for the others."""
        return None

    def default_stay_warm_s(self, definition: ConfigT) -> float:
        """The stay-warm window of a model of ``definition`` that sets none: its kind's."""
        if getattr(definition, "embedding", False):
            return min(self.stay_warm_s, EMBEDDING_STAY_WARM_S)
        return self.stay_warm_s

    def check_load_override(self, patch: Mapping[str, Any]) -> None:
        """Check one load's override values against this backend's table.

        A backend with rules across fields extends this.

        Raises:
            PoolError: ``invalid_load_request`` naming the first offending field.
        """
        for field_name, value in patch.items():
            rule = self.load_constraints.get(field_name)
            if rule is None:
                raise invalid_load_request(
                    f"{field_name} is not a load override of backend {self.name!r}"
                    f" (supported: {sorted(self.load_constraints) or 'none'})",
                    field_name,
                )
            check_override_value(field_name, value, rule)

    def check_adapters(self, definition: ConfigT, *, at_runtime: bool = False) -> None:
        """Refuse LoRA adapters this backend cannot serve.

        Raises:
            PoolError: ``invalid_load_request`` (field ``lora_adapters``): the backend
                takes no adapters, or (``at_runtime``) none on a loaded model.
        """
        if self.adapter_support == "none" and (definition.lora_adapters or at_runtime):
            raise invalid_load_request(
                f"backend {self.name!r} does not serve LoRA adapters (llama_cpp, llama_server,"
                " vllm and vllm_serve do)",
                "lora_adapters",
            )
        if at_runtime and self.adapter_support == "preloaded":
            raise invalid_load_request(
                f"backend {self.name!r} takes LoRA adapters only at load: add it to the"
                " model's lora_adapters and reload the model",
                "lora_adapters",
            )

    def apply_load_override(self, definition: ConfigT, patch: Mapping[str, Any]) -> ConfigT:
        """The effective definition of one load: ``patch`` over ``definition`` by key presence."""
        return definition.model_copy(update=dict(patch))
