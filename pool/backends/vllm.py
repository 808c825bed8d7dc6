"""The ``vllm`` backend: vLLM's async engine in-process, one engine per replica.

Written against vLLM 0.32 (the v1 ``AsyncLLM``). vLLM is imported at the first load,
on a worker thread, never when settings are read. Each replica's engine runs on its own
thread with its own asyncio loop (:mod:`pool.backends._vllm_engine` says how requests
cross between that loop and Trio). The ``vllm_*`` fields become ``AsyncEngineArgs``
through the mapping ``vllm_serve`` uses for its flags (:mod:`pool.backends._vllm_fields`),
and vLLM validates them itself before its engine starts: a value it refuses (a cache
type it does not know, a context longer than the model's) fails the load with 400
``invalid_load_request``, not a 500.

A request is rendered by the pool's prompt format (or the model's own chat template,
``prompt_format: model_template``), tokenized by vLLM's renderer and streamed back in
deltas, with a ``cache_salt`` per tenant and tag so vLLM's automatic prefix caching
(left on) reuses blocks only within a scope (the salts of ``vllm_serve``,
:class:`~pool.backends._server_cache.SaltCache`). vLLM batches: a replica admits
``vllm_max_num_seqs`` requests at once (see
:func:`~pool.backends._vllm_fields.replica_concurrency`), the rest wait in the pool's
queue where priorities and fairness apply.

Images: a model whose ``modalities`` include ``image`` (and whose ``prompt_format`` is
``model_template``) gets each request's images, already inline ``data:`` URLs from the
pool's media loader, decoded to PIL images as the prompt's ``multi_modal_data``; the
model's chat template marks where each one goes and vLLM's processor expands the marks
into the image's tokens. ``vllm_limit_mm_per_prompt`` is vLLM's own check: a request
with more images than it allows is refused with 400 ``invalid_request``.

On a real GPU the engine starts with vLLM's sleep mode (``vllm_sleep_mode``), so the
pool can evict the model by putting the engine to sleep, level 1, and wake it for its
next load (:class:`~pool.backends.SleepingRuntime`; the rules in docs/vram.md).

Tools and structured output go through vLLM's own machinery, as under ``vllm serve``
(:mod:`pool.backends._vllm_tools`): the prompt format shows the model the tools (a
format with no tool convention refuses them), vLLM's tool parser (``vllm_tool_call_parser``,
else the parser of the format's markup, else by model family) adjusts the request and
parses the output, and ``response_format`` or a forced call constrains decoding with
vLLM's structured outputs.
"""

from __future__ import annotations

import gc
import io
import itertools
import logging
import multiprocessing
from collections.abc import Mapping
from functools import partial
from pathlib import Path
from typing import Any, Literal

import trio
from pydantic import Field

from pool.backends._managed import SERVER_SAMPLING
from pool.backends._protocol import (
    Backend,
    CacheFlushed,
    CacheUsage,
    Capabilities,
    GenerationRequest,
    GenerationStats,
    ImagePart,
    LoadContext,
    TokenSink,
    resumes_as_text,
)
from pool.backends._server_cache import SaltCache
from pool.backends._tool_calls import VLLM_TOOL_PARSERS, vllm_tool_parser
from pool.backends._vllm_engine import (
    CLOSE_TIMEOUT_S,
    EngineHost,
    EngineJob,
    SchedulerCounts,
    alive_processes,
    engine_config,
    import_vllm,
    rss_mib,
)
from pool.backends._vllm_fields import (
    CONTEXT_FIELD,
    LOAD_CONSTRAINTS,
    VllmFields,
    VllmLoadOverrides,
    check_vllm_adapters,
    engine_arguments,
    model_source,
    replica_concurrency,
    table_checked,
)
from pool.backends._vllm_tools import chat_spec
from pool.backends.prompt_formats import (
    ModelTemplate,
    PromptFormat,
    RenderedPrompt,
    format_renders_tools,
    format_tool_family,
    format_traits,
    get_prompt_format,
    thinking_modes,
)
from pool.config import resolve_model_path
from pool.errors import BackendError, PoolError
from pool.media import data_url_bytes

__all__ = [
    "CONTEXT_FIELD",
    "LOAD_CONSTRAINTS",
    "VllmBackend",
    "VllmFields",
    "VllmLoadOverrides",
    "VllmModel",
    "VllmRuntime",
]

log = logging.getLogger("pool.backends.vllm")

