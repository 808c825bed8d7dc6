"""The vLLM engine's settings and how they become vLLM's engine arguments.

Shared by ``vllm`` (the engine in-process, built from ``AsyncEngineArgs``) and
``vllm_serve`` (the same arguments as ``vllm serve`` flags), so a ``vllm_*`` field means
the same thing whichever way vLLM runs. :func:`engine_arguments` names every argument
by its ``EngineArgs`` field; ``vllm serve`` spells the same name as ``--kebab-case``.
Nothing here imports vLLM.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import Field, PositiveInt

from pool.backends._protocol import LoadOverrides
from pool.config import CommonModelFields, invalid_load_request


class VllmFields(CommonModelFields):
    """The vLLM engine's fields, shared by ``vllm`` and ``vllm_serve``."""

    vllm_model: str | None = None
    vllm_dtype: str = "auto"
    vllm_gpu_memory_utilization: Annotated[float, Field(gt=0.0, le=1.0)] = 0.9
    vllm_kv_cache_memory_bytes: PositiveInt | None = None
    vllm_kv_cache_dtype: str | None = None
    vllm_max_model_len: PositiveInt | None = None
    vllm_enable_prefix_caching: bool | None = Field(
        None,
        description="vLLM's automatic prefix caching (null: vLLM's default, on); false turns"
        " it off, and a cache flush or scope then has nothing to act on.",
    )
    vllm_tensor_parallel_size: PositiveInt = 1
    vllm_trust_remote_code: bool = False
    vllm_enforce_eager: bool = False
    vllm_max_num_seqs: PositiveInt | None = None
    vllm_limit_mm_per_prompt: dict[str, int] | None = None
    vllm_mm_processor_kwargs: dict[str, Any] | None = None
    vllm_max_pixels: PositiveInt | None = None
    vllm_speculative_method: str | None = None
    vllm_speculative_model: str | None = None
    vllm_speculative_moe_backend: str | None = None
    vllm_speculative_attention_backend: str | None = None
    vllm_num_speculative_tokens: PositiveInt | None = None
    vllm_tool_call_parser: str | None = Field(
        None,
        description="vLLM's tool-call parser (vllm serve's --tool-call-parser); default by"
        " model family (qwen3 -> qwen3_json, Qwen3-Coder -> qwen3_xml, mistral/mixtral ->"
        " mistral, granite -> granite, else hermes); the in-process vllm backend with a"
        " built-in prompt_format takes the parser of the format's markup.",
    )
    vllm_tool_strict_level: Literal["auto", "function", "parameter"] | None = Field(
        None,
        description="vLLM's floor for constraining tool calls (vllm serve's"
        " --tool-strict-level): auto (vLLM's default) pins a call's arguments to its"
        " schema only for tools sent with strict: true, function constrains every call's"
        " envelope, parameter also pins every tool's arguments to its schema.",
    )
    vllm_enable_lora: bool = Field(
        False,
        description="Start the engine with LoRA support (enable_lora) though the model has"
        " no lora_adapters yet, so adapters can be added while it runs; on whenever"
        " lora_adapters is set.",
    )
    vllm_max_loras: PositiveInt | None = Field(
        None, description="vLLM's max_loras: adapters in one batch (vLLM's default: 1)."
    )
    vllm_max_lora_rank: PositiveInt | None = Field(
        None, description="vLLM's max_lora_rank: the largest adapter rank served."
    )

    @property
    def lora_enabled(self) -> bool:
        """Whether the engine starts with LoRA support."""
        return self.vllm_enable_lora or bool(self.lora_adapters)


class VllmLoadOverrides(LoadOverrides):
    vllm_max_model_len: PositiveInt | None = None
    vllm_kv_cache_dtype: str | None = None
    vllm_kv_cache_memory_bytes: PositiveInt | None = None
    vllm_max_pixels: PositiveInt | None = None
    vllm_speculative_method: str | None = None
    vllm_speculative_model: str | None = None
    vllm_speculative_moe_backend: str | None = None
    vllm_speculative_attention_backend: str | None = None
    vllm_num_speculative_tokens: PositiveInt | None = None


LOAD_CONSTRAINTS: dict[str, dict[str, Any]] = {
    "vllm_max_model_len": {"kind": "integer", "minimum": 256, "step": 256},
    # The spec's enum: the values a UI offers. The override check takes any other cache
    # type too (check_kv_cache_dtype below): the installed vLLM decides at load, so a
    # newer vLLM's cache types work without a pool release; one it refuses is a 400.
    "vllm_kv_cache_dtype": {
        "kind": "enum",
        "default": "auto",
        "allowed_values": ["auto", "fp8", "fp8_e4m3", "fp8_e5m2"],
        "examples": ["auto", "fp8"],
    },
    "vllm_kv_cache_memory_bytes": {
        "kind": "integer",
        "minimum": 268435456,
        "step": 268435456,
        "unit": "bytes",
        "display_unit": "mib",
    },
    "vllm_max_pixels": {"kind": "integer", "minimum": 200704, "step": 200704, "unit": "pixels"},
    "vllm_speculative_method": {
        "kind": "string_or_null",
        "format": "vllm_speculative_method",
        "default": None,
        "examples": ["mtp", "draft_model", "mlp_speculator"],
    },
    "vllm_speculative_model": {
        "kind": "string_or_null",
        "format": "hf_id_or_local_path",
        "default": None,
        "examples": ["google/gemma-4-26B-A4B-it-assistant"],
    },
    "vllm_speculative_moe_backend": {
        "kind": "string_or_null",
        "format": "vllm_moe_backend",
        "default": None,
        "examples": ["triton"],
    },
    "vllm_speculative_attention_backend": {
        "kind": "string_or_null",
        "format": "vllm_attention_backend",
        "default": None,
        "examples": ["triton_attn"],
    },
    "vllm_num_speculative_tokens": {"kind": "integer", "minimum": 1, "step": 1, "default": 1},
}

