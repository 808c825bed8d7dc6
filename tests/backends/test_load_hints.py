"""Whether a loaded copy serves a request's load hints (pool/backends/_load_hints.py)."""

from __future__ import annotations

from typing import Any

import pytest

from pool.backends import apply_override, capacity_fields, unmet_load_hint
from pool.config import build_settings

MODELS = build_settings(
    {
        "engine": {
            "models": {
                "gguf": {"backend": "llama_cpp", "gguf_n_ctx": 2048},
                "vllm": {"backend": "vllm", "vllm_max_model_len": 4096},
                "ls": {"backend": "llama_server"},
                "stub": {"backend": "stub"},
            }
        }
    }
).engine.models


def test_capacities_are_the_context_and_the_cache_size() -> None:
    assert capacity_fields("llama_cpp") == {"gguf_n_ctx"}
    assert capacity_fields("vllm") == {"vllm_max_model_len", "vllm_kv_cache_memory_bytes"}
    assert capacity_fields("stub") == frozenset()


@pytest.mark.parametrize(
    ("hint", "met"),
    [
        ({}, True),
        ({"gguf_n_ctx": 1024}, True),  # a smaller context fits the larger one
        ({"gguf_n_ctx": 2048}, True),
        ({"gguf_n_ctx": 2049}, False),
        ({"gguf_n_ctx": None}, True),  # null asks for nothing
        ({"gguf_type_k": "f16"}, True),  # unset is the table's default, f16
        ({"gguf_type_k": "q8_0"}, False),
        ({"gguf_flash_attn": "auto"}, True),
        ({"gguf_flash_attn": "on"}, False),
        ({"stay_warm_s": 5.0}, True),  # the pool's own field says nothing of the copy
        ({"gguf_n_ctx": 512, "gguf_type_v": "q4_0"}, False),
    ],
)
def test_llama_cpp_hints(hint: dict[str, Any], met: bool) -> None:
    assert (unmet_load_hint(MODELS["gguf"], hint) is None) is met


def test_the_reason_names_the_field_and_both_values() -> None:
    reason = unmet_load_hint(MODELS["gguf"], {"gguf_n_ctx": 8192})
    assert reason == "gguf_n_ctx 8192 asked; the loaded copy has 2048"
    reason = unmet_load_hint(MODELS["gguf"], {"gguf_type_k": "q8_0"})
    assert reason == "gguf_type_k 'q8_0' asked; the loaded copy has 'f16'"


def test_a_copy_loaded_with_an_override_is_compared_as_loaded() -> None:
    loaded = apply_override(MODELS["gguf"], {"gguf_n_ctx": 8192, "gguf_type_k": "q8_0"})
    assert unmet_load_hint(loaded, {"gguf_n_ctx": 4096, "gguf_type_k": "q8_0"}) is None
    assert unmet_load_hint(loaded, {"gguf_type_k": "f16"}) is not None


def test_vllm_cache_size_and_dtype() -> None:
    loaded = apply_override(MODELS["vllm"], {"vllm_kv_cache_memory_bytes": 2 * 268435456})
    assert unmet_load_hint(loaded, {"vllm_max_model_len": 2048}) is None
    assert unmet_load_hint(loaded, {"vllm_max_model_len": 8192}) is not None
    assert unmet_load_hint(loaded, {"vllm_kv_cache_memory_bytes": 268435456}) is None
    assert unmet_load_hint(loaded, {"vllm_kv_cache_memory_bytes": 4 * 268435456}) is not None
    assert unmet_load_hint(loaded, {"vllm_kv_cache_dtype": "auto"}) is None
    assert unmet_load_hint(loaded, {"vllm_kv_cache_dtype": "fp8"}) is not None


def test_an_unset_context_is_the_models_own_where_known() -> None:
    # llama_server leaves its context to the model's own when unset.
    ls = MODELS["ls"]
    assert unmet_load_hint(ls, {"llama_server_n_ctx": 512}) == (
        "llama_server_n_ctx 512 asked; the loaded copy has its default"
    )
    assert unmet_load_hint(ls, {"llama_server_n_ctx": 512}, context_length=8192) is None
    assert unmet_load_hint(ls, {"llama_server_n_ctx": 9000}, context_length=8192) is not None
