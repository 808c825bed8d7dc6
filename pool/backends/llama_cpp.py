"""The ``llama_cpp`` backend: GGUF models in-process through llama-cpp-python.

Each replica owns one ``llama_cpp.Llama`` and one worker thread (a
``CapacityLimiter(1)``): a llama context decodes one sequence at a time, so the honest
inflight target is 1 and concurrency comes from replicas. Tokens reach Trio through
:func:`stream_from_thread` without the worker ever waiting for the event loop; a
cancelled request stops the worker at its next token.
"""

from __future__ import annotations

import codecs
import ctypes
import gc
import logging
import struct
import time
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any, ClassVar, Literal

import trio
from pydantic import Field, NonNegativeInt, PositiveInt

from pool.backends._gguf import read_gguf_header
from pool.backends._grammar import load_grammar, output_grammar, tool_call_grammar
from pool.backends._kinds import KindFields
from pool.backends._llama_adapters import LlamaAdapters
from pool.backends._llama_buffers import buffer_sizes, capture_load_log, memory_split
from pool.backends._llama_rank import rank_pairs
from pool.backends._placement import GpuPlacement
from pool.backends._prefix_cache import LlamaPromptCache, scope_matches
from pool.backends._protocol import (
    Backend,
    CacheFlushed,
    CacheUsage,
    Capabilities,
    EmbeddingJob,
    EmbeddingResult,
    FinishReason,
    GenerationRequest,
    GenerationStats,
    LoadContext,
    LoadOverrides,
    MemoryProfile,
    MemorySplit,
    ModelKind,
    TokenSink,
    TokensUsed,
)
from pool.backends._rerank import RankResult, require_rank_head
from pool.backends._saved_states import DiskStates, model_key
from pool.backends._text import StopScanner
from pool.backends._threaded import stream_from_thread
from pool.backends._tool_calls import ToolCallFamily, ToolCallScanner, tool_call_family
from pool.backends._tools import ToolCallDelta
from pool.backends.prompt_formats import (
    ModelTemplate,
    PromptFormat,
    format_renders_tools,
    format_tool_family,
    format_traits,
    get_prompt_format,
    thinking_modes,
)
from pool.config import CommonModelFields, resolve_model_path, state_dir
from pool.errors import BackendError, PoolError

FlashAttn = Literal["on", "off", "auto"]
Pooling = Literal["mean", "cls", "last", "none", "rank"]
log = logging.getLogger("pool.backends")

# llama.h's ``enum llama_pooling_type``.
_POOLING_TYPES: dict[str, int] = {"none": 0, "mean": 1, "cls": 2, "last": 3, "rank": 4}
_POOLING_UNSPECIFIED = -1  # the model's own
# What llama.generate can honour beyond the base fields (logit_bias by a logits processor).
LLAMA_CPP_SAMPLING = frozenset(
    {"min_p", "seed", "presence_penalty", "frequency_penalty", "logit_bias"}
)


