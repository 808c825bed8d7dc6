"""The ``vllm`` backend: vLLM's AsyncLLMEngine in-process (its runtime is not built yet).

Its models validate, list and show their tables; a load fails with ``load_failed``
and says the backend is not available. The engine fields, their load overrides and
tables are vLLM's, so ``vllm_serve`` (a managed ``vllm serve``) takes them from here.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, PositiveInt

from pool.backends._protocol import LoadOverrides
from pool.backends._unavailable import UnavailableBackend
from pool.config import CommonModelFields


class VllmFields(CommonModelFields):
    """The vLLM engine's fields, shared by ``vllm`` and ``vllm_serve``."""

    vllm_model: str | None = None
    vllm_dtype: str = "auto"
    vllm_gpu_memory_utilization: Annotated[float, Field(gt=0.0, le=1.0)] = 0.9
    vllm_kv_cache_memory_bytes: PositiveInt | None = None
    vllm_kv_cache_dtype: str | None = None
    vllm_max_model_len: PositiveInt | None = None
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


class VllmModel(VllmFields):
    """vLLM's AsyncLLMEngine in-process on its own event-loop thread."""

    backend: Literal["vllm"] = "vllm"


class VllmLoadOverrides(LoadOverrides):
    vllm_max_model_len: PositiveInt | None = None
    vllm_kv_cache_dtype: str | None = None
    vllm_kv_cache_memory_bytes: PositiveInt | None = None
    vllm_max_pixels: PositiveInt | None = None
    vllm_speculative_method: str | None = None
    vllm_speculative_model: str | None = None
    vllm_num_speculative_tokens: PositiveInt | None = None


LOAD_CONSTRAINTS: dict[str, dict[str, Any]] = {
    "vllm_max_model_len": {"kind": "integer", "minimum": 256, "step": 256},
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
    "vllm_num_speculative_tokens": {"kind": "integer", "minimum": 1, "step": 1, "default": 1},
}

CONTEXT_FIELD = "vllm_max_model_len"


class VllmBackend(UnavailableBackend[VllmModel]):
    config = VllmModel
    load_overrides = VllmLoadOverrides
    load_constraints = LOAD_CONSTRAINTS
    context_field = CONTEXT_FIELD


BACKEND = VllmBackend()
