"""The ``load_constraints`` and ``load_recommendations`` tables, per backend.

These are served verbatim in admin rows and are also what load bodies are checked
against (400 ``invalid_load_request``), so the UI and the validator cannot drift.
"""

from __future__ import annotations

from typing import Any

_GGML_CACHE_TYPES = ["f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1"]


def _ggml_cache_type() -> dict[str, Any]:
    return {
        "kind": "string_or_null",
        "format": "ggml_type_name",
        "default": "f16",
        "allowed_values": list(_GGML_CACHE_TYPES),
        "examples": ["f16", "q8_0", "q4_0"],
    }


def _exllama_bits() -> dict[str, Any]:
    return {
        "kind": "integer_or_null",
        "minimum": 2,
        "maximum": 8,
        "default": None,
        "null_means": "fp16",
        "allowed_values": [2, 3, 4, 5, 6, 7, 8],
    }


_LLAMA_CPP: dict[str, dict[str, Any]] = {
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

_EXLLAMAV3: dict[str, dict[str, Any]] = {
    "exllama_cache_size": {"kind": "integer", "minimum": 256, "step": 256},
    "exllama_max_rq_tokens": {"kind": "integer", "minimum": 1, "step": 1},
    "exllama_cache_k_bits": _exllama_bits(),
    "exllama_cache_v_bits": _exllama_bits(),
    "exllama_cache_quant": {"kind": "string_or_null", "format": "<bits>|<k_bits>,<v_bits>"},
}

_VLLM: dict[str, dict[str, Any]] = {
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

_LLAMA_SERVER: dict[str, dict[str, Any]] = {
    "llama_server_n_ctx": {"kind": "integer", "minimum": 1, "step": 1},
    "llama_server_image_max_tokens": {"kind": "integer", "minimum": 1, "step": 1},
    "llama_server_spec_type": {
        "kind": "enum",
        "default": "draft-mtp",
        "allowed_values": ["draft-mtp"],
        "examples": ["draft-mtp"],
    },
    "llama_server_spec_draft_n_max": {
        "kind": "integer",
        "minimum": 1,
        "maximum": 6,
        "step": 1,
        "default": 2,
    },
    "llama_server_spec_draft_p_min": {
        "kind": "float",
        "minimum": 0.0,
        "maximum": 1.0,
        "default": 0.0,
    },
}

LOAD_CONSTRAINTS: dict[str, dict[str, dict[str, Any]]] = {
    "llama_cpp": _LLAMA_CPP,
    "exllamav3": _EXLLAMAV3,
    "vllm": _VLLM,
    "vllm_serve": _VLLM,
    "llama_server": _LLAMA_SERVER,
    "ct2": {},
    "openai_remote": {},
    "stub": {},
}

_GGUF_PAIRS = {
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

_EXLLAMA_PAIRS = {
    "exllama_cache_bit_pairs": {
        "kind": "pair_presets",
        "fields": ["exllama_cache_k_bits", "exllama_cache_v_bits"],
        "recommended_pairs": [
            {"label": "fp16", "exllama_cache_k_bits": None, "exllama_cache_v_bits": None},
            {"label": "8/8", "exllama_cache_k_bits": 8, "exllama_cache_v_bits": 8},
            {"label": "8/4", "exllama_cache_k_bits": 8, "exllama_cache_v_bits": 4},
        ],
    }
}

LOAD_RECOMMENDATIONS: dict[str, dict[str, dict[str, Any]]] = {
    "llama_cpp": _GGUF_PAIRS,
    "exllamav3": _EXLLAMA_PAIRS,
}


def load_constraints(backend: str) -> dict[str, dict[str, Any]]:
    """A copy of the constraint table of ``backend`` (callers may serialise or mutate it)."""
    return {k: dict(v) for k, v in LOAD_CONSTRAINTS.get(backend, {}).items()}


def load_recommendations(backend: str) -> dict[str, dict[str, Any]]:
    return {k: dict(v) for k, v in LOAD_RECOMMENDATIONS.get(backend, {}).items()}