class LlamaCppModel(CommonModelFields, KindFields):
    """GGUF in-process through llama-cpp-python.

    ``kind: rerank`` loads a GGUF with a rank head with rank pooling and serves /v1/rerank
    and /v1/score (:mod:`pool.backends._llama_rank`).
    """

    KINDS: ClassVar[tuple[ModelKind, ...]] = ("chat", "embedding", "rerank")

    backend: Literal["llama_cpp"] = "llama_cpp"
    gguf_n_gpu_layers: int = -1
    gguf_n_ctx: PositiveInt = 4096
    gguf_flash_attn: FlashAttn = "auto"
    gguf_type_k: str | None = None
    gguf_type_v: str | None = None
    gguf_n_threads: PositiveInt | None = None
    gguf_n_batch: PositiveInt = 512
    gguf_seed: int | None = None
    pooling: Pooling | None = Field(
        None,
        description="How an embedding model pools token vectors; default: the GGUF's own,"
        " `mean` where the GGUF declares none (a causal chat model).",
    )
    gguf_chat_template: str | None = Field(
        None,
        description="Jinja chat template used by prompt_format model_template in place of"
        " the GGUF's own (e.g. a tool-capable ChatML template for a model whose own has none).",
    )
    tool_call_format: ToolCallFamily | None = Field(
        None,
        description="How a model_template model writes tool calls (hermes, qwen3, mistral,"
        " granite); default: picked from the model's name and architecture. A built-in"
        " prompt_format shows the model its own markup and parses that (qwen3_template:"
        " qwen3, mistral_template: mistral).",
    )
    prefix_cache_mib: NonNegativeInt = Field(
        256,
        description="RAM per replica for saved prompt states of other conversations and"
        " tenants (LRU); 0 keeps only the live context's own prefix.",
    )
    prefix_cache_disk_mib: NonNegativeInt = Field(
        1024,
        description="Bound of the state directory's prompt-states/ folder, where a replica's"
        " saved prompt states go when it unloads (or is evicted) and come back from after"
        " the model reloads with the same file and cache settings; least recently written"
        " first out, across models. 0: nothing is written.",
    )


class LlamaCppLoadOverrides(LoadOverrides):
    gguf_n_ctx: PositiveInt | None = None
    gguf_flash_attn: str | None = None
    gguf_type_k: str | None = None
    gguf_type_v: str | None = None


_GGML_CACHE_TYPES = ["f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1"]


def _ggml_cache_type() -> dict[str, Any]:
    return {
        "kind": "string_or_null",
        "format": "ggml_type_name",
        "default": "f16",
        "allowed_values": list(_GGML_CACHE_TYPES),
        "examples": ["f16", "q8_0", "q4_0"],
    }


LOAD_CONSTRAINTS: dict[str, dict[str, Any]] = {
    "gguf_n_ctx": {"kind": "integer", "minimum": 1, "step": 1},
    "gguf_flash_attn": {
        "kind": "enum",
        "default": "auto",
        "allowed_values": ["on", "off", "auto"],
        "examples": ["auto", "on", "off"],
    },
    "gguf_type_k": _ggml_cache_type(),
    "gguf_type_v": _ggml_cache_type(),
}

LOAD_RECOMMENDATIONS: dict[str, dict[str, Any]] = {
    "gguf_cache_type_pairs": {
        "kind": "pair_presets",
        "fields": ["gguf_type_k", "gguf_type_v"],
        "recommended_pairs": [
            {"label": label, "gguf_type_k": t, "gguf_type_v": t}
            for label, t in (("f16/f16", "f16"), ("q8_0/q8_0", "q8_0"), ("q4_0/q4_0", "q4_0"))
        ],
        "notes": [
            "Presets chosen by the service for GGUF KV cache types.",
            "Symmetric K/V pairs are the safe default: upstream llama.cpp may reduce or turn off"
            " GPU offload for asymmetric pairs.",
        ],
    }
}

# GGML cache type names of the load constraints -> ggml.h's ``enum ggml_type``. The
# numbers are fixed (GGUF files store them), and llama-cpp-python does not export
# every one as a constant (0.3.36 lacks GGML_TYPE_BF16), so they are spelled out here.
_GGML_TYPES: dict[str, int] = {
    "f32": 0,
    "f16": 1,
    "q4_0": 2,
    "q4_1": 3,
    "q5_0": 6,
    "q5_1": 7,
    "q8_0": 8,
    "iq4_nl": 20,
    "bf16": 30,
}
# Cleanup deadline (shielded, bounded, as all cleanup here); freeing takes milliseconds.
_CLOSE_TIMEOUT_S = 30.0