CONTEXT_FIELD = "vllm_max_model_len"


def table_checked(patch: Mapping[str, Any]) -> dict[str, Any]:
    """``patch`` less a ``vllm_kv_cache_dtype`` that is a string or null, for the table
    check: the table's enum is what a UI offers, and vLLM accepts more cache types
    (its ``CacheDType``), judged by the installed vLLM at load (a refusal is a 400)."""
    return {
        k: v
        for k, v in patch.items()
        if not (k == "vllm_kv_cache_dtype" and (v is None or isinstance(v, str)))
    }


def speculative_config(d: VllmFields) -> dict[str, Any] | None:
    """vLLM's ``speculative_config`` from the ``vllm_speculative_*`` fields (None: off)."""
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


def processor_kwargs(d: VllmFields) -> dict[str, Any] | None:
    """``mm_processor_kwargs``: the configured ones, with ``vllm_max_pixels`` over them."""
    processor = dict(d.vllm_mm_processor_kwargs or {})
    if d.vllm_max_pixels is not None:
        processor["max_pixels"] = d.vllm_max_pixels
    return processor or None


def engine_arguments(d: VllmFields) -> dict[str, Any]:
    """Every ``vllm_*`` field as ``EngineArgs`` keyword arguments, the model left out.

    Fields left unset are absent, so vLLM's own defaults apply; the always-set ones
    (dtype, memory share, tensor parallelism, the two switches) are always present.
    """
    arguments: dict[str, Any] = {
        "dtype": d.vllm_dtype,
        "gpu_memory_utilization": d.vllm_gpu_memory_utilization,
        "tensor_parallel_size": d.vllm_tensor_parallel_size,
        "trust_remote_code": d.vllm_trust_remote_code,
        "enforce_eager": d.vllm_enforce_eager,
    }
    optional = {
        "kv_cache_memory_bytes": d.vllm_kv_cache_memory_bytes,
        "kv_cache_dtype": d.vllm_kv_cache_dtype,
        "max_model_len": d.vllm_max_model_len,
        "enable_prefix_caching": d.vllm_enable_prefix_caching,
        "max_num_seqs": d.vllm_max_num_seqs,
        "limit_mm_per_prompt": d.vllm_limit_mm_per_prompt,
        "mm_processor_kwargs": processor_kwargs(d),
        "speculative_config": speculative_config(d),
    }
    arguments.update({key: value for key, value in optional.items() if value is not None})
    if d.lora_enabled:
        arguments["enable_lora"] = True
        if d.vllm_max_loras is not None:
            arguments["max_loras"] = d.vllm_max_loras
        if d.vllm_max_lora_rank is not None:
            arguments["max_lora_rank"] = d.vllm_max_lora_rank
    return arguments


def check_vllm_adapters(d: VllmFields, *, at_runtime: bool) -> None:
    """vLLM's own limits on adapters: a scale is not a vLLM notion (an adapter applies
    as trained), and one added to a running engine needs LoRA support from its start.

    Raises:
        PoolError: ``invalid_load_request`` (field ``lora_adapters``).
    """
    for adapter in d.lora_adapters:
        if adapter.scale != 1.0:
            raise invalid_load_request(
                f"adapter {adapter.name!r}: vLLM applies an adapter as trained (scale 1);"
                f" got scale {adapter.scale:g}",
                "lora_adapters",
            )
    if at_runtime and not d.lora_enabled:
        raise invalid_load_request(
            "this vLLM engine was started without LoRA support: set vllm_enable_lora (or"
            " lora_adapters) and reload the model",
            "lora_adapters",
        )


def model_source(d: VllmFields) -> str | None:
    """What vLLM loads: ``vllm_model`` (an HF id or a path), else ``model_path``."""
    return d.vllm_model or d.model_path


def replica_concurrency(d: VllmFields) -> int:
    """How many requests one engine runs at once, as the pool admits them.

    vLLM batches every sequence it holds, up to ``max_num_seqs``. That limit is the
    default; an explicit ``target_inflight`` may ask for fewer, never for more (the
    rest would only wait inside the engine, out of reach of the pool's priorities).
    Without ``vllm_max_num_seqs`` the engine is sized to ``target_inflight``.
    """
    seqs = d.vllm_max_num_seqs
    if seqs is None:
        return d.target_inflight
    if "target_inflight" in d.model_fields_set:
        return min(d.target_inflight, seqs)
    return seqs
