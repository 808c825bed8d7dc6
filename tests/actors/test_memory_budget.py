"""A runner load's GPU memory budget applied to the load (pool/actors/residency/_memory_budget.py):
vLLM's KV cache gets what the budget leaves beside the weights, and its context what
that cache holds."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pool import PoolError, open_pool
from pool.actors import fit_memory_budget
from pool.backends import LoadRequest
from pool.config import build_settings

MIB = 1024 * 1024
# A Llama-shaped checkpoint: 16 layers, 8 KV heads of 64, bf16: 32 KiB of KV per token.
CONFIG = {
    "model_type": "llama",
    "num_hidden_layers": 16,
    "hidden_size": 2048,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 32000,
    "max_position_embeddings": 8192,
    "torch_dtype": "bfloat16",
}


def _checkpoint(tmp_path: Path) -> Path:
    folder = tmp_path / "llama"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(CONFIG))
    with (folder / "model.safetensors").open("wb") as weights:
        weights.truncate(2000 * MIB)  # sparse: only its size is read
    return folder


async def test_vllm_gets_the_cache_the_budget_leaves(tmp_path: Path) -> None:
    model = {"backend": "vllm_serve", "model_path": str(_checkpoint(tmp_path))}
    settings = build_settings({"engine": {"models": {"v": model}}})
    async with open_pool(settings, startup_loads=False) as pool:
        actor = pool.model("v")
        residence = pool.residence("v")
        whole = residence.vram_estimate().mib  # at the model's own 8192 tokens
        assert whole is not None
        roomy = fit_memory_budget(residence, LoadRequest(), whole + 1000)
        patch = roomy.override_patch()
        # Everything above the weights and buffers is cache: more than 8192 tokens need.
        base = residence.vram_estimate(
            definition=actor.definition.model_copy(update={"vllm_max_model_len": 1}), replicas=1
        ).mib
        assert base is not None
        assert patch == {"vllm_kv_cache_memory_bytes": (whole + 1000 - base) * MIB}
        # A tighter budget shortens the context to what its cache holds, in vLLM's steps.
        tight = fit_memory_budget(residence, LoadRequest(), base + 100).override_patch()
        assert tight["vllm_kv_cache_memory_bytes"] == 100 * MIB
        # 100 MiB at 32 KiB a token (and the estimate's rounding): under 3200 tokens.
        assert tight["vllm_max_model_len"] % 256 == 0 and 2048 <= tight["vllm_max_model_len"] < 3200
        # Nothing left for a cache: a 400 naming the field.
        with pytest.raises(PoolError) as refused:
            fit_memory_budget(residence, LoadRequest(), base)
        assert refused.value.code == "invalid_load_request"
        assert refused.value.details["field"] == "gpuMemoryBudgetMB"