class LlamaCppRuntime:
    """One replica: a ``llama_cpp.Llama`` and the one worker thread that may touch it."""

    def __init__(
        self,
        llama: Any,
        definition: LlamaCppModel,
        prompt_format: PromptFormat,
        limiter: trio.CapacityLimiter,
        tool_family: ToolCallFamily = "hermes",
        disk: DiskStates | None = None,
        buffers: dict[tuple[str, str], float] | None = None,
        adapters: LlamaAdapters | None = None,
    ) -> None:
        self._llama = llama
        # The LoRA adapters loaded into this replica's model (touched on the worker only).
        self.adapters = adapters or LlamaAdapters(llama)
        # What llama.cpp said it allocated while loading: MiB by (device, model|KV).
        self.buffers = buffers or {}
        self._definition = definition
        self._format = prompt_format
        self._tool_family = tool_family
        # llama.cpp contexts are not thread-safe: load, every generation and close of
        # this replica take turns on this limiter.
        self._limiter = limiter
        self._closed = False
        # Prompt states by tenant and tag (touched on the worker thread only).
        self._prompt_cache = LlamaPromptCache(definition.prefix_cache_mib, disk)

    @property
    def vram_mib(self) -> int | None:
        return None

    def memory_split(self) -> MemorySplit | None:
        return memory_split(self.buffers) if self.buffers else None

    async def flush_cache(
        self, *, scope: str, tenant: str | None = None, tag: str | None = None
    ) -> CacheFlushed:
        if self._closed or self._definition.kind != "chat":
            return CacheFlushed()
        return await trio.to_thread.run_sync(
            self._prompt_cache.flush, self._llama, scope, tenant, tag, limiter=self._limiter
        )

    def cache_usage(self) -> CacheUsage | None:
        return None if self._definition.kind != "chat" else self._prompt_cache.usage()

    async def add_adapter(self, name: str, path: Path, scale: float) -> None:
        if self._closed:
            raise BackendError("the llama_cpp runtime is closed")
        # At the worker's next turn: a running generation finishes first, untouched.
        await trio.to_thread.run_sync(self.adapters.add, name, path, scale, limiter=self._limiter)

    async def remove_adapter(self, name: str) -> None:
        if self._closed:
            return
        await trio.to_thread.run_sync(self.adapters.remove, name, limiter=self._limiter)

    async def generate(self, request: GenerationRequest, sink: TokenSink) -> GenerationStats:
        if self._closed:
            raise BackendError("the llama_cpp runtime is closed")
        # Rendering runs on the worker too: a model's own template can be slow.
        return await stream_from_thread(
            partial(self._generate_blocking, request, sink.used), sink, limiter=self._limiter
        )

    def _grammar(self, request: GenerationRequest) -> Any:
        """The grammar that constrains this reply: a forced tool call, or the output
        format's JSON; None leaves the model free."""
        if request.offers_tools and request.tool_choice.forced:
            gbnf = tool_call_grammar(
                request.tools,
                request.tool_choice,
                self._tool_family,
                parallel=_parallel(request),
            )
        elif request.output_format is not None:
            gbnf = output_grammar(request.output_format)
        else:
            return None
        return load_grammar(gbnf)

    def _generate_blocking(
        self,
        request: GenerationRequest,
        used: TokensUsed,
        send: Callable[[str | ToolCallDelta], None],
    ) -> GenerationStats:
        llama = self._llama
        started = time.perf_counter()
        rendered = self._format.render(request, enable_thinking=self._definition.enable_thinking)
        stops = tuple(dict.fromkeys([*rendered.stop, *request.decoding.stop]))
        try:
            tokens = llama.tokenize(rendered.text.encode("utf-8"), add_bos=True, special=True)
            if request.continue_text:
                # Resumed after a pause: the reply so far is prefilled as plain text
                # after the prompt (the tokens it was written in tokenize back the same).
                tokens += llama.tokenize(
                    request.continue_text.encode("utf-8"), add_bos=False, special=False
                )
        except (RuntimeError, ValueError) as exc:
            raise BackendError(f"llama.cpp could not tokenize the prompt: {exc}") from exc
        tokenize_ms = (time.perf_counter() - started) * 1000.0
        n_ctx = llama.n_ctx()
        # The reply needs at least one free position after the prompt.
        if len(tokens) + 1 > n_ctx:
            raise PoolError(
                "invalid_request",
                f"the prompt is {len(tokens)} tokens; model {request.model!r} has a context of"
                f" {n_ctx} tokens",
                details={"prompt_tokens": len(tokens), "n_ctx": n_ctx},
            )
        grammar = self._grammar(request)
        scanner = (
            ToolCallScanner(self._tool_family, parallel=_parallel(request))
            if request.offers_tools
            else None
        )
        emit: Callable[[str], None] = send
        if scanner is not None:

            def emit(text: str) -> None:
                for piece in scanner.feed(text):
                    send(piece)

        gen_started = time.perf_counter()
        try:
            self.adapters.apply(request.adapter)
            cache_key = self.adapters.cache_key(request.cache.key, request.adapter)
            reused = self._prompt_cache.prepare(llama, cache_key, tokens)
            used.cached_tokens = reused
            produced, first_at, finish, stop_sequence = self._decode(
                tokens,
                request,
                stops,
                min(request.decoding.max_tokens, n_ctx - len(tokens)),
                emit,
                used,
                grammar,
            )
        except (RuntimeError, ValueError) as exc:
            raise BackendError(f"llama.cpp generation failed: {exc}") from exc
        if scanner is not None:
            for piece in scanner.finish():
                send(piece)
        ended = time.perf_counter()
        return GenerationStats(
            prompt_tokens=len(tokens),
            cached_tokens=reused,
            output_tokens=produced,
            tokenize_ms=round(tokenize_ms, 3),
            time_to_first_token_ms=None
            if first_at is None
            else round((first_at - started) * 1000.0, 3),
            generate_ms=round((ended - gen_started) * 1000.0, 3),
            finish_reason=finish,
            stop_sequence=stop_sequence,
        )

    def _decode(
        self,
        tokens: list[int],
        request: GenerationRequest,
        stops: tuple[str, ...],
        budget: int,
        send: Callable[[str], None],
        used: TokensUsed,
        grammar: Any = None,
    ) -> tuple[int, float | None, FinishReason, str | None]:
        """Sample up to ``budget`` tokens; returns (tokens, first text time, finish reason,
        the stop string reached). ``used`` follows along: the prompt counts once the
        first token shows its prefill is done, then every token sampled."""
        import llama_cpp

        llama = self._llama
        decoding = request.decoding
        vocab = llama._model.vocab
        # Token pieces are raw bytes: a multi-byte character can span two tokens.
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        scanner = StopScanner(stops)
        produced = 0
        first_at: float | None = None
        finish: FinishReason = "stop"
        if decoding.seed is not None:
            llama.set_seed(decoding.seed)
        for token in llama.generate(
            tokens,
            top_k=decoding.top_k,
            top_p=decoding.top_p,
            min_p=decoding.min_p or 0.0,
            temp=decoding.temperature,  # 0 selects llama.cpp's greedy sampler
            repeat_penalty=decoding.repetition_penalty,
            frequency_penalty=decoding.frequency_penalty or 0.0,
            presence_penalty=decoding.presence_penalty or 0.0,
            logits_processor=_logit_bias(decoding.logit_bias, llama.n_vocab()),
            grammar=grammar,
            reset=True,
        ):
            used.prompt_tokens = len(tokens)
            if llama_cpp.llama_vocab_is_eog(vocab, token):
                break
            produced += 1
            used.output_tokens = produced
            text, stopped = scanner.feed(decoder.decode(llama.detokenize([token])))
            if text:
                if first_at is None:
                    first_at = time.perf_counter()
                send(text)
            if stopped:
                # What follows the stop string (the scanner dropped it) is never sent.
                return produced, first_at, "stop", scanner.hit
            if produced >= budget:
                finish = "length"
                break
        # Ended without a stop string: text held back as a possible stop prefix is part
        # of the reply. The bytes of a character cut off by max_tokens are not: sending
        # them would only put a replacement character at the end.
        tail = scanner.flush()
        if tail:
            if first_at is None:
                first_at = time.perf_counter()
            send(tail)
        return produced, first_at, finish, None

    async def embed(self, job: EmbeddingJob) -> EmbeddingResult:
        if self._closed:
            raise BackendError("the llama_cpp runtime is closed")
        llama = self._llama

        def embed_blocking() -> EmbeddingResult:
            # llama-cpp-python packs the texts into batches of n_batch tokens and up to
            # n_seq_max sequences, so many short inputs cost one decode per batch.
            try:
                vectors, count = llama.embed(
                    list(job.texts), normalize=True, truncate=job.truncate, return_count=True
                )
            except ValueError as exc:
                raise PoolError(
                    "invalid_request",
                    f"model {job.model!r}: {exc} (send shorter texts or truncate: true)",
                ) from exc
            except RuntimeError as exc:
                raise BackendError(f"llama.cpp embedding failed: {exc}") from exc
            if any(v and not isinstance(v[0], int | float) for v in vectors):
                # pooling "none": llama.cpp hands back a vector per token.
                raise BackendError(
                    f"model {job.model!r} embeds each token, not each text (pooling none):"
                    " set its pooling to mean, cls or last"
                )
            return EmbeddingResult(tuple(tuple(float(x) for x in v) for v in vectors), count)

        return await trio.to_thread.run_sync(embed_blocking, limiter=self._limiter)

    @property
    def ranks(self) -> bool:
        return self._definition.kind == "rerank"

    async def rank(self, query: str, documents: Sequence[str]) -> RankResult:
        """The documents scored by the GGUF's rank head (rank pooling)."""
        if self._closed:
            raise BackendError("the llama_cpp runtime is closed")
        llama = self._llama
        # The file names the model in an error: the runtime is not told its pool name.
        name = Path(self._definition.model_path or "model").name
        return await trio.to_thread.run_sync(
            rank_pairs, llama, name, query, documents, limiter=self._limiter
        )

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        llama, self._llama = self._llama, None

        def release() -> None:
            nonlocal llama
            try:
                written = self._prompt_cache.persist(llama)
            except OSError as exc:  # a full disk must not keep the memory from going back
                log.warning("prompt states not written to disk: %s", exc)
            else:
                if written:
                    log.info("%d prompt state(s) kept on disk for the next load", written)
            close = getattr(llama, "close", None)
            if close is not None:
                close()
            del llama
            # Llama holds reference cycles (its sampler, exit stack); collect them now so
            # the model's memory goes back before the replica reports it unloaded.
            gc.collect()
            _return_freed_heap()

        await trio.to_thread.run_sync(release, limiter=self._limiter)


