"""The admin load body: 422 for shape, 400 for backend rules (spec: Validation behavior)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from pool.backends import (
    LoadRequest,
    apply_override,
    load_constraints,
    load_recommendations,
    validate_load_request,
)
from pool.config import build_settings
from pool.errors import PoolError

MODELS = build_settings(
    {
        "engine": {
            "models": {
                "gguf": {"backend": "llama_cpp", "replica_max": 4},
                "exl": {"backend": "exllamav3", "exllama_cache_quant": "8,8"},
                "vllm": {"backend": "vllm"},
                "ls": {"backend": "llama_server"},
                "stub": {"backend": "stub"},
            }
        }
    }
).engine.models


@pytest.mark.parametrize(
    "body",
    [
        {"gguf_n_ctx": 0},
        {"exllama_cache_size": 0},
        {"exllama_max_rq_tokens": 0},
        {"replicas": 0},
        {"gguf_n_ctx": "big"},
        {"no_such_field": 1},
    ],
)
def test_schema_failures_are_422(body: dict[str, Any]) -> None:
    with pytest.raises(ValidationError):
        LoadRequest.model_validate(body)


@pytest.mark.parametrize(
    ("model", "body"),
    [
        ("gguf", {"gguf_type_k": "q8-0"}),
        ("gguf", {"gguf_type_k": "foo"}),
        ("gguf", {"gguf_flash_attn": "fast"}),
        ("exl", {"exllama_cache_k_bits": 8}),
        ("exl", {"exllama_cache_quant": "8", "exllama_cache_k_bits": 8, "exllama_cache_v_bits": 8}),
        ("exl", {"exllama_cache_size": 8000}),
        ("exl", {"exllama_cache_quant": "fp16"}),
        ("exl", {"exllama_cache_k_bits": 9, "exllama_cache_v_bits": 8}),
        ("ls", {"llama_server_spec_type": "medusa"}),
        ("ls", {"llama_server_spec_draft_n_max": 7}),
        ("ls", {"llama_server_spec_draft_p_min": 1.5}),
        ("gguf", {"exllama_cache_size": 4096}),
        ("vllm", {"llama_server_n_ctx": 4096}),
        ("vllm", {"vllm_max_model_len": 1000}),
        ("stub", {"gguf_n_ctx": 1024}),
        ("gguf", {"replicas": 5}),
        ("gguf", {"gguf_n_ctx": None}),
    ],
)
def test_backend_rule_violations_are_400(model: str, body: dict[str, Any]) -> None:
    with pytest.raises(PoolError) as info:
        validate_load_request(LoadRequest.model_validate(body), MODELS[model])
    assert info.value.code == "invalid_load_request" and info.value.status == 400


@pytest.mark.parametrize(
    ("model", "body"),
    [
        ("gguf", {"replicas": 3}),
        (
            "gguf",
            {
                "gguf_n_ctx": 32768,
                "gguf_flash_attn": "auto",
                "gguf_type_k": "q8_0",
                "gguf_type_v": "q4_0",
            },
        ),
        (
            "exl",
            {
                "exllama_cache_size": 32768,
                "exllama_cache_quant": None,
                "exllama_max_rq_tokens": 32768,
            },
        ),
        ("exl", {"exllama_cache_size": 32768, "exllama_cache_quant": "8,4"}),
        (
            "exl",
            {"exllama_cache_size": 32768, "exllama_cache_k_bits": 8, "exllama_cache_v_bits": 4},
        ),
        ("exl", {"exllama_cache_k_bits": None, "exllama_cache_v_bits": None}),
        (
            "vllm",
            {
                "vllm_max_model_len": 16384,
                "vllm_kv_cache_dtype": "fp8",
                "vllm_kv_cache_memory_bytes": 2147483648,
                "vllm_max_pixels": 4014080,
                "vllm_speculative_method": "mtp",
                "vllm_speculative_model": "google/gemma-4-26B-A4B-it-assistant",
                "vllm_num_speculative_tokens": 1,
            },
        ),
        (
            "ls",
            {
                "llama_server_n_ctx": 4096,
                "llama_server_image_max_tokens": 512,
                "llama_server_spec_type": "draft-mtp",
                "llama_server_spec_draft_n_max": 4,
                "llama_server_spec_draft_p_min": 0.25,
            },
        ),
        ("ls", {"llama_server_spec_type": None}),
    ],
)
def test_spec_examples_are_accepted(model: str, body: dict[str, Any]) -> None:
    replicas, patch = validate_load_request(LoadRequest.model_validate(body), MODELS[model])
    assert replicas == body.get("replicas", 1)
    assert patch == {k: v for k, v in body.items() if k != "replicas"}


def test_override_is_a_sparse_patch_where_null_counts() -> None:
    definition = MODELS["exl"]
    _, patch = validate_load_request(
        LoadRequest.model_validate({"exllama_cache_quant": None}), definition
    )
    assert patch == {"exllama_cache_quant": None}
    assert apply_override(definition, patch).exllama_cache_quant is None  # type: ignore[union-attr]
    assert apply_override(definition, {}).exllama_cache_quant == "8,8"  # type: ignore[union-attr]
    bits = apply_override(definition, {"exllama_cache_k_bits": 8, "exllama_cache_v_bits": 4})
    assert bits.exllama_cache_quant == "8,4"  # type: ignore[union-attr]


# The tables of runtime-admin-api ("load_constraints ... by backend"), as the spec
# prints them; vllm_serve shares vLLM's table.
SPEC_TABLES: dict[str, dict[str, Any]] = json.loads(
    (Path(__file__).parents[1] / "data" / "spec_load_constraints.json").read_text()
)
# Fields the pool offers beyond the spec's (docs/backends.md, "vllm").
POOL_ADDITIONS = {"vllm": {"vllm_speculative_moe_backend", "vllm_speculative_attention_backend"}}


@pytest.mark.parametrize("backend", [*SPEC_TABLES, "vllm_serve"])
def test_constraint_tables_are_the_specs_whole(backend: str) -> None:
    """Every entry the spec lists is the spec's, key for key and value for value; the
    only other entries are the pool's documented additions."""
    spec = SPEC_TABLES["vllm" if backend == "vllm_serve" else backend]
    table = load_constraints(backend)
    assert {k: v for k, v in table.items() if k in spec} == spec
    extra = POOL_ADDITIONS.get("vllm" if backend == "vllm_serve" else backend, set())
    assert set(table) - set(spec) == extra


def test_constraint_recommendations_match_the_spec() -> None:
    pairs = load_recommendations("llama_cpp")["gguf_cache_type_pairs"]["recommended_pairs"]
    assert [p["label"] for p in pairs] == ["f16/f16", "q8_0/q8_0", "q4_0/q4_0"]
    assert load_recommendations("exllamav3")["exllama_cache_bit_pairs"]["fields"] == [
        "exllama_cache_k_bits",
        "exllama_cache_v_bits",
    ]