# The pool field behind each engine argument, to name it in a refusal.
_FIELD_OF_ARGUMENT = {
    "kv_cache_memory_bytes": "vllm_kv_cache_memory_bytes",
    "cache_dtype": "vllm_kv_cache_dtype",
    "kv_cache_dtype": "vllm_kv_cache_dtype",
    "max_model_len": "vllm_max_model_len",
    "max_num_seqs": "vllm_max_num_seqs",
    "gpu_memory_utilization": "vllm_gpu_memory_utilization",
    "tensor_parallel_size": "vllm_tensor_parallel_size",
    "limit_mm_per_prompt": "vllm_limit_mm_per_prompt",
    "mm_processor_kwargs": "vllm_mm_processor_kwargs",
    "speculative": "vllm_speculative_method",
    "dtype": "vllm_dtype",
    "sleep_mode": "vllm_sleep_mode",
}
_MIB = 1024 * 1024
_request_numbers = itertools.count()


class VllmModel(VllmFields):
    """vLLM's async engine in-process on its own event-loop thread."""

    backend: Literal["vllm"] = "vllm"
    vllm_sleep_mode: bool = Field(
        True,
        description="On a GPU, start the engine with vLLM's sleep mode (enable_sleep_mode),"
        " so that an eviction puts it to sleep (level 1: weights to host RAM, KV cache"
        " dropped) where the host has the RAM, and its next request wakes it instead of"
        " loading it (docs/vram.md); false: evictions unload it.",
    )


def _on_a_gpu(context: LoadContext) -> bool:
    """Whether the replica was placed on a real GPU (vLLM's sleep mode needs CUDA)."""
    return context.placement is not None and not context.placement.virtual


# The files of a checkpoint's weights: what a level-1 sleep copies to host RAM.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")