def _parallel(request: GenerationRequest) -> bool:
    """Whether several calls may come back: a named function is called once (a small
    model under a grammar that allows more tends to repeat the same call)."""
    return request.parallel_tool_calls and request.tool_choice.mode != "function"


def _logit_bias(pairs: tuple[tuple[int, float], ...], n_vocab: int) -> Any:
    """A logits processor that adds each bias to its token's score (None without any)."""
    if not pairs:
        return None
    import llama_cpp
    import numpy as np

    for token, _ in pairs:
        if token >= n_vocab:
            raise PoolError(
                "invalid_request",
                f"logit_bias: token {token} is not in the vocabulary ({n_vocab} tokens)",
            )
    ids = np.array([t for t, _ in pairs], dtype=np.intc)
    biases = np.array([b for _, b in pairs], dtype=np.single)

    def add_bias(input_ids: Any, scores: Any) -> Any:
        scores = scores.copy()
        scores[ids] += biases
        return scores

    return llama_cpp.LogitsProcessorList([add_bias])


def _return_freed_heap() -> None:
    """Hand memory freed by llama.cpp back to the OS (glibc only; a no-op elsewhere).

    glibc keeps freed blocks in per-thread arenas, and loads and generations run on
    whichever Trio worker thread is free, so without a trim RSS creeps up by tens of
    MiB over repeated load/unload cycles though nothing leaks (measured here: +51 MiB
    over 20 cycles without, under 3 MiB with).
    """
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return
    trim(0)


def _prompt_format(definition: LlamaCppModel, llama: Any) -> PromptFormat:
    template = None
    if definition.prompt_format == "model_template":
        metadata = dict(llama.metadata)
        if definition.gguf_chat_template:
            metadata["tokenizer.chat_template"] = definition.gguf_chat_template
        template = ModelTemplate.from_gguf_metadata(
            metadata,
            lambda token_id: llama.detokenize([token_id], special=True).decode("utf-8", "replace"),
        )
        if template is None:
            raise BackendError("prompt_format model_template: the GGUF has no chat template")
    return get_prompt_format(definition.prompt_format, model_template=template)


def _flash_attention(definition: LlamaCppModel) -> bool:
    """The Python API takes a bool; "auto" turns it on where llama.cpp needs it.

    llama.cpp can only quantize the V cache with flash attention, so "auto" with a
    quantized ``gguf_type_v`` means on; otherwise "auto" keeps the library default (off).
    """
    if definition.gguf_flash_attn != "auto":
        return definition.gguf_flash_attn == "on"
    return definition.gguf_type_v not in (None, "f32", "f16", "bf16")


# llama.cpp's enum llama_split_mode: the whole model on main_gpu, or layers by tensor_split.
SPLIT_MODE_NONE = 0
SPLIT_MODE_LAYER = 1