def weights_mib(model: str) -> int | None:
    """The size of the weights in a local model folder (or file); None for a Hugging
    Face id, whose files vLLM keeps in its own cache."""
    path = Path(model)
    if path.is_file():
        return -(-path.stat().st_size // _MIB)
    if not path.is_dir():
        return None
    total = sum(f.stat().st_size for f in path.iterdir() if f.name.endswith(_WEIGHT_SUFFIXES))
    return -(-total // _MIB) if total else None


def _model_to_load(definition: VllmModel, context: LoadContext) -> str:
    """``vllm_model`` (a local folder, else a Hugging Face id) or ``model_path``."""
    source = model_source(definition)
    if not source:
        raise BackendError("vllm_model (or model_path) is not set")
    if definition.vllm_model is None:
        return str(context.model_path(source))
    try:
        local = resolve_model_path(source, context.settings_dir)
    except FileNotFoundError as exc:
        raise BackendError(str(exc)) from exc
    # Not a folder here: vLLM takes it as a Hugging Face id.
    return str(local) if local.exists() else source


def _prompt_format(definition: VllmModel, host: EngineHost) -> PromptFormat:
    template = None
    if definition.prompt_format == "model_template":
        facts = host.tokenizer
        if facts is None or facts.chat_template is None:
            raise BackendError("prompt_format model_template: the model has no chat template")
        template = ModelTemplate(
            facts.chat_template, facts.bos_token, facts.eos_token, facts.adds_bos
        )
    try:
        return get_prompt_format(
            definition.prompt_format, model_template=template, images=_takes_images(definition)
        )
    except (PoolError, ValueError) as exc:
        raise BackendError(str(exc)) from exc


def tool_parser(definition: VllmModel) -> str:
    """vLLM's tool parser for the model: configured, else the one of the markup the
    prompt format shows the model, else by the model's family (as ``vllm_serve``)."""
    if definition.vllm_tool_call_parser:
        return definition.vllm_tool_call_parser
    family = format_tool_family(definition.prompt_format)
    if family is not None:
        return VLLM_TOOL_PARSERS[family]
    return vllm_tool_parser(model_source(definition))


def _takes_images(definition: VllmModel) -> bool:
    return "image" in definition.modalities


def request_images(request: GenerationRequest) -> list[Any]:
    """The request's images in prompt order, as the PIL images vLLM's processors take.

    The media loader already inlined each one as a ``data:`` URL of a checked type.

    Raises:
        PoolError: ``image_refused`` for an image PIL cannot decode.
    """
    from PIL import Image, UnidentifiedImageError

    images = []
    for turn in request.turns:
        for part in turn.parts:
            if not isinstance(part, ImagePart):
                continue
            try:
                image = Image.open(io.BytesIO(data_url_bytes(part.url)))
                # Decode now (PIL is lazy), on this thread rather than vLLM's loop.
                images.append(image.convert("RGB"))
            except (UnidentifiedImageError, OSError, ValueError) as exc:
                # Its first bytes looked like an image type, the rest is not one.
                raise PoolError(
                    "image_refused",
                    f"image refused (unsupported_type): the image does not decode: {exc}",
                    details={"reason": "unsupported_type"},
                ) from exc
    return images


def sampling_arguments(request: GenerationRequest, rendered: RenderedPrompt) -> dict[str, Any]:
    """The request's decoding settings as ``SamplingParams`` keyword arguments."""
    decoding = request.decoding
    arguments: dict[str, Any] = {
        "temperature": decoding.temperature,
        "top_p": decoding.top_p,
        # vLLM: 0 (or -1) considers every token.
        "top_k": max(0, decoding.top_k),
        "repetition_penalty": decoding.repetition_penalty,
        "max_tokens": decoding.max_tokens,
        "stop": [s for s in dict.fromkeys([*rendered.stop, *decoding.stop]) if s],
    }
    for name in ("min_p", "seed", "presence_penalty", "frequency_penalty"):
        value = getattr(decoding, name)
        if value is not None:
            arguments[name] = value
    if decoding.logit_bias:
        arguments["logit_bias"] = dict(decoding.logit_bias)
    return arguments


class VllmRuntime:
    """One replica: an engine host, its prompt format and what its load measured."""

    def __init__(
        self,
        host: EngineHost,
        definition: VllmModel,
        prompt_format: PromptFormat,
        limiter: trio.CapacityLimiter,
        rss_before_engine_mib: float,
        sleep_ram_mib: int | None = None,
        adapters: Mapping[str, Path] | None = None,
    ) -> None:
        self._host = host
        # The LoRA adapters served: name -> (vLLM's integer id, the adapter's folder).
        self._lora_ids = itertools.count(1)
        self._loras: dict[str, tuple[int, Path]] = {
            name: (next(self._lora_ids), path) for name, path in (adapters or {}).items()
        }
        # Set when the engine runs with sleep mode and its weights' size is known.
        self._sleep_ram_mib = sleep_ram_mib
        self.asleep = False
        self._definition = definition
        self._format = prompt_format
        # Rendering (a model's template can be slow) takes turns on this thread limiter.
        self._limiter = limiter
        self._closed = False
        # Automatic prefix caching is on (vLLM's default); a salt per tenant and tag
        # keeps each scope's cached blocks its own.
        self._salts = SaltCache()
        self._tool_parser = tool_parser(definition)
        self.rss_before_engine_mib = rss_before_engine_mib
        self.rss_loaded_mib = rss_mib()
        self.rss_after_close_mib: float | None = None

    @property
    def vram_mib(self) -> int | None:
        return None

    @property
    def scheduler(self) -> SchedulerCounts:
        """The engine scheduler's counts after its latest step."""
        return self._host.counts

    @property
    def processes_alive(self) -> int:
        """How many of the engine's child processes are still running."""
        return len(alive_processes(self._host.processes))

    @property
    def process_count(self) -> int:
        return len(self._host.processes)

    @property
    def host(self) -> EngineHost:
        """The engine's thread (benchmarks drive the same engine directly through it)."""
        return self._host

    def render(self, request: GenerationRequest) -> RenderedPrompt:
        """``request`` as this replica's prompt format renders it."""
        return self._render(request)

    @property
    def sleep_ram_mib(self) -> int | None:
        """Host RAM a level-1 sleep holds (the weights); None without sleep mode."""
        return self._sleep_ram_mib

    async def sleep(self) -> None:
        """Sleep, level 1: the engine's GPU memory is handed back, its weights kept in
        host RAM (the pool evicts the model this way; see SleepingRuntime)."""
        if self._sleep_ram_mib is None:
            raise BackendError("the engine was started without sleep mode")
        await self._host.sleep()
        self.asleep = True
        log.info("vllm %s: asleep (level 1), weights in host RAM", self._host.name)

    async def wake(self) -> None:
        await self._host.wake()
        self.asleep = False
        log.info("vllm %s: awake", self._host.name)

    async def generate(self, request: GenerationRequest, sink: TokenSink) -> GenerationStats:
        if self._closed:
            raise BackendError("the vllm runtime is closed")
        if self.asleep:
            raise BackendError("the vllm engine is asleep")
        rendered, images = await trio.to_thread.run_sync(
            self._prepare, request, limiter=self._limiter
        )
        job = self.engine_job(request, rendered, images)
        job.used = sink.used
        self._host.submit(job)
        try:
            await job.stream.deliver(sink)
        finally:
            if not job.stream.finished:
                # Cancelled or the sink failed: the engine aborts it before its next
                # step and frees its KV blocks; nothing here waits for that.
                self._host.cancel(job)
        assert job.stats is not None
        return job.stats

    def engine_job(
        self, request: GenerationRequest, rendered: RenderedPrompt, images: list[Any] | None = None
    ) -> EngineJob:
        """What the engine is handed for ``request``: its prompt with the scope's salt,
        and its decoded ``images`` (see :func:`request_images`) as multimodal data."""
        # vLLM shares cached blocks only between prompts of one salt.
        prompt: dict[str, Any] = {
            "prompt": rendered.text,
            "cache_salt": self._salts.salt(request.cache),
        }
        if images:
            prompt["multi_modal_data"] = {"image": images}
        lora = None
        if request.adapter is not None:
            known = self._loras.get(request.adapter.name)
            if known is None and request.adapter.path is not None:
                # Given back when the pool evicted it alone: vLLM loads it with the request.
                known = self._loras[request.adapter.name] = (
                    next(self._lora_ids),
                    Path(request.adapter.path),
                )
            if known is None:
                raise PoolError(
                    "unknown_model", f"LoRA adapter {request.adapter.name!r} is not loaded"
                )
            lora = (request.adapter.name, known[0], str(known[1]))
        return EngineJob(
            request_id=f"{request.request_id}-{next(_request_numbers)}",
            prompt=prompt,
            sampling=sampling_arguments(request, rendered),
            chat=chat_spec(request, self._tool_parser, self._definition.vllm_tool_strict_level),
            lora=lora,
            continue_text=request.continue_text,
        )

    async def add_adapter(self, name: str, path: Path, scale: float) -> None:
        """Register the adapter and have the engine load it now (``AsyncLLM.add_lora``),
        so its first request does not pay for the load."""
        if not self._definition.lora_enabled:
            raise BackendError("the engine was started without LoRA support (vllm_enable_lora)")
        lora_id = next(self._lora_ids)

        async def add(engine: Any) -> bool:
            from vllm.lora.request import LoRARequest

            return bool(await engine.add_lora(LoRARequest(name, lora_id, str(path))))

        try:
            await self._host.run_on_engine(add)
        except Exception as exc:
            raise BackendError(f"vLLM could not load LoRA adapter {path}: {exc}") from exc
        self._loras[name] = (lora_id, path)

    async def remove_adapter(self, name: str) -> None:
        known = self._loras.pop(name, None)
        if known is None or self._closed:
            return

        async def remove(engine: Any) -> bool:
            return bool(await engine.remove_lora(known[0]))

        try:
            await self._host.run_on_engine(remove)
        except Exception as exc:  # noqa: BLE001 - gone from the pool's side all the same
            log.warning("vllm %s: removing adapter %s failed: %s", self._host.name, name, exc)

    async def flush_cache(
        self, *, scope: str, tenant: str | None = None, tag: str | None = None
    ) -> CacheFlushed:
        """Forget the scope's cached prefixes.

        vLLM cannot drop one salt's blocks: a tenant or tag flush moves each matching
        scope to a new salt (its old blocks are never matched again and age out of the
        cache); ``all`` and ``model`` also empty the engine's prefix cache.
        """
        if self._closed:
            return CacheFlushed()
        entries = self._salts.rotate(scope, tenant, tag)
        if scope not in ("all", "model"):
            return CacheFlushed(entries)

        async def reset(engine: Any) -> bool:
            return bool(await engine.reset_prefix_cache())

        try:
            emptied = await self._host.run_on_engine(reset)
        except Exception as exc:  # noqa: BLE001 - the salts moved all the same
            log.warning("vllm %s: the prefix cache reset failed: %s", self._host.name, exc)
            return CacheFlushed(entries)
        if not emptied:
            # vLLM refuses while requests hold blocks; the scopes' new salts still keep
            # every later request from reusing what was there.
            log.warning("vllm %s: the engine did not reset its prefix cache", self._host.name)
        return CacheFlushed(entries)

    def cache_usage(self) -> CacheUsage | None:
        """The engine's KV cache (which holds the prefix cache) and its use now."""
        size = self._host.kv_cache_mib
        if size is None or self._closed:
            return None
        return CacheUsage(round(size, 3), round(size * self._host.counts.kv_cache_usage, 3))

    def _render(self, request: GenerationRequest) -> RenderedPrompt:
        return self._format.render(request, enable_thinking=self._definition.enable_thinking)

    def _prepare(self, request: GenerationRequest) -> tuple[RenderedPrompt, list[Any]]:
        """The rendered prompt (which refuses images the model does not take) and the
        request's images decoded."""
        rendered = self._render(request)
        return rendered, request_images(request) if _takes_images(self._definition) else []

    async def wait_failed(self) -> str:
        """Returns when the engine died (the replica then fails the model)."""
        return await self._host.wait_failed()

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        await self._host.close()
        # vLLM's shutdown force-kills an engine core that did not stop within its timeout
        # (seen on a loaded 2-core machine) without waiting for it: reap what has ended,
        # so no zombie of the engine outlives its unload.
        multiprocessing.active_children()
        gc.collect()
        self.rss_after_close_mib = rss_mib()
        left = alive_processes(self._host.processes)
        log.info(
            "vllm %s: unloaded; %d of its %d processes left; RSS %.0f MiB (%.0f before the"
            " engine started, %.0f while loaded)",
            self._host.name,
            len(left),
            len(self._host.processes),
            self.rss_after_close_mib,
            self.rss_before_engine_mib,
            self.rss_loaded_mib,
        )


class VllmBackend(Backend[VllmModel]):
    config = VllmModel
    load_overrides = VllmLoadOverrides
    load_constraints = LOAD_CONSTRAINTS
    context_field = CONTEXT_FIELD
    cache_bytes_field = "vllm_kv_cache_memory_bytes"
    # The prompt's token ids then the reply's (_vllm_engine.EngineHost._resumed_input).
    resumes_through_prompt = True

    def resumes(self, request: GenerationRequest) -> bool:
        return resumes_as_text(request)

    # Slow to load (30-240 s measured on CPU; CUDA graphs on a GPU): the seed's longest window.
    stay_warm_s = 900.0
    # LoRARequest per request; AsyncLLM.add_lora / remove_lora while it runs.
    adapter_support = "runtime"

    def capabilities(self, definition: VllmModel) -> Capabilities:
        multi_turn, _ = format_traits(definition.prompt_format)
        return Capabilities(
            modalities=("text", "image") if _takes_images(definition) else ("text",),
            multi_turn=multi_turn,
            thinking_modes=thinking_modes(definition.prompt_format),
            sampling=SERVER_SAMPLING,
            # Shown by the prompt format, parsed and constrained by vLLM itself.
            tools=format_renders_tools(definition.prompt_format),
            structured_output=True,
        )

    def check_load_override(self, patch: Mapping[str, Any]) -> None:
        super().check_load_override(table_checked(patch))

    def check_adapters(self, definition: VllmModel, *, at_runtime: bool = False) -> None:
        super().check_adapters(definition, at_runtime=at_runtime)
        check_vllm_adapters(definition, at_runtime=at_runtime)

    def effective_target_inflight(self, definition: VllmModel) -> int:
        return replica_concurrency(definition)

    async def load(self, definition: VllmModel, context: LoadContext) -> VllmRuntime:
        model = _model_to_load(definition, context)
        arguments = engine_arguments(definition)
        # The engine is sized to what the pool admits, unless configured.
        arguments.setdefault("max_num_seqs", replica_concurrency(definition))
        # Sleep mode exists on CUDA only; it lets an eviction keep the weights in RAM.
        sleep_mode = definition.vllm_sleep_mode and _on_a_gpu(context)
        if sleep_mode:
            arguments["enable_sleep_mode"] = True
        limiter = trio.CapacityLimiter(1)
        await trio.to_thread.run_sync(import_vllm, limiter=limiter)
        rss_before = rss_mib()
        vllm_config = await trio.to_thread.run_sync(
            partial(engine_config, model, arguments, _FIELD_OF_ARGUMENT), limiter=limiter
        )
        host = EngineHost(f"vllm-{context.model_name}-{context.replica_index}")
        await host.start(vllm_config)
        try:
            prompt_format = _prompt_format(definition, host)
        except BaseException:
            with trio.move_on_after(CLOSE_TIMEOUT_S, shield=True):
                await host.close()
            raise
        weights = await trio.to_thread.run_sync(weights_mib, model) if sleep_mode else None
        adapters = {a.name: context.model_path(a.path) for a in definition.lora_adapters}
        return VllmRuntime(host, definition, prompt_format, limiter, rss_before, weights, adapters)


BACKEND = VllmBackend()