def gpu_options(placement: GpuPlacement | None, n_gpu_layers: int) -> dict[str, Any]:
    """``Llama(...)`` arguments that put the model where the pool placed it.

    One GPU: ``split_mode`` none with that ``main_gpu``. Several: layers split in the
    placement's proportions (``tensor_split`` is indexed by CUDA device number). None
    for virtual GPUs, for a model kept off the GPU (``gguf_n_gpu_layers: 0``) or for a
    GPU the pool process cannot see: llama.cpp's own defaults then apply.
    """
    if placement is None or placement.virtual or not placement.gpus or n_gpu_layers == 0:
        return {}
    devices = placement.local_indices()
    if devices is None:
        return {}
    if len(devices) == 1:
        return {"split_mode": SPLIT_MODE_NONE, "main_gpu": devices[0]}
    split = [0.0] * (max(devices) + 1)
    for device, share in zip(devices, placement.split, strict=True):
        split[device] = share
    return {"split_mode": SPLIT_MODE_LAYER, "main_gpu": devices[0], "tensor_split": split}


class LlamaCppBackend(Backend[LlamaCppModel]):
    config = LlamaCppModel
    load_overrides = LlamaCppLoadOverrides
    load_constraints = LOAD_CONSTRAINTS
    load_recommendations = LOAD_RECOMMENDATIONS
    resumes_through_prompt = True
    context_field = "gguf_n_ctx"
    # llama.cpp pads its context to a multiple of 256 (llama_context: n_ctx_pad).
    context_padding = 256
    # LoRA adapters load into the resident model; its one context applies one at a time.
    adapter_support = "runtime"
    groups_adapters = True

    def memory_profile(self, definition: LlamaCppModel) -> MemoryProfile:
        return MemoryProfile(
            context=definition.gguf_n_ctx,
            type_k=definition.gguf_type_k,
            type_v=definition.gguf_type_v,
            gpu_layers=definition.gguf_n_gpu_layers,
            batch=definition.gguf_n_batch,
        )

    def holds_cuda_context(self, definition: LlamaCppModel) -> bool:
        # Offloading any layer initialises the GPU backend in the pool process.
        return definition.gguf_n_gpu_layers != 0

    def capabilities(self, definition: LlamaCppModel) -> Capabilities:
        multi_turn, _ = format_traits(definition.prompt_format)
        # In-process GGUF has no vision path, whatever the config says.
        return Capabilities(
            modalities=("text",),
            multi_turn=multi_turn,
            thinking_modes=thinking_modes(definition.prompt_format),
            kind=definition.kind,
            sampling=LLAMA_CPP_SAMPLING,
            # Tools need a format with a tool convention (or a chat template that renders
            # them); output grammars work always.
            tools=format_renders_tools(definition.prompt_format) and definition.kind == "chat",
            structured_output=definition.kind == "chat",
        )

    def effective_target_inflight(self, definition: LlamaCppModel) -> int:
        # One llama context decodes one sequence at a time: more would only queue
        # inside the worker thread, hiding the wait from the scheduler.
        return 1

    async def load(self, definition: LlamaCppModel, context: LoadContext) -> LlamaCppRuntime:
        path = context.model_path(definition.model_path)
        if not path.is_file():
            raise BackendError(f"model file {path} does not exist")
        try:
            import llama_cpp
        except ImportError as exc:
            raise BackendError(
                "llama-cpp-python is not installed (pip install 'llm-pool[llama-cpp]')"
            ) from exc
        kwargs: dict[str, Any] = {
            "model_path": str(path),
            "n_ctx": definition.gguf_n_ctx,
            "n_gpu_layers": definition.gguf_n_gpu_layers,
            "n_batch": min(definition.gguf_n_batch, definition.gguf_n_ctx),
            "flash_attn": _flash_attention(definition),
            "verbose": False,
            **gpu_options(context.placement, definition.gguf_n_gpu_layers),
        }
        if definition.gguf_n_threads is not None:
            kwargs["n_threads"] = definition.gguf_n_threads
        if definition.gguf_seed is not None:
            kwargs["seed"] = definition.gguf_seed
        if definition.kind in ("embedding", "rerank"):
            kwargs["embedding"] = True
            # A pooled sequence (a reranked pair) must fit in one micro-batch.
            kwargs["n_ubatch"] = kwargs["n_batch"]
            if definition.kind == "rerank":
                kwargs["pooling_type"] = _POOLING_TYPES["rank"]
            elif definition.pooling is not None:
                kwargs["pooling_type"] = _POOLING_TYPES[definition.pooling]
        for field in ("gguf_type_k", "gguf_type_v"):
            value = getattr(definition, field)
            if value is not None:
                if value not in _GGML_TYPES:
                    raise BackendError(f"{field} {value!r} is not a supported GGML cache type")
                kwargs[field.removeprefix("gguf_")] = _GGML_TYPES[value]

        buffers: dict[tuple[str, str], float] = {}
        adapter_files = [
            (a.name, context.model_path(a.path, f" (adapter {a.name!r})"), a.scale)
            for a in definition.lora_adapters
        ]
        made: list[LlamaAdapters] = []

        def adapters_of(llama: Any) -> LlamaAdapters:
            if not made:
                made.append(LlamaAdapters(llama))
            return made[0]

        def load_blocking() -> Any:
            if definition.kind == "rerank":
                require_rank_head(path)
            if definition.embedding and "pooling_type" not in kwargs:
                kwargs["pooling_type"] = _default_pooling(path)
            try:
                with capture_load_log(llama_cpp) as logged:
                    llama: Any = llama_cpp.Llama(**kwargs)
            except (ValueError, RuntimeError, OSError) as exc:
                raise BackendError(f"llama.cpp could not load {path}: {exc}") from exc
            buffers.update(buffer_sizes(logged))
            try:
                for name, adapter_path, scale in adapter_files:
                    adapters_of(llama).add(name, adapter_path, scale)
                # Warm-up, as llama-server does: the first forward pass touches every
                # memory-mapped weight page and sizes the compute buffers. Paying for
                # it here keeps it out of the first request's time to first token.
                if definition.kind == "rerank":
                    rank_pairs(llama, context.model_name, "warm up", ("warm up",))
                elif definition.embedding:
                    llama.embed("warm up")
                else:
                    llama.eval([max(llama.token_bos(), 0)])
                    llama.reset()
            except (ValueError, RuntimeError, BackendError) as exc:
                llama.close()
                raise BackendError(f"llama.cpp could not run {path}: {exc}") from exc
            return llama

        limiter = trio.CapacityLimiter(1)
        llama = await trio.to_thread.run_sync(load_blocking, limiter=limiter)
        disk = None
        if definition.kind == "chat" and definition.prefix_cache_disk_mib > 0:
            disk = await trio.to_thread.run_sync(_indexed_states, definition, path, limiter=limiter)
        try:
            prompt_format = _prompt_format(definition, llama)
        except (BackendError, PoolError, ValueError) as exc:
            # Shielded: a load failing during shutdown still frees what it allocated.
            with trio.move_on_after(_CLOSE_TIMEOUT_S, shield=True):
                await trio.to_thread.run_sync(llama.close, limiter=limiter)
            raise BackendError(str(exc)) from exc
        metadata = llama.metadata
        # A built-in format shows the model its own markup, so the reply is parsed in
        # it; a model template shows the model's (configured, else known by its names).
        family = (
            format_tool_family(definition.prompt_format)
            or definition.tool_call_format
            or tool_call_family(
                path.name, metadata.get("general.name"), metadata.get("general.architecture")
            )
        )
        return LlamaCppRuntime(
            llama,
            definition,
            prompt_format,
            limiter,
            family,
            disk,
            buffers,
            adapters_of(llama),
        )

    async def flush_stored(
        self,
        definition: LlamaCppModel,
        settings_dir: str | None,
        scope: str,
        tenant: str | None,
        tag: str | None,
    ) -> CacheFlushed:
        if definition.kind != "chat" or definition.prefix_cache_disk_mib <= 0:
            return CacheFlushed()
        try:
            path = resolve_model_path(definition.model_path or "", settings_dir)
        except (FileNotFoundError, ValueError):
            return CacheFlushed()  # no file: no state of it can be on disk

        def flush_blocking() -> CacheFlushed:
            disk = _indexed_states(definition, path)
            entries, nbytes = disk.remove(lambda key: scope_matches(key, scope, tenant, tag))
            return CacheFlushed(entries, nbytes / (1024 * 1024))

        return await trio.to_thread.run_sync(flush_blocking)


BACKEND = LlamaCppBackend()


def _indexed_states(definition: LlamaCppModel, path: Path) -> DiskStates:
    """The saved prompt states on disk that fit ``definition`` loaded from ``path``
    (the KV cells follow the file and these settings), indexed."""
    disk = DiskStates(
        state_dir() / "prompt-states",
        model_key(
            path,
            n_ctx=definition.gguf_n_ctx,
            type_k=definition.gguf_type_k,
            type_v=definition.gguf_type_v,
            flash_attn=definition.gguf_flash_attn,
        ),
        definition.prefix_cache_disk_mib * 1024 * 1024,
    )
    disk.index()
    return disk


def _default_pooling(path: Path) -> int:
    """The pooling of an embedding model whose ``pooling`` is unset: the GGUF's own,
    else ``mean``.

    A chat GGUF (SmolLM2) declares no pooling type (or ``none``); llama.cpp would then
    hand back one vector per token, where an embedding request wants one per text.
    """
    try:
        metadata = read_gguf_header(path).metadata
    except (OSError, ValueError, struct.error):
        return _POOLING_TYPES["mean"]  # unreadable here: llama.cpp says why, if it can't load it
    declared = [v for k, v in metadata.items() if k.endswith(".pooling_type")]
    if declared and isinstance(declared[0], int) and declared[0] != _POOLING_TYPES["none"]:
        return _POOLING_UNSPECIFIED
    return _POOLING_TYPES["mean"]
